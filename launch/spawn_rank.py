"""The process side of :func:`meshkit.spawn`: ``-m meshkit.launch.spawn_rank SPAWN_DIR``.

Run by the rank bootstrap (so output is tagged and a failure ends the job, as under
``meshkit-run``). Reads the payload :func:`meshkit.launch.spawn.spawn` wrote, takes the
parent's ``sys.path`` and ``sys.argv``, runs the parent's main module again as ``__mp_main__``
where ``fn`` or ``args`` come from it (as multiprocessing's spawn start method does), and calls
``fn(rank, *args)`` with ``rank`` the MPI world rank. An exception's traceback is written to
``SPAWN_DIR/error.RANK`` for the parent before the bootstrap prints it and ends the job.
"""

from __future__ import annotations

import os
import pickle
import runpy
import sys
import types

from .bootstrap import _rank_from_env
from .spawn import ERROR, PAYLOAD, format_child_error

__all__ = ["main"]

# Frames of this module and runpy, hidden from the traceback the parent raises.
_HIDDEN = frozenset({__file__, runpy.__file__, "<frozen runpy>"})


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
    with open(os.path.join(spawn_dir, PAYLOAD), "rb") as f:
        spec = pickle.load(f)
    # The parent's import path first; not the bootstrap's folder, which the rank started from.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [*spec["sys_path"], *(p for p in sys.path if p not in spec["sys_path"] and p != here)]
    sys.argv = list(spec["argv"])
    try:
        if spec["main_name"] is not None or spec["main_path"] is not None:
            _load_main(spec)
        fn = pickle.loads(spec["fn"])
        args = pickle.loads(spec["args"])
        fn(rank, *args)
    except (SystemExit, KeyboardInterrupt):
        raise  # the exit status (or the interrupt) tells the parent
    except BaseException as exc:
        try:
            with open(os.path.join(spawn_dir, f"{ERROR}.{rank}"), "w", encoding="utf-8") as f:
                f.write(format_child_error(exc, _HIDDEN))
        except OSError:  # the parent is gone with its folder: the printed traceback remains
            pass
        raise


if __name__ == "__main__":
    main(sys.argv[1])
