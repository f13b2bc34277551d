"""Context parallelism: ring and all-to-all (Ulysses) attention, forward and backward, equal
to full attention in one process to 1e-12 (float64), causal or not, balanced (head-tail) or not, sequence
lengths that do not divide by cp; the work each rank computes, the bytes the ring sends (read from the
flight recorder), errors raised on every rank; and real processes under meshkit-run."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import meshkit
from context_parallel_cases import inputs, reference
from meshkit.comm import DistValueError, local
from meshkit.parallel import (SequenceSharding, ring_attention, ring_attention_backward, sequence_positions,
                              shard_sequence, ulysses_attention, ulysses_attention_backward, unshard_sequence)

VARIANTS = {"ring": (ring_attention, ring_attention_backward),
            "ulysses": (ulysses_attention, ulysses_attention_backward)}
TOL = 1e-12


def _run(variant: str, cp: int, shape: tuple[int, ...], causal: bool, balanced: bool, dv: int | None = None,
         scale: float | None = None, group_of=None):
    """Every rank: shard the global inputs, attention forward and backward; returns each rank's
    ``(out, dq, dk, dv)``, its context and the unsharded results."""
    q, k, v, dout = inputs(shape, dv=dv)
    forward, backward = VARIANTS[variant]

    def rank():
        group = group_of() if group_of else None
        mine = [shard_sequence(x, group, balanced=balanced) for x in (q, k, v, dout)]
        out, ctx = forward(*mine[:3], group, causal=causal, balanced=balanced, scale=scale)
        grads = backward(ctx, mine[3])
        full = [unshard_sequence(x, shape[-2], group, balanced=balanced) for x in (out, *grads)]
        return (out, *grads), ctx, full

    return (q, k, v, dout), local.run(rank, cp)


def _check(variant, cp, shape, causal, balanced, **kw):
    (q, k, v, dout), results = _run(variant, cp, shape, causal, balanced, **kw)
    want = reference(q, k, v, dout, causal, kw.get("scale"))
    sharding = SequenceSharding(shape[-2], cp, balanced)
    for r, (local_results, ctx, full) in enumerate(results):
        for name, got, ref in zip(("out", "dq", "dk", "dv"), local_results, want):
            np.testing.assert_allclose(got, sharding.shard(ref, r), rtol=0, atol=TOL, err_msg=f"rank {r} {name}")
        for name, got, ref in zip(("out", "dq", "dk", "dv"), full, want):
            np.testing.assert_allclose(got, ref, rtol=0, atol=TOL, err_msg=f"rank {r} unsharded {name}")
    return results


# --------------------------------------------------------------------------- exact against full attention
@pytest.mark.parametrize("variant", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("length", [24, 19])  # 24 divides by 2 * cp for every cp here; 19 by none but 1
def test_forward_and_backward_equal_full_attention(variant, cp, causal, balanced, length):
    _check(variant, cp, (2, 4 if cp != 3 else 6, length, 5), causal, balanced)


@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_three_dims_another_value_head_dim_and_a_scale(variant):
    _check(variant, 3, (6, 13, 4), True, True, dv=7, scale=0.3)


@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_torch_152261_causal_load_balanced_output_equals_attention_without_cp(variant):
    """pytorch #152261: context_parallel's output differed from attention without it; here causal with
    head-tail balancing, on 2 and 4 ranks, at torch's own layout (batch, heads, sequence, head_dim)."""
    for cp in (2, 4):
        _check(variant, cp, (1, 4, 32, 8), True, True)


@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_torch_141429_non_causal_with_load_balancing_equals_attention_without_cp(variant):
    """pytorch #141429: non-causal attention with load balancing on gave other outputs."""
    for cp in (2, 4):
        _check(variant, cp, (1, 4, 32, 8), False, True)


@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_float32_stays_float32_and_within_float32_rounding(variant):
    q, k, v, dout = inputs((2, 3, 13, 8))
    want = reference(q, k, v, dout, True)
    forward, backward = VARIANTS[variant]

    def rank():
        mine = [shard_sequence(x.astype(np.float32), balanced=True) for x in (q, k, v, dout)]
        out, ctx = forward(*mine[:3], causal=True, balanced=True)
        got = (out, *backward(ctx, mine[3]))
        assert all(x.dtype == np.float32 for x in got)
        return [unshard_sequence(x, 13, balanced=True) for x in got]

    for a, b in zip(local.run(rank, 3)[0], want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_cp_dimension_of_a_2d_mesh_is_the_group():
    """``mesh["cp"]`` of a dp x cp mesh: each dp replica runs its own ring on group ranks, not global ones."""
    def cp_mesh():
        return meshkit.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"]

    for variant in VARIANTS:
        (q, k, v, dout), results = _run(variant, 4, (2, 4, 10, 3), True, True, group_of=cp_mesh)
        want = reference(q, k, v, dout, True)
        for local_results, _, full in results:
            for got, ref in zip(full, want):
                np.testing.assert_allclose(got, ref, rtol=0, atol=TOL)


def test_the_docs_snippet_as_written():
    """docs/context_parallel.md's example, run as written on 4 ranks (a 2 x 2 dp x cp mesh)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "context_parallel.md").read_text()
    snippet = page.split("```python\n", 1)[1].split("```", 1)[0]
    Q, K, V, dOut = inputs((2, 4, 11, 3))
    want = reference(Q, K, V, dOut, True)

    def rank():
        scope = {"Q": Q, "K": K, "V": V, "dOut": dOut}
        exec(snippet, scope)
        sharding = SequenceSharding(11, 2, True)
        me = scope["cp"].get_local_rank()
        for got, ref in zip((scope["dq"], scope["dk"], scope["dv"]), want[1:]):
            np.testing.assert_allclose(got, sharding.shard(ref, me), rtol=0, atol=TOL)
        np.testing.assert_allclose(scope["full"], want[0], rtol=0, atol=TOL)

    local.run(rank, 4)


# --------------------------------------------------------------------------- the sharding rule
def test_sharding_rule_written_out():
    assert SequenceSharding(10, 2, balanced=True).chunks == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert SequenceSharding(10, 2, balanced=True).positions(0).tolist() == [0, 1, 2, 8, 9]
    assert SequenceSharding(10, 2, balanced=True).positions(1).tolist() == [3, 4, 5, 6, 7]
    assert SequenceSharding(7, 3).chunks == [(0, 3), (3, 5), (5, 7)]  # numpy.array_split's sizes
    assert [SequenceSharding(16, 4, balanced=True).pieces(r) for r in range(4)] == [
        [(0, 2), (14, 16)], [(2, 4), (12, 14)], [(4, 6), (10, 12)], [(6, 8), (8, 10)]]
    x = np.arange(10)[:, None]
    assert local.run(lambda: shard_sequence(x, balanced=True)[:, 0].tolist(), 2) == [[0, 1, 2, 8, 9],
                                                                                     [3, 4, 5, 6, 7]]
    assert local.run(lambda: sequence_positions(10, balanced=True).tolist(), 2)[1] == [3, 4, 5, 6, 7]
    assert local.run(lambda: unshard_sequence(shard_sequence(x, balanced=True), 10, balanced=True)[:, 0].tolist(),
                     2) == [list(range(10))] * 2


# --------------------------------------------------------------------------- the work of each rank
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_causal_balancing_gives_every_rank_the_same_work(cp):
    shape = (1, 2, 24, 4)  # 24 tokens: 2 * cp chunks of equal length
    for balanced in (True, False):
        _, results = _run("ring", cp, shape, True, balanced)
        forward = [ctx.score_entries for _, ctx, _ in results]
        backward = [ctx.backward_score_entries for _, ctx, _ in results]
        if balanced:
            # each rank: 2 * cp + 1 chunk pairs of (24 / 2cp)^2 scores, per batch x head
            assert forward == [2 * (2 * cp + 1) * (24 // (2 * cp)) ** 2] * cp, forward
            assert backward == forward
        else:
            # rank i computes i + 1 blocks of (24 / cp)^2: the last rank does cp times the first's work
            assert forward == [2 * (i + 1) * (24 // cp) ** 2 for i in range(cp)], forward
        # non-causal: every block, whatever the layout
    _, results = _run("ring", cp, shape, False, False)
    assert [ctx.score_entries for _, ctx, _ in results] == [2 * 24 * 24 // cp] * cp


def test_ulysses_work_is_heads_over_cp_of_the_whole_sequence():
    _, results = _run("ulysses", 2, (1, 4, 12, 3), True, False)
    assert [ctx.score_entries for _, ctx, _ in results] == [2 * 12 * 12] * 2


# --------------------------------------------------------------------------- bytes on the wire (flight recorder)
def _sent_bytes() -> int:
    return sum(int(np.prod(s)) * np.dtype(e["dtype"]).itemsize for e in meshkit.flight_record()
               if e["op"] == "send" for s in e["shapes"])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_sends_cp_minus_one_over_cp_of_k_and_v_per_pass(cp):
    shape = (2, 3, 12, 5)
    q, k, v, dout = inputs(shape, dv=3)

    def rank():
        mine = [shard_sequence(x) for x in (q, k, v, dout)]
        _, ctx = ring_attention(*mine[:3])
        forward = _sent_bytes()
        ring_attention_backward(ctx, mine[3])
        return forward, _sent_bytes() - forward

    kv = k.nbytes + v.nbytes
    for forward, backward in local.run(rank, cp):
        assert forward == (cp - 1) * kv // cp
        # the backward: K/V again, and every block's dK/dV accumulator, cp hops home
        assert backward == (cp - 1) * kv // cp + kv


# --------------------------------------------------------------------------- bad input: an error on every rank
def _errors(cp: int, fn) -> list[str]:
    def rank():
        with pytest.raises(DistValueError) as info:
            fn(meshkit.get_rank())
        return str(info.value)

    return local.run(rank, cp)


@pytest.mark.parametrize("variant", ["ring", "ulysses"])
@pytest.mark.parametrize("case, pattern", [
    ("short", r"sequence \(axis -2 of q\) of 3 tokens over all ranks cannot be split into 2 \* cp = 4 chunks"),
    ("k", r"k has shape \(1, 2, 4, 3\) but q has shape \(1, 2, 2, 3\) on rank 1; they must be equal"),
    ("v", r"v has shape \(1, 4, 2, 3\) but q has shape \(1, 2, 2, 3\) on rank 0"),
    ("one rank", r"q's sequence length \(axis -2\) does not follow the sharding of a 5-token sequence over cp = 2 "
                 r"ranks \(balanced=False\): rank 0 has 2, should have 3, rank 1 has 3, should have 2"),
    ("dims", r"q on rank 0 has 2 dims; valid: 3 to 6"),
    ("causal", r"rank 1 passed another causal than rank 0"),
])
def test_bad_input_raises_the_same_error_on_every_rank(variant, case, pattern):
    forward = VARIANTS[variant][0]

    def call(rank):
        x = np.ones((1, 2, 2, 3))
        if case == "short":
            forward(x[:, :, :1 + rank], x[:, :, :1 + rank], x[:, :, :1 + rank], balanced=True)
        elif case == "k":
            forward(x, np.ones((1, 2, 4, 3)) if rank else x, x)
        elif case == "v":
            forward(x, x, np.ones((1, 4, 2, 3)) if rank == 0 else x)
        elif case == "one rank":
            y = np.ones((1, 2, 2 + rank, 3))
            forward(y, y, y)
        elif case == "dims":
            forward(x[0, 0], x[0, 0], x[0, 0])
        else:
            forward(x, x, x, causal=bool(rank))

    messages = _errors(2, call)
    name = f"{variant}_attention"
    for rank, text in enumerate(messages):
        assert text.startswith(f"meshkit.parallel: rank {rank}: {name}: "), text
        assert re.search(pattern, text), text


def test_ulysses_heads_that_do_not_divide_by_cp_fail_on_every_rank():
    x = np.ones((1, 3, 2, 4))
    messages = _errors(2, lambda rank: ulysses_attention(x, x, x))
    assert all("q's heads (axis -3) = 3 do not divide by cp = 2" in m for m in messages), messages


def test_a_sequence_shorter_than_its_chunks_and_a_wrong_dout_are_named():
    with pytest.raises(DistValueError, match=r"length=3 tokens cannot be split into 2 \* cp = 4 chunks \(balanced\)"):
        SequenceSharding(3, 2, balanced=True)
    with pytest.raises(DistValueError, match=r"rank \d: SequenceSharding: a sequence of length=3"):
        local.run(lambda: shard_sequence(np.ones((1, 3, 1)), balanced=True), 2)
    x = np.ones((1, 2, 2, 3))

    def rank():
        _, ctx = ring_attention(x, x, x)
        with pytest.raises(DistValueError, match=r"ring_attention_backward: dout has shape \(1, 2, 3, 3\) but the "
                                                 r"forward's output has \(1, 2, 2, 3\)"):
            ring_attention_backward(ctx, np.ones((1, 2, 3, 3)))

    local.run(rank, 2)


# --------------------------------------------------------------------------- real processes
@pytest.mark.parametrize("n", [2])  # 13 tokens over 2 ranks: uneven; cp = 3, 4 run on the local engine
def test_ring_and_ulysses_on_real_processes(mpirun, n):
    out = mpirun("mpi_context_parallel.py", n).stdout
    assert out.count("context parallel OK") == n, out


# --------------------------------------------------------------------------- device arrays
@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_device_arrays_stay_on_the_device_and_equal_the_host_reference(cupy, variant):
    """CuPy arrays (tests/doubles/fake_cupy.py, strict: no implicit host copies) over the NCCL engine on the double:
    the math takes its library from the arrays, every result is a device array."""
    from doubles import fake_cupy

    shape = (1, 4, 9, 3)
    q, k, v, dout = inputs(shape)
    forward, backward = VARIANTS[variant]
    want = reference(q, k, v, dout, True)

    def rank():
        meshkit.init_process_group("nccl", timeout=60)
        mine = [shard_sequence(cupy.asarray(x), balanced=True) for x in (q, k, v, dout)]
        out, ctx = forward(*mine[:3], causal=True, balanced=True)
        got = (out, *backward(ctx, mine[3]))
        assert all(isinstance(x, fake_cupy.ndarray) for x in got)
        return [unshard_sequence(x, shape[-2], balanced=True).get() for x in got]

    for got in local.run(rank, 2, init=False, timeout=120):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=0, atol=TOL)
