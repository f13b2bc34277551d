"""What a script learns about the attempt it runs in, under ``meshkit-run --max-restarts``.

``meshkit-run --max-restarts K -n MIN:MAX script.py`` restarts the whole job when a rank fails
(:mod:`meshkit.launch.restarts`); each attempt's ranks get ``MESHKIT_RESTART_COUNT`` (0 on the
first attempt, as torchrun's ``TORCHELASTIC_RESTART_COUNT``) and the job's limits. A script
resumes from its newest complete checkpoint (:class:`meshkit.checkpoint.CheckpointManager`)
whatever the attempt; these helpers say which attempt it is, for logs and for choices such as
not repeating a first attempt's set-up::

    from meshkit import elastic
    if elastic.is_restart():
        print(f"restart {elastic.restart_count()} of {elastic.max_restarts()}")

Under ``meshkit-run --survive K`` no rank is restarted: the survivors of up to K failures carry
on in memory (:func:`survive_budget` is K; docs/elastic.md "Surviving failures").

Outside the launcher (plain ``python``, ``mpiexec``, another launcher) every process is on its
first attempt and there are no restarts. The package reads the environment only: it imports
nothing of meshkit but the variables' names (:mod:`meshkit.launch_protocol`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..launch_protocol import MAX_NPROC_ENV, MAX_RESTARTS_ENV, MIN_NPROC_ENV, RESTART_COUNT_ENV, SURVIVE_ENV

__all__ = ["restart_count", "max_restarts", "is_restart", "world_size_range", "survive_budget", "Attempt", "attempt"]


def _number(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"meshkit.elastic: {name}={text!r} is not an integer (meshkit-run sets it; "
                         "unset it or give an integer >= 0)") from None
    if value < 0:
        raise ValueError(f"meshkit.elastic: {name}={value} is negative (meshkit-run sets it; give an integer >= 0)")
    return value


def restart_count() -> int:
    """Restarts before this attempt: 0 on the first attempt (and outside ``meshkit-run``)."""
    return _number(RESTART_COUNT_ENV, 0)


def max_restarts() -> int:
    """``--max-restarts`` of the job (0 outside ``meshkit-run`` or without restarts)."""
    return _number(MAX_RESTARTS_ENV, 0)


def survive_budget() -> int:
    """``--survive K`` of the job: the rank failures its survivors carry on after, in memory
    (0 outside ``meshkit-run --survive``); see docs/elastic.md "Surviving failures"."""
    return _number(SURVIVE_ENV, 0)


def is_restart() -> bool:
    """Whether this attempt follows a failed one."""
    return restart_count() > 0


def world_size_range() -> tuple[int, int] | None:
    """``(MIN, MAX)`` of ``meshkit-run -n MIN:MAX`` (``(N, N)`` for ``-n N``), or None outside it.

    Raises:
        ValueError: a variable is not an integer >= 0, or MIN is larger than MAX.
    """
    low, high = _number(MIN_NPROC_ENV, 0), _number(MAX_NPROC_ENV, 0)
    if low and high and low > high:
        raise ValueError(f"meshkit.elastic: {MIN_NPROC_ENV}={low} is larger than {MAX_NPROC_ENV}={high} "
                         "(meshkit-run sets them from -n MIN:MAX; unset them or give MIN <= MAX)")
    return (low, high) if low and high else None


@dataclass(frozen=True)
class Attempt:
    """This attempt, as :func:`attempt` reads it."""

    restart_count: int
    max_restarts: int
    world_size_range: tuple[int, int] | None

    @property
    def is_restart(self) -> bool:
        return self.restart_count > 0

    @property
    def last(self) -> bool:
        """No restart follows this attempt if it fails."""
        return self.restart_count >= self.max_restarts


def attempt() -> Attempt:
    """Everything the launcher says about this attempt, read once."""
    return Attempt(restart_count(), max_restarts(), world_size_range())
