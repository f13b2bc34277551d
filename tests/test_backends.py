"""Backends by name: ``Backend``, ``register_backend``, a third-party engine used through
``init_process_group``, the interface check at init, and the built-ins registering the same way.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import ddp_cases
import meshkit
from meshkit import Backend, BackendOptions, register_backend
from meshkit.comm.setup import backends
from meshkit.comm import local
from meshkit.comm.engines.engine import EngineCapabilities
from doubles.toy_backend import Relay, Solo


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test (names registered, Backend.<NAME> constants)."""
    monkeypatch.setattr(backends, "_plugins", dict(backends._plugins))
    constants = set(vars(Backend))
    yield backends.registered_backends()
    for name in set(vars(Backend)) - constants:
        delattr(Backend, name)


def _relay(name: str, calls: Counter, inner: str = "local"):
    factory = backends.registered_backends()[inner]
    return lambda options: Relay(factory(options), name, calls)


def _job(world_size: int) -> dict:
    """What a user's job does on whatever backend the world has: collectives, a subgroup, DDP."""
    rank = meshkit.get_rank()
    x = np.arange(4.0) * (rank + 1)
    meshkit.all_reduce(x)
    pairs = [meshkit.new_group([r, r + 1]) for r in range(0, world_size, 2)]
    mine = pairs[rank // 2]
    y = np.array([float(rank)])
    meshkit.all_reduce(y, group=mine)
    out = np.empty(world_size)
    meshkit.all_gather_into_tensor(out, np.array([rank * 10.0]))
    objects = [None] * world_size
    meshkit.all_gather_object(objects, {"rank": rank})
    params, _ = ddp_cases.train()
    return {"all_reduce": x, "pair": y, "gathered": out, "objects": objects, "params": params,
            "backend": meshkit.get_backend(), "group_backend": mine.backend}


# --------------------------------------------------------------------------- a third-party engine
def test_a_registered_engine_runs_collectives_subgroups_and_ddp_as_the_builtin_does(registry):
    calls = Counter()
    register_backend("relay", _relay("relay", calls))
    assert backends.registered_backends().keys() == {"mpi", "local", "nccl", "relay"}

    def body(backend):
        meshkit.init_process_group(backend, timeout=30)
        return _job(4)
    theirs = local.run(body, 4, "relay", init=False)
    ours = local.run(body, 4, "local", init=False)
    ref = ddp_cases.reference()
    for rank, (got, expected) in enumerate(zip(theirs, ours)):
        assert (got["backend"], got["group_backend"]) == ("relay", "relay")
        np.testing.assert_array_equal(got["all_reduce"], np.arange(4.0) * 10)
        np.testing.assert_array_equal(got["pair"], [rank // 2 * 4 + 1.0])
        np.testing.assert_array_equal(got["gathered"], [0.0, 10.0, 20.0, 30.0])
        assert got["objects"] == [{"rank": r} for r in range(4)]
        ddp_cases.assert_matches_reference(got["params"], ref)
        for key in ("all_reduce", "pair", "gathered"):
            np.testing.assert_array_equal(got[key], expected[key])
        for name in ref:
            np.testing.assert_array_equal(got["params"][name], expected["params"][name])
    # Every rank's collectives reached the registered engine, the subgroups' through its split.
    assert calls["all_reduce"] >= 4 * (2 + ddp_cases.STEPS) and calls["split"] >= 4 and calls["all_gather"] >= 4


def test_a_world_of_one_engine_written_from_scratch_serves_a_training_process(registry):
    engines = []

    def solo(options: BackendOptions) -> Solo:
        assert options.timeout == 20 and options.device_id is None
        engines.append(Solo("solo"))
        return engines[-1]
    Backend.register_backend("solo", solo)  # torch's signature
    meshkit.init_process_group(Backend.SOLO, timeout=20)  # in this process: no MPI, no local.run
    try:
        assert (meshkit.get_backend(), meshkit.get_world_size(), meshkit.get_rank()) == ("solo", 1, 0)
        x = np.arange(3.0)
        meshkit.all_reduce(x, op=meshkit.ReduceOp.AVG)
        np.testing.assert_array_equal(x, np.arange(3.0))
        out = np.empty(3)
        meshkit.reduce_scatter_tensor(out, np.arange(3.0))
        np.testing.assert_array_equal(out, np.arange(3.0))
        group = meshkit.new_group([0])
        objects = [{"a": 1}]
        meshkit.broadcast_object_list(objects, src=0, group=group)
        assert objects == [{"a": 1}] and group.backend == "solo"
        ddp_cases.assert_matches_reference(ddp_cases.train()[0], ddp_cases.reference())
    finally:
        meshkit.destroy_process_group()
    assert len(engines) == 1 and engines[0].calls["all_reduce"] >= 1 + ddp_cases.STEPS


# --------------------------------------------------------------------------- the built-ins
def test_the_builtins_are_looked_up_in_the_registry_like_any_backend(registry):
    assert list(registry) == ["mpi", "local", "nccl"]
    calls = Counter()
    register_backend("local", _relay("local", calls), override=True)  # instrument the built-in

    def body():
        x = np.ones(2)
        meshkit.all_reduce(x)
        return meshkit.get_backend(), x.tolist()
    assert local.run(body, 3) == [("local", [3.0, 3.0])] * 3  # local.run's init_process_group("local")
    assert calls["all_reduce"] == 3

    def by_rule(name):
        meshkit.init_process_group(name)  # "auto" and "gloo" are rules, resolved to "local" here
        meshkit.barrier()
    for rule in ("auto", "gloo", "LOCAL"):
        calls.clear()
        local.run(by_rule, 2, rule, init=False)
        assert calls["barrier"] == 2, rule


def test_mpi_resolves_through_the_registry_in_a_process():
    code = ("import sys; from collections import Counter; sys.path.insert(0, {tests!r})\n"
            "import numpy as np, meshkit; from meshkit.comm.setup import backends; from doubles.toy_backend import Relay\n"
            "calls, mpi = Counter(), backends.registered_backends()['mpi']\n"
            "meshkit.register_backend('mpi', lambda o: Relay(mpi(o), 'mpi', calls), override=True)\n"
            "for name in ('mpi', 'gloo', 'MPI'):\n"
            "    meshkit.init_process_group(name); x = np.ones(2); meshkit.all_reduce(x)\n"
            "    print(name, meshkit.get_backend(), x.sum(), calls['all_reduce']); meshkit.destroy_process_group()\n"
            # a third-party engine that can end the job (aborts_job) gets the abort-on-uncaught-exception
            # hook under plain mpiexec, as mpi and nccl do
            "meshkit.register_backend('relay', lambda o: Relay(mpi(o), 'relay', calls))\n"
            "hook = sys.excepthook; meshkit.init_process_group('relay'); print('hooked', sys.excepthook != hook)\n"
            ).format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["mpi mpi 2.0 1", "gloo mpi 2.0 2", "MPI mpi 2.0 3", "hooked True"], out.stdout


def test_a_registered_engine_over_mpi_trains_ddp_on_real_processes(mpirun):
    out = mpirun("mpi_backend_relay.py", 2, timeout=90).stdout
    for rank in range(2):
        assert f"[rank{rank}]: relay DDP OK, all_reduce calls reached the relay: True" in out, out


# --------------------------------------------------------------------------- the interface check
class _NoCollectives:
    backend, rank, size, max_tag, native_avg, device, watch = "broken", 0, 1, 10, True, None, None
    capabilities = EngineCapabilities()

    def barrier(self):
        pass


class _Coalescing(Solo):
    capabilities = EngineCapabilities(coalesces=True)


def _solo(**attributes):
    engine = Solo("broken")
    for name, value in attributes.items():
        setattr(engine, name, value)
    return engine


@pytest.mark.parametrize(("make", "problem"), [
    (lambda: None, r"its factory returned None, not an engine \(an object implementing meshkit.comm.engines.engine.Engine\)"),
    (_NoCollectives, r"a _NoCollectives that does not implement meshkit.comm.engines.engine.Engine: missing methods "
                     r"\['all_reduce', 'reduce', 'broadcast', 'all_gather', 'reduce_scatter', 'gather', 'scatter', "
                     r"'all_to_all', 'send', 'recv', 'wait', 'exchange', 'split', 'notify', 'notices', 'host_name', "
                     r"'flush', 'free'\]$"),
    (lambda: _solo(capabilities={"queues": True}),
     r"capabilities is \{'queues': True\} \(a dict\), expected an EngineCapabilities$"),
    (lambda: _solo(rank=2, size=2), r" \(rank 2\): its factory returned a Solo .*: rank 2 is not in range\(size\) with size 2$"),
    (lambda: _solo(rank=True), r"rank is True \(a bool\), expected an int$"),
    (lambda: _solo(size="1"), r"size is '1' \(a str\), expected an int$"),
    (lambda: _solo(backend="local"), r"backend is 'local', not 'broken' \(get_backend\(\) reports it\)$"),
    (lambda: _solo(device="cuda:0"), r"device is 'cuda:0', not None or a GPU index$"),
    (lambda: _solo(device=0), r"missing methods \['use_device', 'drain'\]$"),
    (lambda: _Coalescing("broken"), r"missing methods \['start_coalescing', 'end_coalescing'\]$"),
])
def test_an_engine_missing_part_of_the_interface_is_an_error_at_init_naming_the_backend(registry, make, problem):
    register_backend("broken", lambda options: make())
    with pytest.raises(meshkit.DistBackendError, match=r"^meshkit.comm: backend 'broken'.*" + problem):
        meshkit.init_process_group("broken")
    assert not meshkit.is_initialized()


def test_an_engine_without_attributes_names_them(registry):
    class Bare:
        pass
    register_backend("bare", lambda options: Bare())
    with pytest.raises(meshkit.DistBackendError, match=r"backend 'bare': its factory returned a Bare that does not "
                       r"implement meshkit.comm.engines.engine.Engine: missing attributes \['backend', 'rank', 'size', "
                       r"'max_tag', 'native_avg', 'capabilities', 'watch', 'device'\]; missing methods \['all_reduce'"):
        meshkit.init_process_group("bare")


def test_the_check_covers_every_attribute_the_protocol_declares():
    from meshkit.comm.engines.engine import GATED, Engine, methods
    assert set(Engine.__annotations__) == {*backends._ATTRIBUTES, "watch", "device"}
    assert set(GATED) | {"reports_dtype", "needs_progress", "queues", "host_arrays",
                         "authenticated_peers", "watched_requests"} == set(
        EngineCapabilities.__dataclass_fields__)
    # each flag's Protocol declares the methods it gates (what check_engine asks of a registered engine)
    assert {flag: methods(p) for flag, p in GATED.items()} == {
        "checks_calls": ("announce",), "defers": ("defer",), "abandons": ("abandon",), "survives": ("rank_failure",),
        "coalesces": ("start_coalescing", "end_coalescing"), "aborts_job": ("abort",),
        "reports_path": ("path", "paths", "mapped_bytes"), "shares_memory": ("shared_buffer",)}


# --------------------------------------------------------------------------- names
def test_backend_normalizes_names_as_torchs_does():
    assert Backend("MPI") == Backend.MPI == "mpi" and isinstance(Backend("Nccl"), str)
    assert (Backend.GLOO, Backend.LOCAL, Backend.NCCL, Backend.UNDEFINED) == ("gloo", "local", "nccl", "undefined")
    assert Backend("whatever") == "whatever"  # checked at init_process_group, as in torch
    with pytest.raises(TypeError, match=r"Backend\(name\): name must be a str, got int 3"):
        Backend(3)


def test_registration_rules(registry):
    f = lambda options: Solo()  # noqa: E731
    with pytest.raises(TypeError, match=r"register_backend: name must be a str, got NoneType None"):
        register_backend(None, f)
    for bad in ("", "my-backend", "2fast", "a b"):
        with pytest.raises(ValueError, match=rf"register_backend: name {bad!r} is not valid; a backend name is a "
                                             r"letter followed by letters, digits or '_'"):
            register_backend(bad, f)
    for reserved in ("auto", "GLOO", "undefined"):
        with pytest.raises(ValueError, match=rf"name {reserved!r} is reserved: init_process_group resolves "
                                             r"\['auto', 'gloo'\] itself"):
            register_backend(reserved, f)
    with pytest.raises(TypeError, match=r"register_backend\('toy'\): factory must be callable \(factory\(options\) "
                                        r"-> engine\), got str 'Solo'"):
        register_backend("toy", "Solo")
    with pytest.raises(ValueError, match=r"register_backend\('toy'\): devices must name some of \['cpu', 'cuda'\], "
                                         r"got \['gpu'\]"):
        register_backend("toy", f, devices=["gpu"])
    with pytest.raises(TypeError, match="extended_api must be a bool, got 'yes'"):
        Backend.register_backend("toy", f, extended_api="yes")
    for builtin in ("mpi", "NCCL", "local"):
        with pytest.raises(ValueError, match=rf"backend {builtin.lower()!r} is already registered; pass override=True "
                                             r"to replace it \(registered: \['local', 'mpi', 'nccl'\]\)"):
            register_backend(builtin, f)
    assert "toy" not in backends.registered_backends()  # nothing half-registered by the failures
    register_backend("Toy", f, devices="cpu")
    assert Backend.TOY == "toy" and backends.registered_backends()["toy"] is f
    with pytest.raises(ValueError, match="backend 'toy' is already registered"):
        register_backend("TOY", f)
    g = lambda options: Solo("toy")  # noqa: E731
    register_backend("toy", g, override=True)
    assert backends.registered_backends()["toy"] is g
    meshkit.init_process_group("ToY")
    assert meshkit.get_backend() == "toy"
    meshkit.destroy_process_group()


def test_an_unknown_name_lists_the_registered_ones(registry):
    register_backend("toy", lambda options: Solo("toy"))
    with pytest.raises(ValueError, match=r"unknown backend 'ucc'; valid backends are \['auto', 'mpi', 'local', 'nccl', "
                                         r"'toy', 'gloo'\]"):
        meshkit.init_process_group("ucc")
    with pytest.raises(TypeError, match="name must be a str, got int 5"):
        meshkit.init_process_group(5)


# --------------------------------------------------------------------------- devices
def test_a_backends_devices_decide_which_meshes_it_serves(registry):
    from doubles import nccl_double as double
    from meshkit import init_device_mesh
    from meshkit.comm.engines import cuda_runtime
    calls = Counter()
    register_backend("gpurelay", _relay("gpurelay", calls, inner="nccl"), devices=("cpu", "cuda"))
    register_backend("hostrelay", _relay("hostrelay", calls))
    register_backend("cudaonly", _relay("cudaonly", calls), devices="cuda")

    def body(backend, device_type):
        meshkit.init_process_group(backend, timeout=30)
        try:
            mesh = init_device_mesh(device_type, (2,))
        except ValueError as exc:
            return str(exc)
        x = double.to_device(np.full(3, meshkit.get_rank() + 1.0)) if device_type == "cuda" else np.ones(3)
        meshkit.all_reduce(x, group=mesh.get_group())
        got = x.get().tolist() if device_type == "cuda" else x.tolist()
        return mesh.get_group().backend, mesh.device_type, type(mesh.get_group().device).__name__, got
    previous = cuda_runtime.set_runtime(double.FakeRuntime())
    try:
        # a device engine behind the name: its GPU index is the group's device
        assert local.run(body, 2, "gpurelay", "cuda", init=False) == [("gpurelay", "cuda", "int", [3.0] * 3)] * 2
        assert calls["all_reduce"] == 2
        assert local.run(body, 2, "hostrelay", "cpu", init=False) == [("hostrelay", "cpu", "NoneType", [2.0] * 3)] * 2
        assert local.run(body, 2, "hostrelay", "cuda", init=False) == [
            "meshkit.mesh: rank 0: init_device_mesh: device_type 'cuda' needs meshkit's NCCL engine (backend 'nccl'), "
            "but the backend here is 'hostrelay'; call init_process_group('nccl') on GPUs, or use device_type='cpu' "
            "(valid over 'hostrelay': ['cpu'])",
            "meshkit.mesh: rank 1: init_device_mesh: device_type 'cuda' needs meshkit's NCCL engine (backend 'nccl'), "
            "but the backend here is 'hostrelay'; call init_process_group('nccl') on GPUs, or use device_type='cpu' "
            "(valid over 'hostrelay': ['cpu'])"]
        assert local.run(body, 2, "cudaonly", "cpu", init=False)[0] == (
            "meshkit.mesh: rank 0: init_device_mesh: device_type 'cpu' is not served by backend 'cudaonly': it was "
            "registered with devices ['cuda'] (meshkit.register_backend)")
    finally:
        cuda_runtime.set_runtime(previous)
