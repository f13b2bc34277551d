"""Every sharding rule checked against NumPy: :func:`validate_rules` (torch's
``DTensor`` op tests do the same for its sharding strategies).

For every operation in the dispatch tables (:mod:`.dispatch`: each NumPy function of
``FUNCTIONS``, each ufunc of ``UFUNCS``, and every NumPy ufunc when ``UFUNC_METHODS`` has a
``__call__`` rule), plus :data:`COMPOSITES` (``logsumexp``), it takes the samples of
:func:`samples_for` (uneven shapes: 5 rows over 2 or 3 ranks), lays each input out under
every combination of placements (``Shard(d)`` for each dim, ``Replicate()``, ``Partial`` of
each reduce op the dtype allows) on the given mesh, runs the op on the DTensors and rebuilds
the global result from every rank's block and the placements the rule claimed, with no
collective of the library's (the blocks are gathered to rank 0 at the end). Compared
with the op on the whole arrays, a combination is:

* right: the same value (NaN where NumPy has NaN, floats to ``rtol=1e-7``);
* wrong: another value or shape, ranks that disagree on the placements, or Replicate blocks
  that differ: a rule that lies (the count must be zero);
* missing: the rule refused (NotImplementedError): a gap, not an error;
* an error: any other exception where NumPy had none.

A Partial input is split unevenly and with mixed signs: its terms are random and large (three
times the array's magnitude) and only their reduction is the array (for max: each term below
the value, one term equal to it), so a rule that passes a Partial through a nonlinear op
(``exp(p)``) is caught; no input is split evenly, so no symmetry hides a wrong rule. One input
never mixes Partial kinds across mesh dims (sum-then-max is not max-then-sum; the order is the
redistribution's and is not what is checked here).

Where the combinations outnumber ``max_combos`` for one sample, that many are drawn, seeded by
the sample's name and the mesh shape, so a run is the same each time (``max_combos=None``: all).
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from meshkit.comm import broadcast_object_list, gather_object, get_rank, get_world_size
from meshkit.mesh import DeviceMesh
from meshkit.tensor import dispatch, errors
from meshkit.tensor.chunks import local_shape_and_offset, local_slices
from meshkit.tensor.dtensor import DTensor
from meshkit.tensor.placements import Partial, Placement, Replicate, Shard
from meshkit.tensor.reductions import logsumexp

__all__ = ["Sample", "OpReport", "Report", "COMPOSITES", "operations", "samples_for", "validate_rules"]

#: rules outside the tables, validated alike: a function built from the table's ops, and indexing
COMPOSITES: dict[str, Any] = {"meshkit.tensor.logsumexp": logsumexp, "DTensor.__getitem__": "DTensor.__getitem__",
                              "DTensor.__setitem__": "DTensor.__setitem__"}

_KINDS = {"sum": "sum", "avg": "sum", "max": "max", "min": "min"}  # Partial ops that commute with each other


@dataclass(frozen=True)
class Sample:
    """One call to check: ``call(*inputs)`` on the whole arrays and on their DTensors."""

    label: str
    inputs: tuple[np.ndarray, ...]
    call: Callable[..., Any]


@dataclass
class OpReport:
    """What one operation gave: combinations tried, and the wrong, missing and erroring ones."""

    name: str
    tried: int = 0
    wrong: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Report:
    """Per-operation results of :func:`validate_rules`; ``no_sample`` lists table entries it could not test."""

    ops: dict[str, OpReport] = field(default_factory=dict)
    no_sample: list[str] = field(default_factory=list)
    meshes: list[tuple[int, ...]] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        """Operations, combinations tried, wrong, missing, errors."""
        rs = self.ops.values()
        return {"ops": len(self.ops), "tried": sum(r.tried for r in rs), "wrong": sum(len(r.wrong) for r in rs),
                "missing": sum(len(r.missing) for r in rs), "errors": sum(len(r.errors) for r in rs)}

    def merge(self, other: Report) -> Report:
        """This report and ``other`` (another mesh's) together."""
        out = Report(meshes=self.meshes + other.meshes,
                     no_sample=sorted(set(self.no_sample) | set(other.no_sample)))
        for name in dict.fromkeys([*self.ops, *other.ops]):
            a, b = self.ops.get(name, OpReport(name)), other.ops.get(name, OpReport(name))
            out.ops[name] = OpReport(name, a.tried + b.tried, a.wrong + b.wrong, a.missing + b.missing,
                                     a.errors + b.errors)
        return out

    def summary(self, *, examples: int = 3) -> str:
        """A few lines: the totals, then every operation with something wrong, missing or erroring."""
        t = self.totals()
        lines = [f"meshes {self.meshes}: {t['ops']} ops, {t['tried']} placement combinations tried, "
                 f"{t['wrong']} wrong, {t['missing']} missing (refused), {t['errors']} errors"]
        for r in self.ops.values():
            for what in ("wrong", "errors", "missing"):
                found = getattr(r, what)
                if found:
                    lines.append(f"  {r.name}: {len(found)} {what}/{r.tried}, e.g. " + "; ".join(found[:examples]))
        if self.no_sample:
            lines.append(f"  no sample: {', '.join(self.no_sample)}")
        return "\n".join(lines)


def _name(op: Any) -> str:
    if isinstance(op, str):
        return op
    module = getattr(op, "__module__", "") or ""
    return f"np.linalg.{op.__name__}" if module == "numpy.linalg" else f"np.{op.__name__}"


def operations() -> dict[str, Any]:
    """Every operation with a DTensor rule, by name, read from the dispatch tables (not hand-listed)."""
    ops: dict[str, Any] = {}
    for f in dispatch.FUNCTIONS:
        ops.setdefault(_name(f), f)
    for u in dispatch.UFUNCS:
        ops.setdefault(_name(u), u)
    if "__call__" in dispatch.UFUNC_METHODS:
        for name in sorted(dir(np)):
            u = getattr(np, name)
            if isinstance(u, np.ufunc) and u not in dispatch.UFUNCS:
                ops.setdefault(_name(u), u)
    ops.update(COMPOSITES)
    return ops


# ---- samples ---------------------------------------------------------------------------------

def _rng(label: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(label.encode()))


def _ufunc_dtypes(u: np.ufunc) -> tuple[np.dtype, ...] | None:
    """The input dtypes to sample ``u`` with: its float64 loop, else int64, else bool, else mixed."""
    loops = [t.split("->")[0] for t in u.types]
    for want in ("d" * u.nin, "l" * u.nin, "q" * u.nin, "?" * u.nin):
        if want in loops:
            return tuple(np.dtype(c) for c in want)
    for codes in loops:  # ldexp's 'dl', isnat's 'M'
        if all(c in "dlqM" for c in codes):
            return tuple(np.dtype("M8[s]" if c == "M" else c) for c in codes)
    return None


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    kind = np.dtype(dtype).kind
    if kind == "f":
        return rng.standard_normal(shape)
    if kind == "b":
        return rng.random(shape) < 0.5
    if kind == "M":
        return rng.integers(0, 10**9, shape).astype(dtype)
    return rng.integers(0, 6, shape).astype(dtype)


#: input shapes for the generalized ufuncs (np.matvec...), by signature
_CORE_SHAPES = {"(m,n),(n)->(m)": ((5, 6), (6,)), "(n),(n)->()": ((5, 6), (5, 6)),
                "(n),(n,m)->(m)": ((6,), (6, 5))}


def _ufunc_samples(u: np.ufunc) -> list[Sample]:
    dtypes = _ufunc_dtypes(u)
    if dtypes is None or u.nin not in (1, 2):
        return []
    rng = _rng(u.__name__)
    name = f"np.{u.__name__}"
    if u.signature is not None:
        shapes = _CORE_SHAPES.get(u.signature.replace(" ", ""))
        return [] if shapes is None else \
            [Sample(f"{name}{shapes}", tuple(_values(rng, sh, dt) for sh, dt in zip(shapes, dtypes)), u)]
    x = _values(rng, (5, 6), dtypes[0])
    if u.nin == 1:
        return [Sample(f"{name}(x(5,6))", (x,), u)]
    y, row = _values(rng, (5, 6), dtypes[1]), _values(rng, (6,), dtypes[1])
    scalar = dtypes[1].type(2) if dtypes[1].kind != "b" else np.True_
    out = [Sample(f"{name}(x(5,6), y(5,6))", (x, y), u),
           Sample(f"{name}(x(5,6), row(6,))", (x, row), u),
           Sample(f"{name}(x(5,6), {scalar!r})", (x,), lambda a, u=u, s=scalar: u(a, s))]
    if u in (np.add, np.maximum):  # a block of no rows on trailing ranks
        out.append(Sample(f"{name}(x(1,6), row(6,))", (x[:1], row), u))
    if u in (np.add, np.subtract, np.multiply, np.divide):  # the rules that keep a Partial: at inf, 0, -0.0, NaN
        special = np.array([np.inf, -np.inf, 0.0, -0.0, np.nan, 1.0])
        out += [Sample(f"{name}(x(5,6), special(6,))", (x, special), u),
                Sample(f"{name}(special(6,), x(5,6))", (special, x), u),
                Sample(f"{name}(x(5,6), inf)", (x,), lambda a, u=u: u(a, np.inf))]
    return out


def _function_samples(f: Any) -> list[Sample] | None:
    """Hand-written samples for the NumPy functions with rules (None: none known for ``f``)."""
    r = _rng(_name(f))
    x, x3 = r.standard_normal((5, 6)), r.standard_normal((5, 6, 3))
    ints = r.integers(-9, 9, (5, 6))
    reductions = [(np.sum,), (np.mean,), (np.max, np.amax), (np.min, np.amin)]
    for group in reductions:
        if f in group:
            return [Sample(f"{_name(f)}(x, axis=0)", (x,), lambda a: f(a, axis=0)),
                    Sample(f"{_name(f)}(x, axis=1, keepdims=True)", (x,), lambda a: f(a, axis=1, keepdims=True)),
                    Sample(f"{_name(f)}(x3, axis=(0, 2))", (x3,), lambda a: f(a, axis=(0, 2))),
                    Sample(f"{_name(f)}(x)", (x,), lambda a: f(a)),
                    Sample(f"{_name(f)}(x(1,6), axis=0)", (x[:1],), lambda a: f(a, axis=0)),  # empty blocks
                    Sample(f"{_name(f)}(ints, axis=1)", (ints,), lambda a: f(a, axis=1)),
                    Sample(f"{_name(f)}(bools, axis=0)", (ints > 2,), lambda a: f(a, axis=0))]
    cond, cond_col = r.random((5, 6)) < 0.5, r.random((5, 1)) < 0.5
    a, b, c = r.standard_normal((5, 7)), r.standard_normal((7, 3)), r.standard_normal((2, 5, 4))
    q, k = r.standard_normal((2, 3, 5, 4)), r.standard_normal((2, 3, 7, 4))
    p = r.standard_normal((2, 3, 5, 7))
    table: dict[Any, list[Sample]] = {
        np.where: [Sample("np.where(cond, x, row)", (cond, x, x[0]), np.where),
                   Sample("np.where(cond(5,1), x, y)", (cond_col, x, -x), np.where)],
        np.clip: [Sample("np.clip(x, -0.5, 0.5)", (x,), lambda t: np.clip(t, -0.5, 0.5)),
                  Sample("np.clip(x, lo, None)", (x, x[:, :1]), lambda t, lo: np.clip(t, lo, None))],
        np.transpose: [Sample("np.transpose(x)", (x,), np.transpose),
                       Sample("np.transpose(x3, (1, 2, 0))", (x3,), lambda t: np.transpose(t, (1, 2, 0)))],
        np.reshape: [Sample("np.reshape(x(5,6), (5, 2, 3))", (x,), lambda t: np.reshape(t, (5, 2, 3))),
                     Sample("np.reshape(x(5,6), (30,))", (x,), lambda t: np.reshape(t, (30,))),
                     Sample("np.reshape(x3(5,6,3), (5, 18))", (x3,), lambda t: np.reshape(t, (5, 18)))],
        np.copy: [Sample("np.copy(x)", (x,), np.copy)],
        np.astype: [Sample("np.astype(x, float32)", (x,), lambda t: np.astype(t, np.float32)),
                    Sample("np.astype(x*3, int64)", (x * 3,), lambda t: np.astype(t, np.int64)),
                    Sample("np.astype(cond, int64)", (cond,), lambda t: np.astype(t, np.int64))],
        np.shape: [Sample("np.shape(x)", (x,), np.shape)],
        np.ndim: [Sample("np.ndim(x)", (x,), np.ndim)],
        np.size: [Sample("np.size(x)", (x,), np.size)],
        np.dot: [Sample("np.dot(a(5,7), b(7,3))", (a, b), np.dot)],
        np.einsum: [Sample("einsum('td,dh->th')", (a, b), lambda s, t: np.einsum("td,dh->th", s, t)),
                    Sample("einsum('bhqd,bhkd->bhqk')", (q, k), lambda s, t: np.einsum("bhqd,bhkd->bhqk", s, t)),
                    Sample("einsum('bhqk,bhkd->bhqd')", (p, k), lambda s, t: np.einsum("bhqk,bhkd->bhqd", s, t)),
                    Sample("einsum('ij->i')", (x,), lambda s: np.einsum("ij->i", s)),
                    Sample("einsum('ij,ij')", (x, -x), lambda s, t: np.einsum("ij,ij", s, t)),
                    Sample("einsum('tec,td->ecd')", (r.standard_normal((5, 2, 3)), a),
                           lambda s, t: np.einsum("tec,td->ecd", s, t)),
                    Sample("einsum('ii->i')", (x[:5, :5],), lambda s: np.einsum("ii->i", s))],
        np.concatenate: [Sample("np.concatenate([x(5,6), y(3,6)])", (x, x3[:3, :, 0]),
                                lambda s, t: np.concatenate([s, t])),
                         Sample("np.concatenate([x(5,6), y(5,3)], axis=1)", (x, x3[:, :3, 1]),
                                lambda s, t: np.concatenate([s, t], axis=1)),
                         Sample("np.concatenate([x, y], axis=None)", (x, a),
                                lambda s, t: np.concatenate([s, t], axis=None))],
        np.split: [Sample("np.split(x(6,5), 3)", (x.T,), lambda s: np.split(s, 3)),
                   Sample("np.split(x(5,6), [2, -1], axis=1)", (x,), lambda s: np.split(s, [2, -1], axis=1))],
        np.array_split: [Sample("np.array_split(x(5,6), 2)", (x,), lambda s: np.array_split(s, 2)),
                         Sample("np.array_split(x(5,6), 4, axis=1)", (x,), lambda s: np.array_split(s, 4, axis=1))],
        np.take: [Sample("np.take(x, [[0, 4], [2, 2]], axis=0)", (x,), lambda s: np.take(s, [[0, 4], [2, 2]], axis=0)),
                  Sample("np.take(x3, [5, -1, 0], axis=1)", (x3,), lambda s: np.take(s, [5, -1, 0], axis=1)),
                  Sample("np.take(x, 3, axis=1)", (x,), lambda s: np.take(s, 3, axis=1)),
                  Sample("np.take(x, [7, 0])", (x,), lambda s: np.take(s, [7, 0]))],
    }
    table.update(_new_samples(f, r, x, x3, ints))
    if f in table:
        return table[f]
    if f is np.matmul:
        return [Sample("a(5,7) @ b(7,3)", (a, b), np.matmul),
                Sample("c(2,5,4) @ b(4,3)", (c, b[:4]), np.matmul),
                Sample("c(2,5,4) @ d(2,4,3)", (c, r.standard_normal((2, 4, 3))), np.matmul)]
    if f == "DTensor.__getitem__":  # indexing (indexing.py), not a table entry but a rule all the same
        return [Sample("x3[1:4]", (x3,), lambda t: t[1:4]), Sample("x3[2]", (x3,), lambda t: t[2]),
                Sample("x3[:, None, -2:, 1]", (x3,), lambda t: t[:, None, -2:, 1]),
                Sample("x3[..., ::2]", (x3,), lambda t: t[..., ::2]),
                Sample("x[::-1]", (x,), lambda t: t[::-1]), Sample("x[1:4, 5:0:-2]", (x,), lambda t: t[1:4, 5:0:-2]),
                Sample("x[[0, 3, -1]]", (x,), lambda t: t[[0, 3, -1]]),
                Sample("x[:, [5, 0]]", (x,), lambda t: t[:, [5, 0]]),
                Sample("x[[0, 3, -1], [5, 0, 2]]", (x,), lambda t: t[[0, 3, -1], [5, 0, 2]]),
                Sample("x[[[0], [4]], [1, 3, 5]]", (x,), lambda t: t[[[0], [4]], [1, 3, 5]]),
                Sample("x3[[0, 1], [2, 3]]", (x3,), lambda t: t[[0, 1], [2, 3]]),
                Sample("x3[[0, 4], :, [1, 2]]", (x3,), lambda t: t[[0, 4], :, [1, 2]]),
                Sample("x3[:, [1, 5], 2]", (x3,), lambda t: t[:, [1, 5], 2]),
                Sample("x[x > 0]", (x,), lambda t: t[t > 0]),
                Sample("x3[cond]", (x3, cond), lambda t, c: t[c])]
    if f == "DTensor.__setitem__":  # writes: each rank its own part (indexing.setitem)
        return [Sample("x[1, 2] = 5", (x,), lambda t: _set(t, (1, 2), 5.0)),
                Sample("x[1:4, ::2] = row", (x,), lambda t: _set(t, (slice(1, 4), slice(None, None, 2)), x[0, ::2])),
                Sample("x[-1] = nan", (x,), lambda t: _set(t, -1, np.nan)),
                Sample("ints[:, 3] = 7", (ints,), lambda t: _set(t, (slice(None), 3), 7)),
                Sample("x += 1.5; x -= 0.25", (x,), _shift),
                Sample("x[x > 0.5] = -1", (x,), lambda t: _set(t, t > 0.5, -1.0)),
                Sample("x[cond] = 0 (cond plain)", (x,), lambda t: _set(t, cond, 0.0))]
    if f is logsumexp:
        return [Sample("logsumexp(x, axis=1)", (x,), lambda s: logsumexp(s, axis=1)),
                Sample("logsumexp(x3, axis=0, keepdims=True)", (x3 * 30,),
                       lambda s: logsumexp(s, axis=0, keepdims=True)),
                Sample("logsumexp(x)", (x,), logsumexp)]
    return None


def _pad_with_line_sum(vector: Any, widths: Any, axis: int, kwargs: dict) -> None:
    """np.pad's callable mode: the pad holds the line's sum (it reads the whole line)."""
    if widths[0] or widths[1]:
        total = vector[widths[0]:vector.size - widths[1]].sum()
        vector[:widths[0]] = total
        vector[vector.size - widths[1]:] = total


def _set(t: Any, key: Any, value: Any) -> Any:
    t = t.copy()
    t[key] = value
    return t


def _shift(t: Any) -> Any:
    t = t.copy()
    t += 1.5
    t -= 0.25
    return t


def _new_samples(f: Any, r: np.random.Generator, x: np.ndarray, x3: np.ndarray, ints: np.ndarray
                 ) -> dict[Any, list[Sample]]:
    """Samples of the statistics, scans, sorting, movement and linalg rules (issue 40): float64,
    float32, int, bool and complex inputs where NumPy takes them, and NaN."""
    nan = x.copy()
    nan[1, 2] = np.nan
    nan[4, 0] = np.nan
    f32 = x.astype(np.float32)
    bools = ints > 0
    cplx = x + 1j * x[::-1]  # complex: NumPy orders by real part, then imaginary
    cplx_ties = np.round(x) + 1j * ints  # many equal real parts, told apart by the imaginary ones
    cplx_ties[2, 3] = complex(np.nan, 1.0)
    tall = r.standard_normal((13, 3))  # more rows per block than columns: the TSQR of matrix norms
    w6, w5 = np.array([1.0, 2.0, 0.5, 3.0, 1.5, 0.25]), np.array([1.0, 2.0, 0.5, 3.0, 1.5])
    n = _name(f)

    def axes(fn: Any, *, kinds: tuple[str, ...] = ("x", "ints", "f32", "nan", "bools"), **kw: Any) -> list[Sample]:
        data = {"x": x, "ints": ints, "f32": f32, "nan": nan, "bools": bools}
        # one sample per dtype, the axes varied across them (CI runs every sample on 4 meshes)
        out = [Sample(f"{n}(x3, axis=(0, 2))", (x3,), lambda a: fn(a, axis=(0, 2), **kw)),
               Sample(f"{n}(x(1,6), axis=0)", (x[:1],), lambda a: fn(a, axis=0, **kw))]  # empty blocks
        for k, ax in zip(kinds, (None, 1, 0, None, 1)):
            out.append(Sample(f"{n}({k}, axis={ax})", (data[k],), lambda a, ax=ax: fn(a, axis=ax, **kw)))
        return out

    def along(fn: Any, label: str, *, kinds: tuple[str, ...] = ("x", "ints", "f32", "nan")) -> list[Sample]:
        data = {"x": x, "ints": ints, "f32": f32, "nan": nan, "bools": bools}
        out = [Sample(f"{n}(x, axis={ax}{label})", (x,), lambda a, ax=ax: fn(a, ax)) for ax in (0, 1)]
        out += [Sample(f"{n}({k}, axis={ax}{label})", (data[k],), lambda a, ax=ax: fn(a, ax))
                for k, ax in zip(kinds[1:], (0, 1, 0))]
        out.append(Sample(f"{n}(x3, axis=2{label})", (x3,), lambda a: fn(a, 2)))
        return out

    table: dict[Any, list[Sample]] = {
        np.var: axes(np.var) + [Sample("np.var(x, axis=0, ddof=1, keepdims=True)", (x * 1e8 + 3e9,),
                                       lambda a: np.var(a, axis=0, ddof=1, keepdims=True)),
                                Sample("np.var(cplx, axis=0)", (cplx,), lambda a: np.var(a, axis=0)),
                                Sample("np.var(c64)", (cplx.astype(np.complex64),), np.var)],
        np.std: axes(np.std, ddof=1) + [Sample("np.std(cplx, axis=1)", (cplx,), lambda a: np.std(a, axis=1))],
        np.average: [Sample("np.average(x, axis=1, weights=w6)", (x,), lambda a: np.average(a, axis=1, weights=w6)),
                     Sample("np.average(ints, axis=0, weights=w5)", (ints,),
                            lambda a: np.average(a, axis=0, weights=w5)),
                     Sample("np.average(x, weights=x-shaped)", (x,), lambda a: np.average(a, weights=np.abs(x) + 1)),
                     Sample("np.average(f32, axis=0)", (f32,), lambda a: np.average(a, axis=0))],
        np.count_nonzero: [Sample("np.count_nonzero(ints)", (ints,), np.count_nonzero),
                           Sample("np.count_nonzero(ints, axis=0)", (ints,), lambda a: np.count_nonzero(a, axis=0)),
                           Sample("np.count_nonzero(bools, axis=1)", (bools,), lambda a: np.count_nonzero(a, axis=1)),
                           Sample("np.count_nonzero(x3, axis=(0, 2))", (x3,),
                                  lambda a: np.count_nonzero(a, axis=(0, 2)))],
        np.any: axes(np.any, kinds=("ints", "bools", "nan")),
        np.all: axes(np.all, kinds=("ints", "bools", "nan")),
        np.prod: axes(np.prod),
        np.argmax: [
            Sample(f"np.argmax({k}{a})", (v,), lambda t, ax=ax: np.argmax(t, axis=ax))
            for k, v in (("x", x), ("ints", ints), ("nan", nan), ("bools", bools), ("f32", f32))
            for a, ax in (("", None), (", axis=0", 0), (", axis=1", 1))]
        + [Sample("np.argmax(x3, axis=2)", (x3,), lambda t: np.argmax(t, axis=2))]
        + [Sample(f"np.argmax({k}{a})", (v,), lambda t, ax=ax: np.argmax(t, axis=ax))
           for k, v in (("cplx", cplx), ("cplx ties", cplx_ties))
           for a, ax in (("", None), (", axis=0", 0), (", axis=1", 1))],
        np.argmin: [Sample(f"np.argmin({k}{a})", (v,), lambda t, ax=ax: np.argmin(t, axis=ax))
                    for k, v in (("x", x), ("ints", ints // 3), ("nan", nan), ("bools", bools))
                    for a, ax in (("", None), (", axis=0", 0), (", axis=1", 1))]
        + [Sample("np.argmin(x3, axis=1, keepdims=True)", (x3,), lambda t: np.argmin(t, axis=1, keepdims=True)),
           Sample("np.argmin(cplx ties)", (cplx_ties,), np.argmin),
           Sample("np.argmin(cplx ties, axis=0)", (cplx_ties,), lambda t: np.argmin(t, axis=0))],
        np.median: axes(np.median, kinds=("x", "ints", "f32", "nan")),
        np.cumsum: along(np.cumsum, "") + [Sample("np.cumsum(bools, axis=0)", (bools,), lambda a: np.cumsum(a, 0)),
                                           Sample("np.cumsum(x)", (x,), np.cumsum),
                                           Sample("np.cumsum(x[0])", (x[0],), np.cumsum)],
        np.cumprod: along(np.cumprod, ""),
        np.sort: along(np.sort, "") + [Sample("np.sort(x, axis=None)", (x,), lambda a: np.sort(a, axis=None)),
                                       Sample("np.sort(x[0])", (x[0],), np.sort)],
        np.argsort: along(lambda a, ax: np.argsort(a, axis=ax, stable=True), ", stable"),
        np.diff: along(np.diff, "") + [Sample("np.diff(x, n=2, axis=0)", (x,), lambda a: np.diff(a, n=2, axis=0)),
                                       Sample("np.diff(x, axis=0, prepend=0.5)", (x,),
                                              lambda a: np.diff(a, axis=0, prepend=0.5)),
                                       Sample("np.diff(x, n=2, axis=1, prepend=col, append=2 cols)", (x,),
                                              lambda a: np.diff(a, n=2, axis=1, prepend=x[:, :1],
                                                                append=x[:, :2] * 3))],
        np.roll: along(lambda a, ax: np.roll(a, 2, axis=ax), ", 2") + [
            Sample("np.roll(x, -3)", (x,), lambda a: np.roll(a, -3)),
            Sample("np.roll(x, (1, 2), axis=(0, 1))", (x,), lambda a: np.roll(a, (1, 2), axis=(0, 1)))],
        np.flip: along(np.flip, "") + [Sample("np.flip(x)", (x,), np.flip)],
        np.pad: [Sample("np.pad(x, 1)", (x,), lambda a: np.pad(a, 1)),
                 Sample("np.pad(x, ((0, 0), (2, 1)))", (x,), lambda a: np.pad(a, ((0, 0), (2, 1)))),
                 Sample("np.pad(x, ((1, 2), (0, 0)), constant_values=3)", (x,),
                        lambda a: np.pad(a, ((1, 2), (0, 0)), constant_values=3)),
                 Sample("np.pad(ints, 2, mode='reflect')", (ints,), lambda a: np.pad(a, 2, mode="reflect")),
                 Sample("np.pad(x, 1, mode='edge')", (x,), lambda a: np.pad(a, 1, mode="edge")),
                 Sample("np.pad(x, 2, mode='linear_ramp', end_values=(1, -2))", (x,),
                        lambda a: np.pad(a, 2, mode="linear_ramp", end_values=(1, -2))),
                 Sample("np.pad(x, ((1, 2), (0, 1)), mode='maximum', stat_length=3)", (x,),
                        lambda a: np.pad(a, ((1, 2), (0, 1)), mode="maximum", stat_length=3)),
                 Sample("np.pad(ints, 1, mode='minimum')", (ints,), lambda a: np.pad(a, 1, mode="minimum")),
                 Sample("np.pad(x, ((2, 1), (1, 0)), mode='mean')", (x,),
                        lambda a: np.pad(a, ((2, 1), (1, 0)), mode="mean")),
                 Sample("np.pad(ints, 1, mode='mean')", (ints,), lambda a: np.pad(a, 1, mode="mean")),
                 Sample("np.pad(x, (0, 2), mode='median', stat_length=2)", (x,),
                        lambda a: np.pad(a, (0, 2), mode="median", stat_length=2)),
                 Sample("np.pad(x, 1, mode=callable)", (x,), lambda a: np.pad(a, 1, mode=_pad_with_line_sum))],
        np.linalg.norm: [Sample("np.linalg.norm(x)", (x,), np.linalg.norm),
                         Sample("np.linalg.norm(x3, keepdims=True)", (x3,), lambda a: np.linalg.norm(a, keepdims=True)),
                         Sample("np.linalg.norm(cplx)", (cplx,), np.linalg.norm),
                         Sample("np.linalg.norm(nan)", (nan,), np.linalg.norm),
                         Sample("np.linalg.norm(ints, axis=0)", (ints,), lambda a: np.linalg.norm(a, axis=0)),
                         Sample("np.linalg.norm(f32, axis=1)", (f32,), lambda a: np.linalg.norm(a, axis=1)),
                         Sample("np.linalg.norm(x, inf, axis=1)", (x,), lambda a: np.linalg.norm(a, np.inf, axis=1)),
                         Sample("np.linalg.norm(x, -inf, axis=0)", (x,), lambda a: np.linalg.norm(a, -np.inf, axis=0)),
                         Sample("np.linalg.norm(x, 1, axis=0, keepdims=True)", (x,),
                                lambda a: np.linalg.norm(a, 1, axis=0, keepdims=True)),
                         Sample("np.linalg.norm(x, 3, axis=1)", (x,), lambda a: np.linalg.norm(a, 3, axis=1)),
                         Sample("np.linalg.norm(x3, axis=(0, 2))", (x3,), lambda a: np.linalg.norm(a, axis=(0, 2))),
                         Sample("np.linalg.norm(x, 'fro')", (x,), lambda a: np.linalg.norm(a, "fro")),
                         Sample("np.linalg.norm(tall, 2)", (tall,), lambda a: np.linalg.norm(a, 2)),
                         Sample("np.linalg.norm(tall, -2)", (tall,), lambda a: np.linalg.norm(a, -2)),
                         Sample("np.linalg.norm(tall.T, 'nuc')", (tall.T.copy(),), lambda a: np.linalg.norm(a, "nuc")),
                         Sample("np.linalg.norm(x, 'nuc', keepdims=True)", (x,),
                                lambda a: np.linalg.norm(a, "nuc", keepdims=True)),
                         Sample("np.linalg.norm(cplx, 2)", (cplx,), lambda a: np.linalg.norm(a, 2)),
                         Sample("np.linalg.norm(ints, 1)", (ints,), lambda a: np.linalg.norm(a, 1)),
                         Sample("np.linalg.norm(x, -1, axis=(1, 0))", (x,),
                                lambda a: np.linalg.norm(a, -1, axis=(1, 0))),
                         Sample("np.linalg.norm(x, inf)", (x,), lambda a: np.linalg.norm(a, np.inf)),
                         Sample("np.linalg.norm(x, -inf, keepdims=True)", (x,),
                                lambda a: np.linalg.norm(a, -np.inf, keepdims=True))],
        np.outer: [Sample("np.outer(x[0], x[:, 1])", (x[0], x[:, 1]), np.outer),
                   Sample("np.outer(ints, x[0])", (ints, x[0]), np.outer)],
        np.trace: [Sample("np.trace(x)", (x,), np.trace), Sample("np.trace(x, offset=2)", (x,),
                                                                  lambda a: np.trace(a, offset=2)),
                   Sample("np.trace(ints, offset=-1)", (ints,), lambda a: np.trace(a, offset=-1)),
                   Sample("np.trace(nan)", (nan,), np.trace)],
        np.tensordot: [Sample("np.tensordot(x, x, ([1], [1]))", (x, x), lambda a, b: np.tensordot(a, b, ([1], [1]))),
                       Sample("np.tensordot(x3, x, ([0, 1], [0, 1]))", (x3, x),
                              lambda a, b: np.tensordot(a, b, ([0, 1], [0, 1]))),
                       Sample("np.tensordot(x, x3, 0)", (x[:2, :2], x3[:2, :2, :2]),
                              lambda a, b: np.tensordot(a, b, 0))],
        np.dot: [Sample("np.dot(a(5,7), b(7,3))", (r.standard_normal((5, 7)), r.standard_normal((7, 3))), np.dot),
                 Sample("np.dot(x, x[0])", (x, x[0]), np.dot), Sample("np.dot(x[:, 0], x)", (x[:, 0], x), np.dot),
                 Sample("np.dot(x[0], x[1])", (x[0], x[1]), np.dot),
                 Sample("np.dot(x3, x[:3, :2])", (x3, x[:3, :2]), np.dot)],
    }
    return {f: table[f]} if f in table else {}


def samples_for(op: Any) -> list[Sample]:
    """The samples for one operation (a table key or a :data:`COMPOSITES` value); [] if none is known."""
    if isinstance(op, np.ufunc) and op not in dispatch.UFUNCS:
        return _ufunc_samples(op)
    return _function_samples(op) or []


# ---- placements ------------------------------------------------------------------------------

def _partial_ops(dtype: np.dtype) -> tuple[str, ...]:
    # complex numbers have no max or min reduction (the collectives refuse them): sum and avg only
    return {"f": ("sum", "avg", "max", "min"), "b": ("max", "min"), "M": (), "c": ("sum", "avg")}.get(
        dtype.kind, ("sum", "max", "min"))


def _choices(x: np.ndarray, mesh_ndim: int) -> list[tuple[Placement, ...]]:
    """Every placement tuple ``x`` may take on a mesh of ``mesh_ndim`` dims (one Partial kind per input)."""
    one = [*(Shard(d) for d in range(x.ndim)), Replicate(), *(Partial(op) for op in _partial_ops(x.dtype))]
    out = []
    for combo in itertools.product(one, repeat=mesh_ndim):
        kinds = {_KINDS[p.reduce_op] for p in combo if isinstance(p, Partial)}
        if len(kinds) <= 1:
            out.append(combo)
    return out


def _combos(sample: Sample, mesh_shape: tuple[int, ...], max_combos: int | None
            ) -> list[tuple[tuple[Placement, ...], ...]]:
    """The placement combinations to try for ``sample``: all, or ``max_combos`` drawn (deterministically)."""
    per_input = [_choices(x, len(mesh_shape)) for x in sample.inputs]
    total = math.prod(len(c) for c in per_input)
    if max_combos is None or total <= max_combos:
        picks: Iterable[int] = range(total)
    else:
        picks = sorted(_rng(f"{sample.label}{mesh_shape}").choice(total, max_combos, replace=False).tolist())
    out = []
    for n in picks:
        combo = []
        for c in per_input:  # n in mixed radix: one digit per input
            n, digit = divmod(n, len(c))
            combo.append(c[digit])
        out.append(tuple(combo))
    return out


def _terms(value: np.ndarray, op: str, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``n`` terms whose ``op`` reduction is ``value``: uneven, large, of either sign."""
    if n == 1:
        return [value]
    kind = value.dtype.kind
    # three times the largest finite magnitude: a term inf would make the last one inf - inf = NaN
    # (float32: half of it, or its 24 bits would round the split of 6 nested terms past 1e-5)
    scale = (3 if value.dtype != np.float32 else 0.5) * \
        (float(np.max(np.abs(value), initial=0, where=np.isfinite(value))) + 1) if kind == "f" else 0
    if op in ("sum", "avg"):
        target = value * n if op == "avg" else value
        noise = [(rng.standard_normal(value.shape) * scale).astype(value.dtype) if kind == "f" else
                 rng.integers(-50, 50, value.shape).astype(value.dtype) for _ in range(n - 1)]
        terms = [*noise, target - sum(noise)]
        if kind == "f":
            # a zero stays exact only as zero terms: t + (0 - t) nested over mesh dims and summed
            # in the collective's order is a rounding error (1e-16 x / that is not inf), and
            # t + -t is +0.0 where the value is -0.0
            terms = [np.where(value == 0, value, t) for t in terms]
        return terms
    sign = 1 if op == "min" else -1  # max: terms at or below the value; min: at or above
    if kind == "b":
        terms = [(value | (rng.random(value.shape) < 0.5)) if op == "min" else (value & (rng.random(value.shape) < 0.5))
                 for _ in range(n)]
    elif kind == "f":
        terms = [(value + sign * np.abs(rng.standard_normal(value.shape)) * scale).astype(value.dtype)
                 for _ in range(n)]
    else:
        terms = [value + sign * rng.integers(0, 50, value.shape).astype(value.dtype) for _ in range(n)]
    winner = rng.integers(0, n, value.shape)
    for k in range(n):  # one term of each element is the value itself
        terms[k] = np.where(winner == k, value, terms[k])
    return terms


def _block(x: np.ndarray, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
           placements: tuple[Placement, ...], rng: np.random.Generator) -> np.ndarray:
    """This coordinate's block of ``x`` under ``placements`` (Partial terms drawn alike on every rank)."""
    value = x
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            value = _terms(value, p.reduce_op, mesh_shape[i], rng)[coordinate[i]]
    return np.ascontiguousarray(value[local_slices(x.shape, mesh_shape, coordinate, placements)])


# ---- running and checking --------------------------------------------------------------------

def _record(out: Any) -> Any:
    """What a rank sends back for one result: blocks with their layout, or plain values."""
    if isinstance(out, DTensor):
        return ("dtensor", np.asarray(out.to_local()), out.placements, out.shape)
    if isinstance(out, (list, tuple)) and any(isinstance(o, DTensor) for o in out):
        return ("many", [_record(o) for o in out])
    return ("value", out)


def _assemble(records: list[Any], coords: list[tuple[int, ...]], mesh_shape: tuple[int, ...]) -> Any:
    """The global array the ranks' blocks and claimed placements stand for; raises AssertionError if they lie."""
    kinds = {r[0] for r in records}
    if len(kinds) != 1:
        raise AssertionError(f"ranks returned different kinds of result {sorted(kinds)}")
    kind = records[0][0]
    if kind == "value":
        return records[0][1]
    if kind == "many":
        n = {len(r[1]) for r in records}
        if len(n) != 1:
            raise AssertionError(f"ranks returned {sorted(n)} pieces")
        return [_assemble([r[1][j] for r in records], coords, mesh_shape) for j in range(n.pop())]
    layouts = {(r[2], r[3]) for r in records}
    if len(layouts) != 1:
        raise AssertionError(f"ranks claim different placements/shapes {sorted(map(str, layouts))}")
    placements, shape = records[0][2], records[0][3]
    by_coord = dict(zip(coords, (r[1] for r in records)))
    partial = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    canvases: dict[tuple[int, ...], np.ndarray] = {}
    for c, blk in by_coord.items():
        want = local_shape_and_offset(shape, mesh_shape, c, placements)[0]
        if tuple(blk.shape) != tuple(want):
            raise AssertionError(f"coordinate {c} holds a block of shape {blk.shape}, placements {placements} "
                                 f"give it {want}")
        base = tuple(0 if p.is_replicate() else ci for p, ci in zip(placements, c))
        if base != c:
            if not _close(blk, by_coord[base], 0):
                raise AssertionError(f"Replicate blocks differ: coordinate {c} and {base}")
            continue
        key = tuple(c[i] for i in partial)
        canvas = canvases.setdefault(key, np.zeros(shape, dtype=blk.dtype))
        canvas[local_slices(shape, mesh_shape, c, placements)] = blk
    for depth in reversed(range(len(partial))):  # the innermost mesh dim first, as _block nested them
        op = placements[partial[depth]].reduce_op
        grouped: dict[tuple[int, ...], list[np.ndarray]] = {}
        for key in sorted(canvases):
            grouped.setdefault(key[:depth], []).append(canvases[key])
        canvases = {k: _reduce_terms(op, v) for k, v in grouped.items()}
    return canvases[()]


def _reduce_terms(op: str, terms: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack(terms)
    return {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}[op](stacked, axis=0)


def _close(got: Any, want: Any, rtol: float = 1e-7) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False
    if rtol and np.float32 in (getattr(got.dtype, "type", None), getattr(want.dtype, "type", None)):
        rtol = max(rtol, 1e-5)  # float32: another summation order is a few ulp of 6e-8 (DESIGN's bar: 1e-5)
    if want.dtype.kind in "fc" or got.dtype.kind in "fc":
        finite = np.abs(want[np.isfinite(want)]) if want.size else want
        atol = rtol * (1 + (float(np.max(finite)) if finite.size else 0))
        return bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True))
    return bool(np.array_equal(got, want))


def _compare(got: Any, want: Any) -> str | None:
    """None if ``got`` is ``want``, else what differs."""
    if isinstance(want, (list, tuple)) and want and all(isinstance(w, np.ndarray) for w in want):  # split, divmod
        if not isinstance(got, list) or len(got) != len(want):
            return f"{len(got) if isinstance(got, list) else repr(got)} pieces, NumPy {len(want)}"
        for j, (g, w) in enumerate(zip(got, want)):
            if (why := _compare(g, w)) is not None:
                return f"piece {j}: {why}"
        return None
    if isinstance(want, (int, tuple)) and not isinstance(got, np.ndarray):  # np.shape, np.ndim, np.size
        return None if got == want else f"{got!r}, NumPy {want!r}"
    if np.shape(got) != np.shape(want):
        return f"shape {np.shape(got)}, NumPy {np.shape(want)}"
    if np.result_type(got) != np.result_type(want):
        return f"dtype {np.result_type(got)}, NumPy {np.result_type(want)}"
    if not _close(got, want):
        try:
            bad = ~np.isclose(np.asarray(got, dtype=float), np.asarray(want, dtype=float), rtol=1e-7, equal_nan=True)
        except (TypeError, ValueError):  # datetimes, objects: no distance to show
            bad = np.asarray(got) != np.asarray(want)
        got, want = np.asarray(got)[bad][:2], np.asarray(want)[bad][:2]
        return f"values differ at {int(bad.sum())} elements (e.g. {got}, NumPy {want})"
    return None


def validate_rules(mesh: DeviceMesh, *, ops: Sequence[str] | None = None, max_combos: int | None = 24,
                   seed: int = 0) -> Report:
    """Check every operation's rules on ``mesh`` against NumPy (see the module docstring).

    A collective: every rank of the world calls it with the same arguments, the mesh spanning the
    world: the ops issue their own collectives, then one ``gather_object`` of every rank's blocks
    to rank 0, which judges them, and one ``broadcast_object_list`` of the report, so every rank
    returns the same :class:`Report`.

    Args:
        mesh: a CPU mesh of any shape over the whole world (``init_device_mesh("cpu", (2, 3))``).
        ops: operation names to check (as :func:`operations` names them); None: all.
        max_combos: placement combinations per sample at most (drawn deterministically); None: all.
        seed: varies the Partial terms (the sample values are fixed by their names).

    A refusal or error is caught on the rank that raised it and reported, and the run goes on;
    a rule that refuses on some ranks while the others enter a collective would leave those
    waiting until the world's timeout (the rules decide before they communicate, so none does).
    NumPy blocks only: the comparison reads every block on the host.

    Example (the command behind docs/dtensor.md's figures)::

        def body():
            return validate_rules(meshkit.init_device_mesh("cpu", (2, 2)), max_combos=64)
        print(meshkit.comm.local.run(body, 4)[0].summary())
    """
    if math.prod(mesh.shape) != get_world_size():
        raise errors.value_error("validate_rules", f"the mesh {tuple(mesh.shape)} must span the world of "
                                 f"{get_world_size()} ranks (its results are gathered over the world)")
    mesh_shape = tuple(mesh.shape)
    coordinate = tuple(mesh.get_coordinate())
    report = Report(meshes=[mesh_shape])
    plan: list[tuple[str, Sample, tuple[tuple[Placement, ...], ...]]] = []
    for name, op in operations().items():
        if ops is not None and name not in ops:
            continue
        samples = samples_for(op)
        if not samples:
            report.no_sample.append(name)
            continue
        report.ops[name] = OpReport(name)
        plan += [(name, s, combo) for s in samples for combo in _combos(s, mesh_shape, max_combos)]
    records = []
    for n, (name, sample, combo) in enumerate(plan):
        rng = np.random.default_rng([seed, n])  # the same draws on every rank: the terms agree
        args = [DTensor(_block(x, mesh_shape, coordinate, ps, rng), mesh, ps, shape=x.shape)
                for x, ps in zip(sample.inputs, combo)]
        try:
            with np.errstate(all="ignore"):
                records.append(_record(sample.call(*args)))
        except NotImplementedError:
            records.append(("refused",))
        except Exception as exc:  # reported, not raised: the other combinations still run
            records.append(("error", f"{type(exc).__name__}: {str(exc)[:200]}"))
    # rank 0 rebuilds and compares (once, not once per rank) and sends the report to all
    everyone: list[Any] | None = [None] * get_world_size() if get_rank() == 0 else None
    gather_object((coordinate, records), everyone, dst=0)
    if everyone is not None:
        _judge(report, plan, everyone, mesh_shape)
    box = [report]
    broadcast_object_list(box, src=0)
    return box[0]


def _judge(report: Report, plan: list[tuple[str, Sample, Any]], everyone: list[Any],
           mesh_shape: tuple[int, ...]) -> None:
    """Fill ``report`` from every rank's records of ``plan``."""
    coords = [c for c, _ in everyone]
    wanted: dict[str, Any] = {}
    for n, (name, sample, combo) in enumerate(plan):
        r = report.ops[name]
        r.tried += 1
        where = f"{sample.label} {'; '.join(''.join(map(str, ps)) for ps in combo)} on {mesh_shape}"
        mine = [recs[n] for _, recs in everyone]
        outcomes = {m[0] for m in mine}
        if outcomes == {"refused"}:
            r.missing.append(where)
            continue
        if "refused" in outcomes or "error" in outcomes:
            errors = sorted({m[1] for m in mine if m[0] == "error"})
            (r.errors if outcomes <= {"error"} else r.wrong).append(f"{where}: {errors or 'only some ranks refused'}")
            continue
        if sample.label not in wanted:
            with np.errstate(all="ignore"):
                wanted[sample.label] = sample.call(*sample.inputs)
        try:
            got = _assemble(mine, coords, mesh_shape)
        except AssertionError as exc:
            r.wrong.append(f"{where}: {exc}")
            continue
        if (why := _compare(got, wanted[sample.label])) is not None:
            r.wrong.append(f"{where}: {why}")
