"""Issue 36: the gradient protocol's rules, the same for every data-parallel strategy, and the
reducer's behaviour that no test pinned.

36.1: with one loop (``data_parallel``, protocol methods only), DDP, ZeRO-1/2, FSDP and HSDP give
the single-process result (float64, 1e-10) or the same error on every rank when ranks mark
gradients in different orders, mark one twice, skip a ``step()``, or pass float32 gradients of
float64 parameters (the cases are tests/protocol_cases.py's, which also run under ``meshkit-run``
in test_grad_protocol.py). 36.8: ``zero_grad()`` resets what a pass left behind (the averaged
flag, a failed sync), and a sync whose wait timed out is a failed sync.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
import protocol_cases as cases
from meshkit.comm import CollectiveTimeout, local
from meshkit.parallel import SGD, DistributedDataParallel, allreduce_hook

STRATEGIES = cases.RULE_STRATEGIES
REDUCERS = ["ddp", "zero1", "zero2"]  # the strategies of parallel/data_parallelism/reducer.py


def ranks(strategy: str) -> int:
    return 4 if strategy == "hsdp" else 2  # HSDP: a 2x2 (replicate, shard) mesh


# ---------------------------------------------------------------------------- 36.1

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_result_does_not_depend_on_the_order_ranks_mark_gradients(strategy):
    local.run(cases.marks_in_any_order, ranks(strategy), strategy, timeout=30)


@pytest.mark.parametrize("where", ["every", "one"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gradient_marked_twice_is_refused_and_changes_nothing(strategy, where):
    local.run(cases.marked_twice, ranks(strategy), strategy, where, timeout=30)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rank_that_skips_step_fails_the_next_sync_on_every_rank(strategy):
    local.run(cases.skipped_step, ranks(strategy), strategy, timeout=30)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "hsdp"])  # ZeRO's step() all-gathers: see docs/strategies.md
def test_a_rank_that_skips_step_after_clipping_fails_the_next_sync_on_every_rank(strategy):
    local.run(cases.skipped_step_after_clipping, ranks(strategy), strategy, timeout=30)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradients_of_another_dtype_are_refused(strategy):
    local.run(cases.float32_gradients_are_refused, ranks(strategy), strategy, timeout=30)


# ---------------------------------------------------------------------------- 36.8: the reducer

@pytest.mark.parametrize("strategy", REDUCERS)
def test_step_after_zero_grad_without_a_pass_is_refused(strategy):
    """A step, then zero_grad(): the gradients are no longer averages, so step() refuses (stepping
    on zeroed gradients would still move the parameters, by SGD's momentum) and changes nothing."""
    def body() -> None:
        model = cases.rule_model(strategy)
        for step in range(cases.RULE_STEPS):
            model.zero_grad()
            cases.rule_pass(model, step)
            model.step()
            if step == 0:
                model.zero_grad()
                with cases.raises_everywhere(r"step: no synchronized gradient pass since zero_grad\(\)"):
                    model.step()
        cases.assert_rule_result(model, cases.rule_reference(), strategy)

    local.run(body, 2, timeout=30)


@pytest.mark.parametrize("strategy", REDUCERS)
def test_zero_grad_clears_a_failed_sync(strategy):
    """Rank 1 leaves b0 unmarked: the sync fails on every rank; zero_grad() clears the failure, so
    the next pass steps (without it every later step kept raising that the sync failed)."""
    def body() -> None:
        rank = meshkit.get_rank()
        model = cases.rule_model(strategy)
        for step in range(cases.RULE_STEPS):
            model.zero_grad()
            if step == 0:
                cases.rule_pass(model, step, ("w1", "w0") if rank == 1 else ("w1", "b0", "w0"))
                with pytest.warns(DeprecationWarning), cases.raises_everywhere(
                        r"the gradient sync failed on rank\(s\) \[1\]: rank 1: gradients \['b0'\] were not marked"):
                    model.finish_gradient_sync()
                continue
            cases.rule_pass(model, step)
            model.step()
        cases.assert_rule_result(model, cases.rule_reference(skipped=(0,)), strategy)

    local.run(body, 2, timeout=30)


class TimedOutWork:
    """What a hook's work is after its group's timeout passed: ``wait()`` raises CollectiveTimeout."""

    def wait(self, timeout: float | None = None) -> bool:
        raise CollectiveTimeout("meshkit.comm: all_reduce did not complete within the group's timeout", op="all_reduce")


def test_a_timed_out_wait_fails_the_sync():
    """The last bucket's reduction times out on every rank (the first two were averaged): the sync
    is failed, so the half-reduced gradients cannot be read or stepped on, and after zero_grad() the
    next passes train right."""
    def body() -> None:
        timed_out = [True]

        def hook(group, bucket):
            if bucket.is_last() and timed_out[0]:
                timed_out[0] = False
                return TimedOutWork()
            return allreduce_hook(group, bucket)

        model = DistributedDataParallel(cases.rule_params(), mesh=meshkit.init_device_mesh("cpu", (2,)),
                                        optimizer=SGD(lr=0.1, momentum=0.9), comm_hook=hook, **cases.CAPS)
        for step in range(cases.RULE_STEPS):
            model.zero_grad()
            cases.rule_pass(model, step)
            if step == 0:
                with pytest.raises(CollectiveTimeout, match="did not complete within the group's timeout"):
                    model.step()
                for read in (lambda: model.grads["w1"], model.step):
                    with cases.raises_everywhere(r"the last gradient sync raised CollectiveTimeout: .*call zero_grad\(\)"):
                        read()
                continue
            model.step()
        cases.assert_rule_result(model, cases.rule_reference(skipped=(0,)), "ddp")

    local.run(body, 2, timeout=30)
