""""cuda" device meshes over the NCCL engine, against the strict double (tests/doubles/nccl_double.py),
ranks as threads: one commSplit per dimension, each rank's host and GPU in ``describe()``,
``from_group`` without a communicator, and the errors where the backend is not a GPU one.
Nothing here has run on a GPU.
"""

from __future__ import annotations

import collections
import io
import threading

import numpy as np
import pytest

import meshkit
from doubles import nccl_double as double
from support.nccl import on_nccl
from meshkit import DeviceMesh, init_device_mesh
from meshkit.comm.engines import cuda_runtime
from meshkit.comm import local


@pytest.fixture
def splits(monkeypatch):
    """The double as the runtime; counts commSplit calls per thread (rank)."""
    previous = cuda_runtime.set_runtime(double.FakeRuntime())
    counts: collections.Counter[int] = collections.Counter()
    real = double.FakeCommunicator.commSplit

    def counted(self, color, key, config=None):
        counts[threading.get_ident()] += 1
        return real(self, color, key, config)

    monkeypatch.setattr(double.FakeCommunicator, "commSplit", counted)
    yield counts
    cuda_runtime.set_runtime(previous)


def test_cuda_mesh_2x2_splits_once_per_dimension_and_describes_hosts_and_gpus(splits):
    def body():
        mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
        made = splits[threading.get_ident()]
        x = double.to_device(np.full(3, float(meshkit.get_rank())))
        meshkit.all_reduce(x, group=mesh.get_group("tp"))
        out = io.StringIO()
        text = mesh.describe(file=out)
        return made, repr(mesh), x.get().tolist(), text, out.getvalue(), mesh.get_group("tp").host_name()

    got = on_nccl(body, 4)
    assert [g[0] for g in got] == [2, 2, 2, 2]  # dims 0 and 1; the root is the world itself
    assert got[0][1] == "DeviceMesh('cuda', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"
    assert [g[2] for g in got] == [[1.0] * 3, [1.0] * 3, [5.0] * 3, [5.0] * 3]  # tp groups [0, 1], [2, 3]
    host = got[0][5]
    assert got[0][3] == ("DeviceMesh('cuda', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))\n"
                         "  dim 0 'dp' (size 2): groups [[0, 2], [1, 3]]\n"
                         "  dim 1 'tp' (size 2): groups [[0, 1], [2, 3]]\n"
                         f"  host {host}: ranks [0, 1, 2, 3] on GPUs [0, 1, 2, 3]")
    assert got[0][4] == got[0][3] + "\n" and all(g[4] == "" for g in got[1:])  # printed by the first rank


def test_cuda_mesh_from_the_constructor_and_its_slices(splits):
    def body():
        mesh = DeviceMesh("cuda", [[0, 2], [1, 3]], mesh_dim_names=("a", "b"))
        return mesh["b"].mesh.tolist(), mesh["b"].device_type, mesh.get_group("b").backend

    assert on_nccl(body, 4) == [([0, 2], "cuda", "nccl"), ([1, 3], "cuda", "nccl"),
                                ([0, 2], "cuda", "nccl"), ([1, 3], "cuda", "nccl")]


def test_from_group_of_an_nccl_group_creates_no_communicator(splits):
    def body():
        group = meshkit.new_group([1, 2, 3])
        before = splits[threading.get_ident()]
        mesh = DeviceMesh.from_group(group, "cuda", mesh_dim_names=("dp",))
        after = splits[threading.get_ident()]
        same = mesh.get_group("dp") is group if group.is_member else mesh.get_coordinate() is None
        return mesh.mesh.tolist(), after - before, same, mesh.device_type

    assert on_nccl(body, 4) == [([1, 2, 3], 0, True, "cuda")] * 4


@pytest.mark.parametrize("make, message", [
    (lambda: init_device_mesh("cuda", (2,)), r"meshkit.mesh: rank \d: init_device_mesh: device_type 'cuda' needs "
     r"meshkit's NCCL engine \(backend 'nccl'\), but the backend here is 'local'; call "
     r"init_process_group\('nccl'\) on GPUs, or use device_type='cpu' \(valid over 'local': \['cpu'\]\)"),
    (lambda: DeviceMesh("cuda", [0, 1]), r"rank \d: DeviceMesh: device_type 'cuda' needs meshkit's NCCL engine "
     r"\(backend 'nccl'\), but the backend here is 'local'"),
    (lambda: DeviceMesh.from_group(meshkit.new_group([0, 1]), "cuda"), r"rank \d: DeviceMesh.from_group: "
     r"device_type 'cuda' needs meshkit's NCCL engine \(backend 'nccl'\), but the backend here is 'local'"),
    (lambda: init_device_mesh("tpu", (2,)),
     r"unknown device_type 'tpu'; valid types are \['cpu'\] \(backend 'local'\)"),
])
def test_cuda_needs_a_gpu_backend(make, message):
    def body():
        with pytest.raises(meshkit.DistValueError, match=message):
            make()
        return True
    assert local.run(body, 2) == [True, True]


def test_unknown_device_type_over_nccl_lists_cuda(splits):
    def body():
        with pytest.raises(meshkit.DistValueError, match=r"rank \d: init_device_mesh: unknown device_type 'tpu'; "
                           r"valid types are \['cpu', 'cuda'\] \(backend 'nccl'\)"):
            init_device_mesh("tpu", (2,))
        return True
    assert on_nccl(body, 2) == [True, True]


def test_cpu_mesh_over_nccl_stays_valid(splits):
    def body():
        mesh = init_device_mesh("cpu", (2,))
        x = np.ones(2)
        meshkit.all_reduce(x, group=mesh.get_group())
        return mesh.device_type, x.tolist()
    assert on_nccl(body, 2) == [("cpu", [2.0, 2.0])] * 2
