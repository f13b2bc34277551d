"""Debugging a job's collectives: a timeline of every rank's calls, and why a job hung.

* :func:`export_chrome_trace` (collective): every rank's flight record as one Chrome trace
  (``chrome://tracing``, Perfetto): a track per rank and group, each call a complete event.
* With ``MESHKIT_TRACE_DIR`` set, each rank writes its flight record there when a collective
  times out or fails; ``python -m meshkit.debug analyze DIR`` (:func:`report`) reads them all
  (refusing, in bounded time and memory, files that are not valid records) and names the
  divergence: the ranks that never entered the call, the rank whose call differed, the rank that
  arrived late, ranks that called collectives in different orders.
* :func:`start_debug_server` (collective): an HTTP server per rank answering, while the job runs,
  each rank's stacks, in-flight collectives and flight record (``/all`` on any rank: every rank's),
  to whoever holds the job's token (the URL it returns ends with it), within bounded connections.

The debug level (``set_debug_level``), ``breakpoint(rank)`` and the flight recorder itself are in
:mod:`meshkit.comm`; this package builds on comm alone. See docs/hangs.md.

Modules: ``chrome_trace.py`` (``export_chrome_trace``), ``divergence.py`` (reading
``MESHKIT_TRACE_DIR``'s records, naming the divergence), ``server.py`` (``start_debug_server``),
``__main__.py`` (``python -m meshkit.debug analyze``).
"""

from .chrome_trace import chrome_trace, export_chrome_trace
from .divergence import Finding, analyze, load_records, report
from .server import start_debug_server, stop_debug_server

__all__ = ["export_chrome_trace", "chrome_trace", "load_records", "analyze", "report", "Finding", "start_debug_server",
           "stop_debug_server"]
