"""Tensor-parallel styles, ``parallelize``, and the optimizers and clipping on DTensors, on the local engine.

Expected blocks are written out (``w[:, 0:3]``), not recomputed with the shard arithmetic under test;
every strategy is compared with single-process NumPy.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

import dp_tp_cases
import meshkit
from meshkit.comm import local
from meshkit.parallel import (SGD, AdamW, DistributedDataParallel, FullyShardedDataParallel, ZeroRedundancyOptimizer,
                              clip_grad_norm_)
from meshkit.tensor import (ColwiseParallel, DTensor, Partial, Replicate, RowwiseParallel, SequenceParallel, Shard,
                            distribute_tensor, parallelize)
from meshkit.tensor.chunks import local_slices
from meshkit.tensor.parallel import plan_placements


def _params():
    rng = np.random.default_rng(3)
    return {"w0": rng.standard_normal((4, 6)), "b0": rng.standard_normal(6),
            "w1": rng.standard_normal((6, 5)), "b1": rng.standard_normal(5),
            "norm": rng.standard_normal(5)}


# --------------------------------------------------------------------------- styles (pure)
def test_each_style_lays_out_weight_and_bias_in_the_x_at_w_layout():
    shapes = {"w": (4, 6), "b": (6,), "table": (10, 3, 2)}
    assert [ColwiseParallel().param_placement(n, shapes[n]) for n in "wb"] == [Shard(1), Shard(0)]
    assert [RowwiseParallel().param_placement(n, shapes[n]) for n in "wb"] == [Shard(0), Replicate()]
    assert [SequenceParallel().param_placement(n, s) for n, s in shapes.items()] == [Replicate()] * 3
    for style in (ColwiseParallel(), RowwiseParallel()):
        with pytest.raises(ValueError, match=r"param_placement: parameter 'table' has shape \(10, 3, 2\); this style lays out a 2-D "
                                             r"weight \(in, out\)"):
            style.param_placement("table", shapes["table"])


def test_styles_have_torchs_default_layouts_and_compare_by_value():
    assert (ColwiseParallel().input_layouts, ColwiseParallel().output_layouts) == (Replicate(), Shard(-1))
    assert (RowwiseParallel().input_layouts, RowwiseParallel().output_layouts) == (Shard(-1), Replicate())
    assert ColwiseParallel().use_local_output and RowwiseParallel().use_local_output
    assert not SequenceParallel().use_local_output and SequenceParallel().input_layouts == Shard(1)
    assert SequenceParallel(sequence_dim=0).output_layouts == Shard(0)
    assert RowwiseParallel(output_layouts=(Shard(0),)) == RowwiseParallel(output_layouts=Shard(0))
    assert ColwiseParallel() != ColwiseParallel(use_local_output=False) and ColwiseParallel() != RowwiseParallel()
    with pytest.raises(TypeError):
        ColwiseParallel(Shard(0))  # keyword-only, as torch's
    assert repr(RowwiseParallel(output_layouts=Shard(0))) == \
        "RowwiseParallel(input_layouts=Shard(dim=-1), output_layouts=Shard(dim=0), use_local_output=True)"


@pytest.mark.parametrize("make, message", [
    (lambda: ColwiseParallel(input_layouts="replicate"), r"ColwiseParallel: input_layouts must be a Placement"),
    (lambda: RowwiseParallel(output_layouts=[Shard(0), Shard(1)]), r"RowwiseParallel: output_layouts must be a Pl"),
    (lambda: RowwiseParallel(use_local_output=1), r"use_local_output must be a bool, got 1"),
    (lambda: SequenceParallel(sequence_dim=1.0), r"SequenceParallel: sequence_dim must be an int, got 1\.0"),
])
def test_bad_style_arguments_are_named(make, message):
    with pytest.raises(TypeError, match=message):
        make()


# --------------------------------------------------------------------------- parallelize
def test_parallelize_by_names_and_globs_gives_each_rank_its_own_block():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        full = _params()
        out = parallelize(full, mesh, {"[wb]0": ColwiseParallel(), "w1": RowwiseParallel(), "b1": RowwiseParallel()})
        assert list(out) == list(full)
        for name, d in out.items():
            assert isinstance(d, DTensor) and d.shape == full[name].shape and d.device_mesh is mesh
            local_ = d.to_local()
            assert local_.flags.c_contiguous and not np.shares_memory(local_, full[name]), name
        return {name: (d.placements, d.to_local()) for name, d in out.items()}

    full = _params()
    blocks = local.run(body, 2)
    for rank, (cols, rows) in enumerate([(slice(0, 3), slice(0, 3)), (slice(3, 6), slice(3, 6))]):
        want = {"w0": ((Shard(1),), full["w0"][:, cols]), "b0": ((Shard(0),), full["b0"][cols]),
                "w1": ((Shard(0),), full["w1"][rows]), "b1": ((Replicate(),), full["b1"]),
                "norm": ((Replicate(),), full["norm"])}  # in no rule: Replicate
        for name, (placements, block) in want.items():
            assert blocks[rank][name][0] == placements, name
            np.testing.assert_array_equal(blocks[rank][name][1], block, err_msg=name)


@pytest.mark.parametrize("src_data_rank", [0, None])
def test_parallelize_scatters_tp_rank_0s_values_as_torchs_styles_do(src_data_rank):
    # Parameters initialised with a seed per rank (a torch script ported as it is) make
    # one model, tp rank 0's; src_data_rank=None keeps every rank's own array, no data sent
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        rank = meshkit.get_rank()
        mine = {k: v + 100 * rank for k, v in _params().items()}
        plan = {"[wb]0": ColwiseParallel(), "[wb]1": RowwiseParallel()}
        out = parallelize(mine, mesh, plan, src_data_rank=src_data_rank)
        source = 0 if src_data_rank == 0 else rank
        for name, d in out.items():
            want = (_params()[name] + 100 * source)[local_slices(d.shape, mesh.shape, (rank,), d.placements)]
            np.testing.assert_array_equal(d.to_local(), want, err_msg=name)
        return {name: d.full_tensor() for name, d in out.items()}

    for rank, full in enumerate(local.run(body, 2)):
        mixed = [name for name, value in _params().items() if not np.array_equal(full[name], value)]
        # None: each rank's blocks come from its own array, so the sharded ones mix the two inits
        assert mixed == ([] if src_data_rank == 0 else ["w0", "b0", "w1", "b1", "norm"][:3 + 2 * rank]), mixed


def test_a_torch_linear_weight_ports_by_its_transpose_under_the_same_style():
    # Torch's ColwiseParallel is Shard(0) of an (out, in) weight; here Shard(1) of (in, out)
    import meshkit.tensor.parallel.style as style

    readme = (Path(__file__).resolve().parents[1] / "docs" / "dtensor.md").read_text()  # the README's DTensor page
    for text in (style.__doc__, style.ColwiseParallel.__doc__, style.RowwiseParallel.__doc__, readme):
        assert "torch's ``ColwiseParallel``" in text or "torch's `ColwiseParallel`" in text or \
            "torch's ``RowwiseParallel``" in text, text[:200]
    assert "``Shard(0)``" in style.ColwiseParallel.__doc__ and ".T" in style.ColwiseParallel.__doc__
    assert "``Shard(1)``" in style.RowwiseParallel.__doc__ and ".T" in style.RowwiseParallel.__doc__
    rng = np.random.default_rng(5)
    torch_w0, torch_w1, x = rng.standard_normal((6, 4)), rng.standard_normal((3, 6)), rng.standard_normal((5, 4))

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        params = parallelize({"w0": torch_w0.T.copy(), "w1": torch_w1.T.copy()}, mesh,
                             {"w0": ColwiseParallel(), "w1": RowwiseParallel()})
        h = distribute_tensor(x, mesh, [Replicate()]) @ params["w0"]
        return params["w0"].placements, (h @ params["w1"]).full_tensor()

    for placements, y in local.run(body, 2):
        assert placements == (Shard(1),)
        np.testing.assert_allclose(y, x @ torch_w0.T @ torch_w1.T, rtol=1e-12)  # torch: F.linear twice


def test_parallelize_on_the_tp_dim_of_a_2d_mesh_with_uneven_shards():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
        out = parallelize({"w": np.arange(8.0).reshape(2, 4)}, mesh["tp"], {"w": ColwiseParallel()})
        return out["w"].to_local().tolist(), out["w"].full_tensor().tolist()

    cut = [[[0, 1], [4, 5]], [[2, 3], [6, 7]], [[], []]]  # 4 columns over 3 ranks: 2, 2, 0 (torch.chunk)
    for rank, (block, full) in enumerate(local.run(body, 6)):
        assert block == cut[rank % 3] and full == np.arange(8.0).reshape(2, 4).tolist()


def test_an_exact_name_wins_over_globs_and_agreeing_globs_may_overlap():
    shapes = {"w0": np.zeros((4, 6)), "b0": np.zeros(6)}
    plan = {"*": RowwiseParallel(), "w0": ColwiseParallel(), "?0": RowwiseParallel()}
    assert plan_placements(shapes, plan) == {"w0": Shard(1), "b0": Replicate()}


@pytest.mark.parametrize("params, mesh_shape, plan, kind, message", [
    (None, (2,), {"w9": ColwiseParallel()}, ValueError,
     r"parallelize: plan rule 'w9' matches no parameter; parameters are \['w0', 'b0', 'w1', 'b1', 'norm'\]"),
    (None, (2,), {"*0": ColwiseParallel(), "layer.*": RowwiseParallel(), "x?": RowwiseParallel()}, ValueError,
     r"plan rules 'layer\.\*', 'x\?' match no parameter"),
    (None, (2,), {"w0": "colwise"}, TypeError,
     r"parallelize: plan\['w0'\] must be a ParallelStyle \(ColwiseParallel\(\), RowwiseParallel\(\) or "
     r"SequenceParallel\(\)\), got str 'colwise'"),
    (None, (2,), {"w*": ColwiseParallel(), "*0": RowwiseParallel()}, ValueError,
     r"parameter 'w0' matches plan rules \['w\*', '\*0'\] with different styles"),
    (None, (2, 1), {"w0": ColwiseParallel()}, ValueError,
     r"mesh must be the 1-D tp mesh \(e\.g\. mesh\['tp'\]\), got a 2-D mesh"),
    ({"cube": np.zeros((2, 2, 2))}, (2,), {"cube": ColwiseParallel()}, ValueError,
     r"parameter 'cube' has shape \(2, 2, 2\)"),
    ({"w": [[1.0]]}, (2,), {}, TypeError, r"params\['w'\] must be a plain NumPy or CuPy array"),
    ("dtensor", (2,), {}, TypeError, r"params\['w'\] must be a plain NumPy or CuPy array .*got DTensor"),
])
def test_bad_plans_are_refused_naming_the_rule_and_rank(params, mesh_shape, plan, kind, message):
    def body():
        mesh = meshkit.init_device_mesh("cpu", mesh_shape)
        given = _params() if params is None else \
            {"w": distribute_tensor(np.zeros(2), mesh)} if params == "dtensor" else params
        with pytest.raises(kind, match=message) as info:
            parallelize(given, mesh, plan)
        return str(info.value)

    messages = local.run(body, 2)
    assert [m.startswith(f"meshkit.tensor: rank {r}: ") for r, m in enumerate(messages)] == [True] * 2


# --------------------------------------------------------------------------- prepare_input / prepare_output
def test_prepare_input_and_output_convert_at_the_layer_boundaries():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        rank = meshkit.get_rank()
        full = np.arange(12.0).reshape(4, 3)
        # A batch block per rank, declared Shard(0): gathered to the Replicate colwise computes on.
        x = ColwiseParallel(input_layouts=Shard(0)).prepare_input(full[2 * rank:2 * rank + 2], mesh)
        assert x.placements == (Replicate(),)
        np.testing.assert_array_equal(x.to_local(), full)
        # Rowwise wants Shard(-1): a Replicate DTensor is cut locally.
        cut = RowwiseParallel().prepare_input(x)
        assert cut.placements == (Shard(1),) and cut.to_local().shape == (4, 2 if rank == 0 else 1)
        # A Partial output: all-reduced (default), reduce-scattered (Shard(0)), local or not.
        partial = DTensor.from_local(full * (rank + 1), mesh, [Partial()])
        y = RowwiseParallel().prepare_output(partial)
        assert type(y) is np.ndarray
        np.testing.assert_array_equal(y, 3 * full)
        rows = RowwiseParallel(output_layouts=Shard(0), use_local_output=False).prepare_output(partial)
        assert rows.placements == (Shard(0),)
        np.testing.assert_array_equal(rows.to_local(), 3 * full[2 * rank:2 * rank + 2])
        colwise_out = ColwiseParallel().prepare_output(distribute_tensor(full, mesh, [Shard(1)]))
        np.testing.assert_array_equal(colwise_out, full[:, 0:2] if rank == 0 else full[:, 2:3])
        # Sequence parallel: a plain block is taken as cut along the sequence dim; a DTensor is moved to it.
        seq = np.arange(24.0).reshape(2, 4, 3)
        mine = SequenceParallel().prepare_input(seq[:, 2 * rank:2 * rank + 2], mesh)
        assert mine.placements == (Shard(1),) and mine.shape == (2, 4, 3)
        np.testing.assert_array_equal(mine.full_tensor(), seq)
        moved = SequenceParallel().prepare_input(distribute_tensor(seq, mesh))
        np.testing.assert_array_equal(moved.to_local(), seq[:, 2 * rank:2 * rank + 2])
        assert SequenceParallel().prepare_output(moved) is moved
        with pytest.raises(ValueError, match=r"ColwiseParallel\.prepare_input: x is a plain ndarray: pass the tp "
                                             r"device_mesh to lay it out as input_layouts=Replicate\(\)"):
            ColwiseParallel().prepare_input(full)
        with pytest.raises(TypeError, match=r"RowwiseParallel\.prepare_output: y must be the layer's DTensor output"):
            RowwiseParallel().prepare_output(full)

    local.run(body, 2)


def test_prepare_input_of_an_uneven_plain_block_takes_the_global_shape():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        rank = meshkit.get_rank()
        block = np.ones((3, [2, 1][rank]))  # 3 columns over 2 ranks: 2, 1
        x = RowwiseParallel().prepare_input(block, mesh, shape=(3, 3))
        return x.shape, x.full_tensor().sum()

    assert local.run(body, 2) == [((3, 3), 9.0)] * 2


# --------------------------------------------------------------------------- optimizers and clipping on DTensors
MESH_PLACEMENTS = [
    ((3,), {"w": [Shard(1)], "b": [Shard(0)], "v": [Replicate()]}),           # uneven: 5 over 3 = 2, 2, 1
    ((2, 2), {"w": [Replicate(), Shard(1)], "b": [Shard(0), Shard(0)], "v": [Shard(0), Replicate()]}),
]


def _model(dtype=np.float64):
    rng = np.random.default_rng(11)
    params = {"w": rng.standard_normal((4, 5)), "b": rng.standard_normal(5), "v": rng.standard_normal(4)}
    grads = {k: rng.standard_normal(p.shape) for k, p in params.items()}
    return {k: p.astype(dtype) for k, p in params.items()}, {k: g.astype(dtype) for k, g in grads.items()}


@pytest.mark.parametrize("make_opt", [lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
                                      lambda: AdamW(lr=0.01, amsgrad=True)], ids=["sgd", "adamw"])
@pytest.mark.parametrize("mesh_shape, placements", MESH_PLACEMENTS, ids=["1d-uneven", "2x2"])
def test_optimizers_on_dtensors_equal_single_process(make_opt, mesh_shape, placements):
    params, grads = _model()
    want = {k: p.copy() for k, p in params.items()}
    opt = make_opt()
    for _ in range(3):
        opt.step(want, grads)

    def body():
        mesh = meshkit.init_device_mesh("cpu", mesh_shape)
        ps = {k: distribute_tensor(p.copy(), mesh, placements[k]) for k, p in params.items()}
        gs = {k: distribute_tensor(g, mesh, placements[k]) for k, g in grads.items()}
        mine = make_opt()
        for _ in range(3):
            mine.step(ps, gs)
        return {k: p.full_tensor() for k, p in ps.items()}

    for got in local.run(body, int(np.prod(mesh_shape))):
        for k in params:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)  # elementwise rules: bit for bit


def test_optimizer_refuses_a_gradient_laid_out_unlike_its_parameter():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        p = distribute_tensor(np.zeros((2, 4)), mesh, [Shard(1)])
        errors = []
        for g, kind in [(distribute_tensor(np.ones((2, 4)), mesh, [Shard(0)]), ValueError),
                        (distribute_tensor(np.ones((2, 4)), mesh, [Partial()]), ValueError),
                        (np.ones((2, 2)), TypeError)]:
            with pytest.raises(kind) as info:
                SGD(lr=0.1).step({"w": p}, {"w": g})
            errors.append(str(info.value))
        assert not p.to_local().any(), "nothing was updated"
        return errors

    shard0, partial, plain = local.run(body, 2)[1]
    assert shard0 == ("meshkit.parallel: rank 1: SGD.step: grad of parameter 'w' has placements (Shard(dim=0),) "
                      "and shape (2, 4), the parameter (Shard(dim=1),) and (2, 4); redistribute the gradient to "
                      "the parameter's placements first")
    assert "has placements (Partial(sum),)" in partial
    assert "parameter 'w' is a DTensor but its grad a ndarray" in plain


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("mesh_shape, placements", MESH_PLACEMENTS, ids=["1d-uneven", "2x2"])
def test_clip_grad_norm_of_dtensors_equals_single_process(mesh_shape, placements, norm_type):
    _, grads = _model()
    extra = np.array([0.5, -2.0])  # a plain array beside the DTensors: its norm counted by every rank
    want = {k: g.copy() for k, g in grads.items()}
    want_extra = extra.copy()
    want_norm = clip_grad_norm_([*want.values(), want_extra], 0.5, norm_type=norm_type)
    flat = np.concatenate([g.ravel() for g in grads.values()] + [extra])
    assert want_norm == pytest.approx(np.linalg.norm(flat, ord=norm_type), rel=1e-12)

    def body():
        mesh = meshkit.init_device_mesh("cpu", mesh_shape)
        gs = {k: distribute_tensor(g.copy(), mesh, placements[k]) for k, g in grads.items()}
        mine = extra.copy()
        norm = clip_grad_norm_({**gs, "extra": mine}, 0.5, norm_type=norm_type)
        return norm, {k: g.full_tensor() for k, g in gs.items()}, mine

    for norm, got, got_extra in local.run(body, int(np.prod(mesh_shape))):
        assert norm == pytest.approx(want_norm, rel=1e-13)
        for k in grads:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-13, atol=0, err_msg=k)
        np.testing.assert_allclose(got_extra, want_extra, rtol=1e-13)


def test_clip_grad_norm_counts_replicas_once_and_refuses_partial():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2,))
        replicated = distribute_tensor(np.array([3.0, 4.0]), mesh, [Replicate()])
        norm = clip_grad_norm_([replicated], 100.0)
        nan = distribute_tensor(np.array([1.0, np.nan, 2.0]), mesh, [Shard(0)])
        nan_norm = clip_grad_norm_([nan], 1.0, norm_type="inf")
        with pytest.raises(ValueError, match=r"grads\[0\] has placements \(Partial\(sum\),\); a Partial gradient "
                                             r"holds terms, not values: redistribute it"):
            clip_grad_norm_([DTensor.from_local(np.ones(2), mesh, [Partial()])], 1.0)
        return norm, nan_norm

    for norm, nan_norm in local.run(body, 2):
        assert norm == 5.0 and math.isnan(nan_norm)  # the rank without the nan learns it too


# --------------------------------------------------------------------------- data parallel over dp of DTensors
@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (2, 1), (1, 2)], ids=str)
def test_ddp_of_dtensor_params_over_dp_equals_single_process(mesh_shape):
    ref = dp_tp_cases.reference()
    for params, seen in local.run(dp_tp_cases.train, int(np.prod(mesh_shape)), mesh_shape, timeout=30):
        dp_tp_cases.assert_matches_reference(params, ref)
        want = {n: ("DTensor", placements, True) for n, placements in dp_tp_cases.PLACEMENTS.items()}
        assert seen == [want] * dp_tp_cases.STEPS


def test_data_parallel_strategies_of_dtensor_params_equal_single_process_mpi(mpirun):
    strategies = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
    out = mpirun("mpi_dp_tp.py", 4, *strategies).stdout
    assert [out.count(f"DP TP {s} OK") for s in strategies] == [4] * len(strategies), out


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (1, 2)], ids=str)
def test_zero_of_dtensor_params_over_dp_equals_single_process(mesh_shape, stage):
    """ZeRO shards each block over dp (its flat shards cut the blocks anywhere); its clipping adds
    the norm over dp and tp, and every gradient is a DTensor laid out as its parameter."""
    ref = dp_tp_cases.reference()
    for params, seen in local.run(dp_tp_cases.train, int(np.prod(mesh_shape)), mesh_shape, f"zero{stage}",
                                  timeout=30):
        dp_tp_cases.assert_matches_reference(params, ref)
        want = {n: ("DTensor", placements, True) for n, placements in dp_tp_cases.PLACEMENTS.items()}
        assert seen == [want] * dp_tp_cases.STEPS


FSDP_MESHES = [("fsdp", (2, 2)), ("fsdp", (3, 2)), ("fsdp", (1, 2)), ("fsdp", (2, 1)), ("fsdp", (1, 4)),
               ("hsdp", (2, 2, 2)), ("hsdp", (1, 2, 2)), ("hsdp", (2, 1, 2))]


@pytest.mark.parametrize("strategy, mesh_shape", FSDP_MESHES, ids=[f"{s}-{m}" for s, m in FSDP_MESHES])
def test_fsdp_and_hsdp_of_dtensor_params_equal_single_process(strategy, mesh_shape):
    """FSDP flat-shards each rank's block over dp (HSDP over the (replicate, shard) part of a
    (replicate, shard, tp) mesh); unshard yields DTensors laid out as the parameters, reduce_grads
    takes DTensor gradients, clipping adds the norm over dp and tp. 1x4 cuts 5 columns 2, 2, 1, 0."""
    ref = dp_tp_cases.reference()
    for params, seen in local.run(dp_tp_cases.train, int(np.prod(mesh_shape)), mesh_shape, strategy, timeout=60):
        dp_tp_cases.assert_matches_reference(params, ref)
        want = {n: ("DTensor", placements, True) for n, placements in dp_tp_cases.PLACEMENTS.items()}
        assert seen == [want] * dp_tp_cases.STEPS


@pytest.mark.parametrize("kw", [{"blocks": True}, {"reshard_after_forward": False}], ids=["blocks", "keep-unsharded"])
def test_fsdp_of_dtensor_params_takes_blocks_and_keeps_unsharded_dtensors(kw):
    ref = dp_tp_cases.reference()

    def body():
        params, _ = dp_tp_cases.train((2, 2), "fsdp", **kw)
        mesh, fsdp = dp_tp_cases.build((2, 2), "fsdp", reshard_after_forward=kw.get("reshard_after_forward", True))
        with fsdp.unshard(0) as first:
            w1 = first["w1"]
            assert w1.device_mesh == mesh["tp"] and w1.shape == (4, 5) and w1.to_local().shape == ((4, 3), (4, 2))[
                mesh["tp"].get_local_rank()]
        with fsdp.unshard(0) as again:  # gathered again, or (reshard_after_forward=False) the same DTensor
            assert (again["w1"] is w1) == (not kw.get("reshard_after_forward", True))
        fsdp.reduce_grads(0, {n: p * 0 for n, p in again.items()})
        fsdp.step()
        return params

    for params in local.run(body, 4, timeout=30):
        dp_tp_cases.assert_matches_reference(params, ref)


DEVICE_CASES = [("ddp", (2, 2)), ("zero2", (2, 2)), ("fsdp", (2, 2)), ("hsdp", (2, 1, 2))]


@pytest.mark.parametrize("strategy, mesh_shape", DEVICE_CASES, ids=[s for s, _ in DEVICE_CASES])
def test_data_parallel_dtensor_params_on_device_arrays(cupy, strategy, mesh_shape):
    """CuPy blocks (tests/doubles/fake_cupy.py's strict arrays) over the NCCL engine on the double: the
    strategy's DTensors wrap device arrays, and training equals single-process NumPy."""
    from doubles import fake_cupy

    ref = dp_tp_cases.reference()

    def main():
        meshkit.init_process_group("nccl", timeout=60)
        _, model = dp_tp_cases.build(mesh_shape, strategy, "cuda")
        if isinstance(model, FullyShardedDataParallel):
            with model.unshard(0) as params:
                assert all(isinstance(p.to_local(), fake_cupy.ndarray) for p in params.values())
        else:
            assert all(isinstance(p.to_local(), fake_cupy.ndarray) for p in model.params.values())
        return dp_tp_cases.train(mesh_shape, strategy, device="cuda")[0]

    for params in local.run(main, int(np.prod(mesh_shape)), init=False, timeout=120):
        dp_tp_cases.assert_matches_reference(params, ref)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_full_state_dicts_of_dtensor_params_are_the_global_arrays(strategy):
    """``full_state_dict()`` is full NumPy arrays on every rank, also for DTensor
    parameters (their blocks gathered over dp where sharded, then over tp): after training, the
    single-process parameters, and optimizer state of the parameters' global sizes."""
    ref, opt = dp_tp_cases.init_params(), SGD(lr=0.2, momentum=0.9)  # dp_tp_cases.reference's, keeping opt
    for step in range(dp_tp_cases.STEPS):
        grads = dict(dp_tp_cases.grads_in_backward_order(ref, *dp_tp_cases.data(step)))
        clip_grad_norm_(grads, dp_tp_cases.MAX_NORM)
        opt.step(ref, grads)

    def body():
        own = {"optimizer": SGD(lr=0.2, momentum=0.9)} if strategy == "ddp" else {}  # DDP steps its own too
        mesh, model = dp_tp_cases.build((2, 2), strategy, **own)
        dp_tp_cases.steps(mesh, model, None, 0, dp_tp_cases.STEPS)
        return model.full_state_dict()

    for sd in local.run(body, 4, timeout=30):
        assert all(type(p) is np.ndarray for p in sd["model"].values())
        assert sorted(sd["model"]) == sorted(ref)
        dp_tp_cases.assert_matches_reference({n: sd["model"][n] for n in ref}, ref)
        for name, want in ref.items():  # optimizer state shaped as its parameter (issue 37.2: one state shape)
            buf = sd["optim"]["state"][name]["momentum_buffer"]
            assert type(buf) is np.ndarray and buf.shape == want.shape, (name, buf.shape)
            np.testing.assert_allclose(buf, opt.state[name]["momentum_buffer"].reshape(want.shape), rtol=0, atol=1e-10)
            assert sd["optim"]["step"][name] == dp_tp_cases.STEPS


@pytest.mark.parametrize("strategy, who", [("zero1", r"ZeroRedundancyOptimizer\(stage=1\)"),
                                           ("fsdp", "FullyShardedDataParallel")], ids=["zero1", "fsdp"])
def test_sharded_strategies_of_dtensor_params_refuse_to_load_full_state_dicts(strategy, who):
    def body():
        _, model = dp_tp_cases.build((2, 2), strategy)
        with pytest.raises(ValueError, match=rf"rank \d: {who}\.load_full_state_dict: parameters \['w1', 'b1', "
                                             r"'w2', 'b2'\] are DTensors, whose full state dict cannot be loaded "
                                             r".*; use state_dict\(\)"):
            model.load_full_state_dict(model.full_state_dict())

    local.run(body, 4, timeout=30)


@pytest.mark.parametrize("view", [True, False], ids=["bucket-view", "copies"])
def test_ddp_of_dtensors_takes_blocks_too_and_hands_out_dtensors_over_its_own_arrays(view):
    ref = dp_tp_cases.reference()

    def body():
        params, _ = dp_tp_cases.train((2, 2), blocks=True, gradient_as_bucket_view=view)
        mesh, ddp = dp_tp_cases.build((2, 2), gradient_as_bucket_view=view)
        w1 = ddp.params["w1"]
        assert ddp.params["w1"] is w1 and w1.to_local() is ddp._blocks["w1"], "one DTensor over DDP's own block"
        ddp.grads["w1"] = w1 * 0 + 1.0  # a DTensor laid out as the parameter: its block is taken
        assert (ddp.grads["w1"].to_local() == 1.0).all() and ddp.grads["w1"].placements == (Shard(1),)
        return params

    for params in local.run(body, 4, timeout=30):
        dp_tp_cases.assert_matches_reference(params, ref)



def test_the_tensor_parallel_docstring_gives_ddp_the_dtensors_as_they_are():
    """The package's docstring told users to unwrap DTensors for DDP (``to_local()``) and wrap
    the averages back; DDP takes the DTensor dict itself. Its call is run as written."""
    import meshkit.tensor.parallel as tp

    assert "to_local()" not in tp.__doc__, "the docstring still unwraps the DTensors for DDP"
    call = re.search(r"``(DistributedDataParallel\(params, mesh=mesh\[\"dp\"\]\))``", tp.__doc__).group(1)
    full = {n: a for n, a in _params().items() if n in ("w0", "b0")}

    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        params = parallelize(full, mesh["tp"], {"[wb]0": ColwiseParallel()})
        ddp = eval(call, {"DistributedDataParallel": DistributedDataParallel, "params": params, "mesh": mesh})
        ddp.zero_grad()
        for name in reversed(list(params)):
            ddp.mark_grad_ready(name, params[name] * float(mesh["dp"].get_local_rank() + 1))
        ddp.finish_gradient_sync()
        return {n: (type(g), g.placements, g.full_tensor()) for n, g in ddp.grads.items()}

    for grads in local.run(body, 4, timeout=30):
        for name, (kind, placements, value) in grads.items():
            assert kind is DTensor and placements == (Shard(1 if name == "w0" else 0),), (name, placements)
            np.testing.assert_allclose(value, 1.5 * full[name], rtol=1e-15)  # (1 + 2) / 2 over dp


def _tp_params(mesh, placements=None):
    placements = placements or {"w": [Shard(1)]}
    return {n: distribute_tensor(np.ones((4, 6)), mesh["tp"], pl) for n, pl in placements.items()}


@pytest.mark.parametrize("case, message", [
    ("partial", r"params\['w'\] is a DTensor with placements \(Partial\(sum\),\); a Partial parameter holds "
                r"terms of a sum, not values: redistribute it to Shard or Replicate placements first"),
    ("dp-mesh", r"params\['w'\] is a DTensor on mesh \[\[0, 1\], \[2, 3\]\] \(dims \('dp', 'tp'\)\), which holds "
                r"ranks \[\d\] of the data-parallel group \[\d, \d\] besides this rank: it is laid out over the "
                r"data-parallel dimension already"),
    ("placements", r"parameter 'w' differs between rank \d \(a DTensor \(Shard\(dim=1\),\) of global shape \(4, 6\) "
                   r"at coordinate \(\d,\) of a \(2,\) mesh, block shape \(4, 3\), dtype float64\) and rank \d "
                   r"\(a DTensor \(Shard\(dim=0\),\) of global shape \(4, 6\) .*block shape \(2, 6\).*\); every "
                   r"rank must pass the same names, shapes, dtypes and DTensor layouts in the same order"),
    ("coordinate", r"parameter 'w' differs between rank \d \(a DTensor \(Shard\(dim=1\),\) of global shape "
                   r"\(4, 6\) at coordinate \((\d),\) .*\) and rank \d \(a DTensor \(Shard\(dim=1\),\) of global "
                   r"shape \(4, 6\) at coordinate \((?!\1)\d,\)"),
    ("plain", r"parameter 'w' differs between rank \d \(a DTensor .*\) and rank \d \(shape \(4, 6\), dtype "
              r"float64\)"),
], ids=["partial", "dp-mesh", "placements", "coordinate", "plain"])
@pytest.mark.parametrize("strategy", ["ddp", "zero", "fsdp"])
def test_dtensor_params_that_cannot_be_data_parallel_over_dp_are_refused_on_every_rank(case, message, strategy):
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        rank = meshkit.get_rank()
        if case == "partial":
            params = {"w": DTensor.from_local(np.ones((4, 6)), mesh["tp"], [Partial()])}
        elif case == "dp-mesh":
            params = {"w": distribute_tensor(np.ones((4, 6)), mesh, [Replicate(), Shard(1)])}
        elif case == "placements":  # the second dp row lays w out by rows
            params = _tp_params(mesh, {"w": [Shard(1) if rank < 2 else Shard(0)]})
        elif case == "coordinate":  # dp groups [0, 3] and [1, 2]: rank 0 holds columns 0:3, rank 3 columns 3:6
            dp = meshkit.DeviceMesh("cpu", [[0, 1], [3, 2]], mesh_dim_names=("dp", "tp"))["dp"]
            params = _tp_params(mesh)
        else:  # one dp row passes the whole array
            params = _tp_params(mesh) if rank < 2 else {"w": np.ones((4, 6))}
        with pytest.raises(ValueError, match=message) as info:
            if strategy == "ddp":
                DistributedDataParallel(params, mesh=dp)
            elif strategy == "zero":
                ZeroRedundancyOptimizer(params, SGD(lr=0.1), mesh=dp)
            else:
                FullyShardedDataParallel(params, mesh=dp, optimizer=SGD(lr=0.1))
        return str(info.value)

    for rank, text in enumerate(local.run(body, 4, timeout=30)):
        assert text.startswith(f"meshkit.parallel: rank {rank}: "), text


def test_a_gradient_laid_out_unlike_its_parameter_is_refused_naming_both():
    def body():
        mesh, ddp = dp_tp_cases.build((2, 2))
        tp = mesh["tp"]
        ddp.zero_grad()
        errors = []
        for name, grad, kind in [
                ("w1", distribute_tensor(np.ones((4, 5)), tp, [Shard(0)]), ValueError),
                ("w1", distribute_tensor(np.ones((4, 5)), mesh, [Replicate(), Shard(1)]), ValueError),
                ("w1", np.ones((4, 5)), ValueError)]:
            with pytest.raises(kind) as info:
                ddp.mark_grad_ready(name, grad)
            errors.append(str(info.value))
        return errors

    rows, other_mesh, whole = local.run(body, 4, timeout=30)[1]
    assert rows == ("meshkit.parallel: rank 1: DistributedDataParallel.mark_grad_ready: gradient 'w1' is a DTensor "
                    "(Shard(dim=0),) of shape (4, 5) on mesh [0, 1]; parameter 'w1' is (Shard(dim=1),) of shape (4, 5) "
                    "on mesh [0, 1]: redistribute it to the parameter's placements first")
    assert "on mesh [[0, 1], [2, 3]]; parameter 'w1' is (Shard(dim=1),)" in other_mesh
    assert whole.endswith("gradient 'w1' has shape (4, 5) and dtype float64; expected this rank's block of the DTensor "
                          "parameter: shape (4, 2) and dtype float64")


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_sharded_state_dicts_of_dtensor_params_without_optimizer_state(strategy):
    """SGD without momentum keeps no state: the state dict has none for any parameter (placing the
    DTensor parameters' boxes once looked their state up and raised KeyError)."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        params = parallelize(dp_tp_cases.init_params(), mesh["tp"], dp_tp_cases.PLAN)
        if strategy == "fsdp":
            model = FullyShardedDataParallel(params, mesh=mesh["dp"], optimizer=SGD(lr=0.1))
        else:
            model = ZeroRedundancyOptimizer(params, SGD(lr=0.1), mesh=mesh["dp"])
        sd = model.sharded_state_dict()
        return sd["optim"]["state"], {n: [(p.global_shape, p.offsets) for p in v] for n, v in sd["model"].items()}

    for rank, (state, boxes) in enumerate(local.run(body, 4, timeout=30)):
        assert state == {}
        assert {shape for pieces in boxes.values() for shape, _ in pieces} <= {(4, 5), (5,), (5, 3), (3,)}
        cols = (0, 3)[rank % 2]  # w1's block starts at column 0 or 3 (5 columns over tp = 2: 3 + 2)
        assert all(offsets[1] >= cols for _, offsets in boxes["w1"]), boxes["w1"]


@pytest.mark.parametrize("case, message", [
    ("replicate-mesh", r"invalid arguments on (rank \d|ranks \[\d(, \d)*\]): params\['w'\] is a DTensor on mesh "
                       r"\[\[\d, \d\], \[\d, \d\]\] \(dims \('replicate', 'tp'\)\), which holds ranks \[\d\] of the "
                       r"data-parallel mesh \[\d, \d, \d, \d\] besides this rank"),
    ("one-rank", r"invalid arguments on rank 5: params\['w'\] is a DTensor with placements \(Partial\(sum\),\)"),
    ("replicate-coordinate", r"parameter 'w' differs between rank \d \(a DTensor \(Shard\(dim=1\),\) of global shape "
                             r"\(4, 6\) at coordinate \((\d),\) .*\) and rank \d \(a DTensor \(Shard\(dim=1\),\) of "
                             r"global shape \(4, 6\) at coordinate \((?!\1)\d,\)"),
    ("one-rank-units", r"invalid arguments on rank 6: units must put every parameter in exactly one non-empty unit"),
], ids=["replicate-mesh", "one-rank", "replicate-coordinate", "one-rank-units"])
def test_hsdp_refuses_dtensor_params_on_every_rank_of_its_mesh(case, message):
    """HSDP's check runs over the shard group, then the replicate group carrying the first verdict:
    a problem on one rank, or between replicas only, raises on every rank of the (replicate, shard)
    mesh, here 2x2 beside tp = 2 (as DDP's and ZeRO's, the check spans data parallelism, not tp:
    a rank of the other dp mesh constructs, and would meet the failure in its first tp collective)."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp, rank = mesh["replicate", "shard"], meshkit.get_rank()
        params, units = _tp_params(mesh), None
        if case == "replicate-mesh":  # laid out over replicate x tp: its mesh holds a replica
            params = {"w": distribute_tensor(np.ones((4, 6)), mesh["replicate", "tp"], [Replicate(), Shard(1)])}
        elif case == "one-rank":
            params = {"w": DTensor.from_local(np.ones((4, 6)), mesh["tp"], [Partial()])} if rank == 5 else params
        elif case == "replicate-coordinate":  # the second replica pairs tp ranks the other way round
            dp = meshkit.DeviceMesh("cpu", [[[0, 1], [2, 3]], [[5, 4], [7, 6]]],
                                    mesh_dim_names=("replicate", "shard", "tp"))["replicate", "shard"]
        else:
            units = [["w"], ["w"]] if rank == 6 else None
        try:
            FullyShardedDataParallel(params, mesh=dp, optimizer=SGD(lr=0.1), units=units)
        except ValueError as exc:
            return str(exc)
        return None

    raising = {"one-rank": [1, 3, 5, 7], "one-rank-units": [0, 2, 4, 6]}.get(case, list(range(8)))
    texts = local.run(body, 8, timeout=30)
    assert [r for r, text in enumerate(texts) if text is not None] == raising, texts
    for rank in raising:
        assert texts[rank].startswith(f"meshkit.parallel: rank {rank}: FullyShardedDataParallel: "), texts[rank]
        assert re.search(message, texts[rank]), texts[rank]


def test_fsdp_refuses_a_gradient_laid_out_unlike_its_parameter():
    def body():
        mesh, fsdp = dp_tp_cases.build((2, 2), "fsdp")
        tp = mesh["tp"]
        errors = []
        for grad, kind in [(distribute_tensor(np.ones((4, 5)), tp, [Shard(0)]), ValueError),
                           (np.ones((4, 5)), ValueError)]:
            with pytest.raises(kind) as info:
                fsdp.reduce_grads(0, {"w1": grad, "b1": distribute_tensor(np.ones(5), tp, [Shard(0)])})
            errors.append(str(info.value))
        return errors

    rows, whole = local.run(body, 4, timeout=30)[1]
    assert rows == ("meshkit.parallel: rank 1: FullyShardedDataParallel.reduce_grads: gradient 'w1' is a DTensor "
                    "(Shard(dim=0),) of shape (4, 5) on mesh [0, 1]; parameter 'w1' is (Shard(dim=1),) of shape (4, 5) "
                    "on mesh [0, 1]: redistribute it to the parameter's placements first")
    assert whole == ("meshkit.parallel: rank 1: FullyShardedDataParallel.reduce_grads: gradient 'w1' has shape (4, 5) and "
                     "dtype float64; expected this rank's block of the DTensor parameter: shape (4, 2) and dtype float64")


def test_update_asks_for_flat_arrays_not_dtensors():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        params = parallelize({"w": np.zeros((2, 4))}, mesh["tp"], {"w": ColwiseParallel()})
        with pytest.raises(TypeError, match=r"SGD\.update: parameter 'w': update\(\) takes this rank's flat arrays"):
            SGD(lr=0.1).update("w", params["w"], params["w"])

    local.run(body, 2)
