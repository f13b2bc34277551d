"""The job's secret: one per job, handed to its ranks in the environment.

``meshkit-run`` and :func:`meshkit.spawn` make one secret per job (:func:`job_secret`: 64 hex
characters from :func:`secrets.token_hex`) and give it to every rank as ``MESHKIT_JOB_SECRET``;
the ranks' stores authenticate each other with it (``meshkit.comm.env.job_secret`` reads it), so
a process without it (another user's, anyone on the network) is refused. Every attempt of a
restarted job keeps the job's secret. A user who set ``MESHKIT_JOB_SECRET`` already (to join
processes started some other way) keeps theirs, if it is at least :data:`MIN_SECRET_CHARS`
printable ASCII characters without whitespace.

Where it travels: in the environment only, which ``mpiexec`` passes to every rank (hydra passes
the whole environment by default, ``srun`` with its default ``--export=ALL``), and which
``/proc/PID/environ`` shows to the same user (and root) alone; never on a command line, which
``/proc/PID/cmdline`` and ``ps`` show to every user of the host.

:func:`payload_digest` signs :func:`meshkit.spawn`'s payload with it (HMAC-SHA256, handed to the
ranks as :data:`SPAWN_DIGEST_ENV`): a rank unpickles the payload only if it is the file the job's
parent wrote (:mod:`meshkit.launch.spawn_rank`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Mapping

from ..launch_protocol import JOB_SECRET_ENV as PROTOCOL_JOB_SECRET_ENV
from .job import LaunchConfigError

__all__ = ["JOB_SECRET_ENV", "SPAWN_DIGEST_ENV", "MIN_SECRET_CHARS", "job_secret", "check_secret", "payload_digest"]

#: The secret's variable (:mod:`meshkit.launch_protocol`'s, which ``meshkit.comm.env`` reads too).
JOB_SECRET_ENV = PROTOCOL_JOB_SECRET_ENV
#: ``meshkit.spawn``'s HMAC-SHA256 of its payload, in hex, keyed by the job's secret.
SPAWN_DIGEST_ENV = "MESHKIT_SPAWN_DIGEST"
#: The shortest secret a user may set: 32 characters (the generated one has 64 hex characters,
#: 256 bits; 32 printable characters hold at least 128 bits only if chosen at random).
MIN_SECRET_CHARS = 32


def check_secret(value: str) -> str | None:
    """Why ``value`` is not a usable secret (never quoting it), or None."""
    if len(value) < MIN_SECRET_CHARS:
        return f"it has {len(value)} characters, fewer than {MIN_SECRET_CHARS}"
    bad = next((i for i, char in enumerate(value) if not "!" <= char <= "~"), None)
    if bad is not None:
        return f"its character {bad + 1} is whitespace or not printable ASCII"
    return None


def job_secret(environ: Mapping[str, str]) -> str:
    """The job's secret: ``environ``'s :data:`JOB_SECRET_ENV` where the user set one, else a new one.

    Raises:
        LaunchConfigError: the one set is not usable (too short, whitespace, not printable ASCII).
    """
    given = environ.get(JOB_SECRET_ENV)
    if given is None:
        return secrets.token_hex(32)
    problem = check_secret(given)
    if problem is not None:
        raise LaunchConfigError(
            f"meshkit.launch: {JOB_SECRET_ENV} is set but is not a usable secret: {problem}; it must be at least "
            f"{MIN_SECRET_CHARS} characters of printable ASCII without whitespace (unset it, and the launcher makes "
            "one for each job)")
    return given


def payload_digest(secret: str, payload: bytes) -> str:
    """HMAC-SHA256 of ``payload`` keyed by ``secret``, in hex."""
    return hmac.new(secret.encode("ascii"), payload, hashlib.sha256).hexdigest()
