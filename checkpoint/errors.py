"""The one error type of :mod:`meshkit.checkpoint`."""

from __future__ import annotations

from ..comm import DistError

__all__ = ["CheckpointError"]


class CheckpointError(DistError):
    """A checkpoint could not be saved or loaded: names the file or key and what was expected.

    Raised on every rank of the group together (the ranks agree on the outcome before anything
    is committed or written in place), never on some ranks while others hang.
    """
