"""The MPI world's notice channel: how a rank's :class:`~meshkit.comm.notices.Notice` reaches
the others (a call rejected, a rank leaving) while they may be blocked in a collective.

Apart from the engine because it is not a group's traffic: one mailbox serves every engine of
the world, over a communicator of its own (a duplicate of MPI_COMM_WORLD), so notices never
meet collective or user messages; engines only post, drain and flush it.

Notices, like every control message, travel as bytes in the typed format of
:mod:`~meshkit.comm.control`, never pickled (mpi4py's lowercase ``isend``/``recv`` would pickle):
:func:`receive` is how one comes off MPI, also for the engine's exchange (comm/engines/mpi.py).

Every notice sent is received before MPI_Finalize (:func:`settle_all`, at the interpreter's exit),
as MPI requires of a process that is the target of a send. Each rank leaves with a LEFT notice to
every other (comm/setup/lifecycle.py), which a rank leaving too never drained: MPICH's UCX netmod
(between nodes, and ``meshkit-run --simulate-nodes``) printed "UCX WARN unexpected tag-receive
descriptor ... was not matched" twice per rank at the end of every job. The mailbox counts what it
sends to and receives from each rank; at exit the ranks swap their counts (one all-to-all on the
mailbox's communicator: every rank finalizes, so every rank comes) and each receives what is still
due.
"""

from __future__ import annotations

import atexit
import threading
import time

import numpy as np
from mpi4py import MPI

from ..control import ControlMessageError, decode_notice, encode
from . import mpi_ulfm
from .mpi_polling import Poller, completes
from ..notices import Notice

__all__ = ["Mailbox", "receive", "settle_all", "SETTLE_SECONDS"]

#: Seconds a rank at exit waits for the others' counts and the notices still due. MPI_Finalize
#: waits for every rank anyway; this bounds a wait for a rank that never finalizes (one ended
#: without it, whose job its launcher is ending).
SETTLE_SECONDS = 30.0

#: ULFM's error classes for a dead peer (MPI_ERR_PROC_FAILED, MPI_ERR_PROC_FAILED_PENDING), where defined.
_DEAD_PEER = frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING")
                       if hasattr(MPI, name))


def receive(comm: MPI.Comm, source: int, tag: int, status: MPI.Status) -> bytearray | None:
    """The bytes of a message from ``source`` with ``tag`` that has arrived (its sender in
    ``status``), or None if none has. A matched probe (``Improbe``, then ``Mrecv`` of that very
    message into a buffer of its size), so another thread's receive can never take it between the
    two."""
    message = comm.Improbe(source, tag, status)
    if message is None:
        return None
    data = bytearray(status.Get_count(MPI.BYTE))
    message.Recv([data, MPI.BYTE])
    return data


class Mailbox:
    """The notice channel of a world: its own duplicate of MPI_COMM_WORLD, shared by every
    engine of the world, so notices never meet collective or user traffic."""

    _TAG = 7

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self._sent: list[MPI.Request] = []  # each holds its message's bytes until sent
        self._kept: list[Notice] = []  # notices drained beside a malformed one: returned at the next drain
        n = comm.Get_size()
        self._sent_to = np.zeros(n, np.int64)  # notices posted to each rank
        self._got_from = np.zeros(n, np.int64)  # notices received from each rank
        self._counting = threading.Lock()  # the caller and the progress agent may both drain
        _open.append(self)

    def post(self, ranks: list[int], notice: Notice) -> None:
        """Send ``notice`` to these global ranks without waiting (what was sent and has left is forgotten)."""
        self._sent = [r for r in self._sent if not r.Test()]
        data = encode(notice)
        self._sent += [self.comm.Isend([data, MPI.BYTE], dest=r, tag=self._TAG) for r in ranks]
        np.add.at(self._sent_to, list(ranks), 1)

    def drain(self) -> list[Notice]:
        """The notices that have arrived, in order of arrival. A message that is not a notice is a
        ControlMessageError naming its sender (the notices drained with it come at the next drain)."""
        got, self._kept = self._kept, []
        bad: ControlMessageError | None = None
        status = MPI.Status()
        while (data := self._receive(status)) is not None:
            try:
                got.append(decode_notice(data, what=f"rank {self.comm.Get_rank()}: the notice from rank "
                                                    f"{status.Get_source()}"))
            except ControlMessageError as exc:
                bad = bad or exc
        if bad is not None:
            self._kept = got
            raise bad
        return got

    def _receive(self, status: MPI.Status) -> bytearray | None:
        """:func:`receive` from any rank; under ``--survive``, without the dead (below)."""
        for _ in range(2):
            try:
                data = receive(self.comm, MPI.ANY_SOURCE, self._TAG, status)
                if data is not None:
                    with self._counting:
                        self._got_from[status.Get_source()] += 1
                return data
            except MPI.Exception as exc:
                if not mpi_ulfm.enabled() or exc.Get_error_class() not in _DEAD_PEER:
                    failed = mpi_ulfm.rank_failed(exc, self.comm, "reading the notices")  # revoked: recovery began
                    if failed is None:
                        raise
                    raise failed from None
                # Under --survive a dead rank fails every probe from any source (ULFM), also while this
                # rank waits in a call of a group the dead rank was not in (hybrid sharding's replicate
                # all-reduce, measured: a raw MPI error escaped it). The notices are not that call:
                # the failure is acknowledged, and probes go on from the living; the call itself
                # fails where it involves the dead, or is woken by a survivor's revoke.
                self.comm.Ack_failed()
        return None

    def drop(self) -> list[MPI.Request]:
        """Forget the notices not sent yet (a shrink: they may be to the dead); their requests are
        returned, to be kept, never freed (see :func:`meshkit.comm.engines.mpi_ulfm.keep`)."""
        sent, self._sent = self._sent, []
        if self in _open:  # revoked: it can no longer settle at exit
            _open.remove(self)
        return sent

    def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the notices sent have left."""
        deadline = time.monotonic() + timeout
        for request in self._sent:
            completes(request, deadline)
        self._sent = []

    def settle(self, deadline: float) -> bool:
        """Receive every notice the others sent here and are still due (their counts, swapped by one
        all-to-all), after this rank's own have left; False if that did not finish by ``deadline``."""
        for request in self._sent:
            if not completes(request, deadline):
                return False
        self._sent = []
        due = np.empty_like(self._sent_to)
        if not completes(self.comm.Ialltoall(self._sent_to, due), deadline):
            return False
        status, poller = MPI.Status(), None
        while (self._got_from < due).any():
            if self._receive(status) is None:  # counted where it arrives (the notices are of no use now)
                poller = poller or Poller(deadline)
                if not poller.pause():
                    return False
        return True


#: The mailboxes that may still hold notices due (a world's, until a shrink revokes it).
_open: list[Mailbox] = []


def settle_all(timeout: float | None = None) -> None:
    """Before MPI_Finalize: every open mailbox receives what is due to it (see the module
    docstring). In creation order, which every rank shares; best effort: an MPI error (a dead
    peer) or the deadline ends it, and MPI_Finalize follows either way."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    deadline = time.monotonic() + (SETTLE_SECONDS if timeout is None else timeout)
    for mailbox in list(_open):
        try:
            if not mailbox.settle(deadline):
                return
        except MPI.Exception:
            return


atexit.register(settle_all)  # after mpi4py's own (imported above): runs before MPI_Finalize, and after the
# LEFT notices of comm/setup/lifecycle.py's exit hook, registered later (at the first init_process_group)
