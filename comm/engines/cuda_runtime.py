"""The one door to the GPU: everything the NCCL engine needs of CUDA, behind one object.

The NCCL engine (:mod:`meshkit.comm.engines.nccl`) never imports CuPy itself. It asks this module for
the *runtime*, an object with the NCCL module, streams, events, the current stream, device
selection and array pointers. By default that is :class:`CupyRuntime` (CuPy and its NCCL
bindings, whichever ``cupy-cudaXXx`` wheel is installed: nothing here names a CUDA major
version); tests install a double with :func:`set_runtime` and so replace every GPU-specific
part in one place.

What a runtime provides (duck-typed, CuPy's own names where CuPy has them)::

    nccl                      module with NcclCommunicator, groupStart, groupEnd, get_unique_id,
                              NcclError and the NCCL_* constants
    device_count() -> int     GPUs this process sees
    use_device(index)         make ``index`` the calling thread's current device
    current_device() -> int   the calling thread's current device (CUDA's is per thread, 0 at start)
    device_of(x) -> int       the device a device array's memory lies on
    pci_bus_id(index) -> str  the GPU's PCI bus id, ``dddd:bb:dd.f`` (one physical GPU of this host,
                              whatever CUDA_VISIBLE_DEVICES numbers it: how NCCL tells GPUs apart)
    new_stream() -> Stream    a non-blocking stream (``.ptr``, ``.wait_event(event)``)
    new_event() -> Event      an event (``.record(stream)``, ``.done``, ``.synchronize()``)
    event_done(event) -> bool   fired (True) or pending (False); raises the CUDA error of a fault
    current_stream() -> Stream   the calling thread's current stream
    is_device_array(x) -> bool   :func:`meshkit.comm.arrays.is_device_array` (the one rule)
    pointer(x) -> int         the device address of a device array's first element
    pinned_empty(shape, dtype) -> numpy.ndarray   page-locked host memory (for staging copies)
    copy_to_host(src, dst, stream)     enqueue device array -> pinned host array on ``stream``
    copy_to_device(src, dst, stream)   enqueue pinned host array -> device array on ``stream``

The copies are asynchronous, ordered on ``stream`` like a kernel: the caller synchronizes the
stream before it reads ``dst`` on the host (or reuses ``src``). The MPI engine stages device
arrays through them when MPI cannot read device memory.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

from ..arrays import is_device_array
from ..errors import DistBackendError

__all__ = ["CupyRuntime", "runtime", "set_runtime", "gpu_available", "is_device_array", "keep_current_device"]


#: cudaErrorNotReady: what cudaEventQuery returns for an event that has not fired yet.
_CUDA_ERROR_NOT_READY = 600


class CupyRuntime:
    """The runtime over CuPy (``cupy.cuda`` and ``cupy.cuda.nccl``).

    Raises:
        DistBackendError: CuPy or its NCCL bindings cannot be imported, or the CuPy is older
            than 14 (its NcclCommunicator has no ``commSplit``, which builds every sub-group).
    """

    def __init__(self) -> None:
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError as exc:
            raise DistBackendError("meshkit.comm: the 'nccl' backend needs CuPy with NCCL: "
                                   "pip install 'meshkit[cuda12]' (or [cuda13]); import failed: "
                                   f"{exc}") from None
        if not getattr(nccl, "available", True):
            raise DistBackendError("meshkit.comm: CuPy is installed but its NCCL bindings are not available; "
                                   "pip install nvidia-nccl-cu12 (or -cu13)")
        if not hasattr(nccl.NcclCommunicator, "commSplit"):  # added in CuPy 14; found at init, not at the first split
            raise DistBackendError(f"meshkit.comm: the 'nccl' backend needs CuPy >= 14 (NcclCommunicator.commSplit "
                                   f"builds its sub-groups); CuPy {getattr(cupy, '__version__', '?')} is installed: "
                                   "pip install 'cupy-cuda12x>=14' (or cupy-cuda13x)")
        self._cupy = cupy
        self.nccl = nccl

    def device_count(self) -> int:
        return int(self._cupy.cuda.runtime.getDeviceCount())

    def use_device(self, index: int) -> None:
        self._cupy.cuda.Device(index).use()

    def current_device(self) -> int:
        return int(self._cupy.cuda.runtime.getDevice())

    def device_of(self, x: Any) -> int:
        device = getattr(getattr(x, "device", None), "id", None)  # CuPy's ndarray.device: also for an empty array
        if isinstance(device, int):
            return device
        # Any other __cuda_array_interface__ array (Numba, torch): the pointer's own device.
        return int(self._cupy.cuda.runtime.pointerGetAttributes(self.pointer(x)).device)

    def pci_bus_id(self, index: int) -> str:
        """The GPU's PCI bus id (lower case): what NCCL compares to find two ranks on one GPU of a
        host ("Duplicate GPU detected", src/init.cc), so the engine refuses exactly what NCCL would.

        Not ``getDeviceProperties(index)["uuid"]``: CuPy 14 builds it from the ``char[16]`` of
        ``cudaUUID_t``, which Cython converts as a C string, cut at the first zero byte (cython
        issue 3234), so two GPUs whose UUIDs agree up to a zero byte read as one. CuPy exposes no
        other UUID (no ``cudaDeviceGetUuid``, no NVML); ``deviceGetPCIBusId`` returns the bus id whole.
        """
        return str(self._cupy.cuda.runtime.deviceGetPCIBusId(index)).lower()

    def new_stream(self) -> Any:
        return self._cupy.cuda.Stream(non_blocking=True)

    def new_event(self) -> Any:
        return self._cupy.cuda.Event(disable_timing=True)

    def event_done(self, event: Any) -> bool:
        """True once ``event`` fired, False while pending; raises CUDARuntimeError (naming the
        error) when a kernel before it failed. CuPy's ``Event.done`` is ``eventQuery(ptr) == 0``,
        False forever after a fault (stream.pyx), so the status itself is read (runtime.pyx's
        ``eventQuery`` returns cudaEventQuery's status without raising)."""
        runtime = self._cupy.cuda.runtime
        status = runtime.eventQuery(event.ptr)
        if status == 0:  # cudaSuccess
            return True
        if status == _CUDA_ERROR_NOT_READY:
            return False
        raise runtime.CUDARuntimeError(status)

    def current_stream(self) -> Any:
        return self._cupy.cuda.get_current_stream()

    @staticmethod
    def is_device_array(x: Any) -> bool:
        return is_device_array(x)

    @staticmethod
    def pointer(x: Any) -> int:
        return int(x.__cuda_array_interface__["data"][0])

    def pinned_empty(self, shape: Any, dtype: Any) -> Any:
        import cupyx
        return cupyx.empty_pinned(shape, dtype)

    @staticmethod
    def copy_to_host(src: Any, dst: Any, stream: Any) -> None:
        src.get(stream=stream, out=dst, blocking=False)

    @staticmethod
    def copy_to_device(src: Any, dst: Any, stream: Any) -> None:
        dst.set(src, stream=stream)


_lock = threading.Lock()
_installed: Any = None


def runtime() -> Any:
    """The runtime in use: the one :func:`set_runtime` installed, else a :class:`CupyRuntime`
    (created once)."""
    global _installed
    with _lock:
        if _installed is None:
            _installed = CupyRuntime()
        return _installed


def set_runtime(rt: Any) -> Any:
    """Install ``rt`` as the runtime (None: back to CuPy on next use); return the previous one."""
    global _installed
    with _lock:
        previous, _installed = _installed, rt
    return previous


def keep_current_device() -> Callable[[], None] | None:
    """A function that makes the calling thread's current device current on the thread that
    calls it (a task handed to a helper thread starts on device 0, as every new CUDA thread);
    None when no runtime is in use (a host-only job never loads CuPy for this)."""
    try:
        rt = _installed if _installed is not None or "cupy" not in sys.modules else runtime()
        if rt is None:
            return None
        return functools.partial(rt.use_device, rt.current_device())
    except Exception:  # no device here after all: nothing to follow
        return None


def gpu_available() -> bool:
    """True when the runtime can be had and sees at least one GPU (``backend="auto"`` asks).

    Never raises: no CuPy, no driver (CuPy raises ``cudaErrorInsufficientDriver`` on a machine
    without one) or no device all mean False.
    """
    try:
        return runtime().device_count() > 0
    except Exception:  # any failure to reach a GPU means: use MPI
        return False
