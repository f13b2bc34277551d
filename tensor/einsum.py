"""``np.einsum`` on DTensors: the subscripts decide the sharding, per mesh dimension.

On each mesh dimension, for a letter ``L`` (an index of the subscripts):

* every operand holding ``L`` is ``Shard`` on ``L``'s dim and every other operand Replicate:
  each rank computes its part of ``L``; the output is ``Shard`` on ``L``'s output dim, or
  ``Partial(sum)`` where ``L`` is summed away (``'bhqd,bhkd->bhqk'`` with ``h`` sharded stays
  head-sharded; ``'td,dh->th'`` with ``d`` sharded gives Partial(sum), Megatron's row-parallel);
* all Replicate gives Replicate;
* one operand ``Partial(sum|avg)`` and the others Replicate (and finite: ``inf`` times a term 0
  is NaN) gives that Partial (einsum is linear in each operand); a Partial max/min is reduced.

Any other combination is made one of these by the cheapest moves (a local slice of a Replicate
before a collective; logged at DEBUG). A letter repeated inside one operand (a diagonal,
``'ii->i'``) or of size 1 against a larger size elsewhere (broadcast) is never sharded: that
mesh dim is made Replicate. ``...`` is not supported (NotImplementedError).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import errors
from .dispatch import implements
from .dtensor import DTensor
from .placements import Partial, Placement, Replicate, Shard
from .propagation import common_mesh, moved, uniform_finite, unsupported, wrap

__all__ = ["einsum", "parse_subscripts"]


def parse_subscripts(op: str, subscripts: str, ndims: Sequence[int]) -> tuple[list[str], str]:
    """``(the input terms, the output term)`` of explicit or implicit einsum subscripts."""
    text = subscripts.replace(" ", "")
    if "." in text:
        raise NotImplementedError(errors.prefix(op) + f"subscripts {subscripts!r}: '...' has no DTensor rule; "
                                  "name every dim with a letter")
    lhs, arrow, out = text.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise errors.value_error(op, f"subscripts {subscripts!r} name {len(terms)} operands but {len(ndims)} "
                                     "were given")
    for k, (t, n) in enumerate(zip(terms, ndims)):
        if len(t) != n or not t.isalpha():
            raise errors.value_error(op, f"subscripts {subscripts!r}: term {t!r} of operand {k} must be {n} "
                                         f"letters, one per dim of its shape")
    if not arrow:  # implicit: the letters seen once, alphabetically (NumPy's rule)
        letters = "".join(terms)
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, out


def _cost(src: Placement, dst: Placement) -> int:
    return 0 if src == dst else 1 if src.is_replicate() else 2


class _Spec:
    """Letters, their sizes, and which may be sharded, for one einsum call."""

    def __init__(self, op: str, terms: list[str], out: str, operands: Sequence[DTensor]) -> None:
        self.terms, self.out = terms, out
        sizes: dict[str, set[int]] = {}
        for t, x in zip(terms, operands):
            for c, n in zip(t, x.shape):
                sizes.setdefault(c, set()).add(n)
        for c in out:
            if c not in sizes:
                raise errors.value_error(op, f"output letter {c!r} appears in no input term of {terms}")
        self.sizes = {c: max(s) for c, s in sizes.items()}
        # a letter that broadcasts (size 1 beside a larger one) or is a diagonal is never cut
        self.shardable = {c for c, s in sizes.items() if len(s) == 1 and all(t.count(c) <= 1 for t in terms)}
        self.out_shape = tuple(self.sizes[c] for c in out)

    def for_letter(self, c: str) -> tuple[list[Placement], Placement]:
        """Every operand's placement and the output's when letter ``c`` is cut."""
        need = [Shard(t.index(c)) if c in t else Replicate() for t in self.terms]
        return need, Shard(self.out.index(c)) if c in self.out else Partial("sum")


def _plan(spec: _Spec, current: list[Placement], factor_ok: list[bool]) -> tuple[list[Placement], Placement]:
    """``(each operand's placement, the output's)`` on one mesh dim: kept if a rule fits, else the cheapest."""
    options: list[tuple[list[Placement], Placement]] = [([Replicate()] * len(current), Replicate())]
    for p, t in zip(current, spec.terms):
        if isinstance(p, Shard) and t[p.dim] in spec.shardable:
            options.append(spec.for_letter(t[p.dim]))
    partial = [k for k, p in enumerate(current) if p.is_partial()]
    if len(partial) == 1 and current[partial[0]].reduce_op in ("sum", "avg") and \
            all(factor_ok[j] for j in range(len(current)) if j != partial[0]):
        k = partial[0]
        options.append(([current[k] if j == k else Replicate() for j in range(len(current))], current[k]))
    return min(options, key=lambda o: sum(_cost(p, q) for p, q in zip(current, o[0])))


@implements(np.einsum)
def einsum(subscripts: Any, *operands: Any, optimize: Any = False, **kwargs: Any) -> DTensor:
    """``np.einsum(subscripts, *operands)`` on DTensors (see the module's rules)."""
    op = "np.einsum"
    for name, value in kwargs.items():
        if value is not None and not (name == "casting" and value == "safe") and not (name == "order" and value == "K"):
            raise NotImplementedError(errors.prefix(op) + f"{name}= is not supported on DTensors")
    if not isinstance(subscripts, str):
        raise NotImplementedError(errors.prefix(op) + "only the string form of subscripts is supported on DTensors")
    if not operands or not all(isinstance(x, DTensor) for x in operands):
        common_mesh(op, operands)  # names a plain array among them
        raise unsupported(op, *(x.placements for x in operands if isinstance(x, DTensor)))
    mesh = common_mesh(op, operands)
    terms, out = parse_subscripts(op, subscripts, [x.ndim for x in operands])
    spec = _Spec(op, terms, out, operands)
    # a Partial's terms times another operand are the product's terms only where that operand is
    # finite on every rank alike (see propagation.uniform_finite); scanned only when needed
    linear = any(isinstance(p, Partial) and p.reduce_op in ("sum", "avg") for x in operands for p in x.placements)
    factor_ok = [linear and uniform_finite(x) for x in operands]
    plans = [_plan(spec, [x.placements[i] for x in operands], factor_ok) for i in range(mesh.ndim)]
    blocks = [moved(op, f"operand {k}", x, [plan[0][k] for plan in plans]).to_local()
              for k, x in enumerate(operands)]
    local = np.einsum(f"{','.join(terms)}->{out}", *blocks, optimize=optimize)
    return wrap(local, mesh, [plan[1] for plan in plans], spec.out_shape)
