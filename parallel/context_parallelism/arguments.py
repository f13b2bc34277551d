"""Every rank of the context-parallel group checks every rank's q, k, v before any block moves; what a
forward saves of them for its backward (:class:`SavedAttention`).

One all-gather of a small int64 vector per call (:func:`meshkit.comm._seams.agree`'s exchange
here: shapes, dtypes, ``causal``, ``balanced``, ``scale``, and the head count a Ulysses split
needs): each rank then finds the same problems in the same data, so a sequence or head count that cannot be split, shapes that disagree, or one rank sharded wrong
raise the same error on every rank, naming the argument and the rank, instead of one rank raising
while the others wait for its blocks. The global sequence length is the sum of the ranks' lengths.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

from ...comm import DistValueError, ProcessGroup
from ...comm._seams import agree as comm_agree
from ..checks import where
from .sequence import SequenceSharding

__all__ = ["agree", "SavedAttention"]

@dataclasses.dataclass
class SavedAttention:
    """What a forward saves for its backward, in both variants: the group and sharding the arguments
    were checked against, the arguments, the output and each query's log-sum-exp."""

    group: ProcessGroup
    sharding: SequenceSharding
    causal: bool
    scale: float
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any


#: Dimensions of q, k, v the vector holds; more is reported as a problem (attention arrays have 3 or 4).
_DIMS = 6


def _encode(q: Any, k: Any, v: Any, causal: bool, balanced: bool, scale: float | None) -> np.ndarray:
    row = []
    for x in (q, k, v):
        shape = list(x.shape[:_DIMS]) + [-1] * (_DIMS - min(x.ndim, _DIMS))
        row += [x.ndim] + shape
    row += [np.dtype(x.dtype).num if x.dtype.kind == "f" else -1 for x in (q, k, v)]
    bits = -1 if scale is None else struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    row += [int(causal), int(balanced), bits]
    return np.asarray(row, dtype=np.int64)


def _decode(row: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, name in enumerate("qkv"):
        ndim, dims = int(row[i * (1 + _DIMS)]), row[i * (1 + _DIMS) + 1:(i + 1) * (1 + _DIMS)]
        out[name] = (ndim, tuple(int(d) for d in dims[:min(ndim, _DIMS)]))
    base = 3 * (1 + _DIMS)
    out["dtypes"] = tuple(int(d) for d in row[base:base + 3])
    out["flags"] = tuple(int(f) for f in row[base + 3:base + 6])
    return out


def agree(who: str, group: ProcessGroup, q: Any, k: Any, v: Any, *, causal: bool, balanced: bool,
          scale: float | None, heads_split: bool = False) -> SequenceSharding:
    """The sequence's sharding, after every rank checked every rank's arguments (collective).

    Raises:
        DistValueError: on every rank, naming the argument, the rank and what is valid.
    """
    found: list[SequenceSharding] = []

    def problems(g: ProcessGroup, rows: list[dict[str, Any]]) -> str | None:
        problems = _problems(rows, g.size, heads_split)
        if not problems:
            length = sum(r["q"][1][-2] for r in rows)
            if length < (2 * g.size if balanced else g.size):
                chunks = f"2 * cp = {2 * g.size} chunks (balanced)" if balanced else f"cp = {g.size} chunks"
                problems.append(f"the sequence (axis -2 of q) of {length} tokens over all ranks cannot be split into "
                                f"{chunks}: it needs at least one token per chunk")
            else:
                sharding = SequenceSharding(length, g.size, balanced)
                bad = [(rank, r["q"][1][-2], sharding.local_length(rank)) for rank, r in enumerate(rows)
                       if r["q"][1][-2] != sharding.local_length(rank)]
                if bad:
                    listed = ", ".join(f"rank {rank} has {got}, should have {want}" for rank, got, want in bad)
                    problems.append(f"q's sequence length (axis -2) does not follow the sharding of a {length}-token "
                                    f"sequence over cp = {g.size} ranks (balanced={balanced}): {listed}; shard "
                                    "inputs with shard_sequence")
                found.append(sharding)
        return "; ".join(problems) if problems else None

    comm_agree(group, _encode(q, k, v, causal, balanced, scale), compare=problems, exchange=_gather_rows,
               error=lambda message: DistValueError(f"{where(who, group)}: {message}"))
    return found[0]


def _gather_rows(group: ProcessGroup, payload: tuple[None, None, np.ndarray]) -> list[tuple[None, None, dict]]:
    """:func:`agree`'s exchange here: one all-gather of the int64 rows (no verdict or problem to carry:
    one group, and every problem is found in the rows), each decoded."""
    _, _, mine = payload
    everyone = np.empty((group.size, mine.size), dtype=np.int64)
    group.all_gather_into_tensor(everyone, mine)
    return [(None, None, _decode(r)) for r in everyone]


def _problems(rows: list[dict[str, Any]], cp: int, heads_split: bool) -> list[str]:
    problems = []
    for rank, r in enumerate(rows):
        (qn, qs), (_, ks), (vn, vs) = r["q"], r["k"], r["v"]
        if not 3 <= qn <= _DIMS:
            problems.append(f"q on rank {rank} has {qn} dims; valid: 3 to {_DIMS}, laid out "
                            "(*batch, heads, sequence, head_dim)")
            continue
        if ks != qs:
            problems.append(f"k has shape {ks} but q has shape {qs} on rank {rank}; they must be equal")
        if vn != qn or vs[:-1] != qs[:-1]:
            problems.append(f"v has shape {vs} but q has shape {qs} on rank {rank}; they may differ only in the "
                            "last (head_dim) axis")
        names = [n for n, d in zip("qkv", r["dtypes"]) if d == -1]
        if names:
            problems.append(f"{', '.join(names)} on rank {rank} must have a floating dtype")
        elif len(set(r["dtypes"])) != 1:
            problems.append(f"q, k and v on rank {rank} must have one dtype")
    if problems:
        return problems
    first = rows[0]
    for rank, r in enumerate(rows[1:], 1):
        if r["q"][1][:-2] + r["q"][1][-1:] != first["q"][1][:-2] + first["q"][1][-1:] or r["v"][1][-1] != \
                first["v"][1][-1] or r["dtypes"] != first["dtypes"]:
            problems.append(f"q on rank {rank} has shape {r['q'][1]} but rank 0's has {first['q'][1]} (v: "
                            f"{r['v'][1]} and {first['v'][1]}); ranks may differ only in the sequence axis (-2), "
                            "and must share a dtype")
        for i, name in enumerate(("causal", "balanced", "scale")):
            if r["flags"][i] != first["flags"][i]:
                problems.append(f"rank {rank} passed another {name} than rank 0; every rank must pass the same")
    heads = first["q"][1][-3]
    if heads_split and not problems and heads % cp:
        problems.append(f"q's heads (axis -3) = {heads} do not divide by cp = {cp}: the all-to-all "
                        f"(Ulysses) variant gives each rank heads / cp of them; use ring_attention, or a head "
                        "count that is a multiple of cp")
    return problems
