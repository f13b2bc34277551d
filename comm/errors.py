"""Error types of meshkit: every one derives from :class:`DistError`.

Bad input raises :class:`DistValueError` / :class:`DistTypeError`, which are also plain
``ValueError`` / ``TypeError`` so that ``except ValueError`` keeps working, as in torch.
"""

from __future__ import annotations

import time

__all__ = [
    "DistError",
    "DistValueError",
    "DistTypeError",
    "DistBackendError",
    "CollectiveTimeout",
    "CollectiveMismatchError",
    "RankFailedError",
    "DistStoreError",
]


class DistError(RuntimeError):
    """Base class of every error meshkit raises."""


class DistValueError(DistError, ValueError):
    """An argument has the right type but a wrong value (size, rank, shape, state)."""


class DistTypeError(DistError, TypeError):
    """An argument has the wrong type or dtype."""


class DistBackendError(DistError):
    """The collective engine failed or is not available (e.g. MPI or NCCL missing)."""


class CollectiveTimeout(DistError, TimeoutError):
    """A blocking call did not complete within the group's timeout.

    Attributes:
        op: name of the operation, e.g. ``"all_reduce"``.
        group: the group's name.
        seq: the operation's sequence number on that group (same on every rank).
        missing: global ranks that did not arrive, or ``None`` where the engine cannot know.
    """

    def __init__(self, message: str, *, op: str = "", group: str = "", seq: int = -1,
                 missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.group = group
        self.seq = seq
        self.missing = missing


class CollectiveMismatchError(DistError):
    """Ranks of a group called different collectives, or the same one with other arguments.

    Attributes:
        calls: what each global rank called, ``{rank: description}``.
    """

    def __init__(self, message: str, *, calls: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.calls = calls or {}


class RankFailedError(DistError):
    """Another rank failed, so this rank's call cannot complete.

    Raised when a peer's notice shows the call is in vain (a rank of a ``local`` job raised, a
    member broke the group), and, under ``meshkit-run --survive`` (MPI's fault tolerance), when
    the engine reports that ranks died: then ``failed_ranks`` names them and the survivors may
    carry on without them (:func:`meshkit.comm.shrink_world`, docs/elastic.md "Surviving failures").

    Attributes:
        failed_ranks: the global ranks known dead (empty where the failure is not a death).
        raised_ns: when it was made (wall clock, ns): where a survivor learnt of the failure, which
            ``meshkit-run``'s report of a survived failure times as the end of its detection.
    """

    def __init__(self, message: str, *, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = tuple(failed_ranks)
        self.raised_ns = time.time_ns()


class DistStoreError(DistError):
    """A key-value store failed: a key not set within the timeout, its server unreachable or gone.

    Attributes:
        keys: the keys still missing when a wait timed out (empty for other failures).
        waited: seconds waited before giving up, or ``None`` where nothing was waited for.
    """

    def __init__(self, message: str, *, keys: list[str] | None = None, waited: float | None = None) -> None:
        super().__init__(message)
        self.keys = list(keys or [])
        self.waited = waited
