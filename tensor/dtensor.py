"""DTensor: a global array laid out over a DeviceMesh, one placement per mesh dimension.

Each rank holds its block (``to_local()``); ``shape``/``ndim``/``dtype`` describe the global
array. NumPy calls reach the op rules through :mod:`.dispatch`. See :mod:`.placements` for a
worked example of which block each rank holds.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from ..mesh import DeviceMesh
from . import dispatch, errors
from .verify import verify_claims
from .chunks import local_shape_and_offset, normalize_dim
from .indexing import index_plan
from .placements import Partial, Placement, Replicate, Shard
from .redistribute import DEBUG, _logs, _programs, cached, program, remember

__all__ = ["DTensor", "Size", "normalize_placements"]

#: One entry per claim alive and not yet checked, in this process (all ranks of the local engine).
#: Only while there are some do the NumPy protocols look for claims to pass on to their results:
#: otherwise an op pays one global read for them, whether or not shape= was ever passed. A list
#: because append and pop are atomic (the ranks of the local engine are threads) and take no lock
#: that a Claim's __del__, run wherever a reference drops, could find already held.
_pending: list[None] = []
_function_rule = dispatch.FUNCTIONS.get  # the table is filled (and patched) in place: bound once


class Size(int):
    """:attr:`DTensor.size`: the number of elements, as NumPy's ``size`` (it is that int), and
    callable as torch's ``size(dim=None)`` method, so that NumPy code (``d.size``) and torch code
    (``d.size()``, ``d.size(0)``) both read it as they expect."""

    _shape: tuple[int, ...]

    def __new__(cls, count: int, shape: tuple[int, ...]) -> "Size":
        out = super().__new__(cls, count)
        out._shape = shape
        return out

    def __call__(self, dim: int | None = None) -> tuple[int, ...] | int:
        """torch's ``DTensor.size(dim=None)``: the global shape, or its size along ``dim``
        (negative counts from the end; IndexError out of range, as torch's)."""
        if dim is None:
            return self._shape
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise TypeError(errors.prefix("DTensor.size") + f"dim must be an int or None, got {dim!r}")
        return self._shape[normalize_dim(int(dim), len(self._shape), what=errors.prefix("DTensor.size") + "size(dim)")]

    def __reduce__(self) -> tuple[Any, ...]:
        return int, (int(self),)  # pickled, copied: the plain count


class Claim:
    """A global layout asserted without communication: ``from_local``'s ``shape=`` (trusted, as
    torch trusts it).

    :func:`~.verify.verify_claims` compares it with every rank's the first time a DTensor built
    on it (it, or a result computed from it) is redistributed; :meth:`settle` then marks it
    checked, on every rank at once, so the DTensors sharing it pay nothing more. Every rank
    makes its claims in the same program order and checks them in the same collective calls,
    so the state is the same on every rank.
    """

    __slots__ = ("key", "verified")

    def __init__(self, shape: tuple[int, ...], placements: tuple[Placement, ...], dtype: Any) -> None:
        self.key = (shape, placements, np.dtype(dtype).str)
        self.verified = False
        _pending.append(None)

    @property
    def description(self) -> str:
        """What this rank passed, for the error (built only there)."""
        shape, placements, dtype = self.key
        return f"shape={shape} with placements {placements!r} and dtype {np.dtype(dtype)}"

    def settle(self) -> None:
        """Mark the claim checked (every rank agreed)."""
        if not self.verified:
            self.verified = True
            _pending.pop()

    def __getstate__(self) -> tuple[Any, bool]:
        return self.key, self.verified

    def __setstate__(self, state: tuple[Any, bool]) -> None:
        # an unpickled (or copied) claim is made without __init__: counted here, as __del__ uncounts it
        self.key, self.verified = state
        if not self.verified:
            _pending.append(None)

    def __del__(self) -> None:
        if not self.verified:  # dropped before its data ever moved: no longer pending
            try:
                _pending.pop()
            except Exception:  # interpreter shutdown: the module may be half torn down
                pass


def normalize_placements(op: str, mesh: DeviceMesh, placements: Sequence[Placement] | None, ndim: int
                         ) -> tuple[Placement, ...]:
    """``placements`` checked against the mesh and array, Shard dims made non-negative.

    None means all Replicate. Raises (naming ``op`` and the rank) if the length is not the
    mesh's ndim, an entry is not a Placement, or a Shard dim is out of range.
    """
    if not isinstance(mesh, DeviceMesh):
        raise errors.type_error(op, f"device_mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if placements is None:
        return (Replicate(),) * mesh.ndim
    if placements.__class__ is tuple or placements.__class__ is list:  # the common case, already valid
        if len(placements) == mesh.ndim:
            for p in placements:
                kind = p.__class__
                if kind is Shard:
                    if not 0 <= p.dim < ndim:
                        break
                elif kind is not Replicate and kind is not Partial:
                    break
            else:
                return tuple(placements)
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise errors.type_error(op, f"placements must be a sequence of Placement (one per mesh dimension), "
                                    f"got {placements!r}")
    if len(placements) != mesh.ndim:
        raise errors.value_error(op, f"placements has {len(placements)} entries {tuple(placements)!r} but the "
                                     f"mesh has {mesh.ndim} dimensions {mesh.shape}; give one per mesh dimension")
    out = []
    for i, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise errors.type_error(op, f"placements[{i}] must be Shard, Replicate or Partial, got {p!r}")
        if isinstance(p, Shard):
            try:
                p = Shard(normalize_dim(p.dim, ndim, what=f"placements[{i}] Shard(dim={p.dim})"))
            except IndexError as exc:
                raise errors.ShardDimError(errors.prefix(op) + str(exc)) from None
        out.append(p)
    return tuple(out)


def coordinate_of(op: str, mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's mesh coordinate; an error naming ``op`` if the rank is not in the mesh."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise errors.value_error(op, f"this rank is not in the mesh {mesh.mesh.tolist()}")
    return coordinate


#: ``(Replicate(),) * n``, made once: ``full_tensor``'s target
_REPLICATE = tuple((Replicate(),) * n for n in range(9))
_SCALARS = (int, float, bool, complex)


def _operator(ufunc: np.ufunc, name: str, reflected: bool = False) -> Any:
    """``DTensor.<name>`` (``d + e``, ``d > 0``...): where the other operand is a DTensor of the same
    mesh, shape and placements or a Python number, and no placement is Partial, the ufunc on the
    blocks under those placements, wrapped: what :func:`.ufuncs.elementwise`'s first case returns,
    without the trip through NumPy's operator mixin, ``__array_ufunc__`` and the rule (about 2 us
    a call on an 8x8 block, as much as the local work of ``x > 0``). Anything else takes that trip."""
    slow = getattr(NDArrayOperatorsMixin, name)

    def operator(self: DTensor, other: Any) -> Any:
        kind = other.__class__
        placements = self._placements
        if kind is DTensor:
            if other._mesh is not self._mesh or other._placements != placements or other._shape != self._shape:
                return slow(self, other)
            value = other._local
        elif kind in _SCALARS:
            value = other
        else:
            return slow(self, other)
        for p in placements:
            if p.__class__ is Partial:
                return slow(self, other)
        out = _wrap(ufunc(value, self._local) if reflected else ufunc(self._local, value), self._mesh, placements,
                    self._shape)
        if _pending:
            _inherit(out, (self, other), {})
        return out
    operator.__name__ = operator.__qualname__ = name
    operator.__doc__ = f"``np.{ufunc.__name__}`` of the two operands{' (reflected)' if reflected else ''}."
    return operator


class DTensor(NDArrayOperatorsMixin):
    """A distributed array: this rank's block, the mesh, the placements and the global shape.

    Build one with :func:`~meshkit.tensor.distribute_tensor` (every rank passes the same global
    array) or :meth:`DTensor.from_local` (every rank passes its block). Operators (``+``, ``*``,
    ``@``...) and NumPy functions (``np.tanh``, ``np.sum``, ``np.transpose``...) return DTensors
    with the placements torch's sharding propagation gives them.

    Example (2 ranks, mesh ``[0, 1]``): ``distribute_tensor(np.arange(6.).reshape(3, 2), mesh,
    [Shard(0)])``: rank 0's ``to_local()`` is ``[[0, 1], [2, 3]]``, rank 1's ``[[4, 5]]``;
    ``shape`` is ``(3, 2)`` on both.
    """

    # _claims: None (every rank's layout is known to agree), or the unchecked Claims this array
    # was built on (from_local's shape=, inherited by the results of ops), checked at its first
    # redistribution (see _check_claims). _done: None, or the one-entry box a compiled rule shares
    # among its results, holding the program that completes them (full_tensor's lookup, made once
    # per rule instead of once per call: a completed count is a few microseconds)
    __slots__ = ("_local", "_mesh", "_placements", "_shape", "_claims", "_done")
    # NumPy binary operators with an ndarray on the left defer to DTensor's __array_ufunc__.
    __array_priority__ = 100

    # the operators of the hot path (the mixin's others go through __array_ufunc__)
    __add__, __radd__ = _operator(np.add, "__add__"), _operator(np.add, "__radd__", True)
    __sub__, __rsub__ = _operator(np.subtract, "__sub__"), _operator(np.subtract, "__rsub__", True)
    __mul__, __rmul__ = _operator(np.multiply, "__mul__"), _operator(np.multiply, "__rmul__", True)
    __truediv__ = _operator(np.true_divide, "__truediv__")
    __rtruediv__ = _operator(np.true_divide, "__rtruediv__", True)
    __lt__, __le__ = _operator(np.less, "__lt__"), _operator(np.less_equal, "__le__")
    __gt__, __ge__ = _operator(np.greater, "__gt__"), _operator(np.greater_equal, "__ge__")

    def __init__(self, local: Any, device_mesh: DeviceMesh, placements: Sequence[Placement], *,
                 shape: Sequence[int]) -> None:
        """Wrap ``local`` as this rank's block; no check and no communication (use from_local)."""
        self._local = local
        self._mesh = device_mesh
        self._placements = tuple(placements)
        self._shape = tuple(int(s) for s in shape)
        self._claims: tuple[Claim, ...] | None = None
        self._done: list[Any] | None = None

    # ---- construction -------------------------------------------------------------------------

    @staticmethod
    def from_local(local: Any, device_mesh: DeviceMesh, placements: Sequence[Placement] | None = None, *,
                   shape: Sequence[int] | None = None, stride: Sequence[int] | None = None,
                   run_check: bool = False) -> DTensor:
        """A DTensor from every rank's block; no communication unless checking.

        Args:
            local: this rank's block (NumPy or CuPy array).
            device_mesh: the mesh; every rank of it calls ``from_local``.
            placements: one per mesh dimension (None: all Replicate).
            shape: the global shape, the same on every rank. Given, it is trusted as torch trusts
                it: no communication here, only this rank's block is checked against it. It is
                checked across ranks where the data first crosses ranks instead: the first
                redistribution (``redistribute``, ``full_tensor``, or an op's implicit move) of
                this DTensor or of any result computed from it (``x * 2``, ``x @ w``, ``x[...]``)
                first all-gathers a fingerprint of the shapes, placements and dtypes passed (two
                int64 per mesh dim, once per ``from_local`` call), and ranks that passed different
                ones raise there, every one, naming who passed what, instead of reading past
                what the others sent (in a world of one that first redistribution of 8x8 blocks
                took 46 us beside 31 us under MPI, 65 beside 34 us on the local engine; README,
                DTensor costs). DTensors known to agree (``distribute_tensor``, this without
                ``shape=`` or with ``run_check``, results of a checked one) pay nothing per op.
                Never compute it from the block (local size times the mesh size, torch's even
                rule): uneven blocks then give each rank another shape that fits its own block.
                Leave it out instead. Without it and with a Shard
                placement, the blocks' sizes are gathered (one all-gather of 67 int64 per mesh
                dim, every rank of the mesh taking part) and summed, so uneven blocks give the
                right shape on every rank; torch instead assumes even blocks (local size times
                the mesh dim's size), which gave each rank of uneven blocks another shape.
            stride: accepted for torch compatibility and ignored (NumPy blocks carry their own).
            run_check: check collectively that every rank's block fits ``shape`` and that all
                ranks passed the same shape, placements and dtype (also on under
                ``MESHKIT_DEBUG=detail``).

        Raises:
            DistValueError: wrong placements, or (on this rank) a block whose shape is not the
                one ``shape`` gives this rank; on every rank, naming the ranks: without
                ``shape=``, blocks that are not the ``torch.chunk`` cutting of their sum along a
                Shard dim (2, 3 rows: 5 rows are cut 3, 2), differ elsewhere, or come with other
                placements or dtypes; with the check, any disagreement. With ``shape=`` and no
                check, later, on every rank, at the first redistribution of this DTensor or of a
                result computed from it: ranks that passed different shapes, placements or dtypes.

        Example (4 ranks, mesh ``(4,)``): blocks of 2, 2, 1 and 0 rows with ``[Shard(0)]`` give
        ``shape`` ``(5, ...)`` on every rank, with or without ``shape=(5, ...)``.
        """
        from ..comm import DebugLevel
        from ..comm._seams import current_world

        op = "DTensor.from_local"
        if isinstance(local, DTensor):
            raise errors.type_error(op, "local is already a DTensor; pass its to_local()")
        if not hasattr(local, "shape") or not hasattr(local, "dtype"):
            local = np.asarray(local)
        placements = normalize_placements(op, device_mesh, placements, local.ndim)
        coordinate = coordinate_of(op, device_mesh)
        given = shape is not None
        if not given:
            if any(p.__class__ is Shard for p in placements):
                from .verify import infer_global_shape

                shape = infer_global_shape(op, local, device_mesh, placements)
            else:  # Replicate and Partial blocks have the global shape: nothing to learn
                shape = tuple(local.shape)
        else:
            shape = tuple(int(s) for s in shape)
        check = run_check or current_world().debug >= DebugLevel.DETAIL
        if check:
            from .verify import check_from_local

            check_from_local(op, local, device_mesh, placements, shape)
        elif len(shape) != local.ndim or \
                local_shape_and_offset(shape, device_mesh.shape, coordinate, placements)[0] != tuple(local.shape):
            expected = "?" if len(shape) != local.ndim else \
                local_shape_and_offset(shape, device_mesh.shape, coordinate, placements)[0]
            raise errors.value_error(op, f"local has shape {tuple(local.shape)} but global shape {shape} with "
                                         f"placements {placements!r} gives mesh coordinate {coordinate} a block "
                                         f"of shape {expected}")
        out = DTensor(local, device_mesh, placements, shape=shape)
        if given and not check:  # trusted: checked where the data first crosses ranks
            out._claims = (Claim(shape, placements, local.dtype),)
        return out

    # ---- the array's description --------------------------------------------------------------

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh the array is laid out over."""
        return self._mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dimension."""
        return self._placements

    @property
    def shape(self) -> tuple[int, ...]:
        """The global array's shape."""
        return self._shape

    @property
    def ndim(self) -> int:
        """The global array's number of dimensions."""
        return len(self._shape)

    @property
    def dtype(self) -> Any:
        """The dtype (the same on every rank)."""
        return self._local.dtype

    @property
    def size(self) -> "Size":
        """Number of elements of the global array (NumPy's ``size``, an int); called, torch's
        ``DTensor.size(dim=None)``: the global shape, or its size along ``dim``.

        Example (a 4 x 6 global array): ``d.size == 24``, ``d.size() == (4, 6)``, ``d.size(-1) == 6``.
        """
        return Size(int(np.prod(self._shape, dtype=np.int64)), self._shape)

    def __len__(self) -> int:
        """The global first dimension (TypeError for a 0-d DTensor, as NumPy's ``len()``)."""
        if not self._shape:
            raise TypeError(errors.prefix("len()") + "len() of a 0-d DTensor (unsized); use .shape")
        return self._shape[0]

    def __bool__(self) -> bool:
        # An `if d:` would need the global value, a collective hidden in a branch that ranks may
        # not all reach (a hang), and an object's default truth is silently True: refuse, as
        # __array__ does, and name the explicit call.
        raise TypeError(errors.prefix("bool()") + f"the truth value of a DTensor (placements "
                        f"{self._placements!r}) is not taken implicitly; use bool(d.full_tensor()) (a "
                        "collective every rank must call) or test d.to_local() (this rank's block)")

    def to_local(self) -> Any:
        """This rank's block (no copy): for Partial placements, this rank's term."""
        return self._local

    def full_tensor(self) -> Any:
        """The whole global array on every rank (all-gather / all-reduce as needed)."""
        done = self._done
        if done is not None and self._claims is None:  # a compiled rule's result: its program, known
            only = done[0]
            if only is not None and not _logs(DEBUG):
                return only(self._local)
        placements = self._placements
        if self._claims is not None and any(p.__class__ is not Replicate for p in placements):
            self._check_claims("DTensor.full_tensor")  # data will cross ranks: named as the caller's call
        n = len(placements)  # the mesh's ndim
        target = _REPLICATE[n] if n < len(_REPLICATE) else (Replicate(),) * n
        mesh = self._mesh
        # a known request: its program, run here (cached() and the program's call inlined: a
        # completed count or norm is a few microseconds, of which these took a tenth)
        prog = _programs.get((id(mesh), self._shape, placements, target))
        if prog is None or prog.mesh() is not mesh:
            return self.redistribute(placements=target).to_local()
        if prog.same:
            return self._local
        only = prog._only
        if done is not None:  # found for this layout, the one its rule's results all have
            done[0] = only
        return only(self._local) if only is not None and not _logs(DEBUG) else prog(self._local)

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None,
                     *, async_op: bool = False) -> DTensor:
        """The same global array with new placements, by one collective per changing mesh dim.

        Args:
            device_mesh: must be this array's mesh (or None); other meshes are not supported.
            placements: the new placements (None: keep them).
            async_op: accepted for torch compatibility; the result is returned complete.

        Returns:
            A new DTensor whose block has its own memory (a Replicate -> Shard slice is copied, so
            writing into it leaves this DTensor alone), or this DTensor itself when the
            placements do not change, as torch's; the collectives are listed in :mod:`.redistribute`.
        """
        mesh = self._mesh
        if device_mesh is not None and device_mesh is not mesh and device_mesh != mesh:
            raise errors.value_error("DTensor.redistribute", f"device_mesh {device_mesh!r} is not this DTensor's "
                                     f"mesh {mesh!r}; redistribution across meshes is not supported")
        if placements is None:
            return self
        prog = cached(mesh, self._shape, self._placements, placements)  # a known request: checked before
        if prog is None:
            target = normalize_placements("DTensor.redistribute", mesh, placements, len(self._shape))
            prog = program(mesh, self._shape, self._placements, target)
            remember(prog, mesh, self._shape, self._placements, placements)
        if prog.same:
            return self
        if self._claims is not None:
            self._check_claims("DTensor.redistribute")
        return _wrap(prog(self._local), mesh, prog.target, self._shape)

    def _check_claims(self, op: str) -> None:
        """Before this array's data first crosses ranks (``op``): check the shapes it was built on.

        Every rank compares the claims still unchecked (one all-gather of two int64 per mesh dim,
        :func:`~.verify.verify_claims`) and raises if they differ, naming the ranks; after that the
        claims, and every DTensor sharing them, are known to agree. A collective: every rank of
        the mesh reaches it, as it reaches the redistribution that follows.
        """
        pending = tuple(c for c in self._claims or () if not c.verified)
        if pending:
            verify_claims(op, self._mesh, pending)
        self._claims = None

    # ---- NumPy protocols ---------------------------------------------------------------------

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method == "__call__" and ufunc in dispatch.UFUNCS:
            out = dispatch.UFUNCS[ufunc](*inputs, **kwargs)
        else:
            rule = dispatch.UFUNC_METHODS.get(method)
            if rule is None:
                raise NotImplementedError(errors.prefix(f"np.{ufunc.__name__}.{method}")
                                          + f"is not supported on DTensors (placements {self._placements!r})")
            out = rule(ufunc, *inputs, **kwargs)
        if _pending:
            _inherit(out, inputs, kwargs)
        return out

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        rule = _function_rule(func)
        if rule is None:
            module = getattr(func, "__module__", "numpy") or "numpy"
            name = f"np.{module[6:]}.{func.__name__}" if module.startswith("numpy.") and \
                not module.startswith(("numpy._core", "numpy.lib", "numpy.core")) else f"np.{func.__name__}"
            raise NotImplementedError(errors.prefix(name)
                                      + f"has no DTensor rule (placements {self._placements!r}); redistribute to "
                                        f"Replicate first (d.redistribute(placements=[Replicate()] * mesh.ndim) "
                                        f"or d.full_tensor()) and call NumPy on that")
        out = rule(*args, **kwargs)
        if _pending:
            _inherit(out, args, kwargs)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise TypeError(errors.prefix("np.asarray") + "a DTensor is not converted to one array implicitly; "
                        "call full_tensor() (the global array) or to_local() (this rank's block)")

    # NumPy-style methods, routed through the same rules as the functions.
    @property
    def T(self) -> DTensor:
        """The transpose (placements follow the axes)."""
        return np.transpose(self)

    def transpose(self, *axes: Any) -> DTensor:
        """As ``ndarray.transpose``."""
        return np.transpose(self, axes[0] if len(axes) == 1 else (axes or None))

    def reshape(self, *shape: Any) -> DTensor:
        """As ``ndarray.reshape`` (where the sharded axes survive)."""
        return np.reshape(self, shape[0] if len(shape) == 1 else shape)

    def sum(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.sum`` (a sharded axis summed away gives Partial(sum))."""
        return np.sum(self, axis=axis, **kwargs)

    def mean(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.mean``."""
        return np.mean(self, axis=axis, **kwargs)

    def max(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.max`` (a sharded axis reduced away gives Partial(max))."""
        return np.max(self, axis=axis, **kwargs)

    def min(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.min`` (a sharded axis reduced away gives Partial(min))."""
        return np.min(self, axis=axis, **kwargs)

    def var(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.var`` (see :mod:`.statistics`)."""
        return np.var(self, axis=axis, **kwargs)

    def std(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.std``."""
        return np.std(self, axis=axis, **kwargs)

    def prod(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.prod``."""
        return np.prod(self, axis=axis, **kwargs)

    def any(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.any`` (a sharded axis reduced away gives Partial(max))."""
        return np.any(self, axis=axis, **kwargs)

    def all(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.all`` (a sharded axis reduced away gives Partial(min))."""
        return np.all(self, axis=axis, **kwargs)

    def argmax(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.argmax``."""
        return np.argmax(self, axis=axis, **kwargs)

    def argmin(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.argmin``."""
        return np.argmin(self, axis=axis, **kwargs)

    def cumsum(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.cumsum`` (see :mod:`.scans`)."""
        return np.cumsum(self, axis=axis, **kwargs)

    def cumprod(self, axis: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.cumprod``."""
        return np.cumprod(self, axis=axis, **kwargs)

    def argsort(self, axis: Any = -1, **kwargs: Any) -> DTensor:
        """As ``ndarray.argsort`` (see :mod:`.sorting`)."""
        return np.argsort(self, axis=axis, **kwargs)

    def trace(self, offset: int = 0, **kwargs: Any) -> DTensor:
        """As ``ndarray.trace``."""
        return np.trace(self, offset, **kwargs)

    def dot(self, other: Any) -> DTensor:
        """As ``ndarray.dot``."""
        return np.dot(self, other)

    def ravel(self) -> DTensor:
        """The flattened array (``reshape(-1)``: moves blocks where they would not stay whole)."""
        return np.reshape(self, (-1,))

    def flatten(self) -> DTensor:
        """A copy of the flattened array."""
        return np.copy(np.reshape(self, (-1,)))

    def clip(self, min: Any = None, max: Any = None, **kwargs: Any) -> DTensor:
        """As ``ndarray.clip`` (a Partial is reduced first)."""
        return np.clip(self, min, max, **kwargs)

    def copy(self) -> DTensor:
        """A copy of this rank's block, the same placements (``np.copy``)."""
        return np.copy(self)

    def astype(self, dtype: Any, *, copy: bool = True) -> DTensor:
        """As ``ndarray.astype``; a Partial is reduced first unless the cast keeps it (see :mod:`.local_ops`)."""
        return np.astype(self, dtype, copy=copy)

    def __getitem__(self, key: Any) -> DTensor:
        """Integers, slices, ``...`` and None (locally where no block moves), integer arrays (one, or
        several with integers and full slices: ``x[i, j]``), a boolean mask (see :mod:`.indexing`
        and :mod:`.selection`)."""
        try:
            local_key, shape, placements = index_plan(key, self._shape, self._placements)
        except NotImplementedError:  # a sharded dim indexed, or a fancy or boolean key: selection.getitem's rules
            out = dispatch.INDEXING["getitem"](self, key)
            if out._claims is None:
                out._claims = self._claims
            return out
        out = DTensor(self._local[local_key], self._mesh, placements, shape=shape)
        out._claims = self._claims
        return out

    def __setitem__(self, key: Any, value: Any) -> None:
        """``x[key] = value``: each rank writes the part its block holds (see :func:`.selection.setitem`)."""
        dispatch.INDEXING["setitem"](self, key, value)

    def __copy__(self) -> DTensor:
        out = DTensor(self._local, self._mesh, self._placements, shape=self._shape)
        out._claims = self._claims
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> DTensor:
        # The block is copied; the mesh is shared: it holds process groups (communicators, locks)
        # that must not be copied, as torch's DTensor shares its DeviceMesh. Claims are shared too:
        # the copy's shape is the same unchecked one.
        out = DTensor(copy.deepcopy(self._local, memo), self._mesh, self._placements, shape=self._shape)
        out._claims = self._claims
        return out

    def __repr__(self) -> str:
        return (f"DTensor(local_tensor={self._local!r}, device_mesh={self._mesh!r}, "
                f"placements={self._placements!r}, shape={self._shape})")


def block_like(local: Any, like: DTensor) -> DTensor:
    """``local`` laid out as ``like`` (its mesh, placements and global shape) and trusted as much:
    what ``like`` still has to check before its data crosses ranks, the result checks too. For
    state built beside a parameter (its optimizer state) by the strategies and checkpoints; no
    communication."""
    out = _wrap(local, like._mesh, like._placements, like._shape)
    out._claims = like._claims
    return out


def _wrap(local: Any, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...],
          done: list[Any] | None = None) -> DTensor:
    """A DTensor from parts that are already normalized tuples (no conversion, no check). ``done``:
    a compiled rule's box (``[None]`` when made), where the first ``full_tensor()`` of any of its
    results leaves the program that completes them all."""
    out = DTensor.__new__(DTensor)
    out._local = local
    out._mesh = mesh
    out._placements = placements
    out._shape = shape
    out._claims = None
    out._done = done
    return out


def _inherit(out: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Give ``out`` (an op's result: a DTensor or a tuple of them) the unchecked claims of the
    DTensors among ``args`` and ``kwargs`` (one level of lists and tuples: ``np.concatenate``'s,
    ``out=``), so that ``y = x @ w; y.full_tensor()`` checks the shape ``x`` was built on.

    Runs only while some claim is pending (``_pending``); written for the common case of a few
    DTensors known to agree, whose ``_claims`` is None: there
    it costs a small fraction of an op on small blocks.
    """
    pending: list[Claim] | None = None
    for a in (args if not kwargs else (*args, *kwargs.values())):
        for x in ((a,) if a.__class__ is not list and a.__class__ is not tuple else a):
            if x.__class__ is DTensor and x._claims is not None:
                for c in x._claims:
                    if not c.verified:
                        if pending is None:
                            pending = [c]
                        elif c not in pending:
                            pending.append(c)
    if pending is None:
        return
    for o in (out if isinstance(out, tuple) else (out,)):
        if isinstance(o, DTensor):
            o._claims = tuple(dict.fromkeys((*(o._claims or ()), *pending)))
