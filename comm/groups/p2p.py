"""Point-to-point: ``ProcessGroup.isend``/``irecv`` and the Work of a send or receive.

A send or receive is not numbered (its ``seq`` is -1: the two ranks of a message pair it by
tag, not by program order) and is never queued behind the group's collectives; it is checked,
recorded in the flight recorder, posted with one engine call and returned as a
:class:`P2PWork`, whose timeout names the peer that did not take part. In detail mode
(``MESHKIT_DEBUG=detail``) a host message carries a header with its dtype and size, checked by
the receiver, where the engine does not report them itself (MPI moves bytes).

``ProcessGroup.isend``/``irecv`` call :func:`isend`/:func:`irecv` here with the group; they use
its public identity, its engine and its held parts (``queue``, ``failures``).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import numpy as np

from ..arrays import is_device_array
from ..checks import check_array, check_member, check_root, where
from ..debug import ERROR, STATE, T_END, CollectiveRecord
from ..engines.engine import DeadlineExceeded, Request
from ..errors import CollectiveTimeout, DistTypeError, DistValueError
from .work import RequestWork, Work

__all__ = ["isend", "irecv", "P2PWork"]


def _headers(group: Any) -> bool:
    """Detail mode: point-to-point host messages carry a header, where the engine does not already
    report the sender's dtype (MPI moves bytes; the local engine hands over the array)."""
    return group.queue.detail and not group.engine.capabilities.reports_dtype


def isend(group: Any, tensor: np.ndarray, dst: int, tag: int = 0) -> Work:
    """``group.isend``: start sending ``tensor`` to group rank ``dst``; the Work completes when it may be reused."""
    check_member(group, "isend")
    if group.failures.reason is not None:  # a broken group's traffic fails on every member
        group.failures.unusable("isend")
    check_array(group, "isend", "tensor", tensor, writable=False)
    dst = check_root(group, "isend", "dst", dst)
    _check_tag(group, "isend", tag)
    what = f"send to rank {group.ranks[dst]} tag {tag}"
    record = group.queue.flight_entry(-1, group.name, "send", (tensor.shape,), tensor.dtype, "started")
    if _headers(group) and not is_device_array(tensor):
        # A host message carries its dtype and size, checked by the receiver (device messages
        # go over NCCL, which checks counts itself).
        staged = _with_header(tensor)
        keep = functools.partial(_keep_alive, staged)  # the Work holds the staged buffer until sent
        return _p2p_work(group, what, group.engine.send(staged, dst, tag), record, dst, keep)
    request = group.engine.send(tensor, dst, tag)
    return _p2p_work(group, what, request, record, dst, None)


def irecv(group: Any, tensor: np.ndarray, src: int | None = None, tag: int = 0) -> Work:
    """``group.irecv``: start receiving into ``tensor`` from group rank ``src`` (None: any rank).

    ``Work.result()`` is the sender's global rank once the Work completed. A message of
    another size (or, on the local engine, dtype) than ``tensor`` is an error raised by ``wait``
    (on MPI a shorter message has been written into the start of ``tensor`` by then).
    """
    check_member(group, "irecv")
    if group.failures.reason is not None:  # a broken group's traffic fails on every member
        group.failures.unusable("irecv")
    check_array(group, "irecv", "tensor", tensor)
    if src is not None:
        src = check_root(group, "irecv", "src", src)
    _check_tag(group, "irecv", tag)
    peer = "any rank" if src is None else f"rank {group.ranks[src]}"
    record = group.queue.flight_entry(-1, group.name, "recv", (tensor.shape,), tensor.dtype, "started")
    staged = (np.empty(_HEADER + tensor.nbytes, np.uint8)
              if _headers(group) and not is_device_array(tensor) else None)
    request = group.engine.recv(tensor if staged is None else staged, src, tag)

    def epilogue() -> int:
        count, source = request.count, request.source
        dtype = request.dtype  # None where the engine does not know the sender's dtype (engine.Received)
        if staged is not None:
            dtype, count = _read_header(staged, count)
            if dtype == tensor.dtype and count == tensor.size:
                tensor.reshape(-1).view(np.uint8)[...] = staged[_HEADER:]
        if dtype is not None and dtype != tensor.dtype:
            raise DistTypeError(f"{where('recv', group)}: recv buffer has dtype {tensor.dtype} but the message "
                                f"from group rank {source} has dtype {dtype}; receive into a buffer of the "
                                "dtype that was sent")
        if count != tensor.size:
            got = ("more elements than fit" if count < 0 else f"{count}" if isinstance(count, int) else
                   f"{count:g} (its bytes do not divide into {tensor.dtype} elements)")
            raise DistValueError(f"{where('recv', group)}: recv buffer has {tensor.size} elements but the "
                                 f"message from group rank {source} has {got}; receive into a buffer of the "
                                 "size that was sent")
        return group.ranks[source]

    return _p2p_work(group, f"recv from {peer} tag {tag}", request, record, src, epilogue)


def _p2p_work(group: Any, what: str, request: Request, record: CollectiveRecord, peer: int | None,
              epilogue: Callable[[], Any] | None) -> Work:
    queue = group.queue
    work = P2PWork(queue, what, -1, record, request, epilogue, group.timeout)
    work.peer = peer
    if queue.tracks:
        group.world.progress.track(work)
    if work.watched():
        group.world.progress.watchdog(work)
    return work


def _check_tag(group: Any, op: str, tag: int) -> None:
    if not isinstance(tag, (int, np.integer)) or not 0 <= tag <= group.max_tag:
        raise DistValueError(f"{where(op, group)}: tag={tag!r} is out of range (valid: 0..{group.max_tag})")


class P2PWork(RequestWork):
    """Work of a send or receive; a timeout names the peer that did not take part."""

    __slots__ = ("peer",)

    def _fail(self, exc: BaseException) -> BaseException:
        group, record = self._owner_queue.group, self._record
        record[T_END] = time.time()
        if not isinstance(exc, DeadlineExceeded):
            exc = group.failures.engine_error(exc, f"{self._op} on group {group.name}", self._request)  # --survive
            record[STATE], record[ERROR] = "failed", repr(exc)
            return exc
        record[STATE] = "timed_out"
        who = "any rank" if self.peer is None else f"rank {group.ranks[self.peer]}"
        side = "post a matching send" if self._op.startswith("recv") else "receive it"
        return CollectiveTimeout(
            f"meshkit.comm: rank {group.global_rank}: {self._op} on group {group.name} did not complete "
            f"within {group.timeout:.1f} s: {who} did not {side}", op=self._op.split()[0], group=group.name,
            missing=None if self.peer is None else [group.ranks[self.peer]])

    @property
    def _what(self) -> str:
        return self._op


#: Bytes before a point-to-point message's data in detail mode: its dtype (numpy's ``dtype.str``,
#: padded) and its element count, so that the receiver checks both (MPI carries neither).
_HEADER = 24


def _with_header(tensor: np.ndarray) -> np.ndarray:
    staged = np.empty(_HEADER + tensor.nbytes, np.uint8)
    staged[:16] = np.frombuffer(tensor.dtype.str.encode().ljust(16), np.uint8)
    staged[16:24] = np.array([tensor.size], np.int64).view(np.uint8)
    staged[_HEADER:] = tensor.reshape(-1).view(np.uint8)
    return staged


def _read_header(staged: np.ndarray, count: Any) -> tuple[np.dtype | None, Any]:
    """``(dtype, elements)`` a detail-mode message announced; its count as received if it did not fit."""
    if not isinstance(count, int) or count < _HEADER:
        return None, -1 if count == -1 else count
    return np.dtype(bytes(staged[:16]).decode().strip()), int(staged[16:24].view(np.int64)[0])


def _keep_alive(buffer: np.ndarray) -> None:
    """Epilogue that only refers to ``buffer``, so that it outlives the operation reading it."""
