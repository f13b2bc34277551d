"""Point-to-point: any-source receives, tags, message order, timeouts naming the peer."""

from __future__ import annotations

import time

import numpy as np
import pytest

import meshkit
from meshkit.comm import local
from meshkit.comm._seams import resolve_group


def p2p_cases() -> bool:
    rank, n = meshkit.get_rank(), meshkit.get_world_size()
    if rank == 0:
        got = {}
        for _ in range(n - 1):  # any source: every other rank's message, in whatever order
            buf = np.empty(2)
            src = meshkit.recv(buf, src=None)
            got[src] = buf.copy()
        assert got == {r: got[r] for r in range(1, n)} and all((got[r] == r).all() for r in got)
        # tags are matched separately; messages with the same tag arrive in the order sent
        late, early = np.empty(1), np.empty(1)
        w_late = meshkit.irecv(late, src=1, tag=7)
        meshkit.recv(early, src=1, tag=3)
        w_late.wait()
        assert early[0] == 3.0 and late[0] == 7.0
        first, second = np.empty(1), np.empty(1)
        meshkit.recv(first, src=1, tag=5)
        meshkit.recv(second, src=1, tag=5)
        assert (first[0], second[0]) == (1.0, 2.0)
    else:
        meshkit.send(np.full(2, float(rank)), dst=0)
        if rank == 1:
            meshkit.send(np.array([7.0]), dst=0, tag=7)
            meshkit.send(np.array([3.0]), dst=0, tag=3)
            meshkit.send(np.array([1.0]), dst=0, tag=5)
            meshkit.send(np.array([2.0]), dst=0, tag=5)
    meshkit.barrier()
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_point_to_point_local(world_size):
    assert all(local.run(p2p_cases, world_size, timeout=10))


def test_point_to_point_mpi(mpirun):
    assert mpirun("mpi_p2p.py", 3).stdout.count("P2P OK") == 3


def test_recv_timeout_names_the_peer():
    def body():
        if meshkit.get_rank() == 0:
            with pytest.raises(meshkit.CollectiveTimeout, match=r"rank 0: recv from rank 1 tag 4 on group world did "
                                                               r"not complete within 0.2 s: rank 1 did not post a "
                                                               r"matching send") as info:
                meshkit.recv(np.empty(1), src=1, tag=4)
            assert info.value.missing == [1]
    local.run(body, 2, timeout=0.2)


def test_rank_translation_between_world_and_group():
    def body():
        group = meshkit.new_group([1, 3])
        assert meshkit.get_process_group_ranks(group) == [1, 3]
        assert meshkit.get_group_rank(group, 3) == 1 and meshkit.get_global_rank(group, 0) == 1
        with pytest.raises(ValueError, match=r"global rank 2 is not in group group\[1, 3\] \(ranks \[1, 3\]\)"):
            meshkit.get_group_rank(group, 2)
        with pytest.raises(ValueError, match=r"group_rank=2 is out of range for group group\[1, 3\] of size 2"):
            meshkit.get_global_rank(group, 2)
        assert meshkit.get_world_size(group) == 2 and meshkit.get_backend(group) == "local"
        return meshkit.get_rank(group)
    assert local.run(body, 4) == [-1, 0, -1, 1]


def test_abort_fails_the_peers_pending_receive_at_once_and_later_calls_here():
    def body():
        g = resolve_group(None)
        if g.rank == 0:
            g.abort("gave up halfway through a protocol")
            with pytest.raises(meshkit.DistError, match="unusable after an earlier failure: gave up halfway"):
                g.isend(np.zeros(2), 1)
            return None
        start = time.monotonic()
        with pytest.raises(meshkit.RankFailedError) as exc:
            g.irecv(np.zeros(2), 0).wait()
        return str(exc.value), time.monotonic() - start

    text, took = local.run(body, 2, timeout=30)[1]
    assert ("a send or receive on group world (ranks [0, 1]) cannot complete: rank 0 stopped using group world, "
            "sends and receives included: gave up halfway through a protocol") in text and took < 5
