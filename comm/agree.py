"""``agree``: every rank learns every rank's arguments, or every rank raises the same error.

A collective call (a mesh construction, a strategy, a load, a pipeline's first step) must be given
compatible arguments on every rank: a rank that checks only its own and raises leaves the others
waiting for it in the next collective, and ranks that pass different arguments build groups, buckets
or shards that do not match (a silently wrong job). Every such check in meshkit is the same
protocol, written once here:

1. each rank sends, in one small exchange over the group (an ``all_gather_object`` by default),
   either its validated value or what is wrong with its own arguments;
2. if some rank reported a problem, every rank raises: that rank its own error, the others one
   naming it and its problem (:func:`by_ranks`);
3. otherwise every rank runs the same comparison on the same values (``compare``), so all raise the
   same error or none does, and every rank gets every rank's value back.

Over several groups (a mesh's dimensions, HSDP's shard then replicate group) the exchanges run one
after the other, each carrying what the earlier ones found: one exchange per group, and a problem
found in any group reaches every rank of the mesh.

Messages name ranks as every message of meshkit does (:mod:`.naming`: ``rank 3``, ``ranks [0, 2]``).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from .naming import by_ranks
from .objects import all_gather_object

__all__ = ["agree", "invalid_on"]


class AgreeGroup(Protocol):
    """What :func:`agree` reads of a group: its size and its members' global ranks, in order."""

    size: int
    ranks: Sequence[int]


def invalid_on(problems: list[tuple[int, str]]) -> str:
    """The default message of :func:`agree` when ranks reported problems: ``invalid arguments on ...``."""
    return f"invalid arguments on {by_ranks(problems)}"


def _all_gather_object(group: Any, payload: Any) -> list[Any]:
    out: list[Any] = [None] * group.size
    all_gather_object(out, payload, group=group)
    return out


def agree(group: AgreeGroup | Sequence[AgreeGroup], mine: Any = None, *, problem: str | None = None,
          own: BaseException | None = None, compare: Callable[[AgreeGroup, list[Any]], str | None] | None = None,
          error: Callable[[str], BaseException], invalid: Callable[[list[tuple[int, str]]], str] = invalid_on,
          combine: Callable[[list[Any]], Any] | None = None,
          exchange: Callable[[AgreeGroup, Any], Sequence[Any]] | None = None) -> Any:
    """Every rank's ``mine``, once every rank of ``group`` knows that all are valid and agree (collective).

    Every member calls it, with its value or with what is wrong with its own arguments.

    Args:
        group: the group the call is collective over; or several, exchanged over in order (a mesh's
            groups, each holding one member of every group of the exchange before: what an earlier
            exchange found then reaches every rank of the mesh).
        mine: this rank's validated value, plain data (what the object collectives carry: no class of
            one's own); ignored when ``problem`` or ``own`` is given.
        problem: what is wrong with this rank's own arguments, instead of a value.
        own: this rank's own exception instead of a value: raised on this rank after the exchange
            (the other ranks raise ``error(invalid(...))`` naming this rank and ``problem``, by default
            ``str(own)``).
        compare: ``(group, everyone's values in group-rank order) -> what is wrong, or None``, run by
            every member on the same values (so it must not depend on which rank runs it); with
            ``combine``, ``(last group, the combined value)``, once, after the last exchange.
        error: the exception every rank raises, built from the message.
        invalid: the message when ranks reported problems, from ``(global rank, problem)`` pairs.
        combine: over several groups, what a rank sends in the next exchange from everyone's values
            in this one (e.g. their union): after the last, every rank of the mesh holds the same
            combined value, compared once, so every rank raises the very same message. Without it
            each group compares its own members' values (a problem found in an exchange before the
            last reaches every rank; one found in the last, by every group whose members differ).
        exchange: ``(group, payload) -> every member's payload``, one collective (default: an
            ``all_gather_object``); e.g. an engine's unnumbered exchange before the group exists.

    Returns:
        Every member's ``mine`` over the last group, in group-rank order; with ``combine``, the
        combined value after the last exchange.

    Raises:
        ``own``: on the rank that gave it. ``error(message)``: on every other rank when any rank
        reported a problem, and on every rank when ``compare`` found one.

    Example (2 ranks; rank 1 passes ``problem="dim 3 out of range"``)::

        agree(group, {"dim": 0}, error=ValueError)      # rank 0
        # every rank raises ValueError("invalid arguments on rank 1: dim 3 out of range")
    """
    groups = [group] if hasattr(group, "ranks") else list(group)  # type: ignore[arg-type]
    if own is not None and problem is None:
        problem = str(own.args[0]) if own.args else str(own)
    gather = exchange or _all_gather_object
    verdict: str | None = None
    values: Any = []
    for g in groups:
        everyone = gather(g, (verdict, problem, None if problem is not None else mine))
        # the first verdict an earlier exchange found (the same on every rank: see Args)
        verdict = next((v for v, _, _ in everyone if v is not None), None)
        if verdict is None:
            problems = [(g.ranks[i], p) for i, (_, p, _) in enumerate(everyone) if p is not None]
            if problems:
                verdict = invalid(problems)
            elif combine is not None:
                values = mine = combine([v for _, _, v in everyone])
            else:
                values = [v for _, _, v in everyone]
                verdict = compare(g, values) if compare is not None else None
    if verdict is None and combine is not None and compare is not None:
        verdict = compare(groups[-1], values)
    if own is not None:
        raise own
    if verdict is not None:
        raise error(verdict)
    return values
