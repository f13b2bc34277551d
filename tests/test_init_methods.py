"""init_process_group's init methods: env://, tcp://, file://, store=, checked inputs,
the rendezvous (duplicate ranks, ranks that never come), the MPI world under meshkit-run, and the
nccl backend bootstrapped through a store without MPI.

Three tiers: bad input in this process (each error raised before anything is connected); the
nccl engine over the store engine with ranks as threads (``local.run`` with the strict NCCL
double, whose communicators live in one process, and a HashStore); and real processes started by
a plain launcher written here (``subprocess.Popen`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, no mpiexec), whose device collectives go through ``tests/doubles/nccl_process_double.py``
(a stand-in communicator that crosses processes), plus one job under ``meshkit-run``.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import meshkit
from doubles import nccl_double as double
from support.ports import free_port
from conftest import SCRIPTS
from meshkit.comm.engines import cuda_runtime
from meshkit.comm import local
from meshkit.comm.groups.world import local_context

#: Variables a launcher may have set in the environment pytest runs in: removed for every test.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MESHKIT_LAUNCHED")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------- bad input, nothing connected
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(init_method="tcp//localhost:29500", world_size=2, rank=0), meshkit.DistValueError,
     r"init_method='tcp//localhost:29500'\) is not a URL; valid init methods are \['env://', 'tcp://host:port', "
     r"'file:///path'\]"),
    (dict(init_method="udp://localhost:29500", world_size=2, rank=0), meshkit.DistValueError,
     r"unknown scheme 'udp://'; valid init methods are \['env://'"),
    (dict(init_method="tcp://localhost:http", world_size=2, rank=0), meshkit.DistValueError,
     r"init_method='tcp://localhost:http'\) has port 'http': the port must be an integer in 1..65535"),
    (dict(init_method="tcp://localhost:70000", world_size=2, rank=0), meshkit.DistValueError,
     r"has port '70000': the port must be an integer in 1..65535"),
    (dict(init_method="tcp://localhost", world_size=2, rank=0), meshkit.DistValueError,
     r"a tcp:// URL names a host and a port: tcp://host:port"),
    (dict(init_method="tcp://localhost:29500?rank=0", world_size=2, rank=0), meshkit.DistValueError,
     r"a tcp:// URL is tcp://host:port and nothing else"),
    (dict(init_method="file://shared/rendezvous", world_size=2, rank=0), meshkit.DistValueError,
     r"a file:// URL names a file by its absolute path, file:///path/to/file"),
    (dict(init_method="tcp://localhost:29500", world_size=4, rank=4), meshkit.DistValueError,
     r"init_process_group\(world_size=4, rank=4\): rank 4 is out of range for a world of 4 ranks "
     r"\(valid ranks: 0..3\)"),
    (dict(init_method="tcp://localhost:29500", world_size=2), meshkit.DistValueError,
     r"with tcp://localhost:29500 needs world_size and rank; rank not given"),
    (dict(init_method="tcp://localhost:29500", world_size="2", rank=0), meshkit.DistTypeError,
     r"init_process_group\(world_size='2'\): world_size must be an int"),
    (dict(init_method="tcp://localhost:29500", world_size=0, rank=0), meshkit.DistValueError,
     r"init_process_group\(world_size=0\): world_size must be -1 \(not given\) or >= 1"),
    (dict(init_method=29500), meshkit.DistTypeError, r"init_method must be a URL string"),
    (dict(init_method="env://", store=meshkit.HashStore(), world_size=2, rank=0), meshkit.DistValueError,
     r"store and init_method='env://' were both given; give one of them"),
    (dict(store=meshkit.HashStore(), world_size=2), meshkit.DistValueError,
     r"with store= needs world_size and rank; rank not given"),
    (dict(store={"not": "a store"}, world_size=2, rank=0), meshkit.DistTypeError,
     r"store must be a meshkit Store .* got dict"),
    (dict(init_method="env://localhost"), meshkit.DistValueError, r"env:// takes nothing after the '//'"),
    (dict(init_method="env://"), meshkit.DistValueError,
     r"init_method env:// needs RANK and WORLD_SIZE in the environment"),
])
def test_bad_input_is_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        meshkit.init_process_group("mpi", **kwargs)
    assert not meshkit.is_initialized()


@pytest.mark.parametrize("env, match", [
    ({"RANK": "0", "WORLD_SIZE": "four"}, r"init_method env:// reads WORLD_SIZE='four', which is not valid; "
                                          r"WORLD_SIZE must be an integer >= 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, r"reads RANK='-1', which is not valid; RANK must be an integer >= 0"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"init_method env:// says RANK=2, WORLD_SIZE=2: rank 2 is out of range for "
                                       r"a world of 2 ranks \(valid ranks: 0..1\)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, r"reads LOCAL_RANK='x'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "zero"}, r"reads SLURM_LOCALID='zero'"),
])
def test_bad_environment_is_named(monkeypatch, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(meshkit.DistValueError, match=match):
        meshkit.init_process_group("mpi", init_method="env://")


def test_mpi_cannot_form_a_world_from_env_outside_mpiexec(monkeypatch):
    """MPI's world comes from its process manager: the error names meshkit-run.
    Slurm's variables stand in for RANK/WORLD_SIZE (srun without an MPI plugin)."""
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    with pytest.raises(meshkit.DistBackendError, match=r"backend 'mpi' cannot form a world of 3 from init_method "
                       r"env:// says RANK=1, WORLD_SIZE=3: .* Start the job with meshkit-run -n 3 script.py"):
        meshkit.init_process_group("mpi", init_method="env://")
    # torch's default init method is env:// where a torchrun-style launcher set RANK and WORLD_SIZE
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(meshkit.DistBackendError, match=r"cannot form a world of 2 from init_method env:// says "
                       r"RANK=0, WORLD_SIZE=2"):
        meshkit.init_process_group("gloo")


def test_env_needs_the_master_address(fake_gpu, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(meshkit.DistValueError, match=r"init_method env:// needs MASTER_ADDR and MASTER_PORT"):
        meshkit.init_process_group("nccl", init_method="env://", timeout=5)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "99999")
    with pytest.raises(meshkit.DistValueError, match=r"reads MASTER_PORT='99999': the port must be an integer in "
                       r"1..65535"):
        meshkit.init_process_group("nccl", init_method="env://", timeout=5)


def test_a_port_in_use_is_named(fake_gpu):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(meshkit.DistStoreError, match=rf"TCPStore: cannot listen on 127.0.0.1:{port}: the port is "
                           r"in use"):
            meshkit.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                       timeout=2)
    assert not meshkit.is_initialized()


# --------------------------------------------------------------------------- store engine, ranks as threads
def _on_store(fn, n, store, *, timeout=10):
    def main():
        rank = local_context().rank
        meshkit.init_process_group("nccl", store=store, world_size=n, rank=rank, timeout=timeout)
        try:
            return fn(rank)
        finally:
            meshkit.destroy_process_group()
    return local.run(main, n, init=False)


def test_nccl_over_a_store_engine_in_threads(fake_gpu):
    """The strict double's communicators with the store engine as the host engine (a HashStore,
    threads as ranks): device collectives, a sub-group, barrier, the object collectives, and the
    error for host arrays; the store holds none of the world's keys afterwards."""
    store = meshkit.HashStore()

    def body(rank):
        assert meshkit.get_world_size() == 4 and meshkit.get_backend() == "nccl"
        assert meshkit.get_group_rank(None, rank) == rank
        x = double.to_device(np.arange(3.0) * (rank + 1))
        meshkit.all_reduce(x)
        g = meshkit.new_group([1, 3])
        y = double.to_device(np.full(2, float(rank)))
        if rank in (1, 3):
            meshkit.all_reduce(y, group=g)
        meshkit.barrier()
        everyone = [None] * 4
        meshkit.all_gather_object(everyone, ("rank", rank))
        sent = [{"from": 2}] if rank == 2 else [None]
        meshkit.broadcast_object_list(sent, src=2)
        gathered = [None] * 4 if rank == 0 else None
        meshkit.gather_object(rank * 10, gathered, dst=0)
        mine = [None]
        meshkit.scatter_object_list(mine, [f"to {r}" for r in range(4)] if rank == 3 else None, src=3)
        with pytest.raises(meshkit.DistTypeError, match=rf"rank {rank}: broadcast: host \(NumPy\) arrays need a host "
                           r"engine, and this nccl world was started without MPI .* start the job with "
                           r"meshkit-run/mpiexec .* or use the mpi backend under meshkit-run/mpiexec"):
            meshkit.broadcast(np.zeros(2), src=0)
        meshkit.barrier()  # the refused call broke nothing
        return double.to_host(x), double.to_host(y), everyone, sent, gathered, mine

    results = _on_store(body, 4, store)
    for rank, (x, y, everyone, sent, gathered, mine) in enumerate(results):
        np.testing.assert_array_equal(x, np.arange(3.0) * 10)
        np.testing.assert_array_equal(y, [4.0, 4.0] if rank in (1, 3) else [rank, rank])
        assert everyone == [("rank", r) for r in range(4)]
        assert sent == [{"from": 2}]
        assert gathered == ([0, 10, 20, 30] if rank == 0 else None)
        assert mine == [f"to {rank}"]
    assert store.num_keys() == 0, "the world's keys outlived it"
    _on_store(lambda rank: meshkit.barrier(), 4, store)  # the same store serves a second world


def test_a_rank_missing_from_a_store_exchange_is_named(fake_gpu):
    """A monitored barrier that rank 2 never joins: the others fail within its timeout, naming rank 2."""
    store = meshkit.HashStore()

    def body(rank):
        if rank == 2:
            time.sleep(1.5)  # then leaves the barrier to the others, without destroying its world
            return None
        start = time.monotonic()
        with pytest.raises(meshkit.CollectiveTimeout, match=r"monitored_barrier.*\[2\]"):
            meshkit.monitored_barrier(timeout=0.5)
        return time.monotonic() - start

    def main():
        rank = local_context().rank
        meshkit.init_process_group("nccl", store=store, world_size=3, rank=rank, timeout=10)
        return body(rank)

    waited = [w for w in local.run(main, 3, init=False) if w is not None]
    assert max(waited) < 1.4, waited


def test_inside_local_run_the_local_world_is_the_world():
    """world_size/rank that disagree with local.run's job: every rank raises, naming both."""
    def main():
        meshkit.init_process_group("local", world_size=2, rank=0)

    with pytest.raises(meshkit.DistValueError, match=r"init_process_group\(world_size=2, rank=0\) says WORLD_SIZE=2, "
                       r"RANK=0 but meshkit.comm.local.run started this process as rank [0-2] of 3|ranks \[1, 2\] "
                       r"disagree"):
        local.run(main, 3, init=False)

    def agreeing():
        rank = local_context().rank
        meshkit.init_process_group("local", world_size=2, rank=rank)
        meshkit.barrier()
        meshkit.destroy_process_group()
        return rank
    assert local.run(agreeing, 2, init=False) == [0, 1]


def test_a_store_that_never_gets_its_workers_names_the_count(fake_gpu):
    """Threads rendezvous over a HashStore for a world of 3 that only 2 join: both raise within the
    timeout, naming how many arrived and which ranks did not."""
    store = meshkit.HashStore()

    def main():
        rank = local_context().rank
        start = time.monotonic()
        with pytest.raises(meshkit.DistStoreError, match=r"init_process_group over store=: 2 of 3 ranks arrived within "
                           r"the timeout of 0.5 s; ranks \[2\] never did"):
            meshkit.init_process_group("nccl", store=store, world_size=3, rank=rank, timeout=0.5)
        return time.monotonic() - start
    assert max(local.run(main, 2, init=False)) < 3


# --------------------------------------------------------------------------- real processes, no MPI
def start(n_or_ranks, methods, tmp_path, *, timeout=30, extra=None, secret=True):
    """The plain launcher: one ``python scripts/init_world.py`` per rank, with torchrun's variables
    and (``secret``) the job's secret, as a user who starts ranks by hand sets it (docs/security.md)."""
    ranks = range(n_or_ranks) if isinstance(n_or_ranks, int) else n_or_ranks
    size = n_or_ranks if isinstance(n_or_ranks, int) else (extra or {}).get("size", len(ranks))
    port, store_port, tcp_port = free_port(), free_port(), free_port()
    common = {**os.environ, "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "STORE_PORT": str(store_port), "TCP_URL": f"tcp://127.0.0.1:{tcp_port}",
              "FILE_URL": f"file://{tmp_path}/rendezvous", "MESHKIT_TEST_NCCL_FILE": str(tmp_path / "nccl-double"),
              "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    common.pop("MESHKIT_JOB_SECRET", None)
    if secret:
        common["MESHKIT_JOB_SECRET"] = secrets.token_hex(32)
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "init_world.py"), methods, str(timeout)],
                              env={**common, "RANK": str(r), "LOCAL_RANK": str(i)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i, r in enumerate(ranks)]
    return [p.communicate(timeout=timeout + 60)[0] for p in procs], [p.returncode for p in procs]


def test_nccl_worlds_of_processes_from_every_init_method(tmp_path):
    """Three processes, no MPI: env://, the default (env://), tcp://, file:// and store= in turn, each
    world checked (device all_reduce, a sub-group, barrier, objects, the host-array error) and
    destroyed; the FileStore's file is removed by its last user."""
    outputs, codes = start(3, "env,default,tcp,file,store", tmp_path)
    assert codes == [0, 0, 0], "\n".join(outputs)
    for rank, out in enumerate(outputs):
        for method in ("env", "default", "tcp", "file", "store"):
            assert re.search(rf"^OK {method} rank {rank} of 3 pids \[\d+, \d+, \d+\]$", out, re.M), out
        assert "HOST meshkit.comm: rank" in out and "start the job with meshkit-run/mpiexec" in out
    assert not (tmp_path / "rendezvous").exists()


def test_two_processes_claiming_one_rank_all_fail(tmp_path):
    """Ranks 0, 1, 1 of a world of 3: every process raises, naming rank 1 and both processes."""
    outputs, codes = start([0, 1, 1], "env", tmp_path, timeout=20)
    assert codes == [3, 3, 3], "\n".join(outputs)
    for out in outputs:
        assert re.search(r"ERROR DistValueError: meshkit.comm: init_process_group over env:// \(MASTER_ADDR=127.0.0.1, "
                         r"MASTER_PORT=\d+\): rank 1 was claimed by two processes: pid \d+ on host \S+ and pid \d+ on "
                         r"host \S+; every rank needs its own rank", out), out


def test_a_rank_that_never_comes_fails_the_others_within_the_timeout(tmp_path):
    """Ranks 0 and 1 of a world of 3 (file://): both fail after the 2 s timeout, naming the count."""
    began = time.monotonic()
    outputs, codes = start([0, 1], "file", tmp_path, timeout=2, extra={"size": 3})
    assert codes == [3, 3], "\n".join(outputs)
    for out in outputs:
        assert re.search(r"ERROR DistStoreError: meshkit.comm: init_process_group over file://\S+: 2 of 3 ranks "
                         r"arrived within the timeout of 2 s; ranks \[2\] never did", out), out
    assert time.monotonic() - began < 2 + 20  # the timeout, plus starting two interpreters on a loaded box


def test_a_rank_that_leaves_is_named_at_once_not_at_the_timeout(tmp_path):
    """Rank 1's script ends after init (its LEFT notice goes through the store): rank 0's barrier
    fails within seconds, naming rank 1, though the timeout is 30 s."""
    outputs, codes = start(2, "leave", tmp_path, timeout=30)
    assert codes == [0, 2], "\n".join(outputs)
    found = re.search(r"LEFT after ([\d.]+) s: .*rank 1 left the job", outputs[0])
    assert found and float(found.group(1)) < 5, outputs[0]


# --------------------------------------------------------------------------- under meshkit-run: MPI's world
def test_under_meshkit_run_an_init_method_that_disagrees_is_an_error_naming_both(mpirun):
    out = mpirun("init_disagree.py", 2, timeout=60).stdout
    for r in (0, 1):
        assert re.search(rf"\[rank{r}\]: ENV meshkit.comm: init_method env:// says RANK={1 - r}, WORLD_SIZE=2 but "
                         rf"meshkit-run started this process as rank {r} of 2", out), out
        assert re.search(rf"\[rank{r}\]: ARGS meshkit.comm: init_process_group\(world_size=4, rank=3\) with "
                         rf"tcp://127.0.0.1:1 says WORLD_SIZE=4, RANK=3 but meshkit-run started this process as "
                         rf"rank {r} of 2", out), out
        assert f"[rank{r}]: AGREED {r} of 2" in out, out
    assert re.search(r"\[rank1\]: ONE .* says WORLD_SIZE=2, RANK=0 but meshkit-run started this process as rank 1 "
                     r"of 2", out), out
    assert re.search(r"\[rank0\]: ONE meshkit.comm: rank 0: init_process_group: ranks \[1\] disagree with the world",
                     out), out
