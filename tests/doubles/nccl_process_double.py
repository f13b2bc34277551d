"""A stand-in NCCL communicator that crosses processes, for the nccl world started without MPI.

The strict double (``nccl_double.py``) keeps every rank's communicator in one process, so it
cannot serve an nccl world of N processes. :class:`ProcessRuntime` is that double's runtime
(device arrays, streams, events, device selection) with ``nccl`` replaced by a communicator whose
collectives exchange their data through a :class:`meshkit.FileStore` (``$MESHKIT_TEST_NCCL_FILE``)
and run synchronously, inside the enqueue: what it checks is the data each rank gets, not stream
order or NCCL's argument rules (the strict double checks those, in threads). Only what
``tests/test_init_methods.py`` uses: allReduce, reduce, broadcast, allGather, reduceScatter and
commSplit; point-to-point and grouped calls raise.
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any

import numpy as np

import meshkit
from . import nccl_double as double

__all__ = ["ProcessRuntime", "STORE_ENV"]

STORE_ENV = "MESHKIT_TEST_NCCL_FILE"


class ProcessCommunicator:
    """``NcclCommunicator(ndev, commId, rank)`` whose ranks may be processes."""

    def __init__(self, ndev: int, commId: Any, rank: int, config: Any = None) -> None:  # noqa: N803
        self._key, self._n, self._rank, self._calls = bytes(commId).hex()[:16], ndev, rank, 0
        self._store = meshkit.FileStore(os.environ[STORE_ENV])
        self._store.set_timeout(timedelta(seconds=30))
        self._exchange("init")  # ncclCommInitRank returns once every rank joined

    def _exchange(self, value: Any) -> list[Any]:
        base = f"{self._key}/{self._calls}"
        self._calls += 1
        self._store.set(f"{base}/{self._rank}", pickle.dumps(value))
        keys = [f"{base}/{r}" for r in range(self._n)]
        self._store.wait(keys)
        return [pickle.loads(self._store.get(k)) for k in keys]

    @staticmethod
    def _view(ptr: int, count: int, datatype: int) -> np.ndarray:
        return double._region(ptr, count, double._TYPES[datatype])

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        parts = self._exchange(self._view(sendbuf, count, datatype).copy())
        self._view(recvbuf, count, datatype)[...] = double._reduce(op, parts)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        parts = self._exchange(self._view(sendbuf, count, datatype).copy())
        if self._rank == root:
            self._view(recvbuf, count, datatype)[...] = double._reduce(op, parts)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        mine = self._view(sendbuff, count, datatype).copy() if self._rank == root else None
        self._view(recvbuff, count, datatype)[...] = self._exchange(mine)[root]

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        parts = self._exchange(self._view(sendbuf, count, datatype).copy())
        self._view(recvbuf, count * self._n, datatype)[...] = np.concatenate(parts)

    def reduceScatter(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                      stream: int) -> None:
        parts = self._exchange(self._view(sendbuf, count * self._n, datatype).copy())
        whole = double._reduce(op, parts)
        self._view(recvbuf, count, datatype)[...] = whole[self._rank * count:(self._rank + 1) * count]

    def send(self, *args: Any) -> None:
        raise NotImplementedError("the process double has no point-to-point (gather, scatter, all_to_all, send)")

    recv = send

    def commSplit(self, color: int, key: int, config: Any = None) -> ProcessCommunicator | None:  # noqa: N802
        parts = self._exchange((color, key, self._rank))
        if color == -1:
            return None
        members = sorted((k, r) for c, k, r in parts if c == color)
        comm_id = f"{self._key}.{self._calls}.{color}".encode()
        return ProcessCommunicator(len(members), comm_id, [r for _, r in members].index(self._rank))

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._n

    def check_async_error(self) -> None:
        pass

    def destroy(self) -> None:
        self._store.close()

    abort = destroy


class _ProcessNccl:
    """``cupy.cuda.nccl`` with :class:`ProcessCommunicator`; the real constants."""

    NcclCommunicator = ProcessCommunicator
    NcclError = double.FakeNcclError
    available = True

    def __init__(self) -> None:
        for name, value in double.CONSTANTS.items():
            setattr(self, name, value)

    @staticmethod
    def groupStart() -> None:  # noqa: N802
        raise NotImplementedError("the process double has no grouped calls")

    groupEnd = groupStart

    @staticmethod
    def get_unique_id() -> bytes:
        return os.urandom(16)

    @staticmethod
    def get_version() -> int:
        return 23203


class ProcessRuntime(double.FakeRuntime):
    """The strict double's runtime with a communicator that crosses processes."""

    nccl = _ProcessNccl()
