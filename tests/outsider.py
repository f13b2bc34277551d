"""Another local user, for the security tests: code run as user ``nobody`` through ``setpriv``.

An outsider knows what any local user can learn (ports, paths in /tmp, process lists) and not the
job's secret (``/proc/PID/environ`` is readable by the same user only). Its code runs with the
system's own Python and the standard library alone, as an attacker's would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

__all__ = ["OUTSIDER_UID", "can_run_as_outsider", "run_as_outsider"]

OUTSIDER_UID = 65534  # nobody


def _python() -> str:
    for candidate in ("/usr/bin/python3", sys.executable):
        if os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


def can_run_as_outsider() -> bool:
    """Whether this machine lets the tests run code as another user (root with setpriv)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    probe = subprocess.run(_command("import os; print(os.getuid())"), capture_output=True, text=True, timeout=30)
    return probe.returncode == 0 and probe.stdout.strip() == str(OUTSIDER_UID)


def _command(code: str, *args: str) -> list[str]:
    return ["setpriv", f"--reuid={OUTSIDER_UID}", f"--regid={OUTSIDER_UID}", "--clear-groups", _python(), "-c", code,
            *args]


def run_as_outsider(code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``code`` (with ``args`` in ``sys.argv[1:]``) as user nobody, in an environment that holds
    nothing of the job's (no secret); the caller checks :func:`can_run_as_outsider` first."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(_command(code, *args), capture_output=True, text=True, timeout=timeout, env=env, cwd="/")
