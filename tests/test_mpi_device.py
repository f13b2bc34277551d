"""Device arrays over the MPI engine, against the double (tests/doubles/nccl_double.py) as the runtime.

On real processes (2 ranks, ``meshkit-run``): every collective and point-to-point on device
arrays, staged through pinned host buffers (``MESHKIT_CUDA_AWARE_MPI=0``) and handed to MPI as
they are (``=1``); staging buffers reused across calls; an output a failed operation never
touched; the mix of host and device arrays; staging on the engine's own stream (ordered by an
event, not waiting for the caller's later work) and in chunks; CUDA-aware detection. In process: the double's staging copies are strict
(pinned buffers only, stream order after the caller's writes, nothing read before a sync).
Nothing here has run on a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from doubles import nccl_double as double

from meshkit.comm.engines import cuda_runtime

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.parametrize("mode", ["staged", "aware"])
def test_every_collective_on_device_arrays_over_mpi(mpirun, mode):
    env = {"MESHKIT_CUDA_AWARE_MPI": "1" if mode == "aware" else "0"}
    out = mpirun("mpi_device_arrays.py", 2, mode, env=env, timeout=240).stdout
    found = dict(re.findall(rf"\[rank(\d)\]: OK {mode} (\d+) checks", out))
    assert found == {"0": "519", "1": "247"}, out  # the host suite less its strided-NumPy-input checks
    pinned = re.findall(r"pinned=(\d+)", out)
    if mode == "staged":
        assert all(int(p) > 0 for p in pinned) and len(pinned) == 2, out
    else:
        assert pinned == ["0", "0"], out


def test_failed_operation_leaves_the_device_output_untouched(mpirun):
    out = mpirun("mpi_device_faults.py", 2, "timeout", env={"MESHKIT_CUDA_AWARE_MPI": "0"}, timeout=60).stdout
    assert "[rank0]: all_reduce: CollectiveTimeout: meshkit.comm: rank 0: all_reduce #0 on group world" in out, out
    assert "[rank0]: all_reduce output [0.0, 1.0, 2.0, 3.0] copies back 0" in out, out
    assert "[rank0]: recv: CollectiveTimeout" in out, out
    assert "[rank0]: recv output [7.0, 7.0] copies back 0" in out, out


def test_a_chunked_operation_that_times_out_copies_no_chunk_back(mpirun):
    out = mpirun("mpi_device_faults.py", 2, "chunked-timeout", env={"MESHKIT_CUDA_AWARE_MPI": "0"}, timeout=60).stdout
    assert "[rank0]: chunked all_reduce: CollectiveTimeout: meshkit.comm: rank 0: all_reduce #0" in out, out
    assert "[rank0]: chunked all_reduce output [0.0, 1.0, 2.0, 3.0] copies to host 4 back 0" in out, out


def test_a_failed_copy_back_fails_the_work_and_leaves_the_output(mpirun):
    out = mpirun("mpi_device_faults.py", 2, "copy-back-fails", env={"MESHKIT_CUDA_AWARE_MPI": "0"},
                 timeout=60).stdout
    assert "[rank0]: copy-back: FakeNcclError: double: copy_to_device failed (injected)" in out, out
    assert "[rank0]: copy-back completed True success False output [0.0, 1.0, 2.0, 3.0]" in out, out
    assert "[rank1]: copy-back completed True success True output [0.0, 2.0, 4.0, 6.0]" in out, out


def test_staging_copies_follow_the_callers_writes_and_large_buffers_go_to_mpi_in_chunks(mpirun):
    """One job of 3 ranks, two cases. "overlap": the copies run on the engine's staging stream, after
    an event on the caller's stream: a Work completes while the caller's stream is busy with work
    queued after the collective. "chunks": all_reduce, reduce and broadcast above CHUNK_BYTES (16
    bytes here) are posted chunk by chunk as their copies arrive; every collective still matches
    NumPy; one copy back."""
    n = 3
    out = mpirun("mpi_device_streams.py", n, "overlap", "chunks", env={"MESHKIT_CUDA_AWARE_MPI": "0"},
                 timeout=200).stdout
    for rank in range(n):
        assert f"[rank{rank}]: wait with the caller's stream busy: True" in out, out
        assert f"[rank{rank}]: result [60.0, 6.0, 6.0, 6.0]" in out, out  # x[0] written before: copied
    assert "[rank1]: broadcast [0.0, 1.0, 2.0]" in out, out
    for rank in range(n):
        assert re.search(rf"\[rank{rank}\]: checks \d+", out), out
        assert f"[rank{rank}]: all_reduce 1001 float64: 501 copies to host, 1 back" in out, out  # 2 per chunk
    assert "[rank1]: broadcast 5 float64: 3 copies to host, 0 back" in out, out  # the root reads in 3 chunks
    assert "[rank0]: broadcast 5 float64: 0 copies to host, 1 back" in out, out


def test_a_staging_stream_that_skips_the_event_wait_fails_on_the_double(mpirun):
    """An engine whose staging stream ignores wait_event: the double refuses both copies."""
    out = mpirun("mpi_device_streams.py", 2, "no-event-wait", env={"MESHKIT_CUDA_AWARE_MPI": "0"}, timeout=60).stdout
    assert ("[rank1]: recv: FakeNcclError: double: copy_to_device: the stream is not ordered after write #1 to the "
            "device array on another stream") in out, out
    assert ("[rank1]: send: FakeNcclError: double: copy_to_host: the stream is not ordered after the caller's "
            "current stream") in out, out


def test_cuda_aware_override_must_be_0_or_1(mpirun):
    out = mpirun("mpi_device_faults.py", 2, "bad-env", timeout=60).stdout
    for rank in (0, 1):
        assert (f"[rank{rank}]: bad-env: DistValueError: meshkit.comm: rank {rank}: MESHKIT_CUDA_AWARE_MPI='yes' "
                "is not valid; valid values are 0 (stage device arrays through host memory) and 1 (MPI reads "
                "device memory)") in out, out


def test_cuda_aware_detection_asks_the_mpi_library_mpi4py_does_not_wrap():
    """mpi4py 4.1 has no Query_cuda_support: the answer comes from the loaded libmpi's MPIX
    functions (found through ctypes), after MESHKIT_CUDA_AWARE_MPI and mpi4py's own query."""
    env = {k: v for k, v in os.environ.items() if k != "MESHKIT_CUDA_AWARE_MPI"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "mpi_cuda_aware.py")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"real library libmpi\S* -> False", lines[0]), lines  # no GPU here: MPICH says 0
    assert lines[1:] == [
        "MPIX_Query_cuda_support 1 -> True", "MPIX_Query_cuda_support 0 -> False",
        "MPIX_GPU_query_support 1 -> True", "MPIX_GPU_query_support 0 -> False",
        "MPIX_GPU_query_support failing -> False", "neither -> False", "no library -> False",
        "mpi4py Query_cuda_support 1, library 0 -> True",
        "MESHKIT_CUDA_AWARE_MPI=0, library 1 -> False", "MESHKIT_CUDA_AWARE_MPI=1, library 1 -> True"], lines


# --------------------------------------------------------------------------- the double's copies
@pytest.fixture
def rt():
    return double.FakeRuntime()


def test_copies_run_in_stream_order_and_only_once_synchronized(rt):
    dev = double.to_device(np.arange(4.0))
    host = rt.pinned_empty((4,), np.float64)
    host[...] = -1
    stream = rt.current_stream()
    rt.copy_to_host(dev, host, stream)
    assert host.tolist() == [-1.0] * 4  # not synchronized yet: a host reading now reads stale data
    stream.synchronize()
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0]
    host *= 10
    rt.copy_to_device(host, dev, stream)
    stream.synchronize()
    assert dev.get().tolist() == [0.0, 10.0, 20.0, 30.0]
    assert (rt.pinned_allocations, rt.copies_to_host, rt.copies_to_device) == (1, 1, 1)


def test_copies_need_pinned_buffers_of_the_same_size(rt):
    dev = double.to_device(np.arange(4.0))
    with pytest.raises(double.FakeNcclError, match="ndarray is not a buffer of pinned_empty"):
        rt.copy_to_host(dev, np.empty(4), rt.current_stream())
    with pytest.raises(double.FakeNcclError, match=r"host buffer of shape \(3,\) float64 for a device array of shape \(4,\) float64"):
        rt.copy_to_host(dev, rt.pinned_empty((3,), np.float64), rt.current_stream())
    with pytest.raises(double.FakeNcclError, match="DeviceArray is not a buffer of pinned_empty"):
        rt.copy_to_device(dev, double.to_device(np.zeros(4)), rt.current_stream())


def test_a_copy_on_a_stream_not_ordered_after_the_writes_is_refused(rt):
    dev = double.to_device(np.arange(4.0))
    dev[0] = 5  # a write on the current stream
    other = rt.new_stream()
    with pytest.raises(double.FakeNcclError, match="copy_to_host: the stream is not ordered after the caller's"):
        rt.copy_to_host(dev, rt.pinned_empty((4,), np.float64), other)
    event = rt.new_event()
    event.record(rt.current_stream())
    other.wait_event(event)
    host = rt.pinned_empty((4,), np.float64)
    rt.copy_to_host(dev, host, other)
    other.synchronize()
    assert host.tolist() == [5.0, 1.0, 2.0, 3.0]


def test_a_copy_into_device_memory_follows_the_last_write_to_it_not_later_unrelated_ones(rt):
    dev = double.to_device(np.zeros(4))  # allocated (a write) on the current stream
    staging, host = rt.new_stream(), rt.pinned_empty((4,), np.float64)
    host[...] = 1
    with pytest.raises(double.FakeNcclError, match=r"copy_to_device: the stream is not ordered after write #\d+ "
                                                   "to the device array on another stream"):
        rt.copy_to_device(host, dev, staging)
    event = rt.new_event()
    event.record(rt.current_stream())
    staging.wait_event(event)
    double.to_device(np.ones(8))  # the caller writes elsewhere since: no hazard for the copy
    rt.copy_to_device(host, dev, staging)
    staging.synchronize()
    assert dev.get().tolist() == [1.0] * 4


@pytest.mark.parametrize("aware", ["0", None], ids=["staged", "detected"])
def test_real_cupy_arrays_over_mpi_on_a_real_gpu(mpirun, aware):
    """Two ranks sharing the GPU (one GPU holds one NCCL rank, but any number of MPI ranks)."""
    if not cuda_runtime.gpu_available():
        pytest.skip("no GPU: CuPy sees no CUDA device here (device arrays over MPI are tested over the double)")
    env = {} if aware is None else {"MESHKIT_CUDA_AWARE_MPI": aware}
    out = mpirun("mpi_cupy_gpu.py", 2, env=env, timeout=300).stdout
    lines = [line for line in out.splitlines() if " OK " in f" {line.split(': ', 1)[-1]} "]
    assert len(lines) == 2 and all("of 2" in line for line in lines), out
