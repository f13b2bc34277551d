"""How every message of meshkit names ranks: ``rank 3`` for one, ``ranks [0, 2]`` for several.

One formatter, so that a user reads the same words whichever package raised (an agreement, a
detail-mode mismatch, the hang analyzer). Imports nothing: every module of comm may use it.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

__all__ = ["name_ranks", "by_ranks"]


def name_ranks(ranks: Sequence[int]) -> str:
    """``"rank 3"`` for one rank, ``"ranks [0, 2]"`` for several: how every message names ranks."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def by_ranks(items: Iterable[tuple[int, Any]], sep: str = ": ") -> str:
    """``"ranks [0, 2]: A; rank 1: B"``: ranks grouped by what they have (``str`` of it; None left out),
    the groups in the order of their first rank.

    ``sep`` goes between the ranks and the text (``" passed "`` gives ``"rank 1 passed B"``).
    """
    groups: dict[str, list[int]] = {}
    for rank, what in sorted(items, key=lambda item: item[0]):
        if what is not None:
            groups.setdefault(str(what), []).append(rank)
    return "; ".join(f"{name_ranks(ranks)}{sep}{text}" for text, ranks in groups.items())
