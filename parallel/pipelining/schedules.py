"""Pipeline schedules (torch.distributed.pipelining's names), as per-rank lists of actions.

A schedule is pure arithmetic: for each rank, the order in which it runs forward (``F``) and
backward (``B``) passes of (microbatch, stage) pairs. :mod:`.pipeline` executes the lists;
nothing here communicates, so every order is tested without processes.

* GPipe: all forwards, then all backwards (in the same microbatch order): every microbatch's
  activations are alive at once on every stage.
* 1F1B (PipeDream-Flush): stage ``s`` of ``p`` runs ``p - s - 1`` warm-up forwards, then
  alternates one forward and one backward, then the remaining backwards: at most ``p - s``
  microbatches' activations are alive on stage ``s``.
* Interleaved 1F1B (Megatron-LM's virtual pipeline): rank ``r`` holds the ``v`` stages ``r, r +
  p, ..., r + (v - 1) p``; microbatches go through the rank's stages in rounds of ``p``, which
  shrinks the bubble by ``v`` (Narayanan et al., 2021, sec. 2.2).

Bubble fractions of the ideal schedule (forward time f, backward b per microbatch and stage):
``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Action", "gpipe_order", "one_f_one_b_order", "interleaved_order", "bubble_fraction"]


class Action(NamedTuple):
    """One pass: ``kind`` "F" or "B", of ``microbatch`` through ``stage``."""

    kind: str
    microbatch: int
    stage: int


def gpipe_order(stage: int, num_stages: int, n_microbatches: int) -> list[Action]:
    """GPipe on ``stage``: forwards of every microbatch, then their backwards."""
    return ([Action("F", m, stage) for m in range(n_microbatches)] +
            [Action("B", m, stage) for m in range(n_microbatches)])


def one_f_one_b_order(stage: int, num_stages: int, n_microbatches: int) -> list[Action]:
    """1F1B on ``stage``: warm-up forwards, one forward one backward, cool-down backwards."""
    warmup = min(num_stages - stage - 1, n_microbatches)
    out = [Action("F", m, stage) for m in range(warmup)]
    f, b = warmup, 0
    while f < n_microbatches:
        out.append(Action("F", f, stage))
        out.append(Action("B", b, stage))
        f, b = f + 1, b + 1
    out += [Action("B", m, stage) for m in range(b, n_microbatches)]
    return out


def interleaved_order(rank: int, ranks: int, virtual: int, n_microbatches: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B on ``rank`` of ``ranks``, holding ``virtual`` stages each.

    The k-th forward of the rank is microbatch ``(k // (p v)) p + k % p`` through its local stage
    ``(k // p) % v``; backwards go through the local stages in reverse. Warm-up is
    ``2 (p - rank - 1) + (v - 1) p`` forwards. Needs ``n_microbatches`` a multiple of ``p``.
    """
    p, v, m = ranks, virtual, n_microbatches
    total = m * v

    def forward(k: int) -> Action:
        local = (k // p) % v
        return Action("F", (k // (p * v)) * p + k % p, rank + local * p)

    def backward(k: int) -> Action:
        local = v - 1 - (k // p) % v
        return Action("B", (k // (p * v)) * p + k % p, rank + local * p)

    # Megatron-LM: with as many microbatches as ranks, every forward runs first
    warmup = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)
    out = [forward(k) for k in range(warmup)]
    f, b = warmup, 0
    while f < total:
        out.append(forward(f))
        out.append(backward(b))
        f, b = f + 1, b + 1
    out += [backward(k) for k in range(b, total)]
    return out


def bubble_fraction(kind: str, ranks: int, n_microbatches: int, virtual: int = 1) -> float:
    """The ideal idle fraction of a rank: ``(p - 1) / (v m + p - 1)`` (``v = 1`` but for interleaved)."""
    v = virtual if kind == "interleaved" else 1
    return (ranks - 1) / (v * n_microbatches + ranks - 1)
