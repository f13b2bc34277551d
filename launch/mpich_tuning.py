"""MPICH's collective selection, retuned for the nonblocking collectives meshkit uses.

meshkit's MPI engine issues every collective in its nonblocking form (``Iallreduce``...) so
that a blocking call can honour its timeout. MPICH picks a nonblocking algorithm from a
selection tree built into the library; for ``Iallreduce`` it switches from recursive doubling
to reduce-scatter + allgather (RSA) above 2 KB. Measured with the ``mpich`` 5.0.2 wheel on one
2-core host: raw ``Iallreduce`` polled with ``Test``, float32, the algorithm forced with
``MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM``, time relative to blocking ``Allreduce``:

=======  ============================  ============================
bytes    2 ranks: recursive doubling   4 ranks: recursive doubling
         / RSA                         / RSA
=======  ============================  ============================
4 KB     0.64 / 0.98                   0.72 / 1.25
6 KB     0.73 / 0.90                   0.74 / 1.19
8 KB     1.80 / 0.99                   1.49 / 1.22
12 KB    1.76 / 0.94                   1.33 / 1.21
=======  ============================  ============================

So up to 6 KB recursive doubling is the faster one (MPICH's default made a 4 KB all_reduce
at 4 ranks take 1.8x the blocking call), and from 8 KB it is not.

:func:`tuned_environment` rewrites that one threshold: it reads the selection tree out of the
MPICH library next to the ``mpiexec`` that ``meshkit-run`` uses (the JSON MPICH itself would
load, so every algorithm name is one this library knows), raises the recursive-doubling bound
of ``Iallreduce`` to :data:`IALLREDUCE_RECURSIVE_DOUBLING_MAX` bytes, writes the tree to a file
and points ``MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE`` at it. Nothing changes when the
variable is already set, when ``MESHKIT_MPICH_TUNING=0``, or when the library or that rule is
not found (another MPI, another MPICH version): then MPICH's own selection applies.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from typing import Any

from .bootstrap import replace_whole
from .job import LaunchConfigError

__all__ = ["tuned_environment", "retune", "IALLREDUCE_RECURSIVE_DOUBLING_MAX", "SELECTION_ENV", "OPT_OUT_ENV"]

logger = logging.getLogger("meshkit.launch")

SELECTION_ENV = "MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE"
OPT_OUT_ENV = "MESHKIT_MPICH_TUNING"
#: Largest Iallreduce (bytes) that uses recursive doubling (MPICH's default: 2048).
IALLREDUCE_RECURSIVE_DOUBLING_MAX = 6144

_IALLREDUCE = "collective=iallreduce"
_INTRA = "comm_type=intra"
_RULE_PREFIX = "avg_msg_size<="
_RECURSIVE_DOUBLING = "algorithm=MPIR_Iallreduce_intra_sched_recursive_doubling"


def retune(tree: dict[str, Any]) -> bool:
    """Raise the recursive-doubling bound of Iallreduce in MPICH's selection ``tree`` in place.

    Returns False (and leaves ``tree`` as it was) when the rule is not the expected
    ``avg_msg_size<=N -> recursive doubling`` as the first intra-communicator rule.
    """
    intra = tree.get(_IALLREDUCE, {}).get(_INTRA)
    if not isinstance(intra, dict) or not intra:
        return False
    first = next(iter(intra))
    if not first.startswith(_RULE_PREFIX) or list(intra[first]) != [_RECURSIVE_DOUBLING]:
        return False
    bound = first[len(_RULE_PREFIX):]
    if not bound.isdigit() or int(bound) >= IALLREDUCE_RECURSIVE_DOUBLING_MAX:
        return False
    # Rebuilt in the same order: MPICH takes the first rule that matches.
    rebuilt = {(f"{_RULE_PREFIX}{IALLREDUCE_RECURSIVE_DOUBLING_MAX}" if key == first else key): value
               for key, value in intra.items()}
    intra.clear()
    intra.update(rebuilt)
    return True


def _library_next_to(mpiexec: str) -> str | None:
    """The shared MPI library of the installation ``mpiexec`` belongs to (``<prefix>/lib``).

    The versioned file (``libmpi.so.12``): the unversioned name may be a linker script, as in
    the ``mpich`` wheel.
    """
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(mpiexec)))
    for libdir in ("lib", "lib64"):
        found = [path for path in glob.glob(os.path.join(prefix, libdir, "libmpi.so.*")) if os.path.isfile(path)]
        if found:
            return max(found, key=os.path.getsize)
    return None


def _builtin_selection(library: str) -> dict[str, Any] | None:
    """The MPIR-level selection tree compiled into ``library`` (a NUL-terminated JSON string)."""
    with open(library, "rb") as f:
        data = f.read()
    at = data.find(b'"' + _IALLREDUCE.encode() + b'"')
    if at < 0:
        return None
    start, end = data.rfind(b"\0", 0, at) + 1, data.find(b"\0", at)
    try:
        tree = json.loads(data[start:end].decode(), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError):
        return None
    return tree if isinstance(tree, dict) else None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; ValueError on a repeated key, which a dict would silently drop
    (the rewritten tree must say everything MPICH's own said)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("repeated key in MPICH's selection tree")
    return out


def tuned_environment(mpiexec: str, directory: str, env: dict[str, str]) -> dict[str, str]:
    """Variables to add to the job's environment (empty when nothing is tuned).

    Args:
        mpiexec: the launcher's ``mpiexec``; the MPICH library is looked up beside it.
        directory: where the rewritten selection file is written (the job's own directory).
        env: the environment the job would get (user settings win).

    Raises:
        LaunchConfigError: ``MESHKIT_MPICH_TUNING`` is set to something other than 0 or 1.
    """
    choice = env.get(OPT_OUT_ENV, "1")
    if choice.strip() not in ("0", "1"):  # the message has meshkit.comm.env's form (launch imports no comm)
        raise LaunchConfigError(f"meshkit.launch: {OPT_OUT_ENV}={choice!r} is not valid; valid values are 1 (the "
                          "default: retune MPICH's Iallreduce selection) and 0 (leave MPICH's selection alone)")
    if SELECTION_ENV in env or choice.strip() == "0":
        return {}
    found = shutil.which(mpiexec)
    try:
        library = _library_next_to(found) if found else None
        tree = _builtin_selection(library) if library else None
    except OSError as exc:
        logger.debug("MPICH selection not retuned: %s", exc)
        return {}
    if tree is None or not retune(tree):
        logger.debug("MPICH selection not retuned (library %s)", library)
        return {}
    path = os.path.join(directory, "mpich-coll-selection.json")
    replace_whole(path, json.dumps(tree).encode("utf-8"))  # (exclusively, 0600) the ranks' MPICH reads it
    logger.debug("Iallreduce uses recursive doubling up to %d bytes (%s)", IALLREDUCE_RECURSIVE_DOUBLING_MAX, path)
    return {SELECTION_ENV: path}
