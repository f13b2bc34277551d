"""The process side of :func:`meshkit.spawn`: ``-m meshkit.launch.spawn_rank SPAWN_DIR``.

Run by the rank bootstrap (so output is tagged and a failure ends the job, as under
``meshkit-run``). Reads the payload :func:`meshkit.launch.spawn.spawn` wrote, takes the
parent's ``sys.path`` and ``sys.argv``, runs the parent's main module again as ``__mp_main__``
where ``fn`` or ``args`` come from it (as multiprocessing's spawn start method does), and calls
``fn(rank, *args)`` with ``rank`` the MPI world rank. An exception's traceback is written to
``SPAWN_DIR/error.RANK`` for the parent before the bootstrap prints it and ends the job.

Nothing is unpickled before the payload is known to be the parent's (:func:`read_payload`):
``SPAWN_DIR`` is a directory of this user's, not a link, open to nobody else (the parent's
``mkdtemp``), the payload a regular file of this user's, not a link, mode 0600, and its
HMAC-SHA256 keyed by the job's secret is the one the parent computed
(``MESHKIT_SPAWN_DIGEST``; both variables come in the environment, which no other user can
read or set). A payload written by anyone else (another user who made or swapped the folder, or
any process without the secret) is refused, naming the reason.
"""

from __future__ import annotations

import hmac
import os
import pickle
import runpy
import sys
import types

from .bootstrap import _rank_from_env, not_private, write_exclusive
from .secret import JOB_SECRET_ENV, SPAWN_DIGEST_ENV, payload_digest
from .spawn import ERROR, PAYLOAD, format_child_error

__all__ = ["main", "read_payload", "check_folder"]

# Frames of this module and runpy, hidden from the traceback the parent raises.
_HIDDEN = frozenset({__file__, runpy.__file__, "<frozen runpy>"})


def _where(spawn_dir: str, rank: int) -> str:
    return f"meshkit.spawn: process {rank}: refusing to load {os.path.join(spawn_dir, PAYLOAD)!r}"


def check_folder(spawn_dir: str, rank: int) -> None:
    """Raise PermissionError unless ``spawn_dir`` is a directory of this user's, not a link, that
    no other user may open (the parent's ``mkdtemp``)."""
    try:
        problem = not_private(os.lstat(spawn_dir), directory=True)
    except OSError as exc:
        problem = f"unreadable ({exc.strerror or exc})"
    if problem is not None:
        raise PermissionError(f"{_where(spawn_dir, rank)}: its folder is {problem}")


def read_payload(spawn_dir: str, rank: int) -> bytes:
    """The payload's bytes, once they are known to be what the job's parent wrote (module docstring).

    Raises:
        PermissionError: the folder or the file is not this user's private one, or the payload's
            HMAC is not the parent's (or the job has no secret or digest to check it with).
    """
    where = _where(spawn_dir, rank)
    secret, digest = os.environ.get(JOB_SECRET_ENV), os.environ.get(SPAWN_DIGEST_ENV)
    if not secret or not digest:
        raise PermissionError(f"{where}: {JOB_SECRET_ENV} and {SPAWN_DIGEST_ENV} must both be set (meshkit.spawn "
                              "sets them) to check it is the parent's")
    check_folder(spawn_dir, rank)
    try:
        fd = os.open(os.path.join(spawn_dir, PAYLOAD), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PermissionError(f"{where}: it cannot be opened as a regular file ({exc.strerror or exc}; a symbolic "
                              "link is refused)") from None
    with os.fdopen(fd, "rb") as f:
        problem = not_private(os.fstat(fd), directory=False)
        if problem is not None:
            raise PermissionError(f"{where}: it is {problem}")
        payload = f.read()
    if not hmac.compare_digest(payload_digest(secret, payload), digest):
        raise PermissionError(f"{where}: it is not the file the job's parent wrote (its HMAC-SHA256 under "
                              f"{JOB_SECRET_ENV} differs from {SPAWN_DIGEST_ENV})")
    return payload


def _load_main(spec: dict) -> None:
    """Run the parent's main module as ``__mp_main__`` and make it ``__main__`` (for pickle)."""
    if spec["main_name"] is not None and spec["main_name"] != "__main__" and not spec["main_name"].endswith(".__main__"):
        content = runpy.run_module(spec["main_name"], run_name="__mp_main__", alter_sys=False)
    elif spec["main_path"] is not None:
        content = runpy.run_path(spec["main_path"], run_name="__mp_main__")
    else:
        return
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(content)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def main(spawn_dir: str) -> None:
    rank = _rank_from_env()
    check_folder(spawn_dir, rank)  # before anything is written into it (error.RANK)
    try:
        spec = pickle.loads(read_payload(spawn_dir, rank))  # checked: the parent's own bytes
        # The parent's import path first; not the bootstrap's folder, which the rank started from.
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [*spec["sys_path"], *(p for p in sys.path if p not in spec["sys_path"] and p != here)]
        sys.argv = list(spec["argv"])
        if spec["main_name"] is not None or spec["main_path"] is not None:
            _load_main(spec)
        fn = pickle.loads(spec["fn"])
        args = pickle.loads(spec["args"])
        fn(rank, *args)
    except (SystemExit, KeyboardInterrupt):
        raise  # the exit status (or the interrupt) tells the parent
    except BaseException as exc:
        try:  # into the folder checked above, exclusively: the parent reads it back
            write_exclusive(os.path.join(spawn_dir, f"{ERROR}.{rank}"), format_child_error(exc, _HIDDEN).encode())
        except OSError:  # the parent is gone with its folder: the printed traceback remains
            pass
        raise


if __name__ == "__main__":
    main(sys.argv[1])
