"""Collective bandwidth and latency, nccl-tests style: meshkit side by side with raw mpi4py (and gloo).

Run it by hand (it is a measurement, not a test; nothing here asserts on timings)::

    mpiexec -n 4 python benchmarks/collectives.py
    mpiexec -n 4 python benchmarks/collectives.py --ops all_reduce --max-bytes 1M --plot
    mpiexec -n 2 python benchmarks/collectives.py --min-bytes 64K --max-bytes 64M --iters 20 --warmup 2
    meshkit-run -n 4 benchmarks/collectives.py --json /tmp/coll.json --plot /tmp/coll.png

With the pip-installed ``mpich`` wheel, ``mpiexec`` is the one next to the venv's ``python``
(e.g. ``/tmp/venv/bin/mpiexec -n 4 /tmp/venv/bin/python benchmarks/collectives.py``).

What is measured, for each op and size:

* The size column is the bytes of the largest buffer, as in nccl-tests: all_reduce and
  broadcast the buffer, all_gather the output, reduce_scatter the input, all_to_all each of
  its two buffers. Sizes are rounded up so that they split into one whole-element chunk per
  rank. ``algbw = size / time``; ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for
  all_reduce, ``(n-1)/n`` for all_gather, reduce_scatter and all_to_all, 1 for broadcast
  (nccl-tests' PERFORMANCE.md), so busbw is comparable with the link's bandwidth.
* Every engine works on the same NumPy buffers, and its result is checked at each size before
  it is timed (a wrong answer aborts the run; an op gloo lacks is recorded as null).
* Besides meshkit and raw mpi4py, ``--engines`` may add ``meshkit-mpi`` (meshkit with its
  shared-memory path stepped aside: its MPI path in the same job), ``meshkit-shared`` (meshkit on
  buffers of ``group.shared_buffer``, which DDP's buckets use: all_reduce, all_gather into and
  reduce_scatter of one in place, no copy in or out; docs/collectives.md's "shm in place" column;
  allocated once per op and size, and kept until the end) and ``copy`` (one core's ``np.copyto``
  of the same bytes: the memory's limit, the ``meshkit busbw/copy`` column).
* Engines are interleaved in rounds: each round runs, per engine, ``warmup`` untimed calls,
  a barrier (whose waiting ranks yield their core), then ``iters`` timed calls; the engine
  order rotates from round to round so that none is always first. A call's time is the MAX
  over ranks of that rank's per-call average; the reported time is the median over the rounds
  (5 by default). On a shared machine (2 cores running 4 ranks) noise comes in bursts that hit
  one round, and the median rejects them.
* Without ``--iters``, the number of iterations adapts to the size: about 0.2 s of timed
  calls per engine in all (so thousands of calls for 8 bytes), never fewer than 5 per round.

Rank 0 prints one table per op, a summary line per op against the project's target
(meshkit's all_reduce within 5 % of mpi4py's time at >= 64 KB, at most 10 us slower at
<= 4 KB), and writes JSON (default ``benchmarks/results/collectives-n{N}.json``) and, with
``--plot``, a PNG of bus bandwidth and of the meshkit/mpi4py time ratio against size.

**GPU** (``--device cuda``; CuPy buffers, one GPU per rank chosen by the node-local rank)::

    python benchmarks/collectives.py --device cuda                    # --backend nccl, world size 1
    mpiexec -n 2 python benchmarks/collectives.py --device cuda --backend mpi

* ``--backend nccl``: meshkit's NCCL engine (``init_process_group("nccl")``) against ``nccl``,
  raw ``cupy.cuda.nccl.NcclCommunicator`` calls made here (its own communicator, from a unique
  id broadcast over mpi4py, on its own stream): ``allReduce``, ``broadcast``, ``allGather``,
  ``reduceScatter``, and ``send``/``recv`` between ``groupStart``/``groupEnd`` for all_to_all.
  NCCL holds one rank per GPU: on one GPU this is world size 1.
* ``--backend mpi``: meshkit's MPI engine on CuPy buffers against raw mpi4py staging by hand
  (``mpi4py-staged``: device -> pinned host buffer, the MPI call on the host, host -> device)
  and, when MPI is CUDA-aware (``meshkit.comm.engines.mpi.cuda_aware_mpi``: ``MESHKIT_CUDA_AWARE_MPI``,
  else the MPI library's MPIX query), raw mpi4py on the device buffers (``mpi4py-cuda``). Several ranks may share one GPU.

Every engine works on the same CuPy buffers, checked at each size before timing (inputs
written from the host, the result read back). GPU timing is host wall clock around ``iters``
calls issued back to back and then the engine's synchronize (its stream, or the caller's
stream that meshkit's ``Work.wait`` ordered), so queued device work is inside the time. In
``sync`` mode a call is a blocking collective on both sides: meshkit's ``async_op=False`` call
returns once the collective finished, and the raw NCCL call is followed by a synchronize of
its stream (raw mpi4py is blocking anyway); in ``async`` mode meshkit's two ``async_op=True``
calls and ``Work.wait`` (which orders the caller's stream, no host wait) against two raw
calls issued back to back. The summary checks the project's GPU target: meshkit within 3 % of the
raw time at >= 1 MB and at most 15 us per call slower below 1 MB (against ``nccl``, or the raw
mpi4py engine doing what meshkit's MPI engine does: ``mpi4py-cuda`` when MPI is CUDA-aware,
else ``mpi4py-staged``). JSON goes to ``benchmarks/results/collectives-cuda-{backend}-n{N}.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from _common import (LOG, Progress, add_output_args, barrier, calibrate_iters, format_size, init_gloo,
                     log2_size_axis, matplotlib_missing, max_over_ranks, median, parse_checked, parse_size, placement,
                     png_path, print0, require_pyplot, run_metadata, save_figure, setup_logging, size_sweep,
                     time_calls, usage_error, write_json)
from mpi4py import MPI

import meshkit
from meshkit.comm.engines import cuda_runtime
from meshkit.comm.engines.mpi import cuda_aware_mpi
from meshkit.comm.engines.nccl import NCCL_DTYPES

RESULTS = Path(__file__).resolve().parent / "results"

#: Timed seconds per engine per (op, size), over all rounds, when --iters is not given.
TARGET_SECONDS = 0.2
#: Fewest timed calls per round when --iters is not given.
MIN_ITERS = 5
#: The project's targets for meshkit's overhead over raw mpi4py (the summary checks them).
LARGE_BYTES, MAX_RATIO = 64 << 10, 1.05
SMALL_BYTES, MAX_EXCESS_US = 4 << 10, 10.0


@dataclasses.dataclass(frozen=True)
class Targets:
    """meshkit's allowed overhead over the reference engine ``ref``: a time ratio of at most
    ``max_ratio`` at >= ``large_bytes``, at most ``max_excess_us`` more per call at <=
    ``small_bytes`` (``below``: at < ``small_bytes``)."""

    ref: str
    large_bytes: int
    max_ratio: float
    small_bytes: int
    max_excess_us: float
    below: bool = False

    def small(self, nbytes: int) -> bool:
        return nbytes < self.small_bytes if self.below else nbytes <= self.small_bytes

    @property
    def small_label(self) -> str:
        return f"{'<' if self.below else '<='} {format_size(self.small_bytes)}"


CPU_TARGETS = Targets("mpi4py", LARGE_BYTES, MAX_RATIO, SMALL_BYTES, MAX_EXCESS_US)
#: The project's target on a GPU: within 3 % at >= 1 MB, at most 15 us per call slower below 1 MB.
GPU_TARGETS = Targets("nccl", 1 << 20, 1.03, 1 << 20, 15.0, below=True)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One collective: its functions, buffer layout and nccl-tests' bus-bandwidth factor.

    ``torch_fn``: its name in the torch.distributed-style API (meshkit, torch); ``mpi_fn``: in
    mpi4py's ``Comm``. ``chunk_input``: the input is one rank's chunk of the size (all_gather).
    ``chunk_output``: the output is one chunk (reduce_scatter).
    ``in_place``: one buffer is both input and output (all_reduce, broadcast).
    """

    name: str
    torch_fn: str
    mpi_fn: str
    bus_factor: Callable[[int], float]
    chunk_input: bool = False
    chunk_output: bool = False
    in_place: bool = False


OPS = {spec.name: spec for spec in (
    OpSpec("all_reduce", "all_reduce", "Allreduce", lambda n: 2 * (n - 1) / n, in_place=True),
    OpSpec("all_gather", "all_gather_into_tensor", "Allgather", lambda n: (n - 1) / n, chunk_input=True),
    OpSpec("reduce_scatter", "reduce_scatter_tensor", "Reduce_scatter_block", lambda n: (n - 1) / n,
           chunk_output=True),
    OpSpec("broadcast", "broadcast", "Bcast", lambda n: 1.0, in_place=True),
    OpSpec("all_to_all", "all_to_all_single", "Alltoall", lambda n: (n - 1) / n),
)}
ENGINES = ("meshkit", "mpi4py", "gloo", "mpi4py-guarded", "meshkit-mpi", "meshkit-shared", "copy")


@dataclasses.dataclass
class Buffers:
    """The arrays one (op, size) runs on; ``inp is out`` for in-place ops."""

    inp: np.ndarray
    out: np.ndarray


def make_buffers(spec: OpSpec, count: int, dtype: np.dtype, n: int,
                 zeros: Callable[[int, np.dtype], Any] = np.zeros) -> Buffers:
    """Zero-filled buffers for ``spec`` where the largest holds ``count`` elements (made by
    ``zeros(count, dtype)``: NumPy's, or a device allocator)."""
    inp = zeros(count // n if spec.chunk_input else count, dtype)
    out = inp if spec.in_place else zeros(count // n if spec.chunk_output else count, dtype)
    return Buffers(inp, out)


Call = Callable[[], object]


@dataclasses.dataclass
class Engine:
    """A collective library under test.

    ``bind(op, buffers)`` returns a zero-argument call of ``op`` on ``buffers``. ``optional``:
    an op that raises on its first call is reported as unsupported (null) instead of aborting.
    On a GPU, ``finish`` waits for the device work the calls enqueued (it ends every timed
    block, inside the time) and ``inputs_written`` orders the engine's own stream after what
    the harness wrote into the buffers; both do nothing on the CPU.
    """

    name: str
    bind: Callable[[str, Buffers], Call]
    close: Callable[[], None] = lambda: None
    optional: bool = False
    finish: Callable[[], None] = lambda: None
    inputs_written: Callable[[], None] = lambda: None
    checked: bool = True  # False: not a collective (``copy``), its result is not checked
    #: ``(op, buffers) -> buffers``: the engine's own buffers like ``buffers`` (where the caller asks
    #: the library for them: ``meshkit-shared``); checked and timed on those. None: the common ones.
    own_buffers: Callable[[str, Buffers], Buffers] | None = None


# --------------------------------------------------------------------------- engines
def _spec(op: str) -> OpSpec:
    """``OPS[op]``; ValueError for an unknown op."""
    if op not in OPS:
        raise ValueError(f"meshkit.bench: unknown op {op!r}")
    return OPS[op]


#: ``--mode``: ``sync`` times one blocking call; ``async`` two nonblocking calls (on two sets of
#: buffers) started back to back, then both waited for: meshkit's ``async_op=True`` and
#: ``Work.wait`` against mpi4py's ``I*`` calls and ``Waitall``.
MODES = ("sync", "async")


def _second(b: Buffers) -> Buffers:
    """Another set of buffers like ``b`` (for the second call of async mode)."""
    inp = b.inp.copy()
    return Buffers(inp, inp if b.out is b.inp else b.out.copy())


def torch_style_bind(api: Any, convert: Callable[[np.ndarray], Any] = np.asarray,
                     mode: str = "sync") -> Callable[[str, Buffers], Call]:
    """``Engine.bind`` for a torch.distributed-style ``api`` (meshkit, ``torch.distributed``).

    Its calls are ``fn(out, inp)``, ``all_reduce(out)`` and ``broadcast(out, 0)``, on the
    buffers passed through ``convert`` (e.g. ``torch.from_numpy``).
    """
    def arguments(op: str, b: Buffers) -> tuple:
        inp, out = convert(b.inp), convert(b.out)
        return {"all_reduce": (out,), "broadcast": (out, 0)}.get(op, (out, inp))

    def bind(op: str, b: Buffers) -> Call:
        fn = getattr(api, _spec(op).torch_fn)
        if mode == "sync":
            return functools.partial(fn, *arguments(op, b))
        first, second = arguments(op, b), arguments(op, _second(b))

        def both() -> None:
            w1 = fn(*first, async_op=True)
            w2 = fn(*second, async_op=True)
            w1.wait()
            w2.wait()
        return both

    return bind


def meshkit_engine(mode: str = "sync") -> Engine:
    """meshkit's torch.distributed-style API on its default (world) group."""
    return Engine("meshkit", torch_style_bind(meshkit, mode=mode))


#: A threshold no buffer reaches: the shared-memory path steps aside for every call.
_NEVER = 1 << 62


def meshkit_mpi_engine(mode: str = "sync") -> Engine:
    """meshkit on the same world group with its shared-memory path stepped aside (its engine's
    thresholds, ``MESHKIT_SHM_MIN_BYTES``, ``MESHKIT_SHM_MOVE_MIN_BYTES`` and the one-meeting path's
    ``MESHKIT_SHM_SMALL_MIN_BYTES``, set above every size for the call): meshkit over MPI, in
    the same job as the shared-memory path, on the same buffers. Without the path (``MESHKIT_SHM=0``,
    a world across nodes) it is plain ``meshkit``."""
    from meshkit.comm._seams import resolve_group
    from meshkit.comm.engines.shm import ShmEngine

    engine = resolve_group(None).engine
    plain = torch_style_bind(meshkit, mode=mode)
    if not isinstance(engine, ShmEngine):
        return Engine("meshkit-mpi", plain)
    shm = engine

    def bind(op: str, b: Buffers) -> Call:
        fn = plain(op, b)

        def over_mpi() -> None:
            least, moved, small = shm.min_bytes, shm.move_min_bytes, shm.small.least
            shm.min_bytes = shm.move_min_bytes = shm.small.least = _NEVER
            try:
                fn()
            finally:
                shm.min_bytes, shm.move_min_bytes, shm.small.least = least, moved, small
        return over_mpi

    return Engine("meshkit-mpi", bind)


def meshkit_shared_engine(mode: str = "sync") -> Engine:
    """meshkit on buffers it handed out (``group.shared_buffer``, as DDP's buckets are): all_reduce
    and all_gather_into_tensor into one, reduce_scatter_tensor of one, in place with no copy in or
    out (the "shm in place" column; a user who asks for the buffer gets this). Other ops, and a
    world without the path, run on such buffers as on any (ordinary memory without the path)."""
    from meshkit.comm._seams import resolve_group

    group = resolve_group(None)

    def shared(like: np.ndarray) -> np.ndarray:
        return group.shared_buffer(like.nbytes).view(like.dtype).reshape(like.shape)

    def own_buffers(op: str, b: Buffers) -> Buffers:
        spec = _spec(op)
        if spec.in_place:
            inp = shared(b.inp)
            return Buffers(inp, inp)
        if op == "all_gather":
            return Buffers(b.inp.copy(), shared(b.out))
        return Buffers(shared(b.inp), b.out.copy())

    return Engine("meshkit-shared", torch_style_bind(meshkit, mode=mode), own_buffers=own_buffers)


def copy_engine() -> Engine:
    """Not a collective: one core copying the op's largest buffer (``np.copyto`` of the same bytes),
    measured in the same rounds: the memory system's limit that busbw is compared with (the ``copy``
    column's algbw)."""
    def bind(op: str, b: Buffers) -> Call:
        src = b.out if b.out.nbytes >= b.inp.nbytes else b.inp
        return functools.partial(np.copyto, np.empty_like(src), src)

    return Engine("copy", bind, checked=False)


def _mpi_arguments(op: str, b: Buffers) -> tuple:
    """mpi4py's buffer arguments of ``op`` on ``b`` (in place where meshkit's call is)."""
    return {"all_reduce": (MPI.IN_PLACE, b.out), "broadcast": (b.out, 0)}.get(op, (b.inp, b.out))


def _mpi_start(comm: MPI.Comm, op: str) -> Callable[..., MPI.Request]:
    """The nonblocking mpi4py call of ``op``: Allreduce -> Iallreduce, Bcast -> Ibcast."""
    return getattr(comm, "I" + _spec(op).mpi_fn.lower())


def mpi4py_engine(mode: str = "sync") -> Engine:
    """Raw mpi4py collectives on a duplicate of COMM_WORLD: the floor meshkit sits on (blocking
    calls in sync mode, ``I*`` calls and ``Waitall`` in async mode)."""
    comm = MPI.COMM_WORLD.Dup()
    arguments = _mpi_arguments  # shared with mpi4py_gpu_engine

    def bind(op: str, b: Buffers) -> Call:
        if mode == "sync":
            return functools.partial(getattr(comm, _spec(op).mpi_fn), *arguments(op, b))
        start = _mpi_start(comm, op)
        first, second = arguments(op, b), arguments(op, _second(b))

        def both() -> None:
            MPI.Request.Waitall([start(*first), start(*second)])
        return both

    return Engine("mpi4py", bind, close=comm.Free)


def guarded_engine() -> Engine:
    """Raw mpi4py with the cheapest cross-rank size/dtype guard (docs/hangs.md): each
    call starts, beside the op, an ``Iallreduce(MAX)`` of a 2-integer signature (the element
    count and its negation: max and min at once; a dtype code would ride the same way), and waits
    for both. What a default check would cost
    meshkit under MPI, measured against ``mpi4py`` in the same run; sync mode only."""
    comm = MPI.COMM_WORLD.Dup()

    def bind(op: str, b: Buffers) -> Call:
        start, args = _mpi_start(comm, op), _mpi_arguments(op, b)
        signature = np.array([b.out.size, -b.out.size], np.int64)
        seen = np.empty(2, np.int64)

        def guarded() -> None:
            MPI.Request.Waitall([start(*args), comm.Iallreduce(signature, seen, MPI.MAX)])
        return guarded

    return Engine("mpi4py-guarded", bind, close=comm.Free)


def gloo_engine(comm: MPI.Comm, mode: str = "sync") -> Engine:
    """torch.distributed with the gloo backend, on ``torch.from_numpy`` views of the same buffers.

    The rendezvous is torch's ``env://``: rank 0 picks a free TCP port (a socket bound to port
    0), mpi4py broadcasts it, and RANK/WORLD_SIZE come from MPI. MASTER_ADDR is 127.0.0.1 when
    all ranks share a host, else rank 0's host name. Ops gloo lacks (``reduce_scatter_tensor``
    in many torch versions) raise on their first call and are reported as null.

    Raises:
        ImportError: torch is not installed.
    """
    import torch  # noqa: F401  (the ImportError is the signal that gloo is unavailable)
    import torch.distributed as dist

    address = init_gloo(comm)
    LOG.info("gloo: torch %s, rendezvous at %s", torch.__version__, address)
    return Engine("gloo", torch_style_bind(dist, torch.from_numpy, mode), close=dist.destroy_process_group,
                  optional=True)


def torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def make_engines(names: list[str], comm: MPI.Comm, mode: str = "sync") -> list[Engine]:
    makers: dict[str, Callable[[], Engine]] = {
        "meshkit": lambda: meshkit_engine(mode), "mpi4py": lambda: mpi4py_engine(mode),
        "gloo": lambda: gloo_engine(comm, mode), "mpi4py-guarded": guarded_engine,
        "meshkit-mpi": lambda: meshkit_mpi_engine(mode), "meshkit-shared": lambda: meshkit_shared_engine(mode),
        "copy": copy_engine}
    return [makers[name]() for name in names]


# --------------------------------------------------------------------------- GPU engines
#: GPU engines of each backend (``--device cuda --backend ...``); the first is meshkit.
GPU_ENGINES = {"nccl": ("meshkit", "nccl"), "mpi": ("meshkit", "mpi4py-staged", "mpi4py-cuda")}


def device_zeros(count: int, dtype: np.dtype) -> Any:
    """A zero-filled device array of ``count`` elements (CuPy). Tests replace this function,
    together with the runtime (``cuda_runtime.set_runtime``), to run the GPU path against the
    double of tests/doubles/nccl_double.py."""
    import cupy
    return cupy.zeros(count, dtype)


@dataclasses.dataclass
class DeviceSpace:
    """Device buffers, reached from the host through the runtime of ``meshkit.comm.engines.cuda_runtime``
    (CuPy's calls: ``cupyx.empty_pinned``, ``ndarray.get(out=)``, ``ndarray.set``): the checks
    write inputs and read results through pinned host buffers, on the current stream."""

    rt: Any

    def zeros(self, count: int, dtype: np.dtype) -> Any:
        return device_zeros(count, dtype)

    def upload(self, dst: Any, src: np.ndarray) -> None:
        """Device array ``dst`` <- host array ``src``, finished when this returns."""
        stream = self.rt.current_stream()
        pinned = self.rt.pinned_empty(dst.shape, dst.dtype)
        pinned[...] = src
        self.rt.copy_to_device(pinned, dst, stream)
        stream.synchronize()

    def download(self, src: Any) -> np.ndarray:
        """A host copy of device array ``src`` (after the current stream's work)."""
        stream = self.rt.current_stream()
        pinned = self.rt.pinned_empty(src.shape, src.dtype)
        self.rt.copy_to_host(src, pinned, stream)
        stream.synchronize()
        return pinned


def _ordered_after_caller(rt: Any, stream: Any) -> None:
    """Make ``stream`` wait for what the caller's current stream has enqueued so far."""
    event = rt.new_event()
    event.record(rt.current_stream())
    stream.wait_event(event)


def meshkit_gpu_engine(rt: Any, mode: str = "sync") -> Engine:
    """meshkit's API on device arrays (its NCCL or MPI engine, as initialized). ``finish``
    synchronizes the caller's stream, which ``Work.wait`` ordered after meshkit's collectives."""
    return Engine("meshkit", torch_style_bind(meshkit, lambda x: x, mode),
                  finish=lambda: rt.current_stream().synchronize())


def nccl_engine(comm: MPI.Comm, rt: Any, dtype: np.dtype, mode: str = "sync") -> Engine:
    """Raw ``NcclCommunicator`` calls on a communicator and a stream of their own.

    The unique id is made on rank 0 and broadcast over ``comm``; the communicator takes the
    calling thread's current device (meshkit's NCCL engine chose it: the node-local rank). In
    sync mode each call is followed by a synchronize of the stream (a blocking collective).
    """
    nccl = rt.nccl
    uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None, root=0)
    nc = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
    stream = rt.new_stream()
    n = comm.Get_size()
    datatype, sum_op = getattr(nccl, NCCL_DTYPES[dtype.name]), nccl.NCCL_SUM

    def issue(op: str, b: Buffers) -> Callable[[], None]:
        pi, po, s = rt.pointer(b.inp), rt.pointer(b.out), stream.ptr
        match op:
            case "all_reduce":
                return lambda: nc.allReduce(pi, po, b.out.size, datatype, sum_op, s)
            case "broadcast":
                return lambda: nc.broadcast(pi, po, b.out.size, datatype, 0, s)
            case "all_gather":
                return lambda: nc.allGather(pi, po, b.inp.size, datatype, s)
            case "reduce_scatter":
                return lambda: nc.reduceScatter(pi, po, b.out.size, datatype, sum_op, s)
            case "all_to_all":
                chunk = b.inp.size // n
                step = chunk * b.inp.itemsize

                def all_to_all() -> None:
                    nccl.groupStart()
                    try:
                        for peer in range(n):
                            nc.send(pi + peer * step, chunk, datatype, peer, s)
                            nc.recv(po + peer * step, chunk, datatype, peer, s)
                    finally:
                        nccl.groupEnd()
                return all_to_all
        raise ValueError(f"meshkit.bench: unknown op {op!r}")

    def bind(op: str, b: Buffers) -> Call:
        first = issue(op, b)
        if mode == "sync":
            def blocking() -> None:
                first()
                stream.synchronize()
            return blocking
        extra = _second(b)
        second = issue(op, extra)

        def both(_keep: tuple = (b, extra)) -> None:  # NCCL gets pointers: the arrays must stay alive
            first()
            second()
        return both

    return Engine("nccl", bind, close=nc.destroy, finish=stream.synchronize,
                  inputs_written=lambda: _ordered_after_caller(rt, stream))


def mpi4py_gpu_engine(rt: Any, *, staged: bool, mode: str = "sync") -> Engine:
    """Raw mpi4py on device arrays: ``staged`` by hand (device -> pinned host buffer, except on a
    broadcast's receivers; the MPI call on the host buffers; host -> device; each copy finished
    before the next step), or on the device arrays themselves (CUDA-aware MPI, after a synchronize of the caller's
    stream, since MPI is not stream-aware)."""
    comm = MPI.COMM_WORLD.Dup()

    def pinned(b: Buffers) -> Buffers:
        inp = rt.pinned_empty(b.inp.shape, b.inp.dtype)
        return Buffers(inp, inp if b.out is b.inp else rt.pinned_empty(b.out.shape, b.out.dtype))

    def bind(op: str, b: Buffers) -> Call:
        devices = [b] if mode == "sync" else [b, _second(b)]
        hosts = [pinned(d) for d in devices] if staged else devices
        arguments = [_mpi_arguments(op, h) for h in hosts]
        blocking, start = getattr(comm, _spec(op).mpi_fn), _mpi_start(comm, op)
        reads = op != "broadcast" or comm.Get_rank() == 0  # a broadcast's receivers send nothing

        def call() -> None:
            stream = rt.current_stream()
            if staged and reads:
                for d, h in zip(devices, hosts):
                    rt.copy_to_host(d.inp, h.inp, stream)
            stream.synchronize()
            if mode == "sync":
                blocking(*arguments[0])
            else:
                MPI.Request.Waitall([start(*a) for a in arguments])
            if staged:
                for d, h in zip(devices, hosts):
                    rt.copy_to_device(h.out, d.out, stream)
                stream.synchronize()
        return call

    return Engine("mpi4py-staged" if staged else "mpi4py-cuda", bind, close=comm.Free)


def make_gpu_engines(names: list[str], backend: str, comm: MPI.Comm, rt: Any, dtype: np.dtype,
                     mode: str = "sync") -> list[Engine]:
    makers: dict[str, Callable[[], Engine]] = {
        "meshkit": lambda: meshkit_gpu_engine(rt, mode), "nccl": lambda: nccl_engine(comm, rt, dtype, mode),
        "mpi4py-staged": lambda: mpi4py_gpu_engine(rt, staged=True, mode=mode),
        "mpi4py-cuda": lambda: mpi4py_gpu_engine(rt, staged=False, mode=mode)}
    return [makers[name]() for name in names]


def gpu_targets(backend: str, engines: list[str]) -> Targets:
    """The project's GPU targets against the raw engine that does what meshkit's engine does."""
    if backend == "nccl":
        ref = "nccl"
    else:
        ref = "mpi4py-cuda" if "mpi4py-cuda" in engines and cuda_aware_mpi() else "mpi4py-staged"
    return dataclasses.replace(GPU_TARGETS, ref=ref)


def gpu_problem() -> str | None:
    """Why no GPU can be used here (CuPy or NCCL missing, no driver, no device), or None."""
    try:
        count = cuda_runtime.runtime().device_count()
    except Exception as exc:  # no CuPy, no driver: reported as the reason
        return f"{type(exc).__name__}: {exc}"
    return None if count > 0 else "CuPy sees 0 GPUs"


def gpu_metadata(rt: Any) -> dict[str, Any]:
    """The GPU, CuPy and NCCL versions of this run (None where they cannot be read)."""
    meta: dict[str, Any] = {"gpu": None, "cupy": None, "nccl": None, "cuda_aware_mpi": cuda_aware_mpi()}
    try:
        meta["nccl"] = rt.nccl.get_version()
        import cupy
        meta["cupy"] = cupy.__version__
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        meta["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    except Exception:  # metadata only: a double or a missing field leaves None
        pass
    return meta


# --------------------------------------------------------------------------- correctness check
def _cast(value: int, dtype: np.dtype) -> Any:
    """``value`` in ``dtype`` (integers wrap, as MPI's sums of them do)."""
    return np.asarray(value, dtype=np.int64).astype(dtype)


def fill_for_check(op: str, b: Buffers, rank: int, n: int) -> None:
    """Inputs whose result identifies every rank and chunk; outputs zeroed."""
    if b.out is not b.inp:
        b.out.fill(0)
    match op:
        case "all_reduce" | "broadcast" | "all_gather":
            b.inp[...] = _cast(rank + 1, b.inp.dtype)
        case "reduce_scatter":
            for j, chunk in enumerate(b.inp.reshape(n, -1)):
                chunk[...] = _cast((j + 1) * (rank + 1), b.inp.dtype)
        case "all_to_all":
            for j, chunk in enumerate(b.inp.reshape(n, -1)):
                chunk[...] = _cast(rank * n + j + 1, b.inp.dtype)


def result_ok(op: str, b: Buffers, rank: int, n: int) -> bool:
    """Whether ``b.out`` holds what ``op`` must produce from :func:`fill_for_check`'s inputs."""
    match op:
        case "all_reduce":
            return bool(np.all(b.out == _cast(n * (n + 1) // 2, b.out.dtype)))
        case "broadcast":
            return bool(np.all(b.out == _cast(1, b.out.dtype)))
        case "all_gather":
            return all(np.all(c == _cast(i + 1, c.dtype)) for i, c in enumerate(b.out.reshape(n, -1)))
        case "reduce_scatter":
            return bool(np.all(b.out == _cast((rank + 1) * n * (n + 1) // 2, b.out.dtype)))
        case "all_to_all":
            chunks = b.out.reshape(n, -1)
            return all(np.all(c == _cast(i * n + rank + 1, c.dtype)) for i, c in enumerate(chunks))
    raise ValueError(f"meshkit.bench: unknown op {op!r}")


def check_engine(engine: Engine, op: str, fn: Call, b: Buffers, comm: MPI.Comm,
                 space: DeviceSpace | None = None) -> bool:
    """Run ``fn`` once on known inputs on every rank; True if every rank got the right result.

    A wrong result, or an exception from a required engine, aborts the benchmark on every rank
    (a benchmark of a wrong answer is meaningless); an optional engine's exception (gloo
    lacking an op) returns False everywhere. With a device ``space``, the inputs are written
    through host buffers and the result read back (after the engine's ``finish``).
    """
    rank, n = comm.Get_rank(), comm.Get_size()
    host = b if space is None else host_mirror(b)
    fill_for_check(op, host, rank, n)
    error: str | None = None
    try:
        if space is not None:
            write_buffers(space, b, host)
            engine.inputs_written()
        fn()
        engine.finish()
        if space is not None:
            host.out[...] = space.download(b.out)
    except Exception as exc:  # reported below on every rank, not swallowed
        error = f"{type(exc).__name__}: {exc}"
    errors = comm.allgather(error)
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed and engine.optional:
        if rank == 0:
                LOG.warning("%s does not run %s; recorded as null (%s)", engine.name, op,
                            next(iter(failed.values())))
        return False
    if failed:
        raise RuntimeError(f"meshkit.bench: {engine.name} {op} failed on ranks {sorted(failed)}: {failed}")
    wrong = [r for r, ok in enumerate(comm.allgather(result_ok(op, host, rank, n))) if not ok]
    if wrong:
        raise RuntimeError(f"meshkit.bench: {engine.name} {op} of {b.out.nbytes} bytes gave a wrong result "
                           f"on ranks {wrong}")
    return True


def host_mirror(b: Buffers) -> Buffers:
    """Zeroed NumPy buffers shaped like ``b`` (one array if ``b``'s op is in place)."""
    inp = np.zeros(b.inp.shape, b.inp.dtype)
    return Buffers(inp, inp if b.out is b.inp else np.zeros(b.out.shape, b.out.dtype))


def write_buffers(space: DeviceSpace, b: Buffers, host: Buffers) -> None:
    """Copy the host buffers ``host`` into the device buffers ``b`` (input, and output if separate)."""
    space.upload(b.inp, host.inp)
    if b.out is not b.inp:
        space.upload(b.out, host.out)


# --------------------------------------------------------------------------- measurement
@dataclasses.dataclass
class Settings:
    """Iterations per timed block and warm-up calls (None: adaptive), and the number of rounds."""

    iters: int | None
    warmup: int | None
    rounds: int
    stat: str = "median"  # how a size's time is taken from its rounds: median, or min (--stat)


def run_rounds(calls: dict[str, Call], comm: MPI.Comm, iters: int, warmup: int,
               rounds: int, finish: dict[str, Callable[[], None]] | None = None) -> dict[str, list[float]]:
    """Per-call seconds of each engine in each round: MAX over ranks of the per-rank average.

    ``finish[name]`` (GPU engines) ends the warm-up and each timed block, inside the time.
    """
    names = list(calls)
    finish = finish or {}
    local = np.zeros((rounds, len(names)))
    for r in range(rounds):
        for k in range(len(names)):
            i = (r + k) % len(names)  # rotate: no engine always runs first
            call, done = calls[names[i]], finish.get(names[i])
            for _ in range(warmup):
                call()
            if done is not None:
                done()
            barrier(comm)
            local[r, i] = time_calls(call, iters, done)
    worst = np.array(max_over_ranks(comm, local.ravel())).reshape(rounds, len(names))
    return {name: worst[:, i].tolist() for i, name in enumerate(names)}


def measure(op: str, nbytes: int, engines: list[Engine], unsupported: set[tuple[str, str]],
            dtype: np.dtype, comm: MPI.Comm, settings: Settings,
            space: DeviceSpace | None = None) -> list[dict[str, Any]]:
    """JSON rows (one per engine) of ``op`` at ``nbytes``; null times where an engine lacks it.

    ``space``: the buffers are device arrays made and reached through it (None: NumPy).
    """
    n = comm.Get_size()
    spec = OPS[op]
    count = nbytes // dtype.itemsize
    b = make_buffers(spec, count, dtype, n, np.zeros if space is None else space.zeros)
    calls: dict[str, Call] = {}
    owned: list[Buffers] = []  # engines' own buffers (own_buffers), zeroed with the common ones
    for engine in engines:
        if (engine.name, op) in unsupported:
            continue
        eb = b if engine.own_buffers is None or space is not None else engine.own_buffers(op, b)
        if eb is not b:
            owned.append(eb)
        fn = engine.bind(op, eb)
        if not engine.checked or check_engine(engine, op, fn, eb, comm, space):
            calls[engine.name] = fn
        else:
            unsupported.add((engine.name, op))
    if space is None:
        for each in [b, *owned]:
            each.inp.fill(0)  # zeros: sums stay finite however many calls run in place
            each.out.fill(0)
    else:
        write_buffers(space, b, host_mirror(b))
        for engine in engines:
            engine.inputs_written()
    finish = {e.name: e.finish for e in engines} if space is not None else None
    iters, warmup = settings.iters, settings.warmup
    if calls and iters is None:  # calibrated on the first engine; every engine then runs as many calls
        first = next(iter(calls))
        iters = calibrate_iters(calls[first], comm, min_iters=MIN_ITERS, budget_s=TARGET_SECONDS / settings.rounds,
                                finish=finish[first] if finish else None)
    if warmup is None:
        warmup = max(1, (iters or 0) // 10)
    per_round = run_rounds(calls, comm, iters or 0, warmup, settings.rounds, finish) if calls else {}
    return [row(op, nbytes, count, e.name, per_round.get(e.name), iters, n, settings.stat) for e in engines]


def row(op: str, nbytes: int, count: int, engine: str, rounds: list[float] | None, iters: int | None,
        n: int, stat: str = "median") -> dict[str, Any]:
    if rounds is None:
        return {"op": op, "bytes": nbytes, "count": count, "engine": engine, "time_us": None,
                "algbw_gbs": None, "busbw_gbs": None, "iters": None, "rounds": None}
    seconds = min(rounds) if stat == "min" else median(rounds)
    algbw = nbytes / seconds / 1e9
    return {"op": op, "bytes": nbytes, "count": count, "engine": engine, "time_us": seconds * 1e6,
            "algbw_gbs": algbw, "busbw_gbs": algbw * OPS[op].bus_factor(n), "iters": iters,
            "rounds": [t * 1e6 for t in rounds]}


# --------------------------------------------------------------------------- report
def ratio(rows: list[dict[str, Any]], nbytes: int, ref: str = "mpi4py") -> float | None:
    """meshkit's time over ``ref``'s at ``nbytes`` (rows of one op), None if either is missing."""
    times = {r["engine"]: r["time_us"] for r in rows if r["bytes"] == nbytes}
    mk, base = times.get("meshkit"), times.get(ref)
    return mk / base if mk is not None and base else None


def table_header(op: str, engines: list[str], n: int, dtype: np.dtype, ref: str = "mpi4py",
                 where: str = "") -> list[str]:
    """The title and column lines of one op's table; ``where`` (e.g. ``on cuda, nccl``) follows the dtype."""
    title = f"# {op}: {n} ranks, {dtype}{where}, time = median over rounds of the slowest rank's mean per call"
    top = f"# {'':>14} {'':>8} {'':>10}" + "".join(f" | {name:^32}" for name in engines)
    cols = f"# {'op':>14} {'size':>8} {'count':>10}" + " | time(us) algbw(GB/s) busbw(GB/s)" * len(engines)
    has_ratio = "meshkit" in engines and ref in engines
    fraction = " | meshkit busbw/copy" if "meshkit" in engines and "copy" in engines else ""
    return [title, top, cols + (f" | meshkit/{ref}" if has_ratio else "") + fraction]


def table_line(rows: list[dict[str, Any]], ref: str = "mpi4py") -> str:
    """One table row from the rows of one (op, size), one per engine."""
    first = rows[0]
    cells = [f"  {first['op']:>14} {format_size(first['bytes']):>8} {first['count']:>10}"]
    for r in rows:
        if r["time_us"] is None:
            cells.append(f" | {'n/a':>8} {'':>11} {'':>11}")
        else:
            cells.append(f" | {r['time_us']:8.1f} {r['algbw_gbs']:11.3f} {r['busbw_gbs']:11.3f}")
    engines = {r["engine"] for r in rows}
    if {"meshkit", ref} <= engines:
        q = ratio(rows, first["bytes"], ref)
        cells.append(f" | {q:{max(14, len(ref) + 8)}.3f}" if q is not None else f" | {'n/a':>{max(14, len(ref) + 8)}}")
    if {"meshkit", "copy"} <= engines:
        q = copy_fraction(rows)
        cells.append(f" | {q:19.3f}" if q is not None else f" | {'n/a':>19}")
    return "".join(cells)


def copy_fraction(rows: list[dict[str, Any]]) -> float | None:
    """meshkit's busbw over the ``copy`` engine's algbw (one core's copy of the same bytes), rows of one size."""
    bw = {r["engine"]: (r["busbw_gbs"], r["algbw_gbs"]) for r in rows}
    mk, copy = bw.get("meshkit"), bw.get("copy")
    return mk[0] / copy[1] if mk and copy and mk[0] is not None and copy[1] else None


def summary_line(op: str, rows: list[dict[str, Any]], targets: Targets = CPU_TARGETS) -> str | None:
    """Worst meshkit/ref time ratio at large sizes and worst excess in us at small ones, vs ``targets``
    (on the CPU: >= 64K and <= 4K against mpi4py)."""
    ref = targets.ref
    times: dict[int, dict[str, float]] = {}
    for r in rows:
        if r["time_us"] is not None:
            times.setdefault(r["bytes"], {})[r["engine"]] = r["time_us"]
    pairs = {s: (t["meshkit"], t[ref]) for s, t in times.items() if "meshkit" in t and ref in t}
    if not pairs:
        return None
    parts = []
    large = {s: mk / base for s, (mk, base) in pairs.items() if s >= targets.large_bytes}
    if large:
        s = max(large, key=large.__getitem__)
        verdict = "met" if large[s] <= targets.max_ratio else "MISSED"
        parts.append(f"worst time ratio at >= {format_size(targets.large_bytes)}: {large[s]:.3f} at "
                     f"{format_size(s)} (target <= {targets.max_ratio}: {verdict})")
    small = {s: mk - base for s, (mk, base) in pairs.items() if targets.small(s)}
    if small:
        s = max(small, key=small.__getitem__)
        verdict = "met" if small[s] <= targets.max_excess_us else "MISSED"
        parts.append(f"worst excess at {targets.small_label}: {small[s]:+.1f} us at {format_size(s)} "
                     f"(target <= {targets.max_excess_us:g} us: {verdict})")
    if not parts:
        return None
    return f"# {op} summary (meshkit vs {ref}): " + "; ".join(parts)


def plot(rows: list[dict[str, Any]], ops: list[str], engines: list[str], path: Path, title: str,
         targets: Targets = CPU_TARGETS) -> None:
    """busbw vs size per op (top row) and meshkit/ref time ratio (bottom row), one PNG."""
    plt = require_pyplot()
    with_ratio = "meshkit" in engines and targets.ref in engines
    nrows = 2 if with_ratio else 1
    fig, axes = plt.subplots(nrows, len(ops), figsize=(4.2 * len(ops), 3.4 * nrows + 0.6), squeeze=False,
                             sharex="col", gridspec_kw={"height_ratios": [3, 2][:nrows]})
    for j, op in enumerate(ops):
        of_op = [r for r in rows if r["op"] == op]
        sizes = sorted({r["bytes"] for r in of_op})
        ax = axes[0, j]
        for name in engines:
            pts = [(r["bytes"], r["busbw_gbs"]) for r in of_op if r["engine"] == name and r["busbw_gbs"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=name)
        ax.set_title(op)
        ax.set_yscale("log")
        ax.grid(True, which="major", alpha=0.3)
        log2_size_axis(ax, sizes, max_ticks=7)
        if j == 0:
            ax.set_ylabel("bus bandwidth (GB/s)")
            ax.legend(loc="upper left", fontsize="small")
        if with_ratio:
            _plot_ratio(axes[1, j], of_op, sizes, targets, first=j == 0)
        axes[-1, j].set_xlabel("size (bytes)")
    save_figure(fig, path, title)


def _plot_ratio(ax: Any, rows: list[dict[str, Any]], sizes: list[int], targets: Targets, *, first: bool) -> None:
    """meshkit/ref time on a log2 y axis; the ratio target drawn where it applies (e.g. 1.05 at >= 64K)."""
    from matplotlib.ticker import FuncFormatter
    large, most = targets.large_bytes, targets.max_ratio
    pts = [(s, q) for s in sizes if (q := ratio(rows, s, targets.ref)) is not None]
    if pts:
        ax.plot(*zip(*pts), marker="o", markersize=3, color="black")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    if sizes[-1] >= large:
        ax.hlines(most, max(large, sizes[0]), sizes[-1], color="tab:red", linewidth=1,
                  linestyle="--", label=f"target <= {most} (>= {format_size(large)})")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.grid(True, which="major", alpha=0.3)
    log2_size_axis(ax, sizes, max_ticks=7)
    if first:
        ax.set_ylabel(f"time meshkit / {targets.ref}")
        if sizes[-1] >= large:
            ax.legend(loc="best", fontsize="small")


# --------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated ops (default: {','.join(OPS)})")
    p.add_argument("--min-bytes", type=parse_size, default="8", help="smallest size: 8, 64K, 1M (default: 8)")
    p.add_argument("--max-bytes", type=parse_size, default="64M", help="largest size (default: 64M)")
    p.add_argument("--step-factor", type=float, default=2.0, help="each size is this times the last (default: 2)")
    p.add_argument("--dtype", default="float32", help="NumPy dtype of the buffers (default: float32)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per engine per round (default: adaptive, about "
                        f"{TARGET_SECONDS} s per engine over all rounds, at least {MIN_ITERS} per round)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls per engine before each timed block (default: max(1, iters / 10))")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported (default: 5)")
    p.add_argument("--stat", default="median", choices=("median", "min"),
                   help="a size's time over the rounds: median, or min (the least disturbed round on a loaded "
                        "machine; default: median)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes in place of the sweep, e.g. 4K,16K,64K,1M,4M,16M,64M")
    p.add_argument("--engines", default=None,
                   help=f"comma-separated, from {', '.join(ENGINES)} "
                        "(default: meshkit,mpi4py, plus gloo when torch is importable); with --device cuda, "
                        "from meshkit,nccl (--backend nccl) or meshkit,mpi4py-staged,mpi4py-cuda (--backend mpi; "
                        "default: mpi4py-cuda only when MPI is CUDA-aware)")
    p.add_argument("--device", default="cpu",
                   help="where buffers live: cpu (NumPy) or cuda (CuPy, one GPU per rank; default: cpu)")
    p.add_argument("--backend", default=None,
                   help="meshkit's engine: mpi (--device cpu), nccl or mpi (--device cuda; default: nccl)")
    p.add_argument("--mode", default="sync", choices=MODES,
                   help="sync: one blocking call; async: two async_op=True calls, then both waits, against "
                        "mpi4py's I* calls and Waitall (default: sync)")
    add_output_args(p, json_help="result file (default: benchmarks/results/collectives-n{N}.json)",
                    plot_from_help=None)
    return p


def _split(text: str, valid: Sequence[str], what: str, p: argparse.ArgumentParser, rank: int) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in valid]
    if bad or not names:
        usage_error(p, rank, f"invalid {what} {bad or text!r}; valid {what} are {list(valid)}")
    return list(dict.fromkeys(names))


def parse_args(rank: int, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line (identically on every rank; rank 0 prints errors)."""
    p = build_parser()
    args = parse_checked(p, rank, argv, _invalid)
    args.ops = _split(args.ops, list(OPS), "ops", p, rank)
    if args.sizes is not None:
        try:
            args.sizes = [parse_size(s.strip()) for s in args.sizes.split(",") if s.strip()]
        except (ValueError, argparse.ArgumentTypeError):
            usage_error(p, rank, f"invalid --sizes {args.sizes!r}; use sizes such as 4K,64K,1M")
    args.dtype = np.dtype(args.dtype)
    if args.device == "cuda":
        args.engines = _split(args.engines or ",".join(_default_gpu_engines(args.backend)),
                              GPU_ENGINES[args.backend], "engines", p, rank)
        if "mpi4py-cuda" in args.engines and not cuda_aware_mpi():
            usage_error(p, rank, "engine mpi4py-cuda needs a CUDA-aware MPI, and this one is not (or "
                                 "MESHKIT_CUDA_AWARE_MPI=0); use mpi4py-staged")
        return args
    args.backend = "mpi"
    default_engines = "meshkit,mpi4py,gloo" if torch_importable() else "meshkit,mpi4py"
    args.engines = _split(args.engines or default_engines, ENGINES, "engines", p, rank)
    if "gloo" in args.engines and not torch_importable():
        usage_error(p, rank, "engine gloo needs torch, which is not installed (pip install torch)")
    if "mpi4py-guarded" in args.engines and args.mode != "sync":
        usage_error(p, rank, "engine mpi4py-guarded times one blocking call: use it with --mode sync")
    return args


def _default_gpu_engines(backend: str) -> list[str]:
    names = list(GPU_ENGINES[backend])
    if backend == "mpi" and not cuda_aware_mpi():
        names.remove("mpi4py-cuda")
    return names


def _invalid(args: argparse.Namespace) -> str | None:
    """The first problem with ``args`` that argparse cannot see, or None."""
    if args.device not in ("cpu", "cuda"):
        return f"invalid --device {args.device!r}; valid devices are ['cpu', 'cuda']"
    backends = ["mpi"] if args.device == "cpu" else list(GPU_ENGINES)
    if args.backend is None:
        args.backend = backends[0]
    if args.backend not in backends:
        return f"invalid --backend {args.backend!r} with --device {args.device}; valid backends are {backends}"
    try:
        dtype = np.dtype(args.dtype)
    except TypeError:
        return f"invalid --dtype {args.dtype!r}; use a NumPy dtype name such as float32, float64, int32"
    if dtype.kind not in "iufc":
        return f"invalid --dtype {args.dtype!r} (kind {dtype.kind!r}); use an integer, float or complex dtype"
    if args.backend == "nccl" and dtype.name not in NCCL_DTYPES:
        return f"invalid --dtype {args.dtype!r} with --backend nccl; NCCL reduces {list(NCCL_DTYPES)}"
    for name in ("iters", "warmup"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "iters" else 0):
            return f"invalid --{name} {value}; it must be >= {1 if name == 'iters' else 0}"
    if args.rounds < 1:
        return f"invalid --rounds {args.rounds}; it must be >= 1"
    if not args.step_factor > 1:
        return f"invalid --step-factor {args.step_factor}; it must be > 1"
    if args.min_bytes > args.max_bytes or args.min_bytes < 1:
        return (f"invalid sizes --min-bytes {args.min_bytes} --max-bytes {args.max_bytes}; "
                "need 1 <= min <= max")
    if args.device == "cuda" and (problem := gpu_problem()) is not None:
        return (f"--device cuda needs a GPU that CuPy can use, and there is none here ({problem}); "
                "run it on a GPU machine, or use --device cpu")
    return matplotlib_missing(args)


# --------------------------------------------------------------------------- main
def run(args: argparse.Namespace, comm: MPI.Comm, engines: list[Engine], space: DeviceSpace | None = None,
        targets: Targets = CPU_TARGETS) -> list[dict[str, Any]]:
    """Measure every (op, size), printing each table row on rank 0 as it is measured.

    ``space``: device buffers (``--device cuda``); ``targets``: what the summary lines check.
    """
    rank, n = comm.Get_rank(), comm.Get_size()
    sizes = size_sweep(args.min_bytes, args.max_bytes, args.step_factor, multiple=n * args.dtype.itemsize)
    if args.sizes:
        unit = n * args.dtype.itemsize
        sizes = [-(-s // unit) * unit for s in args.sizes]
    settings = Settings(args.iters, args.warmup, args.rounds, args.stat)
    names = [e.name for e in engines]
    unsupported: set[tuple[str, str]] = set()
    rows: list[dict[str, Any]] = []
    where = placement(comm)
    if where["oversubscribed"] and rank == 0:
        LOG.warning("%d ranks on a host with %d cores: oversubscribed, so times include OS scheduling and "
                    "vary from run to run; compare engines within one run", where["ranks_per_host"],
                    where["cores_per_host"])
    show_bar = rank == 0 and not args.no_progress
    with Progress(len(args.ops) * len(sizes), enabled=show_bar, unit="size") as progress:
        say: Callable[[str], None] = progress.write if show_bar else functools.partial(print0, rank)
        for op in args.ops:
            progress.start_group(op)
            where_run = "" if space is None else f" on cuda ({args.backend}, {args.mode})"
            say("\n".join(table_header(op, names, n, args.dtype, targets.ref, where_run)))
            of_op: list[dict[str, Any]] = []
            for nbytes in sizes:
                measured = measure(op, nbytes, engines, unsupported, args.dtype, comm, settings, space)
                of_op += measured
                say(table_line(measured, targets.ref))
                progress.step(format_size(nbytes))
            say((summary_line(op, of_op, targets) or f"# {op}: no meshkit/{targets.ref} pair to compare") + "\n")
            rows += of_op
    return rows


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD.Dup()  # barriers and time reductions: never in an engine's way
    rank = comm.Get_rank()
    args = parse_args(rank, argv)
    setup_logging(rank, args.verbose)
    space: DeviceSpace | None = None
    targets, extra = CPU_TARGETS, {}
    if args.device == "cuda":
        rt = cuda_runtime.runtime()
        if args.backend == "mpi":  # NCCL's engine picks its GPU itself; several MPI ranks may share one
            local = comm.Split_type(MPI.COMM_TYPE_SHARED)
            rt.use_device(local.Get_rank() % rt.device_count())
            local.Free()
        meshkit.init_process_group(args.backend)
        space, targets = DeviceSpace(rt), gpu_targets(args.backend, args.engines)
        engines = make_gpu_engines(args.engines, args.backend, comm, rt, args.dtype, args.mode)
        extra = {"device": "cuda", "backend": args.backend, "mode": args.mode, "reference": targets.ref,
                 **gpu_metadata(rt)}
    else:
        meshkit.init_process_group("mpi")
        engines = make_engines(args.engines, comm, args.mode)
    try:
        rows = run(args, comm, engines, space, targets)
    finally:
        for engine in engines:
            engine.close()
        meshkit.destroy_process_group()
    meta = run_metadata(comm, benchmark="collectives", dtype=str(args.dtype), engines=args.engines,
                        ops=args.ops, rounds=args.rounds, iters=args.iters, warmup=args.warmup,
                        target_seconds=TARGET_SECONDS if args.iters is None else None, **extra)
    if rank == 0:
        save(args, meta, rows, targets)
    comm.Free()
    return 0


def save(args: argparse.Namespace, meta: dict[str, Any], rows: list[dict[str, Any]],
         targets: Targets = CPU_TARGETS) -> None:
    """Write the JSON and, with --plot, the PNG (rank 0 only; nothing collective here)."""
    n = meta["world_size"]
    device = "" if args.device == "cpu" else f"cuda-{args.backend}-"
    path = args.json or RESULTS / f"collectives-{device}n{n}{'' if args.mode == 'sync' else '-' + args.mode}.json"
    write_json(path, meta, rows)
    LOG.info("wrote %s", path)
    if args.plot is not None:
        png = png_path(args.plot, path)
        title = (f"meshkit collectives ({args.mode}): {n} ranks, {args.dtype}, {meta['hostname']}, "
                 f"{meta['mpi_library'][:60]}")
        if args.device == "cuda":
            title += f", cuda {args.backend} on {meta.get('gpu')}"
        if meta["oversubscribed"]:
            title += f" ({meta['ranks_per_host']} ranks on {meta['cores_per_host']} cores)"
        plot(rows, args.ops, args.engines, png, title, targets)
        LOG.info("wrote %s", png)


if __name__ == "__main__":
    sys.exit(main())
