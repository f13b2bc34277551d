"""Pipeline schedules (torch.distributed.pipelining's names), as per-rank lists of actions.

A schedule is pure arithmetic: for each rank, the order in which it runs forward (``F``) and
backward (``B``) passes of (microbatch, stage) pairs; the zero-bubble schedules split the
backward into ``B`` (the input gradient, on the critical path) and ``W`` (the weight gradient,
run later, into what would be idle time). :mod:`.pipeline` executes the lists;
nothing here communicates, so every order is tested without processes.

* GPipe: all forwards, then all backwards (in the same microbatch order): every microbatch's
  activations are alive at once on every stage.
* 1F1B (PipeDream-Flush): stage ``s`` of ``p`` runs ``p - s - 1`` warm-up forwards, then
  alternates one forward and one backward, then the remaining backwards: at most ``p - s``
  microbatches' activations are alive on stage ``s``.
* Interleaved 1F1B (Megatron-LM's virtual pipeline): rank ``r`` holds the ``v`` stages ``r, r +
  p, ..., r + (v - 1) p``; microbatches go through the rank's stages in rounds of ``p``, which
  shrinks the bubble by ``v`` (Narayanan et al., 2021, sec. 2.2).

* ZB-H1 and ZB-V (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241):
  see :func:`zb_h1_order` and :func:`zbv_order`.

Bubble fractions of the ideal schedule (forward time f, backward b per microbatch and stage):
``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved; the
zero-bubble ones in :func:`bubble_fraction`, equal to :func:`simulate`'s (tested).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Action", "gpipe_order", "one_f_one_b_order", "interleaved_order", "zb_h1_order", "zbv_order",
           "simulate", "bubble_fraction"]


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
    """The ideal idle fraction of a rank: ``(p - 1) / (v m + p - 1)`` (``v = 1`` but for
    interleaved) for "gpipe", "1f1b", "interleaved"; for "zbh1" and "zbv", that of
    :func:`simulate` with the paper's equal F, B and W times (Qi et al., 2024, sec. 3):
    ``i / (3 m + i)`` idle passes ``i = max(p - 1, 2 p - 1 - m)`` for ZB-H1 (about a third of
    1F1B's once ``m >= p``), and ``i / (6 m + i)``, ``i = max(p - 1, 4 p - 2 - 2 m)`` in passes of
    one of the two chunks for ZB-V (about a sixth of 1F1B's once ``2 m >= 3 p - 1``: only the
    first forward's way to the last rank stays idle)."""
    p, m = ranks, n_microbatches
    if kind == "zbh1":
        idle = max(p - 1, 2 * p - 1 - m)
        return idle / (3 * m + idle)
    if kind == "zbv":
        idle = max(p - 1, 4 * p - 2 - 2 * m)
        return idle / (6 * m + idle)
    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"meshkit.parallel: bubble_fraction: kind must be one of gpipe, 1f1b, interleaved, zbh1, "
                         f"zbv, got {kind!r}")
    v = virtual if kind == "interleaved" else 1
    return (p - 1) / (v * m + p - 1)


# --------------------------------------------------------------------------- zero bubble (B and W split)
def zb_h1_order(stage: int, num_stages: int, n_microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2024, sec. 3.1) on ``stage``: 1F1B's forwards and input-gradient
    backwards ``B``, each followed by a weight-gradient pass ``W``; stage ``s``'s ``W`` lag its
    ``B`` by ``s`` (torch's ``_get_1f1b_rank_ops`` with ``num_1f1b_microbatches = rank``), and the
    cool-down's ``W`` fill the gaps while it waits for gradients. A stage holds at most ``p``
    microbatches (F done, W not yet): 1F1B's peak on its first stage."""
    p, s, m = num_stages, stage, n_microbatches
    warmup = min(p - s - 1, m)
    out = [Action("F", k, s) for k in range(warmup)]
    f = b = w = 0
    f = warmup
    steady = 0
    while b < m:
        if f < m:
            out.append(Action("F", f, s))
            f += 1
        out.append(Action("B", b, s))
        b += 1
        if steady >= s:
            out.append(Action("W", w, s))
            w += 1
        steady += 1
    out += [Action("W", k, s) for k in range(w, m)]
    return out


def zbv_order(rank: int, ranks: int, n_microbatches: int) -> list[Action]:
    """ZB-V (Qi et al., 2024, sec. 6; torch's ``ScheduleZBVZeroBubble``) on ``rank`` of ``ranks``.

    Rank ``r`` holds stage ``r`` (chunk 0, on the way down) and stage ``2p - 1 - r`` (chunk 1,
    on the way up): the first and last stage are on rank 0, the two middle ones on rank ``p - 1``.
    The order is torch's: warm-up forwards of chunk 0, then chunk 1 and 0 alternately, then
    F/B/W of chunk 1, a steady phase of F/B/W on each chunk, and a cool-down of B then W;
    computed for ``max(m, 2p - 1)`` microbatches and the passes of microbatches >= m dropped
    (as torch does), so any ``m >= 1`` runs.
    """
    p = ranks
    n = max(2 * p - 1, n_microbatches)
    c0, c1 = rank, 2 * p - 1 - rank
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        out.append(Action("F", f0, c0))
        f0 += 1
    for _ in range(rank):
        out += [Action("F", f1, c1), Action("F", f0, c0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - rank):
        out += [Action("F", f1, c1), Action("B", b1, c1), Action("W", b1, c1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(Action("F", f0, c0))
            f0 += 1
        out += [Action("B", b0, c0), Action("W", b0, c0), Action("F", f1, c1), Action("B", b1, c1),
                Action("W", b1, c1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out += [Action("B", b0, c0), Action("B", b1, c1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - rank):
        out += [Action("B", b0, c0), Action("W", w0, c0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [Action("W", k, c1) for k in range(w1, b1)]
    out += [Action("W", k, c0) for k in range(w0, b0)]
    return [a for a in out if a.microbatch < n_microbatches]


def simulate(orders: list[list[Action]], num_stages: int, costs: dict[str, float] | None = None
             ) -> list[float]:
    """Run every rank's order against the dependencies with pass times ``costs`` (default: 1
    each; "B" of a schedule without "W" is the whole backward) and free transfers; return each
    rank's busy fraction of the step (the step: the last pass's end). Raises ValueError on a
    deadlock or a pass out of dependency order."""
    costs = {"F": 1.0, "B": 1.0, "W": 1.0, **(costs or {})}
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * len(orders), [0.0] * len(orders)
    while any(pos[r] < len(o) for r, o in enumerate(orders)):
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                needs = []
                if a.kind == "F" and a.stage > 0:
                    needs.append(("F", a.microbatch, a.stage - 1))
                if a.kind == "B":
                    needs.append(("F", a.microbatch, a.stage))
                    if a.stage < num_stages - 1:
                        needs.append(("B", a.microbatch, a.stage + 1))
                if a.kind == "W":
                    needs.append(("B", a.microbatch, a.stage))
                if any(n not in done for n in needs):
                    break
                start = max([clock[r]] + [done[n] for n in needs])
                clock[r] = start + costs[a.kind]
                done[tuple(a)] = clock[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise ValueError(f"deadlock: ranks wait at {[o[i] if i < len(o) else None for o, i in zip(orders, pos)]}")
    end = max(clock)
    return [sum(costs[a.kind] for a in o) / end for o in orders]
