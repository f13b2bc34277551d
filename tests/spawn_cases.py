"""Functions that ``meshkit.spawn`` runs in its processes (importable by name, as spawn needs).

Each takes ``(rank, out_dir, ...)`` and writes what its rank saw to ``out_dir/rank{r}.txt``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

import meshkit


def _write(out_dir: str, rank: int, text: str) -> None:
    Path(out_dir, f"rank{rank}.txt").write_text(text)


def all_reduce_ranks(rank: int, out_dir: str, scale: float) -> None:
    """A world of nprocs: the sum of scale * rank over the ranks, and what each rank is told."""
    meshkit.init_process_group(timeout=30)
    x = np.array([scale * rank])
    meshkit.all_reduce(x)
    _write(out_dir, rank, f"rank={rank} world_rank={meshkit.get_rank()} size={meshkit.get_world_size()} "
                          f"RANK={os.environ.get('RANK')} WORLD_SIZE={os.environ.get('WORLD_SIZE')} sum={x[0]:g}")
    meshkit.destroy_process_group()


def fail_on(rank: int, out_dir: str, bad_rank: int, how: str) -> None:
    """Rank ``bad_rank`` fails (``how``: raise, exit3, sigkill) or hangs (``hang``) while the others
    wait for it in a barrier that would never end (its timeout is far beyond the test's)."""
    meshkit.init_process_group(timeout=600)
    if rank == bad_rank:
        if how == "hang":
            time.sleep(600)
        if how == "raise":
            raise ValueError(f"rank {rank} cannot go on")
        if how == "exit3":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    _write(out_dir, rank, "waiting")
    meshkit.barrier()
    _write(out_dir, rank, "passed the barrier")
