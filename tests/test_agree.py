"""comm's one agreement (comm/agree.py): every rank's value, or every rank raises the same error.

In-process (the local engine, threads as ranks): the users of agree() (mesh construction, the
strategies' set-up, state dict and checkpoint loads, the pipeline's first step, context-parallel
arguments, DTensor checks, init's debug levels) have their own tests of what they check.
"""

from __future__ import annotations

import pytest

import meshkit
from meshkit.comm import local
from meshkit.comm._seams import agree, by_ranks, name_ranks


def test_every_rank_gets_every_ranks_value():
    def body():
        rank = meshkit.get_rank()
        return agree(meshkit.comm._seams.resolve_group(None), {"rank": rank}, error=ValueError)

    assert local.run(body, 3) == [[{"rank": 0}, {"rank": 1}, {"rank": 2}]] * 3


def test_a_problem_on_one_rank_raises_on_every_rank_and_its_own_error_on_that_rank():
    def body():
        rank = meshkit.get_rank()
        own = KeyError("dim 3 is out of range") if rank == 1 else None
        with pytest.raises(Exception) as info:
            agree(meshkit.comm._seams.resolve_group(None), rank, own=own, error=ValueError)
        agree(meshkit.comm._seams.resolve_group(None), rank, error=ValueError)  # the job's traffic still works
        return type(info.value), str(info.value)

    got = local.run(body, 3)
    assert got[1] == (KeyError, "'dim 3 is out of range'")
    assert got[0] == got[2] == (ValueError, "invalid arguments on rank 1: dim 3 is out of range")


def test_a_difference_found_by_compare_raises_the_same_message_everywhere():
    def differ(group, values):
        return None if len(set(values)) == 1 else "ranks differ: " + by_ranks(zip(group.ranks, values), " passed ")

    def body():
        value = 7 if meshkit.get_rank() == 2 else 5
        with pytest.raises(ValueError) as info:
            agree(meshkit.comm._seams.resolve_group(None), value, compare=differ, error=ValueError)
        return str(info.value)

    assert local.run(body, 4) == ["ranks differ: ranks [0, 1, 3] passed 5; rank 2 passed 7"] * 4


def _counting(calls):
    def exchange(group, payload):
        calls.append(group.ranks)
        out = [None] * group.size
        meshkit.all_gather_object(out, payload, group=group)
        return out
    return exchange


def test_over_a_mesh_one_exchange_per_dimension_and_a_problem_anywhere_reaches_every_rank():
    """2x2 mesh [[0, 1], [2, 3]]: rank 3's problem, found by its row group, reaches rank 0, which
    shares no group with it; each rank takes part in two exchanges, one per mesh dimension."""
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        rank, calls = meshkit.get_rank(), []
        problem = "a bad block" if rank == 3 else None
        with pytest.raises(ValueError) as info:
            agree(list(reversed(mesh.get_all_groups())), rank, problem=problem, error=ValueError,
                  exchange=_counting(calls))
        return str(info.value), calls

    for rank, (message, calls) in enumerate(local.run(body, 4)):
        assert message == "invalid arguments on rank 3: a bad block"
        assert len(calls) == 2, calls


def test_combine_gives_every_rank_of_the_mesh_everything_and_the_very_same_message():
    def body():
        mesh = meshkit.init_device_mesh("cpu", (2, 2))
        rank = meshkit.get_rank()
        shape = (6, 4) if rank == 2 else (5, 4)

        def differ(_, passed):
            shapes = {tuple(v) for v in passed.values()}
            return None if len(shapes) == 1 else "shapes differ: " + by_ranks(sorted(passed.items()), " passed ")

        with pytest.raises(ValueError) as info:
            agree(mesh.get_all_groups(), {rank: shape}, error=ValueError, compare=differ,
                  combine=lambda parts: {k: v for p in parts for k, v in p.items()})
        everything = agree(mesh.get_all_groups(), {rank: shape}, error=ValueError,
                           combine=lambda parts: {k: v for p in parts for k, v in p.items()})
        return str(info.value), everything

    results = local.run(body, 4)
    assert {message for message, _ in results} == {"shapes differ: ranks [0, 1, 3] passed (5, 4); rank 2 passed (6, 4)"}
    assert all(sorted(everything) == [0, 1, 2, 3] for _, everything in results)


def test_ranks_are_named_one_way():
    assert name_ranks([3]) == "rank 3" and name_ranks((0, 2)) == "ranks [0, 2]"
    assert by_ranks([(2, "B"), (0, "A"), (1, None), (3, "A")]) == "ranks [0, 3]: A; rank 2: B"
