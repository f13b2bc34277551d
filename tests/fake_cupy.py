"""A strict fake ``cupy`` module over the NCCL double's device memory (tests/nccl_double.py).

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
  is refused too (CuPy copies it to the device implicitly; a hot path must not).

Every array wraps a ``DeviceArray`` of the double (an allocation, or a view of one), so pointers,
live allocations, the device of each thread and the stream model (host access synchronizes the
current stream; writes are ordered on it) are the double's, not a second copy of them.

Install it for a test with :func:`installed` (a context manager that puts it in ``sys.modules``
as ``cupy``), together with ``nccl_double.FakeRuntime`` for the engine.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Any, Iterator

import numpy as np

import nccl_double as double

__all__ = ["ndarray", "module", "installed", "IMPLICIT"]

#: CuPy's message for an implicit device-to-host conversion (cupy/_core/core.pyx, ``__array__``).
IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy "
            "array explicitly.")


def _unsupported(x: Any) -> TypeError:
    return TypeError(f"Unsupported type {type(x)}")


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
        return _call(getattr(ufunc, method), *inputs, **kwargs)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
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
    def device_id(self) -> int:
        return self._a.device_id

    def get(self, stream: Any = None, out: Any = None, blocking: bool = True) -> np.ndarray:
        """The explicit device-to-host copy (synchronizes the current stream)."""
        host = self._a.get()
        if out is not None:
            out[...] = host
            return out
        return host

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """The explicit host-to-device copy into this array."""
        if not isinstance(arr, np.ndarray) or arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"set: needs a numpy.ndarray of shape {self.shape} and dtype {self.dtype}")
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
    def reshape(self, *shape: Any, **kwargs: Any) -> ndarray:
        return ndarray._of(self._a.reshape(*shape, **kwargs))

    def ravel(self) -> ndarray:
        return ndarray._of(self._a.ravel())

    def view(self, dtype: Any = None) -> ndarray:
        if dtype is not None and isinstance(dtype, type) and issubclass(dtype, np.ndarray):
            raise TypeError("cupy.ndarray.view: a numpy.ndarray view of device memory does not exist")
        return ndarray._of(self._a.view() if dtype is None else self._a.view(dtype))

    def copy(self, order: str = "C") -> ndarray:
        return _wrap(double.to_device(self._a.get()))

    def astype(self, dtype: Any, copy: bool = True, **kwargs: Any) -> ndarray:
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _wrap(double.to_device(self._a.get().astype(dtype, **kwargs)))

    def fill(self, value: Any) -> None:
        self._a[...] = _dev(value)

    def __getattr__(self, name: str) -> Any:  # reductions and other methods: sum, max, dot, any, ...
        if name.startswith("_") or not callable(getattr(np.ndarray, name, None)):
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")

        def method(*args: Any, **kwargs: Any) -> Any:
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
def _empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(shape, dtype)


def _full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    out = ndarray(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)
    out._a[...] = fill_value
    return out


def _like(filler: Any) -> Any:
    def like(a: Any, dtype: Any = None, shape: Any = None) -> ndarray:
        if not isinstance(a, ndarray):
            raise _unsupported(a)
        return filler(a.shape if shape is None else shape, dtype or a.dtype)
    return like


def _asarray(a: Any, dtype: Any = None, order: Any = None, *, blocking: bool = False) -> ndarray:
    """The explicit host-to-device copy (or the array itself if already on the device)."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return _wrap(double.to_device(np.array(a, dtype=dtype)))


def _array(a: Any, dtype: Any = None, copy: bool = True, **kwargs: Any) -> ndarray:
    if isinstance(a, ndarray):
        return a.astype(dtype or a.dtype)
    return _asarray(a, dtype)


def _asnumpy(a: Any, stream: Any = None) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def _get_array_module(*args: Any) -> Any:
    return module if any(isinstance(a, ndarray) for a in args) else np


class _Generator:
    """``cupy.random.Generator``: draws on the host and copies them to the device once."""

    def __init__(self, seed: Any) -> None:
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        return _wrap(double.to_device(self._rng.standard_normal(size, dtype=dtype)))

    def random(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        return _wrap(double.to_device(self._rng.random(size, dtype=dtype)))


class _FakeCupy(types.ModuleType):
    """The module: explicit functions above; any other NumPy function or ufunc, strictly wrapped."""

    def __getattr__(self, name: str) -> Any:
        target = getattr(np, name)  # AttributeError for names NumPy lacks, as a missing CuPy name would
        if isinstance(target, type) or not callable(target):
            return target  # dtypes (float64, int32...), constants (pi, inf, newaxis)
        wrapped = functools.partial(_call, target)
        setattr(self, name, wrapped)
        return wrapped


module = _FakeCupy("cupy", __doc__)
module.__dict__.update({
    "ndarray": ndarray, "empty": _empty, "zeros": lambda shape, dtype=float: _full(shape, 0, dtype),
    "ones": lambda shape, dtype=float: _full(shape, 1, dtype), "full": _full,
    "empty_like": _like(_empty), "zeros_like": _like(lambda s, d: _full(s, 0, d)),
    "ones_like": _like(lambda s, d: _full(s, 1, d)), "asarray": _asarray, "array": _array,
    "asnumpy": _asnumpy, "get_array_module": _get_array_module,
    "random": types.SimpleNamespace(default_rng=_Generator), "__file__": __file__,
})


@contextlib.contextmanager
def installed() -> Iterator[Any]:
    """``sys.modules["cupy"]`` is this module, and the double is the CUDA runtime, for the block."""
    from meshkit.comm import cuda_runtime

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
