"""meshkit.checkpoint under contention: one verdict for every rank, and a failed save leaves nothing.

Two jobs saving the same checkpoint id at once (two local worlds in threads, and two real
``meshkit-run`` jobs on one directory), a full disk on one rank or all of them, a rank that
raises or is too slow: every rank of a save gets the same outcome, with the real cause, from
``save`` and from ``async_save``'s future; the failed save removes its temporary directory and
never another job's; the winner of a race is complete and loads.

The per-rank cases here also run on real processes (``tests/scripts/mpi_checkpoint_contention.py``).
"""

from __future__ import annotations

import errno
import os
import pathlib
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import meshkit
from meshkit import checkpoint as dcp
from meshkit.checkpoint import writer
from meshkit.comm import local
from meshkit.tensor import Shard, distribute_tensor

OPS = ["save", "async_save"]
LOST_RACE = "another save committed it first"


# --------------------------------------------------------------------------- per-rank cases (also on real processes)
def outcome(directory: Path, op: str, value: float, timeout: float | None = None) -> str:
    """Save ``{"x": ..., "value": value}`` (``x`` sharded over the world) to ``directory/ck`` with
    ``op``; ``"committed"`` or ``"<exception type>: <message>"`` as this rank saw it."""
    n = meshkit.get_world_size()
    mesh = meshkit.init_device_mesh("cpu", (n,))
    sd = {"x": distribute_tensor(np.full(8 * n, value), mesh, [Shard(0)]), "value": value}
    try:
        if op == "save":
            dcp.save(sd, checkpoint_id=directory / "ck", timeout=timeout)
        else:
            dcp.async_save(sd, checkpoint_id=directory / "ck", timeout=timeout).result(timeout=60)
    except Exception as exc:  # noqa: BLE001 (the test compares what every rank raised)
        return f"{type(exc).__name__}: {exc}"
    return "committed"


def full_disk(ranks: set[int], setattr: Callable[[Any, str, Any], None]) -> None:
    """The disk is full for ``ranks``: their data files and markers in a save's temporary
    directory fail with ENOSPC (``setattr``: monkeypatch's, or plain ``setattr`` in a script)."""
    real_write, real_text = writer.write_chunks, pathlib.Path.write_text

    def write_chunks(directory, rank, chunks):
        if rank in ranks:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / f"data-{rank:05d}.bin"))
        return real_write(directory, rank, chunks)

    def write_text(self, *args, **kwargs):
        if ".tmp-" in self.parent.name and any(self.name.startswith(f"rank-{r}.") for r in ranks):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_text(self, *args, **kwargs)

    setattr(writer, "write_chunks", write_chunks)
    setattr(pathlib.Path, "write_text", write_text)


def meet_at_commit(arrive: Callable[[], None], setattr: Callable[[Any, str, Any], None]) -> None:
    """Rank 0 calls ``arrive()`` (which waits for the other job) just before its commit rename,
    so that two jobs both plan, write and then race for the same id."""
    real = os.rename

    def rename(src, dst):
        if ".tmp-" in Path(src).name:
            arrive()
        return real(src, dst)

    setattr(writer.os, "rename", rename)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def loaded_value(directory: Path) -> tuple[float, list[float]]:
    def body():
        sd = {"x": np.zeros(16), "value": None}
        dcp.load(sd, checkpoint_id=directory / "ck")
        return sd["value"], sorted(set(sd["x"].tolist()))

    return local.run(body, 1)[0]


def one_verdict(outcomes: list[str], pattern: str) -> str:
    """Every rank saw the same outcome, matching ``pattern``; returns it."""
    assert len(set(outcomes)) == 1, outcomes
    assert re.search(pattern, outcomes[0]), outcomes[0]
    return outcomes[0]


# --------------------------------------------------------------------------- two jobs, one id
@pytest.mark.parametrize("op", OPS)
def test_two_local_jobs_racing_for_one_id_give_one_winner_and_one_verdict_each(op, tmp_path, monkeypatch):
    barrier = threading.Barrier(2, timeout=30)
    meet_at_commit(barrier.wait, monkeypatch.setattr)
    results: dict[float, list[str]] = {}

    def job(value):
        results[value] = local.run(outcome, 2, tmp_path, op, value, timeout=30)

    threads = [threading.Thread(target=job, args=(v,)) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [1.0, 2.0], results
    winners = [v for v, got in results.items() if got == ["committed", "committed"]]
    assert len(winners) == 1, results
    loser = 3.0 - winners[0]
    one_verdict(results[loser], rf"^CheckpointError: meshkit\.checkpoint: rank 0: committing '.*ck' failed: {LOST_RACE}")
    assert leftovers(tmp_path) == []
    assert loaded_value(tmp_path) == (winners[0], [winners[0]])


def test_two_meshkit_run_jobs_racing_for_one_id_give_one_winner_and_one_verdict_each(tmp_path):
    from conftest import launch
    procs: dict[str, Any] = {}

    def job(value):
        procs[value] = launch("mpi_checkpoint_contention.py", 2, str(tmp_path), "race", value, timeout=60,
                              check=False)

    threads = [threading.Thread(target=job, args=(v,)) for v in ("1", "2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    results = {float(v): _outcomes(proc)["save"] for v, proc in procs.items()}
    winners = [v for v, got in results.items() if got == ["committed", "committed"]]
    assert len(winners) == 1, (results, [p.stderr[-2000:] for p in procs.values()])
    one_verdict(results[3.0 - winners[0]], rf"^CheckpointError: .*rank 0: committing '.*ck' failed: {LOST_RACE}")
    assert leftovers(tmp_path) == []
    assert loaded_value(tmp_path) == (winners[0], [winners[0]])


def _outcomes(proc) -> dict[str, list[str]]:
    """``{op: each rank's outcome, in rank order}`` from a mpi_checkpoint_contention.py job."""
    found: dict[str, dict[int, str]] = {}
    for rank, op, text in re.findall(r"OUTCOME (\d+) (\S+) (.*)", proc.stdout):
        found.setdefault(op, {})[int(rank)] = text
    assert proc.returncode == 0 and all(sorted(got) == [0, 1] for got in found.values()), proc.stdout + proc.stderr
    return {op: [got[0], got[1]] for op, got in found.items()}


# --------------------------------------------------------------------------- a full disk, a raising or slow rank
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("full", [{0}, {1}, {0, 1}])
def test_a_full_disk_on_any_rank_gives_every_rank_enospc_and_leaves_nothing(full, op, tmp_path, monkeypatch):
    full_disk(full, monkeypatch.setattr)
    got = local.run(outcome, 2, tmp_path, op, 1.0, timeout=30)
    first = min(full)
    one_verdict(got, rf"^CheckpointError: meshkit\.checkpoint: rank {first}: writing '.*\.ck\.tmp-[0-9a-f]+' "
                     r"failed: \[Errno 28\] No space left on device")
    assert ("(and 1 more rank failed)" in got[0]) == (full == {0, 1})
    assert leftovers(tmp_path) == [] and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("full", ["1", "0,1"])
def test_a_full_disk_on_real_processes_gives_every_rank_enospc_and_leaves_nothing(full, tmp_path):
    from conftest import launch
    proc = launch("mpi_checkpoint_contention.py", 2, str(tmp_path), "enospc", full, timeout=60, check=False)
    got = _outcomes(proc)
    assert sorted(got) == sorted(OPS), proc.stdout
    for op in OPS:
        one_verdict(got[op], rf"^CheckpointError: .*rank {full[0]}: writing .* failed: \[Errno 28\] No space")
        assert leftovers(tmp_path / op) == [] and not (tmp_path / op / "ck").exists()


@pytest.mark.parametrize("op", OPS)
def test_a_rank_that_raises_while_writing_fails_the_save_on_every_rank_and_leaves_nothing(op, tmp_path, monkeypatch):
    real = writer.write_chunks

    def broken(directory, rank, chunks):
        if rank == 1:
            raise RuntimeError("a bug in a writer")
        return real(directory, rank, chunks)

    monkeypatch.setattr(writer, "write_chunks", broken)
    start = time.monotonic()
    got = local.run(outcome, 2, tmp_path, op, 1.0, timeout=20)
    one_verdict(got, r"^CheckpointError: meshkit\.checkpoint: rank 1: writing .* failed: RuntimeError: a bug in a writer$")
    assert time.monotonic() - start < 10  # told at once, not after the timeout
    assert leftovers(tmp_path) == [] and not (tmp_path / "ck").exists()


def test_a_rank_too_slow_to_write_fails_the_save_on_every_rank_and_leaves_nothing(tmp_path, monkeypatch):
    real = writer.write_chunks

    def slow(directory, rank, chunks):
        if rank == 1:
            time.sleep(2.0)
        return real(directory, rank, chunks)

    monkeypatch.setattr(writer, "write_chunks", slow)
    got = local.run(outcome, 2, tmp_path, "save", 1.0, timeout=0.5)
    one_verdict(got, r"^CheckpointError: meshkit\.checkpoint: rank 0: ranks \[1\] did not finish writing '.*ck' "
                     r"within 0\.5 s; nothing was committed$")
    assert leftovers(tmp_path) == [] and not (tmp_path / "ck").exists()


def test_a_save_after_a_failed_one_on_the_same_group_succeeds(tmp_path, monkeypatch):
    """The failed save's messages are all consumed: the next save of the group pairs its own."""
    real = writer.write_chunks
    fail = [True]

    def once(directory, rank, chunks):
        if fail[0] and rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(directory, rank, chunks)

    monkeypatch.setattr(writer, "write_chunks", once)

    def body():
        first = outcome(tmp_path / "a", "async_save", 1.0)
        meshkit.barrier()
        fail[0] = False
        return first, outcome(tmp_path / "b", "save", 2.0), outcome(tmp_path / "c", "async_save", 3.0)

    for first, second, third in local.run(body, 2):
        assert "No space left on device" in first and (second, third) == ("committed", "committed")
    assert loaded_value(tmp_path / "b") == (2.0, [2.0]) and loaded_value(tmp_path / "c") == (3.0, [3.0])
