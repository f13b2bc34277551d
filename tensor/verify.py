"""Collective checks of DTensor construction.

Always on (cheap, see the sweeps below): ``from_local`` without ``shape=`` infers the global
shape from every rank's block (:func:`infer_global_shape`); ``distribute_tensor`` checks that
every rank passed the same arguments (:func:`check_same_arguments`).

Deferred (:func:`verify_claims`): ``from_local``'s trusted ``shape=`` is compared across ranks
at the first redistribution of a DTensor built on it (see ``dtensor.Claim``).

With ``run_check=True`` or ``MESHKIT_DEBUG=detail`` (:func:`check_from_local`): one small
object exchange per mesh dimension (:func:`meshkit.comm._seams.agree`), each carrying what the
ranks passed so far, so that after the last every rank knows what every rank of the mesh passed.
So a rank whose block does not fit the global shape, or ranks that passed different
shapes or placements, make every rank raise the same error instead of computing on a wrong
layout (or waiting for a rank that already raised).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..comm._seams import PreparedCollective, agree, by_ranks, prepare_collective
from ..mesh import DeviceMesh
from . import errors
from .chunks import chunk_range, local_shape_and_offset
from .placements import Partial, Placement, Replicate, Shard

__all__ = ["check_from_local", "infer_global_shape", "check_same_arguments", "verify_claims"]


def check_from_local(op: str, local: Any, mesh: DeviceMesh, placements: Sequence[Placement],
                     shape: Sequence[int]) -> None:
    """Raise on every rank of ``mesh`` unless every block fits ``shape`` and all agree on it.

    Collective over each mesh dimension's group: one small object exchange per mesh dimension
    (:func:`~meshkit.comm._seams.agree`), each carrying what the ranks passed so far, so that after
    the last every rank holds what every rank of the mesh passed and raises the same error.
    """
    rank = mesh.get_rank()
    mine = {rank: (tuple(mesh.get_coordinate()), tuple(shape), _plain(placements), tuple(local.shape),
                   str(local.dtype))}
    agree(mesh.get_all_groups(), mine, combine=lambda passed: {k: v for p in passed for k, v in p.items()},
          compare=lambda _, passed: _problems(mesh, passed), error=lambda message: errors.value_error(op, message))


def _plain(placements: Sequence[Placement]) -> tuple[tuple[Any, ...], ...]:
    """``placements`` as plain data (``("S", dim)``, ``("R",)``, ``("P", op)``): what the ranks
    exchange, since an object collective over a group whose peers are not authenticated carries
    only meshkit's typed format (comm/control.py), never a pickled Placement."""
    return tuple(("S", p.dim) if isinstance(p, Shard) else ("P", p.reduce_op) if isinstance(p, Partial) else ("R",)
                 for p in placements)


def _placements(plain: Sequence[Sequence[Any]]) -> tuple[Placement, ...]:
    """The placements of :func:`_plain`."""
    return tuple(Shard(p[1]) if p[0] == "S" else Partial(p[1]) if p[0] == "P" else Replicate() for p in plain)


def _problems(mesh: DeviceMesh, passed: dict[int, tuple]) -> str | None:
    """What is wrong with what every rank of the mesh passed (the same on every rank), or None."""
    arguments = {rank: (shape, plain, dtype) for rank, (_, shape, plain, _, dtype) in passed.items()}
    if len(set(arguments.values())) > 1:
        return "ranks passed different arguments: " + _passed(
            {rank: f"shape {shape}, placements {_placements(plain)!r}, dtype {dtype}"
             for rank, (shape, plain, dtype) in arguments.items()})
    problems = []
    for rank, (coord, shape, plain, local_shape, _) in sorted(passed.items()):
        if len(shape) != len(local_shape):
            problems.append(f"rank {rank}'s local has {len(local_shape)} dims, the shape {shape} has {len(shape)}")
        elif (want := local_shape_and_offset(shape, mesh.shape, coord, _placements(plain))[0]) != local_shape:
            problems.append(f"rank {rank}'s local has shape {local_shape} but global shape {shape} with placements "
                            f"{_placements(plain)!r} gives it {want}")
    return "; ".join(problems) or None


# ---- agreement sweeps: the global shape of from_local, the arguments of distribute_tensor ------
#
# One all-gather of a small fixed-size int64 vector per mesh dimension, right to left. After the
# round over mesh dim i every rank of a dim-i group holds the same vector (the group's combined
# state), so after the last round (mesh dim 0) every rank of the mesh holds the same one: all
# return the same global shape, or all raise. Only when something is wrong does a second sweep
# (object all-gathers, the error path) collect what each rank passed, to name the ranks.
# The vectors are tiny, so the Python around the collective is most of the cost: the collective
# is prepared once per group (no argument checks per call) and the rows are combined as lists.

#: Array dimensions a from_local vector has room for (NumPy 2's and CuPy's limit). The vector's
#: size must not depend on the arguments: ranks that disagree on ndim must still exchange the
#: same number of bytes.
_MAX_NDIM = 64
_OK, _FOUND, _BAD_ARGS = 0, 1, 2  # the flag in slot 0: fine / a problem found / a rank's own arguments failed

#: Prepared all-gathers kept, by ``(id(group), width)``; the oldest is dropped beyond this. An
#: entry holds its group (so an id is never another group's), as the redistribution programs do.
PREPARED_MAX = 256

_prepared: dict[tuple[int, int], PreparedCollective] = {}
_prepared_lock = threading.Lock()  # ranks of the local engine are threads


def _gather(group: Any, vec: list[int]) -> list[list[int]]:
    """Every group member's ``vec`` (all of one length), in group-rank order."""
    key = (id(group), len(vec))
    gather = _prepared.get(key)
    if gather is None or gather.group is not group:
        gather = prepare_collective(group, "all_gather_into_tensor", (len(vec),), np.int64)
        with _prepared_lock:
            if len(_prepared) >= PREPARED_MAX:
                _prepared.pop(next(iter(_prepared)), None)
            _prepared[key] = gather
    return gather(np.array(vec, np.int64)).reshape(group.size, len(vec)).tolist()


@functools.lru_cache(maxsize=4096)
def digest(*parts: Any) -> int:
    """A 56-bit fingerprint of ``repr(parts)``, the same in every process (not ``hash``: salted)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=7).digest(), "little")


def _sweep(mesh: DeviceMesh, vec: list[int], combine: Callable[[int, list[list[int]]], tuple[list[int], str | None]]
           ) -> tuple[list[int], list[str]]:
    """Run the rounds; ``combine(i, rows)`` gives the group's state after mesh dim ``i`` and a
    problem it found (every member computes the same). Returns the final state and the problems
    this rank saw."""
    found: list[str] = []
    groups = mesh.get_all_groups()
    for i in range(len(groups) - 1, -1, -1):
        rows = _gather(groups[i], vec)
        flag = max(row[0] for row in rows)
        if flag != _OK:
            vec = [flag, *rows[0][1:]]
            continue
        vec, problem = combine(i, rows)
        if problem is not None:
            found.append(problem)
    return vec, found


def _raise_everywhere(op: str, mesh: DeviceMesh, found: list[str], description: Any, own: Exception | None,
                      explain: Callable[[dict[int, Any]], str]) -> None:
    """The error path: every rank learns the problems and what each rank passed, and raises.

    A rank whose own arguments failed re-raises its own error; the others raise one naming it.
    """
    def union(known: list[tuple[list[str], dict[int, Any]]]) -> tuple[list[str], dict[int, Any]]:
        return sorted(set().union(*(k[0] for k in known))), {r: v for k in known for r, v in k[1].items()}

    def message(_: Any, known: tuple[list[str], dict[int, Any]]) -> str:
        if own is not None:
            return str(own)  # (raised as it is)
        problems, passed = known
        return "; ".join(problems) if problems else explain(passed)

    agree(mesh.get_all_groups(), (sorted(set(found)), {mesh.get_rank(): description}), combine=union, compare=message,
          error=lambda text: own if own is not None else errors.value_error(op, text))


def _passed(passed: dict[int, Any]) -> str:
    """``"ranks [0, 2] passed A; rank 1 passed B"``: ranks grouped by what they passed."""
    return by_ranks(passed.items(), " passed ")


def infer_global_shape(op: str, local: Any, mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, ...]:
    """The global shape from every rank's block (``from_local`` without ``shape=``); collective.

    One all-gather of 67 int64 per mesh dimension. Right to left, each mesh dim's group joins
    its blocks: along a Shard dim the sizes must be the ``torch.chunk`` cutting of their sum
    (``ceil(T/n)`` each, the rest last) and the other dims equal; along Replicate and Partial
    dims the shapes must be equal. Every rank of the mesh gets the same shape, or every rank
    raises naming the ranks and sizes.

    Example (4 ranks, mesh ``(4,)``, ``[Shard(0)]``): blocks of 2, 2, 1 and 0 rows give 5 rows on
    every rank; blocks of 1, 2, 2, 0 raise (5 rows are cut 2, 2, 1, 0).
    """
    ndim = local.ndim
    if ndim > _MAX_NDIM:
        raise errors.value_error(op, f"local has {ndim} dimensions; at most {_MAX_NDIM} are supported")
    placements = tuple(placements)
    vec = [_OK, digest(placements, local.dtype.str, ndim), ndim, *local.shape] + [0] * (_MAX_NDIM - ndim)

    def combine(i: int, rows: list[list[int]]) -> tuple[list[int], str | None]:
        out = list(rows[0])
        if any(row[1] != out[1] for row in rows):
            out[0] = _FOUND
            return out, None  # the placements, dtype or ndim differ: named from what each rank passed
        shapes = [tuple(row[3:3 + ndim]) for row in rows]
        if all(shape == shapes[0] for shape in shapes) and not isinstance(placements[i], Shard):
            return out, None
        p, n = placements[i], len(rows)
        ranks = list(mesh.get_group(i).ranks)
        if isinstance(p, Shard):
            d = p.dim
            sizes = [shape[d] for shape in shapes]
            total = sum(sizes)
            chunks = [stop - start for start, stop in (chunk_range(total, n, k) for k in range(n))]
            if any(shape[:d] + shape[d + 1:] != shapes[0][:d] + shapes[0][d + 1:] for shape in shapes):
                problem = (f"the blocks of ranks {ranks} (mesh dim {i}, {p!r}) have shapes {shapes}, which differ "
                           f"outside array dim {d}")
            elif sizes != chunks:
                problem = (f"the blocks of ranks {ranks} (mesh dim {i}, {p!r}) have {sizes} along array dim {d}, "
                           f"which is not how {total} are cut over {n} ranks: blocks follow torch.chunk ({chunks}: "
                           f"ceil({total}/{n}) each, the rest last); cut the blocks that way")
            else:
                out[3 + d] = total
                return out, None
        else:
            problem = (f"the blocks of ranks {ranks} (mesh dim {i}, {p!r}) have shapes {shapes}; along a "
                       f"{type(p).__name__} mesh dim every rank holds a block of the same shape")
        out[0] = _FOUND
        return out, problem

    vec, found = _sweep(mesh, vec, combine)
    if vec[0] != _OK:
        _raise_everywhere(op, mesh, found, f"placements {placements!r} with a {ndim}-d {local.dtype} block",
                          None,
                          lambda passed: "the ranks passed blocks that do not make one DTensor: " + _passed(passed))
    return tuple(vec[3:3 + ndim])


def check_same_arguments(op: str, mesh: DeviceMesh, arguments: dict[str, Any] | None,
                         own: Exception | None) -> None:
    """Raise on every rank of ``mesh`` unless all passed the same ``arguments``; collective.

    One all-gather of two int64 per mesh dimension (a fingerprint of the arguments). ``own`` is
    this rank's error with its own arguments, if any: it is raised here, after every rank has
    heard of it (the others raise one naming this rank), so that no rank waits for another that
    already failed. ``arguments`` (None when ``own``) are hashable values, described as
    ``name value, ...`` in the error.
    """
    if own is not None:
        vec = [_BAD_ARGS, 0]
        description: Any = f"arguments that failed: {own}"
    else:
        vec = [_OK, digest(*arguments.items())]  # type: ignore[union-attr]

    vec, found = _sweep(mesh, vec, _same_digest)
    if vec[0] != _OK:
        if own is None:
            description = ", ".join(f"{k} {v}" if isinstance(v, str) else f"{k} {v!r}"
                                    for k, v in arguments.items())  # type: ignore[union-attr]
        _raise_everywhere(op, mesh, found, description, own,
                          lambda passed: f"every rank must pass the same {_listed(list(arguments or {}))}, but "
                                         + _passed(passed))


def _same_digest(i: int, rows: list[list[int]]) -> tuple[list[int], str | None]:
    """A sweep's combine for ``[status, digest]`` rows: found (a digest that differs), else the first row."""
    if any(row[1] != rows[0][1] for row in rows):
        return [_FOUND, rows[0][1]], None
    return rows[0], None


def _listed(names: list[str]) -> str:
    """``"a, b and c"``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# ---- claims: from_local's trusted shape=, checked where the data first crosses ranks -----------


def verify_claims(op: str, mesh: DeviceMesh, claims: Sequence[Any]) -> None:
    """Raise on every rank of ``mesh`` unless all ranks made the same ``claims``; collective.

    One all-gather of two int64 per mesh dimension (a fingerprint of the claims, as
    :func:`check_same_arguments`), right to left; on success the claims are marked verified.
    ``op`` is where the data was about to cross ranks.
    """
    vec = [_OK, digest(*(c.key for c in claims))]  # claims: dtensor.Claim

    vec, found = _sweep(mesh, vec, _same_digest)
    if vec[0] != _OK:
        _raise_everywhere(
            op, mesh, found, " and ".join(f"DTensor.from_local({c.description})" for c in claims), None,
            lambda passed: "the ranks built this DTensor (or the DTensors it was computed from) on global layouts "
                           "that differ, so its blocks do not make one array: " + _passed(passed) + "; from_local "
                           "trusts shape= without communication (checked here, where the data first crosses "
                           "ranks): pass the same global shape on every rank (not the local size times the mesh "
                           "size: uneven blocks make that differ), or leave shape= out to have the block sizes "
                           "gathered")
    for c in claims:
        c.settle()
