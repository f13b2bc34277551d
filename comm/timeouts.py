"""The timeout every blocking call honours: its default and how a user sets it."""

from __future__ import annotations

import datetime

from . import env
from .errors import DistTypeError

__all__ = ["DEFAULT_TIMEOUT", "resolve_timeout"]

#: Seconds a blocking call waits by default (torch's default for non-NCCL groups is 30 min;
#: meshkit prefers a hang reported in 5 min). Overridden by ``MESHKIT_TIMEOUT`` or ``timeout=``.
DEFAULT_TIMEOUT = 300.0


def resolve_timeout(timeout: float | datetime.timedelta | None) -> float:
    """Seconds from ``timeout`` (a number or timedelta), else ``MESHKIT_TIMEOUT``, else the default."""
    if timeout is None:
        from_env = env.timeout()
        return DEFAULT_TIMEOUT if from_env is None else from_env
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise DistTypeError(f"meshkit.comm: timeout must be seconds (float) or a timedelta, got {timeout!r}")
    return env.check_timeout(float(timeout))
