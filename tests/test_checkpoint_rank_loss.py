"""A save that meets a dead rank under ``meshkit-run --survive``: nothing is committed, what it wrote
is removed, and the survivors get the ``RankFailedError`` naming the dead (their loop shrinks and
redoes) instead of a ``CheckpointError``; other failures still fail the save with a message.

The verdict exchange is driven over a group double whose requests fail as the MPI engine's do
under ULFM (the same error types); the whole path runs under the launcher in tests/test_survive_launch.py
(examples/train_mlp.py, a rank killed inside a save, rank 0 among them)."""

from __future__ import annotations

import pytest

from meshkit.checkpoint import writer
from meshkit.comm import CollectiveTimeout, DistError, RankFailedError


class _Work:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def wait(self, timeout: float | None = None) -> bool:
        if self.error is not None:
            raise self.error
        return True


class _Group:
    """Ranks 0..size-1; every receive fails with ``error``, every send completes."""

    def __init__(self, rank: int, size: int, error: Exception) -> None:
        self.rank, self.size, self.ranks, self.max_tag, self.error = rank, size, list(range(size)), 99, error
        self.sent: list[int] = []
        self.messages: list = []

    def irecv(self, buf, src, tag):
        return _Work(self.error)

    def isend(self, buf, dst, tag):
        self.sent.append(dst)
        self.messages.append(buf.copy())
        return _Work(None)


class _Verdict(_Group):
    """A rank other than 0 whose receive gets ``message`` (rank 0's verdict): rank 0 is alive."""

    def __init__(self, message) -> None:
        super().__init__(1, 3, None)
        self.message = message

    def irecv(self, buf, src, tag):
        buf[:] = self.message
        return _Work(None)


def test_rank_zero_removes_the_save_tells_everyone_and_raises_the_dead_ranks(tmp_path):
    tmp = tmp_path / ".step_3.tmp-x"
    tmp.mkdir()
    (tmp / "rank-0.json").write_text("[]")
    g = _Group(0, 3, RankFailedError("rank 2 died", failed_ranks=(2,)))
    with pytest.raises(RankFailedError, match="rank 2 died") as caught:
        writer._decide(g, 1, tmp, tmp_path / "step_3", {"arrays": {}}, None, 5.0)
    assert caught.value.failed_ranks == (2,)
    assert not tmp.exists() and not (tmp_path / "step_3").exists()
    assert g.sent == [1, 2]  # the verdict went out before the error: no survivor waits for it
    # ... and it says ranks died: a survivor whose own receive from rank 0 worked raises the
    # RankFailedError naming them too (a CheckpointError would end its loop: the job died with it)
    with pytest.raises(RankFailedError, match=r"rank 1: the save of '.*step_3' failed: rank 0 met dead rank\(s\) "
                                              r"\[2\] \(.*rank 2 died.*\); nothing was committed") as caught:
        writer._report(_Verdict(g.messages[0]), 1, tmp_path / "step_3", None, 5.0)
    assert caught.value.failed_ranks == (2,)


def test_a_verdict_of_failure_without_deaths_is_still_a_message(tmp_path):
    verdict = writer._report(_Verdict(writer._message(1, "rank 2: disk full")), 1, tmp_path / "step_3", None, 5.0)
    assert verdict == "rank 2: disk full"
    assert writer._report(_Verdict(writer._message(1, None)), 1, tmp_path / "step_3", None, 5.0) is None


def test_another_rank_raises_the_dead_ranks_instead_of_a_verdict(tmp_path):
    g = _Group(1, 3, RankFailedError("rank 0 died", failed_ranks=(0,)))
    with pytest.raises(RankFailedError, match="rank 0 died"):
        writer._report(g, 1, tmp_path / "step_3", None, 5.0)


@pytest.mark.parametrize("error, says", [
    (CollectiveTimeout("rank 0 did not arrive"), "no verdict from rank 0 on .* within 5 s"),
    (DistError("the group is broken"), r"no verdict from rank 0 on '[^']*' \(the group is broken\)"),
    (RankFailedError("rank 0 raised"), r"no verdict from rank 0 on '[^']*' \(rank 0 raised\)"),  # no death named
])
def test_other_failures_still_fail_the_save_with_a_message_that_says_what_happened(tmp_path, error, says):
    verdict = writer._report(_Group(1, 3, error), 1, tmp_path / "step_3", None, 5.0)
    assert verdict is not None
    assert __import__("re").search(says, verdict), verdict
