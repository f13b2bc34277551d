"""Every rank's flight record as one Chrome trace: a timeline of the job's collectives.

The file is the Chrome trace event format (a JSON object with ``traceEvents``), which
``chrome://tracing`` and Perfetto (ui.perfetto.dev) load: one process per rank (``pid`` = the
rank), one thread per group (``tid``: the same number for a group on every rank, named by
metadata events), each call a complete event (``"ph": "X"``) named after its op, with its
sequence number, shapes, dtype, bytes and state in ``args``.

Clocks: each entry's start and end are the rank's wall clock (``time.time()``), so that ranks on
different hosts land on one axis; ``ts`` is microseconds since the earliest event of the job.
Ranks on one host share the clock exactly; across hosts the alignment is as good as their clock
synchronisation (NTP: typically well under a millisecond), which the file states in ``otherData``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from ..comm import DistTypeError, gather_object, get_rank
from ..comm._seams import current_world, flight_document

__all__ = ["export_chrome_trace", "chrome_trace"]


def _nbytes(shapes: list[list[int]], dtype: str | None) -> int:
    """The bytes of the call's first array (the input): 0 where it has none or no dtype."""
    if not shapes or dtype is None:
        return 0
    try:
        return math.prod(shapes[0]) * np.dtype(dtype).itemsize
    except TypeError:  # a dtype NumPy does not know by name (a CuPy-only one): its size is unknown
        return 0


def chrome_trace(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """The trace of these ranks' flight records (:func:`meshkit.comm._seams.flight_document`)."""
    starts = [e["t_start"] or e["t_scheduled"] for d in documents for e in d["entries"]
              if (e["t_start"] or e["t_scheduled"]) is not None]
    t0 = min(starts, default=0.0)
    tracks: dict[tuple[str, tuple[int, ...] | None], int] = {}
    for d in documents:
        for e in d["entries"]:
            key = (e["group"], tuple(e["ranks"]) if e["ranks"] is not None else None)
            tracks.setdefault(key, len(tracks))
    events: list[dict[str, Any]] = []
    for d in sorted(documents, key=lambda d: d["rank"]):
        rank = d["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        used = sorted({tracks[(e["group"], tuple(e["ranks"]) if e["ranks"] is not None else None)]
                       for e in d["entries"]})
        for (group, ranks), tid in tracks.items():
            if tid in used:
                label = group if ranks is None else f"{group} {list(ranks)}"
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}})
                events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                               "args": {"sort_index": tid}})
        for e in d["entries"]:
            start = e["t_start"] or e["t_scheduled"]
            if start is None:
                continue
            end = e["t_end"] if e["t_end"] is not None else d["time"]  # still running when the record was read
            key = (e["group"], tuple(e["ranks"]) if e["ranks"] is not None else None)
            events.append({
                "name": e["op"], "cat": e["group"], "ph": "X", "pid": rank, "tid": tracks[key],
                "ts": round((start - t0) * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3),
                "args": {"seq": e["seq"], "shapes": e["shapes"], "dtype": e["dtype"],
                         "bytes": _nbytes(e["shapes"], e["dtype"]), "state": e["state"],
                         **({"error": e["error"]} if e["error"] else {})}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "meshkit.debug.export_chrome_trace", "t0_unix_seconds": t0,
                          "clock": "each rank's wall clock (time.time()); ts in microseconds since t0; ranks on "
                                   "different hosts are aligned as well as the hosts' clocks are (NTP)"}}


def export_chrome_trace(path: str | os.PathLike[str]) -> None:
    """Write every rank's flight record to ``path`` as one Chrome trace (rank 0 writes it).

    Collective over the world: every rank calls it; their records are gathered to rank 0, which
    writes one JSON file loadable in ``chrome://tracing`` and Perfetto. Each rank keeps its last
    64 operations (the flight recorder's size), so the timeline shows the recent past, the
    export's own gather not included.

    Args:
        path: the file rank 0 writes (its folder must exist); the other ranks ignore it.

    Raises:
        DistTypeError: ``path`` is not a str or path-like (checked on every rank, before the gather).

    Example (2 ranks)::

        meshkit.all_reduce(x)
        meshkit.debug.export_chrome_trace("trace.json")   # rank 0 writes trace.json
    """
    if not isinstance(path, (str, os.PathLike)):
        raise DistTypeError(f"meshkit.debug: rank {get_rank()}: export_chrome_trace: path must be a str or "
                            f"path-like, got {type(path).__name__} {path!r}")
    world = current_world()
    document = flight_document(world)
    gathered: list[Any] | None = [None] * world.size if world.rank == 0 else None
    gather_object(document, gathered, dst=0)
    if gathered is not None:
        with open(path, "w") as out:
            json.dump(chrome_trace(gathered), out)

