"""Sharded state dicts (state/boxes.py): boxes of flat ranges, views into the strategies,
and the chain a resharding checkpoint makes possible: FSDP at 4 ranks -> ZeRO-2 at 3 -> DDP at 2 ->
one process -> HSDP on 2x2, each resuming from the last one's pieces, equals uninterrupted
single-process training. The "checkpoint" here is an in-memory dict of global arrays assembled
from every rank's pieces, so that these tests check the strategies' side alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ddp_cases
import meshkit
import sharded_cases as cases
from meshkit.comm import local
from meshkit.parallel import DistributedDataParallel, ShardedArray
from meshkit.parallel._seams import optimizer_state_views
from meshkit.parallel.data_parallelism.flat import FlatLayout, flat_shard_pieces
from meshkit.state._seams import flat_range_boxes


# --------------------------------------------------------------------------- boxes of flat ranges
@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4), data=st.data())
def test_flat_range_boxes_tile_the_range_with_contiguous_boxes(shape, data):
    size = math.prod(shape)
    start = data.draw(st.integers(0, size))
    stop = data.draw(st.integers(start, size))
    boxes = flat_range_boxes(shape, start, stop)
    assert len(boxes) <= max(2 * len(shape) - 1, 1)
    index = np.arange(size).reshape(shape)
    covered = []
    for offsets, lengths in boxes:
        block = index[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        flat = block.reshape(-1)
        assert np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)), (offsets, lengths)  # contiguous
        covered.extend(flat.tolist())
    assert covered == list(range(start, stop))


def test_flat_range_boxes_example_and_bad_range():
    assert flat_range_boxes((3, 4), 2, 11) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    with pytest.raises(ValueError, match=r"range \[3, 13\) is outside an array of 12 elements"):
        flat_range_boxes((3, 4), 3, 13)


def test_shard_pieces_are_views_covering_each_parameter_once():
    params = {"a": np.arange(12.0).reshape(3, 4), "b": np.arange(5.0) + 100, "c": np.array(7.0)}
    for shards in (1, 2, 3, 4, 7):
        layout = FlatLayout.over(params, shards)
        flat = layout.pack(params, params["a"])
        seen = {name: np.full(p.shape, np.nan) for name, p in params.items()}
        for index in range(shards):
            lo, hi = layout.shard_range(index)
            shard = flat[lo:hi]
            for name, pieces in flat_shard_pieces(layout, shard, index).items():
                for piece in pieces:
                    assert np.shares_memory(piece.local, shard), name
                    box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.lengths))
                    assert np.isnan(seen[name][box]).all(), (name, piece.offsets)  # no overlap
                    seen[name][box] = piece.local
        for name, p in params.items():
            assert np.array_equal(seen[name], p), (shards, name)


def test_a_box_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match=r"offsets \(2, 0\) of lengths \(2, 4\) does not fit in an array of shape"):
        ShardedArray(np.zeros((2, 4)), (3, 4), (2, 0))


# --------------------------------------------------------------------------- the chain
def _leaves(sd):
    """(path, value) for every array leaf of a state dict (a list of pieces is one leaf)."""
    for key, value in sd.items():
        if isinstance(value, dict):
            for path, leaf in _leaves(value):
                yield (key, *path), leaf
        else:
            yield (key,), value


def _export(sd) -> list:
    """This rank's pieces as (path, global shape, offsets, copy)."""
    out = []
    for path, value in _leaves({"model": sd["model"], "state": sd["optim"]["state"]}):
        for piece in value if isinstance(value, list) else [ShardedArray(value, value.shape, (0,) * value.ndim)]:
            out.append((path, piece.global_shape, piece.offsets, np.array(piece.local)))
    return out


def _assemble(per_rank: list[list], steps: dict) -> dict:
    """The global arrays from every rank's pieces (every element written: no gaps)."""
    store: dict = {"step": steps}
    for pieces in per_rank:
        for path, shape, offsets, data in pieces:
            full = store.setdefault(path, np.full(shape, np.nan, dtype=data.dtype))
            full[tuple(slice(o, o + n) for o, n in zip(offsets, data.shape))] = data
    for path, full in store.items():
        if path != "step":
            assert not np.isnan(full).any(), f"{path}: some elements were held by no rank"
    return store


def _fill(sd, store) -> None:
    """Load ``store`` into the views of ``sd`` in place (what a checkpoint load does), steps replaced."""
    for path, value in _leaves({"model": sd["model"], "state": sd["optim"]["state"]}):
        for piece in value if isinstance(value, list) else [ShardedArray(value, value.shape, (0,) * value.ndim)]:
            piece.local[...] = store[path][tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.lengths))]
    sd["optim"]["step"] = dict(store["step"])


def _resume(strategy, store, *args) -> None:
    sd = strategy.sharded_state_dict(*args)
    _fill(sd, store)
    strategy.load_sharded_state_dict(sd["model"], sd["optim"], *args)


def _initial_store(kind: str) -> dict:
    """What a fresh single-process model and optimizer hold: the initial parameters, zero state, step 0."""
    params, opt = ddp_cases.init_params(True), cases.make_opt(kind)
    sd = {"model": params, "optim": optimizer_state_views(opt, params)}
    return _assemble([_export(sd)], sd["optim"]["step"])


def _train_ddp(kind, store, steps):
    ddp = DistributedDataParallel(ddp_cases.init_params(True), find_unused_parameters=True)
    opt = cases.make_opt(kind)
    _resume(ddp, store, opt)
    cases.ddp_steps(ddp, opt, steps)
    sd = ddp.sharded_state_dict(opt)
    return _export(sd), sd["optim"]["step"]


def _train_alone(kind, store, steps):
    params, opt = ddp_cases.init_params(True), cases.make_opt(kind)
    sd = {"model": params, "optim": optimizer_state_views(opt, params)}
    _fill(sd, store)
    opt.steps.update(sd["optim"]["step"])
    for step in steps:
        grads = {name: np.zeros_like(p) for name, p in params.items()}
        for m in range(cases.MICRO):
            for name, g in cases.local_grads(params, step, m).items():
                grads[name] += g
        opt.step(params, grads)
    sd = {"model": params, "optim": optimizer_state_views(opt, params)}
    return _export(sd), sd["optim"]["step"]


def _train_sharded(train, store, steps, **kw):
    held = []

    def setup(strategy):
        held.append(strategy)
        _resume(strategy, store)

    train(steps=steps, setup=setup, **kw)
    sd = held[0].sharded_state_dict()
    return _export(sd), sd["optim"]["step"]


def _stage(n, fn, *args, **kw):
    results = local.run(lambda: fn(*args, **kw), n)
    steps = {name: int(count) for name, count in results[0][1].items()}  # StepCounts read now: a snapshot
    assert all(r[1] == steps for r in results)
    return _assemble([r[0] for r in results], steps)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_resuming_across_strategies_and_world_sizes_equals_uninterrupted_training(kind):
    store = _initial_store(kind)
    store = _stage(4, _train_sharded, lambda **kw: cases.train_fsdp(kind, **kw), store, range(0, 1))
    store = _stage(3, _train_sharded, lambda **kw: cases.train_zero(2, kind, **kw), store, range(1, 2))
    store = _stage(2, _train_ddp, kind, store, range(2, 3))
    store = _stage(1, _train_alone, kind, store, range(3, 4))
    store = _stage(4, _train_sharded, lambda **kw: cases.train_fsdp(kind, mesh_shape=(2, 2), **kw), store,
                   range(4, 5))
    ref = cases.reference(kind, steps=5)
    cases.assert_matches({path[1]: a for path, a in store.items() if path[0] == "model"}, ref, "chain")
    assert set(store["step"].values()) == {5}


def test_a_fresh_strategy_holds_its_optimizer_state_before_the_first_step():
    def body():
        holder = []
        cases.train_zero(1, "adamw", steps=range(0), setup=holder.append)
        sd = holder[0].sharded_state_dict()
        return {name: sorted(keys) for name, keys in sd["optim"]["state"].items()}, sd["optim"]["step"]

    (state, step), _ = local.run(body, 2)
    assert state == {name: ["exp_avg", "exp_avg_sq"] for name in ddp_cases.init_params(True)}
    assert {int(count) for count in step.values()} == {0}


def test_a_piece_of_another_box_is_refused():
    def body():
        holder = []
        cases.train_fsdp("sgd", steps=range(0), setup=holder.append)
        fsdp = holder[0]
        sd = fsdp.sharded_state_dict()
        mine = sd["model"]["w1"]
        other = [ShardedArray(np.zeros((1, 1)), (6, 5), (5, 4))] * max(len(mine), 1)
        with pytest.raises(meshkit.DistValueError, match=r"model\['w1'\]: (got a piece of box \(\(5, 4\), "
                                                         r"\(1, 1\)\)|has 1 pieces on this rank, expected 0)"):
            fsdp.load_sharded_state_dict({**sd["model"], "w1": other}, sd["optim"])
        with pytest.raises(meshkit.DistValueError, match=r"model must have the keys"):
            fsdp.load_sharded_state_dict({"w1": mine}, sd["optim"])
        bad_steps = {**sd["optim"], "step": {**sd["optim"]["step"], "b1": 3}}
        with pytest.raises(meshkit.DistValueError, match=r"step counts of parameters .* must be given and equal"):
            fsdp.load_sharded_state_dict(sd["model"], bad_steps)
        return True

    assert local.run(body, 2) == [True, True]


@pytest.mark.parametrize("opt", [lambda: meshkit.parallel.SGD(lr=0.1, momentum=0.9, dampening=0.5, nesterov=False),
                                 lambda: meshkit.parallel.AdamW(lr=0.01, amsgrad=True)])
def test_materialized_state_behaves_as_no_state(opt):
    """Zero state at step 0 (what a checkpoint of a fresh optimizer holds) steps exactly as none:
    SGD's first step still makes its buffer the gradient, whatever the dampening."""
    rng = np.random.default_rng(3)
    p0, grads = rng.standard_normal(7), [rng.standard_normal(7) for _ in range(3)]
    fresh, materialized = opt(), opt()
    a, b = p0.copy(), p0.copy()
    views = materialized.materialize("p", b)
    assert all(not v.any() for v in views.values()) and materialized.steps == {"p": 0}
    for g in grads:
        fresh.step({"p": a}, {"p": g})
        materialized.step({"p": b}, {"p": g})
    assert np.array_equal(a, b)
    assert all(materialized.state["p"][k] is views[k] for k in views)  # updated in place: views stay live
