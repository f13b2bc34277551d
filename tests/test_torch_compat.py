"""What ported torch.distributed code expects: torchrun's variables under meshkit-run,
``is_*_available()``, ``barrier(device_ids=...)`` and the ``"gloo"`` backend.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

import meshkit
from doubles import nccl_double as double
from meshkit.comm.engines import cuda_runtime
from meshkit.comm import local
from meshkit.comm._seams import current_world
from meshkit.launch import bootstrap, cli


# --------------------------------------------------------------------------- torchrun's variables
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_meshkit_run_sets_torchruns_variables_agreeing_with_meshkits_rank(mpirun, backend):
    # Stale values from the caller's environment must not reach the ranks.
    out = mpirun("launch_torchrun_env.py", 3, backend, env={"RANK": "7", "LOCAL_WORLD_SIZE": "9"}, timeout=60).stdout
    ports = set()
    for r in range(3):
        line = next(l for l in out.splitlines() if l.startswith(f"[rank{r}]: "))
        match = re.fullmatch(rf"\[rank{r}\]: RANK={r} WORLD_SIZE=3 LOCAL_RANK={r} LOCAL_WORLD_SIZE=3 "
                             rf"MASTER_ADDR=127\.0\.0\.1 MASTER_PORT=(\d+) \| meshkit rank {r} of 3 on mpi", line)
        assert match, out
        ports.add(int(match.group(1)))
    assert len(ports) == 1 and 0 < ports.pop() < 65536, out


@pytest.mark.parametrize(("env", "expected"), [
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
     {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}),
    # Slurm announces no node-local size in one number: LOCAL_WORLD_SIZE is left out, not stale.
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "LOCAL_WORLD_SIZE": "9"},
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}),
])
def test_torchruns_variables_come_from_the_process_managers(env, expected):
    environ = dict(env)
    bootstrap.set_torchrun_env(environ)
    assert {k: environ[k] for k in bootstrap.TORCHRUN_ENV_VARS if k in environ} == expected


def test_the_rendezvous_address_is_local_unless_the_job_may_span_hosts():
    import socket
    assert cli.rendezvous_address(["mpiexec"], [], {})[0] == "127.0.0.1"
    for args, env in ((["-hosts", "a,b"], {}), (["--hostfile=h"], {}), ([], {"SLURM_JOB_NUM_NODES": "2"}),
                      ([], {"MESHKIT_MPIEXEC": "srun"}), ([], {"HYDRA_HOST_FILE": "h"})):
        address, port = cli.rendezvous_address(["mpiexec"], args, env)
        assert address == socket.getfqdn() and 0 < port < 65536, (args, env)
    with socket.socket() as s:  # the port was free: it can be bound
        s.bind(("127.0.0.1", cli.rendezvous_address(["mpiexec"], [], {})[1]))


# --------------------------------------------------------------------------- is_*_available
def test_availability_is_exported():
    for name in ("is_available", "is_mpi_available", "is_nccl_available"):
        assert name in meshkit.comm.__all__ and getattr(meshkit, name) is getattr(meshkit.comm, name)
    assert meshkit.is_available() is True


def test_a_star_import_gives_the_torch_surface_and_the_packages_and_keeps_the_builtin_breakpoint():
    """``from meshkit import *`` as ``from torch.distributed import *`` would be used: the names of
    meshkit's ``__all__`` (comm's, the mesh, ``spawn``, every package), never a shadowed builtin."""
    import builtins
    from pathlib import Path

    names: dict = {}
    exec("from meshkit import *", names)
    assert "breakpoint" not in names and "breakpoint" not in meshkit.__all__
    shadowed = sorted(n for n in meshkit.__all__ if hasattr(builtins, n))
    assert not shadowed, f"from meshkit import * would shadow builtins: {shadowed}"
    assert meshkit.breakpoint is meshkit.comm.breakpoint  # still there by its full name, as torch's dist.breakpoint
    assert set(meshkit.comm.__all__) - {"breakpoint"} <= set(names)
    root = Path(meshkit.__file__).parent
    # launch_protocol: the launcher-to-rank names, not user API (the rank bootstrap loads it by path)
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file() and p.name not in ("tests", "launch_protocol")}
    assert packages == {"comm", "mesh", "tensor", "state", "parallel", "checkpoint", "plan", "debug", "launch",
                        "elastic"}, packages
    assert packages <= set(meshkit.__all__) and all(names[p] is getattr(meshkit, p) for p in packages)


def _python(code: str, **env: str) -> str:
    import os
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_is_mpi_available_does_not_initialize_mpi():
    code = "import sys, meshkit; print(meshkit.is_mpi_available(), 'mpi4py.MPI' in sys.modules)"
    assert _python(code) == "True False"
    # No MPI library where mpi4py looks for it: False, and no error.
    assert _python(code, MPI4PY_LIBMPI="/nonexistent/libmpi.so") == "False False"
    assert _python("import sys; sys.modules['mpi4py'] = None\nimport meshkit; print(meshkit.is_mpi_available())") \
        == "False"


def test_is_nccl_available_is_false_without_cupy_and_never_raises():
    assert _python("import sys; sys.modules['cupy'] = None\nimport meshkit; print(meshkit.is_nccl_available())") \
        == "False"
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl
        expected = bool(getattr(nccl, "available", True))
    except Exception:
        expected = False
    assert _python("import meshkit; print(meshkit.is_nccl_available())") == str(expected)


# --------------------------------------------------------------------------- barrier(device_ids=)
def test_barrier_accepts_device_ids_on_host_engines_and_checks_their_type():
    def body():
        meshkit.barrier(device_ids=[0])
        meshkit.barrier(device_ids=[5])  # host engines: no GPU to name; accepted and ignored
        assert meshkit.barrier(device_ids=(1,), async_op=True).wait()
        for bad, kind in (("0", TypeError), (0, TypeError), ([0, 1], ValueError), ([], ValueError),
                          ([-1], ValueError), ([True], ValueError), (["0"], ValueError)):
            with pytest.raises(kind, match=rf"rank {meshkit.get_rank()}: barrier: device_ids must be a list of one "
                                           rf"GPU index of this rank \(as torch's, e.g. \[local_rank\]\), got "
                                           rf"{re.escape(repr(bad))}"):
                meshkit.barrier(device_ids=bad)
        return True
    assert local.run(body, 2, timeout=10) == [True, True]


def test_barrier_on_nccl_checks_device_ids_against_the_groups_gpu():
    previous = cuda_runtime.set_runtime(double.FakeRuntime())
    try:
        def body():
            meshkit.init_process_group("nccl", timeout=10)
            device = current_world().default_group.engine.device
            meshkit.barrier(device_ids=[device])
            with pytest.raises(meshkit.DistValueError, match=rf"rank {meshkit.get_rank()}: barrier: device_ids="
                                                             rf"\[{device + 1}\] is not this rank's GPU in group "
                                                             rf"world: its collectives run on device {device}"):
                meshkit.barrier(device_ids=[device + 1])
            meshkit.barrier(device_ids=[device])  # the refused call left the group usable
            return device
        devices = local.run(body, 2, init=False)
        assert sorted(devices) == [0, 1]
    finally:
        cuda_runtime.set_runtime(previous)


# --------------------------------------------------------------------------- "gloo"
def test_gloo_is_the_host_engine():
    def body():
        meshkit.init_process_group("gloo")
        x = np.array([float(meshkit.get_rank() + 1)])
        meshkit.all_reduce(x)
        return meshkit.get_backend(), x[0]
    assert local.run(body, 3, init=False) == [("local", 6.0)] * 3
    # In a process (and under meshkit-run: the test with torchrun's variables), "mpi".
    code = "import meshkit; meshkit.init_process_group('gloo'); print(meshkit.get_backend(), meshkit.get_world_size())"
    assert _python(code) == "mpi 1"


# --------------------------------------------------------------------------- Timeouts and futures
def test_timeouts_take_torchs_timedelta():
    """``monitored_barrier(timeout=timedelta)`` and ``Work.wait(timeout=timedelta)`` raised
    TypeError; torch takes a timedelta (and ``Work.wait``'s default, timedelta(0), means no bound
    of the caller's own)."""
    from datetime import timedelta

    def body():
        meshkit.monitored_barrier(timeout=timedelta(seconds=30))
        x = np.full(2, meshkit.get_rank() + 1.0)
        assert meshkit.all_reduce(x, async_op=True).wait(timeout=timedelta(seconds=30)) is True
        assert meshkit.all_reduce(x, async_op=True).wait(timeout=timedelta(0)) is True  # torch's kNoTimeout
        for bad, error in ((timedelta(seconds=-1), meshkit.DistValueError), ("5", meshkit.DistTypeError)):
            with pytest.raises(error, match=r"Work.wait\(timeout="):
                meshkit.all_reduce(x, async_op=True).wait(timeout=bad)
            meshkit.barrier()  # the all-reduce whose wait was refused still completes
        with pytest.raises(meshkit.DistValueError, match="timeout must be positive, got 0.0"):
            meshkit.monitored_barrier(timeout=timedelta(0))
        return x.tolist()

    assert local.run(body, 2) == [[24.0, 24.0]] * 2  # 1 + 2, doubled by each of the other three all-reduces


def test_a_works_future_resolves_to_its_outputs_as_torchs():
    """``Work.get_future()`` was missing. torch's resolves to the list of output tensors; meshkit's
    is a concurrent.futures.Future with torch's wait/value/then, its error that of the operation."""
    import concurrent.futures

    def body():
        r = meshkit.get_rank()
        x = np.full(2, r + 1.0)
        fut = meshkit.all_reduce(x, async_op=True).get_future()
        assert isinstance(fut, concurrent.futures.Future)
        halved = fut.then(lambda f: f.value()[0] / 2)  # the DDP hook pattern
        assert halved.wait().tolist() == [1.5, 1.5] and fut.value()[0] is x and fut.done()
        seen = []
        out = [np.zeros(1), np.zeros(1)]
        gathered = meshkit.all_gather(out, np.full(1, float(r)), async_op=True).get_future()
        gathered.add_done_callback(lambda f: seen.append(len(f.result()[0])))
        assert gathered.result(timeout=30)[0] is out and seen == [2] and not gathered.cancel()
        recv = meshkit.irecv(np.zeros(1), src=1 - r) if r == 0 else meshkit.isend(np.ones(1), dst=0)
        value = recv.get_future().wait()
        assert len(value) == 1 and value[0].tolist() == [1.0 if r == 0 else 1.0]
        pending = meshkit.irecv(np.zeros(1), src=1 - r, tag=7).get_future()
        with pytest.raises(meshkit.DistValueError, match=r"value\(\) of a future whose operation has not completed"):
            pending.value()
        with pytest.raises(concurrent.futures.TimeoutError):
            pending.result(timeout=0.01)
        meshkit.barrier()  # neither rank sends before both timed out
        meshkit.send(np.full(1, 5.0), dst=1 - r, tag=7)
        assert pending.wait()[0].tolist() == [5.0]
        return True

    assert local.run(body, 2) == [True, True]


def test_a_failed_operations_future_holds_its_error():
    def body():
        if meshkit.get_rank() == 1:
            return "skipped"
        fut = meshkit.irecv(np.zeros(1), src=1).get_future()
        chained = fut.then(lambda f: f.value())
        with pytest.raises(meshkit.CollectiveTimeout, match="rank 1 did not post a matching send"):
            chained.wait()
        return type(fut.exception()).__name__

    assert local.run(body, 2, timeout=0.3)[0] == "CollectiveTimeout"


def test_torch_distributed_debug_is_read_where_meshkit_debug_is_not_set(monkeypatch):
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` was ignored: a ported job's environment asked for the
    checks of detail mode and got none."""
    from meshkit.comm.debug import DebugLevel

    monkeypatch.delenv("MESHKIT_DEBUG", raising=False)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert local.run(meshkit.get_debug_level, 2) == [DebugLevel.DETAIL] * 2  # the world's level
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "info")
    assert meshkit.get_debug_level() == DebugLevel.INFO
    monkeypatch.setenv("MESHKIT_DEBUG", "off")  # meshkit's own variable decides where set
    assert meshkit.get_debug_level() == DebugLevel.OFF
    monkeypatch.delenv("MESHKIT_DEBUG")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "VERBOSE")
    with pytest.raises(meshkit.DistValueError, match=r"TORCH_DISTRIBUTED_DEBUG='VERBOSE' is not valid; valid values "
                                                     r"are \['off', 'info', 'detail'\]"):
        meshkit.get_debug_level()


def test_the_reduce_op_table_of_the_docs_is_what_the_code_accepts():
    """docs/collectives.md listed complex PRODUCT (and MIN, MAX) while the code refused it, as torch
    does: the docs now hold a table by dtype, checked here against check_op_dtype."""
    from pathlib import Path

    from meshkit import ReduceOp
    from meshkit.comm.reduce_op import check_op_dtype

    text = (Path(meshkit.__file__).parent / "docs" / "collectives.md").read_text()
    rows = dict(re.findall(r"^\| (\w+) [^|]*\| ([A-Z, ()a-z]+) \|$", text, re.M))
    rows.pop("dtype", None)  # the header
    examples = {"float": ["float16", "float32", "float64", "longdouble"], "integer": ["int8", "uint64", "int32"],
                "complex": ["complex64", "complex128"], "bool": ["bool"]}
    assert set(rows) == set(examples), rows
    for kind, dtypes in examples.items():
        listed = {ReduceOp[w] for w in re.findall(r"\b[A-Z]+\b", rows[kind])}
        for dtype in dtypes:
            for op in ReduceOp:
                try:
                    check_op_dtype(op, np.dtype(dtype), lambda: "here")
                    accepted = True
                except meshkit.DistTypeError:
                    accepted = False
                assert accepted == (op in listed), (kind, dtype, op)

    def body():
        with pytest.raises(meshkit.DistTypeError, match=r"rank \d: all_reduce: ReduceOp.PRODUCT is not defined for "
                                                         r"dtype complex128; valid ops for this dtype are \['AVG', 'SUM'\]"):
            meshkit.all_reduce(np.ones(2, complex), ReduceOp.PRODUCT)
        with pytest.raises(meshkit.DistTypeError, match=r"ReduceOp.PREMUL_SUM \(torch's _make_nccl_premul_sum\(factor\)"
                                                         r".* multiply the input by factor in place \(x \*= factor\), "
                                                         r"then reduce with ReduceOp.SUM"):
            meshkit.all_reduce(np.ones(2), ReduceOp.PREMUL_SUM)
        x = np.full(2, meshkit.get_rank() + 1.0)
        x *= 0.5  # the way: scale, then sum
        meshkit.all_reduce(x, ReduceOp.SUM)
        return x.tolist()

    assert local.run(body, 2) == [[1.5, 1.5]] * 2
