"""How many ranks an attempt of an elastic ``meshkit-run`` job starts: ``-n MIN:MAX`` and slots.

``-n 4`` starts 4 ranks every time; ``-n 2:4`` starts as many as the slots allow, at most 4,
and at least 2 (else the job cannot go on). The slots are read again before every attempt, so
a restart after a host lost slots comes back smaller (torchrun's ``--nnodes MIN:MAX``, on
ranks rather than nodes):

* ``--slots S``: S slots on this host, fixed for the job;
* ``--hostfile FILE``: one host per line, ``host``, ``host:S`` (hydra's form) or ``host slots=S``
  (Open MPI's), ``#`` starting a comment; a host without a count has one slot. Re-read before
  each attempt: whoever manages the machines may shrink (or grow) it between attempts. A file
  naming hosts other than this one is handed to ``mpiexec -f`` with the counts of that attempt;
* neither: MAX slots.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from dataclasses import dataclass

__all__ = ["NprocRange", "parse_nproc", "Hosts", "read_hostfile", "available", "LOCAL_NAMES"]

_HOST_LINE = re.compile(r"(?P<host>[^\s:#]+)(?::(?P<colon>\S+)|\s+slots\s*=\s*(?P<slots>\S+))?")
#: Names that mean this host in a host file.
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class NprocRange:
    """``-n MIN:MAX`` (``-n N`` is ``N:N``)."""

    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.min != self.max

    def __str__(self) -> str:
        return str(self.max) if not self.elastic else f"{self.min}:{self.max}"


def parse_nproc(text: str) -> NprocRange:
    """The argparse type of ``-n``: ``N`` or ``MIN:MAX``, integers >= 1 with MIN <= MAX."""
    low, colon, high = text.partition(":")
    if not colon:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1 (or MIN:MAX), got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
        return NprocRange(value, value)
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with integers >= 1, got {text!r}") from None
    if lo < 1 or hi < 1:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with integers >= 1, got {text!r}")
    if lo > hi:
        raise argparse.ArgumentTypeError(f"MIN {lo} is larger than MAX {hi} in {text!r}; write MIN:MAX, "
                                         f"e.g. {hi}:{lo}")
    return NprocRange(lo, hi)


@dataclass(frozen=True)
class Hosts:
    """What a host file says: ``(host, slots)`` in order."""

    path: str
    entries: tuple[tuple[str, int], ...]

    @property
    def slots(self) -> int:
        return sum(n for _, n in self.entries)

    def remote(self) -> bool:
        """Whether it names a host other than this one."""
        here = {socket.gethostname(), socket.getfqdn(), os.uname().nodename, *LOCAL_NAMES}
        return any(host not in here for host, _ in self.entries)

    def hydra_lines(self) -> str:
        """The file in hydra's ``host:slots`` form (for ``mpiexec -f``)."""
        return "".join(f"{host}:{n}\n" for host, n in self.entries)


def read_hostfile(path: str) -> Hosts:
    """Parse ``path`` (module docstring). Raises ValueError naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read host file {path!r}: {exc.strerror or exc}") from None
    entries: list[tuple[str, int]] = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.fullmatch(line)
        count = None if match is None else match.group("colon") or match.group("slots")
        try:
            slots = 1 if match is not None and count is None else int(count or "")
        except ValueError:
            slots = -1
        if match is None or slots < 0:
            raise ValueError(f"host file {path!r}, line {number}: expected 'host', 'host:SLOTS' or 'host slots=SLOTS' "
                             f"with SLOTS an integer >= 0, got {raw.strip()!r}")
        entries.append((match.group("host"), slots))
    return Hosts(path, tuple(entries))


def available(nproc: NprocRange, *, slots: int | None, hostfile: str | None) -> tuple[int, str, Hosts | None]:
    """``(slots, where they come from, the host file read)`` for the next attempt.

    Raises:
        ValueError: the host file cannot be read or parsed.
    """
    if hostfile is not None:
        hosts = read_hostfile(hostfile)
        return hosts.slots, f"--hostfile {hostfile}", hosts
    if slots is not None:
        return slots, f"--slots {slots}", None
    return nproc.max, f"-n {nproc}", None
