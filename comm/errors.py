"""Error types of meshkit: every one derives from :class:`DistError`.

Bad input raises :class:`DistValueError` / :class:`DistTypeError`, which are also plain
``ValueError`` / ``TypeError`` so that ``except ValueError`` keeps working, as in torch.
"""

from __future__ import annotations

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
    """Another rank of an in-process (``local``) job raised; this rank was woken to stop."""


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
