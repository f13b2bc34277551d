"""The MPI world's notice channel: how a rank's :class:`~meshkit.comm.notices.Notice` reaches
the others (a call rejected, a rank leaving) while they may be blocked in a collective.

Apart from the engine because it is not a group's traffic: one mailbox serves every engine of
the world, over a communicator of its own (a duplicate of MPI_COMM_WORLD), so notices never
meet collective or user messages; engines only post, drain and flush it.
"""

from __future__ import annotations

import time

from mpi4py import MPI

from .mpi_polling import completes
from .notices import Notice

__all__ = ["Mailbox"]


class Mailbox:
    """The notice channel of a world: its own duplicate of MPI_COMM_WORLD, shared by every
    engine of the world, so notices never meet collective or user traffic."""

    _TAG = 7

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self._sent: list[MPI.Request] = []

    def post(self, ranks: list[int], notice: Notice) -> None:
        """Send ``notice`` to these global ranks without waiting (what was sent and has left is forgotten)."""
        self._sent = [r for r in self._sent if not r.Test()]
        self._sent += [self.comm.isend(notice, dest=r, tag=self._TAG) for r in ranks]

    def drain(self) -> list[Notice]:
        """The notices that have arrived, in order of arrival."""
        got = []
        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=self._TAG, status=status):
            got.append(self.comm.recv(source=status.Get_source(), tag=self._TAG))
        return got

    def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the notices sent have left."""
        deadline = time.monotonic() + timeout
        for request in self._sent:
            completes(request, deadline)
        self._sent = []
