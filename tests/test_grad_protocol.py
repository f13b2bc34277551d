"""Issue 12: the manual gradient protocol and state-dict loading never give a silently wrong result.

Each case (tests/protocol_cases.py) ends in the right result or in an error on every rank that
names the rank, the object and what to do. Cases where ranks do different things also run on
real processes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import protocol_cases as cases
from meshkit.comm import local
from meshkit.parallel import SGD, AdamW

KINDS = cases.KINDS
SHARDED = ["zero1", "zero2", "fsdp"]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_reading_gradients_before_finish_raises_and_changes_nothing(kind, n):
    local.run(cases.read_before_finish_changes_nothing, n, kind, timeout=20)


@pytest.mark.parametrize("kind", KINDS)
def test_using_gradients_of_an_incomplete_pass_raises(kind):
    local.run(cases.read_in_incomplete_pass_raises, 2, kind, timeout=20)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_step_refuses_gradients_that_are_not_averaged(stage):
    local.run(cases.zero_step_refuses_unsynchronized_gradients, 2, stage, timeout=20)


def test_zero2_gradient_of_a_launched_bucket_cannot_be_read():
    local.run(cases.zero2_grads_of_a_launched_bucket_are_guarded, 2, timeout=20)


@pytest.mark.parametrize("kind", KINDS)
def test_strategy_owns_its_parameters(kind):
    local.run(cases.owns_its_parameters, 2, kind, timeout=20)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_a_sync_failing_on_one_rank_fails_on_every_rank(kind, n):
    start = time.perf_counter()
    local.run(cases.one_rank_fails_the_sync, n, kind, timeout=20)
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_that_catches_the_error_and_carries_on_gets_averages(kind):
    local.run(cases.one_rank_catches_and_carries_on, 2, kind, timeout=20)


@pytest.mark.parametrize("kind", SHARDED)
def test_state_dict_loading_is_strict(kind):
    local.run(cases.state_dict_loading_is_strict, 2, kind, timeout=30)


@pytest.mark.parametrize("kind", SHARDED)
def test_state_dict_strict_false_keeps_what_is_missing(kind):
    local.run(cases.state_dict_strict_false_keeps_what_is_missing, 2, kind, timeout=30)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", SHARDED)
def test_state_dicts_differing_across_ranks_are_refused(kind, n):
    local.run(cases.state_dicts_differing_across_ranks_are_refused, n, kind, timeout=30)


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "fsdp"])
def test_parameters_in_another_order_on_one_rank(kind):
    local.run(cases.different_order_across_ranks_raises, 2, kind, timeout=20)


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "fsdp"])
def test_bad_parameter_on_one_rank_fails_every_rank_at_once(kind):
    local.run(cases.bad_argument_on_one_rank_raises_everywhere, 3, kind, timeout=20)


def test_settings_differing_across_ranks():
    local.run(cases.settings_differing_across_ranks_raise, 2, timeout=20)


def test_optimizer_load_state_dict_checks_values():
    opt = AdamW(lr=0.1)
    opt.step({"w": np.zeros(3)}, {"w": np.ones(3)})
    sd = opt.state_dict()
    with pytest.raises(ValueError, match=r"^meshkit\.parallel: rank 0: AdamW\.load_state_dict: state\['w'\]\['exp_avg'\] "
                                         r"must be a 1-D array of floating point, got ndarray of shape \(3,\) and dtype int64"):
        opt.load_state_dict({**sd, "state": {"w": {**sd["state"]["w"], "exp_avg": np.zeros(3, np.int64)}}})
    with pytest.raises(TypeError, match=r"AdamW: lr must be a real number, got str 'fast'"):
        opt.load_state_dict({**sd, "hyper": {**sd["hyper"], "lr": "fast"}})
    with pytest.raises(ValueError, match=r"hyper must have the keys \['amsgrad', 'betas', 'eps', 'lr', "):
        opt.load_state_dict(SGD(lr=0.1).state_dict())


def test_cross_rank_cases_on_real_processes(mpirun):
    start = time.perf_counter()
    out = mpirun("mpi_protocol.py", 3, timeout=120).stdout
    assert out.count("PROTOCOL OK") == 3, out
    assert time.perf_counter() - start < 100, "every failure must end within seconds, not at a timeout"
