"""A strict fake ``cupy`` module over the NCCL double's device memory (tests/doubles/nccl_double.py).

``nccl_double.DeviceArray`` is an ``np.ndarray`` subclass, so code that treats a device array as
NumPy (``np.asarray(x)``, ``np.zeros_like(x)``, mixing it with host arrays) passes silently on it.
This module's :class:`ndarray` is *not* an ``np.ndarray``; it behaves as CuPy does where CuPy is
strict:

* ``type(x).__module__ == "cupy"`` (so ``meshkit.parallel.array_namespace`` picks this module),
  ``x.data.ptr``, ``__cuda_array_interface__``, ``x.get()`` (the explicit device-to-host copy);
* ``np.asarray(x)`` / ``np.array(x)`` raise CuPy's own TypeError ("Implicit conversion to a NumPy
  array is not allowed. ..."), so a silent device-to-host copy fails the test that makes it;
* its functions, operators and ufuncs refuse ``numpy.ndarray`` arguments as CuPy does
  (``TypeError: Unsupported type <class 'numpy.ndarray'>``); only :func:`asarray` / :func:`array`
  take host arrays (the explicit host-to-device copy). Stricter than CuPy: ``x[...] = host_array``
  is refused too (CuPy copies it to the device implicitly; a hot path must not);
* it refuses what CuPy lacks (see "what CuPy accepts" below): every NumPy function reaching it
  (``np.take(x, i, mode=...)`` through ``__array_function__``, ``cupy.errstate``, a ufunc's
  ``where=``, ``x.sum(initial=...)``) is bound to the signature of the real CuPy function of the
  same name, so an argument CuPy has not is the TypeError it is on a GPU, and a name CuPy has not
  the AttributeError; ``x.device`` is CuPy's (a device with ``.id``; there is no ``device_id``);
  ``x.set(host)`` of another dtype is CuPy's TypeError.

Every array wraps a ``DeviceArray`` of the double (an allocation, or a view of one), so pointers,
live allocations, the device of each thread and the stream model (host access synchronizes the
current stream; writes are ordered on it) are the double's, not a second copy of them.

Install it for a test with :func:`installed` (a context manager that puts it in ``sys.modules``
as ``cupy``), together with ``nccl_double.FakeRuntime`` for the engine.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
import types
from typing import Any, Iterator

import numpy as np

from . import nccl_double as double

__all__ = ["ndarray", "module", "installed", "IMPLICIT", "REAL", "SIGNATURES", "UFUNCS", "ABSENT", "UFUNC_KWARGS",
           "GUFUNCS", "GUFUNC_KWARGS", "UFUNC_METHODS", "Device", "real_signature", "recorded_signature", "spec_of",
           "Reference", "reference"]

#: CuPy's message for an implicit device-to-host conversion (cupy/_core/core.pyx, ``__array__``).
IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy "
            "array explicitly.")


def _unsupported(x: Any) -> TypeError:
    return TypeError(f"Unsupported type {type(x)}")


# --------------------------------------------------------------------------- what CuPy accepts
# What the real CuPy refuses, the fake refuses: every call reaching it is bound to the signature of
# the real CuPy function of the same name (an argument CuPy has not is a TypeError, as on a GPU),
# and a name CuPy has not is an AttributeError. The reference is the installed CuPy (cupy-cuda12x
# imports and shows its signatures without a GPU; the cuda12 CI job installs it), else the
# table below, recorded from CuPy 14.2.0 and compared with the installed CuPy by
# tests/test_cupy_strictness.py. A call the table does not know, with no CuPy installed, fails
# naming the entry to record (:func:`spec_of` of the real function).
def _load_real() -> Any:
    """The installed CuPy; None only where none is installed. An installed CuPy that fails to
    import raises here: a broken CuPy must fail the tests that use it, not loosen the fake."""
    if importlib.util.find_spec("cupy") is None:
        return None
    return importlib.import_module("cupy")


#: The real CuPy module (None where CuPy is not installed).
REAL = _load_real()
#: The CuPy version the table below was recorded from.
RECORDED_FROM = "14.2.0"
#: Keyword arguments of a CuPy ufunc's call (CuPy 14.2 cupy/_core/_kernel.pyx ``ufunc.__call__``:
#: any other is ``TypeError: Wrong arguments {...}``, ``where=`` included, before the GPU is touched).
UFUNC_KWARGS = ("out", "dtype", "casting")
#: Keyword arguments of a generalized ufunc's call (``cupy.matmul``, cupy/_core/_gufuncs.py).
GUFUNC_KWARGS = ("axes", "axis", "keepdims", "casting", "dtype", "signature", "order", "out")
#: NumPy ufuncs that are generalized ufuncs in CuPy.
GUFUNCS = ("matmul",)
#: The ufuncs whose methods CuPy implements (``_kernel.pyx``: reduce/accumulate of add and multiply
#: only, reduceat of add, ``at`` of the ufuncs with a scatter op, among those of :data:`UFUNCS`; the
#: dtypes ``at`` takes are not modelled); others raise NotImplementedError. ``outer``: every ufunc.
UFUNC_METHODS = {"reduce": ("add", "multiply"), "accumulate": ("add", "multiply"), "reduceat": ("add",),
                 "at": ("add", "bitwise_and", "bitwise_or", "bitwise_xor", "maximum", "minimum", "subtract"),
                 "outer": None}


def real_signature(f: Any) -> inspect.Signature:
    """``f``'s signature: inspect's, or, for Cython functions without one, parsed from the first
    line of the docstring (``_ndarray_base.get(self, stream=None, out=None, blocking=True)``,
    ``get_current_stream(int device_id=-1)``; C types dropped, every default read as None)."""
    try:
        return inspect.signature(f)
    except (TypeError, ValueError):
        pass
    head = (f.__doc__ or "").strip().splitlines()[0].split("->")[0]
    return recorded_signature(head[head.index("(") + 1:head.rindex(")")])


def recorded_signature(spec: str) -> inspect.Signature:
    """A signature from its parameter list (``"a, indices, axis=None, out=None"``, or as
    :func:`spec_of` writes it, ``"a, indices, axis=, out="``): names, kinds and which have defaults."""
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
        elif part.startswith("**"):
            params.append(inspect.Parameter(part[2:], inspect.Parameter.VAR_KEYWORD))
        elif part.startswith("*"):
            params.append(inspect.Parameter(part[1:], inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
        elif part == "/":
            params = [q.replace(kind=inspect.Parameter.POSITIONAL_ONLY) for q in params]
        else:
            name, eq, _ = part.partition("=")
            params.append(inspect.Parameter(name.split()[-1].split(":")[0], kind,
                                            default=None if eq else inspect.Parameter.empty))
    return inspect.Signature(params)


def spec_of(sig: inspect.Signature) -> str:
    """The table's form of ``sig``: names, ``=`` for a default, ``*``, ``*args``, ``**kw``, ``/``."""
    out, star = [], False
    for q in sig.parameters.values():
        if q.kind is q.VAR_POSITIONAL:
            out.append(f"*{q.name}")
            star = True
        elif q.kind is q.VAR_KEYWORD:
            out.append(f"**{q.name}")
        else:
            if q.kind is q.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(q.name + ("=" if q.default is not q.empty else ""))
        if q.kind is q.POSITIONAL_ONLY and (len(out) == len(sig.parameters) or
                                            list(sig.parameters.values())[len(out)].kind is not q.POSITIONAL_ONLY):
            out.append("/")
    return ", ".join(out)


class Reference:
    """Where the fake reads what CuPy has: the real module, or (``real=None``) the recorded table.

    Paths name CuPy's objects as its ``__array_function__`` finds them: ``take``, ``linalg.norm``,
    ``ndarray.sum`` (a method: its signature has ``self``), ``ufunc.reduce`` (a method of every
    ufunc), ``random.Generator.standard_normal``."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def _resolve(self, path: str) -> Any:
        first, *rest = path.split(".")
        obj = type(self.real.add) if first == "ufunc" else getattr(self.real, first)
        for part in rest:
            obj = getattr(obj, part)
        return obj

    def has(self, path: str) -> bool:
        """Whether CuPy has ``path``; with the table, LookupError for a path it does not record."""
        if self.real is None:
            if path in SIGNATURES or path in UFUNCS:
                return True
            if path in ABSENT:
                return False
            raise LookupError(f"fake_cupy: whether CuPy has cupy.{path} is not recorded, and no CuPy is installed to "
                              "ask: pip install 'meshkit[cuda12]' (CuPy imports without a GPU), or record it in "
                              "tests/doubles/fake_cupy.py (SIGNATURES, UFUNCS or ABSENT)")
        try:
            self._resolve(path)
        except AttributeError:
            return False
        return True

    def signature(self, path: str) -> inspect.Signature:
        if self.real is not None:
            return real_signature(self._resolve(path))
        spec = SIGNATURES.get(path)
        if spec is None:
            raise LookupError(f"fake_cupy: no recorded CuPy signature for cupy.{path}, and no CuPy is installed to "
                              f"read it from: pip install 'meshkit[cuda12]' (CuPy imports without a GPU), or record "
                              f"SIGNATURES[{path!r}] = spec_of(real_signature(cupy.{path})) in tests/doubles/fake_cupy.py")
        return recorded_signature(spec)

    def version(self) -> str:
        return getattr(self.real, "__version__", "?") if self.real is not None else f"{RECORDED_FROM} (recorded)"


_reference = Reference(REAL)


@contextlib.contextmanager
def reference(ref: Reference) -> Iterator[Reference]:
    """The fake reads what CuPy has from ``ref`` for the block (``Reference(None)``: the recorded table,
    as on a machine without CuPy)."""
    global _reference
    saved, _reference = _reference, ref
    try:
        yield ref
    finally:
        _reference = saved


def _check(path: str, args: Any, kwargs: dict[str, Any], *, method: bool = False) -> None:
    """Bind ``args``/``kwargs`` to CuPy's ``path`` as CuPy would: its TypeError where they do not fit."""
    sig = _reference.signature(path)
    named = {p.name for p in sig.parameters.values() if p.kind not in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)}
    if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        for name in kwargs:  # Python names an unexpected keyword before a missing argument
            if name not in named:
                raise TypeError(f"cupy.{path}() got an unexpected keyword argument {name!r} (fake_cupy: the "
                                f"signature of cupy.{path} in CuPy {_reference.version()} is {sig})")
    try:
        sig.bind(*(("self",) if method else ()), *args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"cupy.{path}() {exc} (fake_cupy: the signature of cupy.{path} in CuPy "
                        f"{_reference.version()} is {sig})") from None


def _cupy_path(func: Any) -> str:
    """The CuPy name of NumPy function ``func``, as CuPy's ``__array_function__`` looks it up
    (cupy/_core/core.pyx: ``func.__module__`` past ``numpy``, then ``func.__name__``)."""
    return ".".join([*(getattr(func, "__module__", None) or "numpy").split(".")[1:], func.__name__])


def _check_function(func: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """A NumPy function called on device arrays: CuPy's of the same name must exist and take the arguments."""
    path = _cupy_path(func)
    if not _reference.has(path):  # CuPy's __array_function__ returns NotImplemented: NumPy's TypeError
        raise TypeError(f"no implementation found for 'numpy.{path}' on types that implement __array_function__: "
                        f"[<class 'cupy.ndarray'>] (fake_cupy: CuPy {_reference.version()} has no cupy.{path})")
    _check(path, args, kwargs)


def _check_ufunc(ufunc: Any, method: str, inputs: Any, kwargs: dict[str, Any]) -> None:
    """A NumPy ufunc (or one of its methods) on device arrays, as CuPy's ufunc takes it."""
    name = ufunc.__name__
    if not _reference.has(name):
        raise TypeError(f"operand type(s) all returned NotImplemented from __array_ufunc__({ufunc!r}, {method!r}, ...) "
                        f"(fake_cupy: CuPy {_reference.version()} has no cupy.{name})")
    if method == "__call__":
        allowed = GUFUNC_KWARGS if name in GUFUNCS else UFUNC_KWARGS
        bad = {k: v for k, v in kwargs.items() if k not in allowed}
        if bad:
            if name in GUFUNCS:
                raise TypeError(f"_GUFunc.__call__() got an unexpected keyword argument {next(iter(bad))!r}")
            raise TypeError(f"Wrong arguments {bad}")
        return
    supported = UFUNC_METHODS.get(method, ())
    if supported is not None and name not in supported:
        raise NotImplementedError(f"`cupy_{name}.{method}` is not supported yet")
    _check(f"ufunc.{method}", inputs, kwargs, method=True)


def _dev(x: Any) -> Any:
    """The double's array behind ``x`` (a DeviceArray); scalars pass; host arrays are refused."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        raise _unsupported(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_dev(v) for v in x)
    return x


def _wrap(x: Any) -> Any:
    """A result as CuPy returns it: arrays (and NumPy scalars) as device arrays."""
    if isinstance(x, double.DeviceArray):
        return ndarray._of(x)
    if isinstance(x, (np.ndarray, np.generic)):
        return ndarray._of(double.to_device(np.asarray(x)))
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class Device:
    """``cupy.cuda.Device``: ``.id``, ``int()``, ``use()`` and ``with device:`` (the double's current device)."""

    __slots__ = ("id", "_before")

    def __init__(self, device: int = 0) -> None:
        self.id = int(device)
        self._before: list[int] = []

    def __int__(self) -> int:
        return self.id

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"

    def use(self) -> None:
        double._tls.device = self.id

    def __enter__(self) -> Device:
        self._before.append(double._device())
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        double._tls.device = self._before.pop()


class ndarray:  # noqa: N801 - CuPy's name
    """A device array (``cupy.ndarray``) over the double's device memory."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape: Any, dtype: Any = float) -> None:
        self._a = double.DeviceArray(shape, np.dtype(dtype))

    @classmethod
    def _of(cls, a: Any) -> ndarray:
        out = cls.__new__(cls)
        out._a = a
        return out

    # ---- what CuPy refuses
    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(IMPLICIT)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _check_ufunc(ufunc, method, inputs, kwargs)
        return _call(getattr(ufunc, method), *inputs, **kwargs)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        _check_function(func, args, kwargs)
        return _call(func, *args, **kwargs)

    # ---- the device side
    @property
    def data(self) -> _Pointer:
        return _Pointer(self._a.data.ptr)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self._a.__cuda_array_interface__

    @property
    def _device_memory(self) -> Any:
        """The double's allocation (or view of one) behind this array (for FakeRuntime's copies)."""
        return self._a

    @property
    def device(self) -> Device:
        """The device the array lies on (CuPy's ``ndarray.device``; CuPy has no ``device_id``)."""
        return Device(self._a.device_id)

    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
        """The explicit device-to-host copy (synchronizes the current stream)."""
        host = self._a.get()
        if out is not None:
            out[...] = host
            return out
        return host

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """The explicit host-to-device copy into this array, refused as CuPy 14.2 refuses it
        (cupy/_core/core.pyx ``_ndarray_base.set``: the type, then the dtype, then the shape)."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        self._a[...] = arr

    # ---- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray._of(self._a.T))

    @property
    def base(self) -> ndarray | None:
        return None if self._a.base is None else ndarray._of(self._a.base)

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"cupy.{self._a.get()!r}"

    # ---- indexing (results are device arrays, also 0-d ones, as CuPy's)
    def __getitem__(self, key: Any) -> ndarray:
        key = _dev(key) if isinstance(key, (ndarray, tuple)) else key
        out = self._a[key]
        if not isinstance(out, np.ndarray):  # an element: read after the stream's earlier work
            double._host_sync()
            out = self._a[key]
        return _wrap(out)

    def __setitem__(self, key: Any, value: Any) -> None:
        key = _dev(key) if isinstance(key, (ndarray, tuple)) else key
        self._a[key] = _dev(value)

    def __iter__(self) -> Iterator[ndarray]:
        return (self[i] for i in range(len(self)))

    # ---- scalars reach the host only explicitly (item/float/int/bool synchronize, as CuPy's)
    def item(self) -> Any:
        return self._a.get().item()

    def __float__(self) -> float:
        return float(self._a.get())

    def __int__(self) -> int:
        return int(self._a.get())

    def __bool__(self) -> bool:
        return bool(self._a.get())

    def tolist(self) -> Any:
        return self._a.get().tolist()

    # ---- methods
    def reshape(self, *shape: Any, order: str = "C", copy: Any = None) -> ndarray:
        return ndarray._of(self._a.reshape(*shape, order=order, copy=copy))

    def ravel(self, order: str = "C") -> ndarray:
        return ndarray._of(self._a.ravel(order))

    def view(self, dtype: Any = None) -> ndarray:
        if dtype is not None and isinstance(dtype, type) and issubclass(dtype, np.ndarray):
            raise TypeError("cupy.ndarray.view: a numpy.ndarray view of device memory does not exist")
        return ndarray._of(self._a.view() if dtype is None else self._a.view(dtype))

    def copy(self, order: str = "C") -> ndarray:
        return _wrap(double.to_device(self._a.get()))

    def astype(self, dtype: Any, order: str = "K", casting: Any = None, subok: Any = None,
               copy: bool = True) -> ndarray:
        for name, given in (("subok", subok), ("casting", casting)):  # CuPy 14.2 core.pyx: taken, never used
            if given is not None:
                raise TypeError(f"{name} is not supported yet")
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _wrap(double.to_device(self._a.get().astype(dtype, order=order)))

    def fill(self, value: Any) -> None:
        self._a[...] = _dev(value)

    def __getattr__(self, name: str) -> Any:  # reductions and other methods: sum, max, dot, any, ...
        if name.startswith("_") or not callable(getattr(np.ndarray, name, None)) or \
                not _reference.has(f"ndarray.{name}"):
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")

        def method(*args: Any, **kwargs: Any) -> Any:
            _check(f"ndarray.{name}", args, kwargs, method=True)
            double._host_sync()  # a kernel reading the array runs after the stream's earlier work
            return _wrap(getattr(self._a, name)(*_dev(list(args)), **{k: _dev(v) for k, v in kwargs.items()}))

        return method


def _operator(name: str, inplace: bool = False) -> Any:
    def op(self: ndarray, *other: Any) -> Any:
        result = getattr(self._a, name)(*_dev(list(other)))
        if result is NotImplemented:
            return NotImplemented
        return self if inplace else _wrap(result)
    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor"):
    setattr(ndarray, f"__{_name}__", _operator(f"__{_name}__"))
    setattr(ndarray, f"__r{_name}__", _operator(f"__r{_name}__"))
    setattr(ndarray, f"__i{_name}__", _operator(f"__i{_name}__", inplace=True))
for _name in ("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge", "eq", "ne"):
    setattr(ndarray, f"__{_name}__", _operator(f"__{_name}__"))
ndarray.__hash__ = None  # type: ignore[assignment]
ndarray.__module__ = "cupy"


def _call(func: Any, *args: Any, **kwargs: Any) -> Any:
    """``func`` (a NumPy function or ufunc) on device arrays, refusing host arrays (as CuPy's)."""
    out = kwargs.get("out")
    args = _dev(list(args))
    kwargs = {k: _dev(v) for k, v in kwargs.items()}
    result = func(*args, **kwargs)
    if out is not None:  # the result is the output array itself, not a copy of it
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out
    return _wrap(result)


# --------------------------------------------------------------------------- the module
# The explicit functions take CuPy's parameter names (a subset of them: tests/test_cupy_strictness.py
# checks each against the real function), so a call CuPy refuses is refused here too.
def _empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(shape, dtype)


def _full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    out = ndarray(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)
    out._a[...] = fill_value
    return out


def _zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _full(shape, 0, dtype)


def _ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _full(shape, 1, dtype)


def _like(filler: Any, a: Any, dtype: Any, shape: Any) -> ndarray:
    if not isinstance(a, ndarray):
        raise _unsupported(a)
    return filler(a.shape if shape is None else shape, dtype or a.dtype)


def _empty_like(prototype: Any, dtype: Any = None, order: str = "K", subok: Any = None, shape: Any = None) -> ndarray:
    return _like(_empty, prototype, dtype, shape)


def _zeros_like(a: Any, dtype: Any = None, order: str = "K", subok: Any = None, shape: Any = None) -> ndarray:
    return _like(_zeros, a, dtype, shape)


def _ones_like(a: Any, dtype: Any = None, order: str = "K", subok: Any = None, shape: Any = None) -> ndarray:
    return _like(_ones, a, dtype, shape)


def _asarray(a: Any, dtype: Any = None, order: Any = None, *, copy: Any = None, blocking: bool = False) -> ndarray:
    """The explicit host-to-device copy (or the array itself if already on the device)."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return _wrap(double.to_device(np.array(a, dtype=dtype)))


def _array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K", subok: bool = False, ndmin: int = 0, *,
           blocking: bool = False) -> ndarray:
    if isinstance(obj, ndarray):
        return obj.astype(dtype or obj.dtype)
    return _wrap(double.to_device(np.array(obj, dtype=dtype, ndmin=ndmin)))


def _asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None, *, blocking: bool = True) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(out=out)
    if isinstance(a, np.ndarray) and out is None:
        return a
    host = np.asarray(a)
    if out is not None:
        out[...] = host
        return out
    return host


def _get_array_module(*args: Any) -> Any:
    return module if any(isinstance(a, ndarray) for a in args) else np


class _Generator:
    """``cupy.random.Generator``: draws on the host and copies them to the device once."""

    def __init__(self, seed: Any = None) -> None:
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size: Any = None, dtype: Any = np.float64, out: Any = None) -> ndarray:
        return self._drawn(self._rng.standard_normal(size, dtype=dtype), out)

    def random(self, size: Any = None, dtype: Any = np.float64, out: Any = None) -> ndarray:
        return self._drawn(self._rng.random(size, dtype=dtype), out)

    @staticmethod
    def _drawn(values: Any, out: Any) -> ndarray:
        if out is None:
            return _wrap(double.to_device(np.asarray(values)))
        out.set(np.asarray(values, out.dtype).reshape(out.shape))
        return out


def _module_has(name: str) -> bool:
    """Whether ``cupy.<name>`` exists: the real module's say, or (no CuPy) the table's for a
    function; dtypes and constants are NumPy's (CuPy re-exports them)."""
    if _reference.real is not None:
        return hasattr(_reference.real, name)
    target = getattr(np, name, None)
    if target is None:
        return False
    plain = not callable(target) or target is np.dtype or isinstance(target, type) and issubclass(target, np.generic)
    return plain or _reference.has(name)


def _function(name: str, target: Any) -> Any:
    """``cupy.<name>``: NumPy's ``target`` on device arrays, called as CuPy's would be."""
    if isinstance(target, np.ufunc):
        def ufunc(*args: Any, **kwargs: Any) -> Any:
            _check_ufunc(target, "__call__", args, kwargs)
            return _call(target, *args, **kwargs)
        return ufunc

    def function(*args: Any, **kwargs: Any) -> Any:
        _check(name, args, kwargs)
        return _call(target, *args, **kwargs)
    function.__name__ = name
    return function


class _FakeCupy(types.ModuleType):
    """The module: explicit functions above; any other NumPy function or ufunc CuPy has, strictly wrapped."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or not _module_has(name):
            raise AttributeError(f"module 'cupy' has no attribute {name!r}")
        target = getattr(np, name)  # AttributeError for names NumPy lacks: the fake does not model them
        if isinstance(target, type) or not callable(target):
            return target  # dtypes (float64, int32...), constants (pi, inf, newaxis)
        wrapped = _function(name, target)
        setattr(self, name, wrapped)
        return wrapped


module = _FakeCupy("cupy", __doc__)
module.__dict__.update({
    "ndarray": ndarray, "empty": _empty, "zeros": _zeros, "ones": _ones, "full": _full,
    "empty_like": _empty_like, "zeros_like": _zeros_like, "ones_like": _ones_like, "asarray": _asarray, "array": _array,
    "asnumpy": _asnumpy, "get_array_module": _get_array_module,
    "random": types.SimpleNamespace(default_rng=_Generator, Generator=_Generator), "__file__": __file__,
})


@contextlib.contextmanager
def installed() -> Iterator[Any]:
    """``sys.modules["cupy"]`` is this module, and the double is the CUDA runtime, for the block."""
    from meshkit.comm.engines import cuda_runtime

    saved = sys.modules.get("cupy")
    sys.modules["cupy"] = module
    previous = cuda_runtime.set_runtime(double.FakeRuntime())
    try:
        yield module
    finally:
        cuda_runtime.set_runtime(previous)
        if saved is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved


# --------------------------------------------------------------------------- the recorded table
#: CuPy's signatures (as :func:`spec_of` writes them) of every function, method and ufunc method
#: the fake is called with in the test suite, recorded from CuPy 14.2.0; read only where no CuPy is
#: installed (tests/test_cupy_strictness.py compares it with the installed CuPy).
SIGNATURES: dict[str, str] = {
    "all": "a, axis=, out=, keepdims=",
    "arange": "start, stop=, step=, dtype=",
    "argsort": "a, axis=, kind=",
    "ascontiguousarray": "a, dtype=",
    "bincount": "x, weights=, minlength=",
    "clip": "a, a_min, a_max, out=",
    "concatenate": "tup, axis=, out=, *, dtype=, casting=",
    "copyto": "dst, src, casting=, where=",
    "einsum": "*operands, **kwargs",
    "empty_like": "prototype, dtype=, order=, subok=, shape=",
    "eye": "N, M=, k=, dtype=, order=",
    "full_like": "a, fill_value, dtype=, order=, subok=, shape=",
    "max": "a, axis=, out=, keepdims=",
    "moveaxis": "a, source, destination",
    "outer": "a, b, out=",
    "ndarray.any": "self, axis=, out=, keepdims=",
    "ndarray.argmax": "self, axis=, out=, dtype=, keepdims=",
    "ndarray.dot": "self, b, out=",
    "ndarray.max": "self, axis=, out=, keepdims=",
    "ndarray.mean": "self, axis=, dtype=, out=, keepdims=",
    "ndarray.sum": "self, axis=, dtype=, out=, keepdims=",
    "ndarray.transpose": "self, *axes",
    "result_type": "*arrays_and_dtypes",
    "shape": "a",
    "stack": "tup, axis=, out=, *, dtype=, casting=",
    "sum": "a, axis=, dtype=, out=, keepdims=",
    "swapaxes": "a, axis1, axis2",
    "take": "a, indices, axis=, out=",
    "take_along_axis": "a, indices, axis",
    "transpose": "a, axes=",
    "where": "condition, x=, y=",
    "ufunc.reduce": "self, array, axis=, dtype=, out=, keepdims=",
    "ufunc.accumulate": "self, array, axis=, dtype=, out=",
    "ufunc.reduceat": "self, array, indices, axis=, dtype=, out=",
    "ufunc.outer": "self, A, B, **kwargs",
    "ufunc.at": "self, a, indices, b=",
}
#: Names NumPy has and CuPy 14.2 lacks that meshkit might reach for (``errstate``: meshkit's
#: attention asks for it; the others: ``np.block``, ``np.insert``... on device arrays).
ABSENT = ("errstate", "seterr", "block", "insert", "unstack", "vecdot", "nanquantile", "ndarray.resize")
#: CuPy's ufuncs (and, :data:`GUFUNCS`, generalized ufuncs) the fake is called with in the test suite,
#: recorded from CuPy 14.2.0 (their call takes :data:`UFUNC_KWARGS`, not a signature).
UFUNCS = ("add", "bitwise_and", "bitwise_or", "bitwise_xor", "divide", "exp", "greater", "isfinite", "isnan", "log",
          "logaddexp", "matmul", "maximum", "minimum", "multiply", "power", "sqrt", "subtract", "tanh")
