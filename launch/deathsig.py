"""Start ``mpiexec`` so that it gets SIGTERM when the launcher dies, however it dies.

``python -I -S deathsig.py PARENT_PID COMMAND...`` sets Linux's ``PR_SET_PDEATHSIG`` to SIGTERM and
executes COMMAND in its place (the same process, so the launcher's ``Popen`` is ``mpiexec``'s).
Run by path, importing only ``ctypes``, ``os`` and ``sys``, so that it adds to each attempt only an
interpreter's start beyond a bare ``fork``/``exec``.

Why: the ranks on the launcher's host end with it through their watchers
(:mod:`meshkit.launch.bootstrap`), and ``mpiexec`` with them. Ranks on other hosts have no
watcher of the launcher: they end when ``mpiexec`` ends the job, which it did not do on its own
when the launcher died (it is in a session of its own, for the launcher's signal forwarding).
SIGTERM, not SIGKILL: ``mpiexec`` passes it on to every rank and ends once they have ended; a
killed ``mpiexec`` would have its proxies SIGKILL the watchers here before they clean up.

Why not ``Popen(preexec_fn=...)``: it is unsafe in a process with threads (``meshkit.spawn`` may
run in one), and this costs one small exec. ``PR_SET_PDEATHSIG`` fires when the *thread* that
forked the child ends: the launcher starts ``mpiexec`` from the thread that supervises the job to
its end (its main thread, or :func:`meshkit.spawn`'s job thread). A launcher already gone by the
time the setting takes effect is caught by comparing the parent's pid.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv: list[str]) -> None:
    """``argv``: ``[PARENT_PID, COMMAND, ARGS...]``; never returns."""
    parent, command = int(argv[0]), argv[1:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the watchers alone end the ranks here
        pass
    if os.getppid() != parent:  # the launcher died before the setting took effect
        os._exit(128 + signal.SIGTERM)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"meshkit-run: could not start {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
