"""Module-level collectives with torch.distributed's names and signatures.

Each takes ``group=None`` (the world) and ``async_op=False``; with ``async_op=True`` it returns
a :class:`~meshkit.comm.groups.work.Work`. As in torch, ``src``/``dst`` are *global* ranks and
``group_src``/``group_dst`` are ranks within ``group``; pass one of the two.

Per-rank example (world of 4, ``dp = new_group([0, 2])``)::

    x = np.array([float(get_rank())])
    all_reduce(x, group=dp)          # ranks 0 and 2: x == [2.]; ranks 1, 3 must not call it
    broadcast(x, src=2, group=dp)    # src is global rank 2 (group rank 1)
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Callable, Sequence, cast

import numpy as np

from .checks import where
from .engines.engine import Coalesces
from .errors import DistTypeError, DistValueError
from .groups.group import ProcessGroup
from .reduce_op import ReduceOp
from .groups.work import Work
from .setup.registry import resolve_group
from .groups.world import current_world

__all__ = [
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv",
]


def _group_rank(g: ProcessGroup, op: str, arg: str, global_rank: int | None, group_rank: int | None) -> int:
    """Resolve torch's (``src``, ``group_src``) pair to a group rank."""
    if group_rank is not None:
        if global_rank is not None:
            raise DistValueError(f"{where(op, g)}: pass either {arg} or group_{arg}, not both")
        return group_rank
    if global_rank is None:
        raise DistValueError(f"{where(op, g)}: {arg} (a global rank) or group_{arg} (a rank in the group) "
                             "is required")
    if isinstance(global_rank, bool) or not isinstance(global_rank, (int, np.integer)):
        raise DistTypeError(f"{where(op, g)}: {arg} must be an int rank, got {global_rank!r}")
    index = g._group_rank_of.get(int(global_rank))
    if index is None:
        raise DistValueError(f"{where(op, g)}: {arg}={global_rank} is not a rank of group {g.name} "
                             f"(global ranks {list(g.ranks)}); {arg} is a global rank, group_{arg} a rank "
                             "within the group")
    return index


def _outputs(work: Work | None, outputs: list) -> Work | None:
    """``work`` (None for a synchronous call) naming the call's output arrays: its future's value,
    as torch's (``[tensor]`` for an all-reduce, ``[output_tensor_list]`` for an all-gather)."""
    return None if work is None else work._with_outputs(outputs)


def all_reduce(tensor: np.ndarray, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group in place on every rank.

    Example (3 ranks): rank r holds ``[r, 1]``; after ``all_reduce(x)`` every rank holds
    ``[3, 3]``; with ``op=ReduceOp.MAX``, ``[2, 1]``.
    """
    return _outputs((current_world().default_group if group is None else resolve_group(group)).all_reduce(
        tensor, op, async_op=async_op), [tensor])


def reduce(tensor: np.ndarray, dst: int | None = None, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` across the group into ``dst``'s ``tensor`` (others keep theirs)."""
    g = resolve_group(group)
    return _outputs(g.reduce(tensor, _group_rank(g, "reduce", "dst", dst, group_dst), op, async_op=async_op), [tensor])


def broadcast(tensor: np.ndarray, src: int | None = None, group: ProcessGroup | None = None,
              async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Copy ``src``'s ``tensor`` into every rank's ``tensor``."""
    g = resolve_group(group)
    return _outputs(g.broadcast(tensor, _group_rank(g, "broadcast", "src", src, group_src), async_op=async_op),
                    [tensor])


def all_gather(tensor_list: list[np.ndarray], tensor: np.ndarray, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Every rank receives every rank's ``tensor``: ``tensor_list[r]`` is rank r's.

    Example (2 ranks): rank r passes ``tensor = [r]``; both get ``tensor_list == [[0], [1]]``.
    """
    return _outputs(resolve_group(group).all_gather(tensor_list, tensor, async_op=async_op), [tensor_list])


def all_gather_into_tensor(output_tensor: np.ndarray, input_tensor: np.ndarray,
                           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Concatenate every rank's ``input_tensor`` (in rank order) into ``output_tensor``."""
    return _outputs(resolve_group(group).all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op),
                    [output_tensor])


def gather(tensor: np.ndarray, gather_list: list[np.ndarray] | None = None, dst: int | None = None,
           group: ProcessGroup | None = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on ``dst`` (None elsewhere)."""
    g = resolve_group(group)
    return _outputs(g.gather(tensor, gather_list, _group_rank(g, "gather", "dst", dst, group_dst), async_op=async_op),
                    [gather_list] if gather_list is not None else [])


def scatter(tensor: np.ndarray, scatter_list: list[np.ndarray] | None = None, src: int | None = None,
            group: ProcessGroup | None = None, async_op: bool = False, group_src: int | None = None) -> Work | None:
    """``src`` sends ``scatter_list[r]`` to rank r's ``tensor``."""
    g = resolve_group(group)
    return _outputs(g.scatter(tensor, scatter_list, _group_rank(g, "scatter", "src", src, group_src),
                              async_op=async_op), [tensor])


def reduce_scatter(output: np.ndarray, input_list: list[np.ndarray], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank r receives the reduction of every rank's ``input_list[r]``."""
    return _outputs(resolve_group(group).reduce_scatter(output, input_list, op, async_op=async_op), [output])


def reduce_scatter_tensor(output: np.ndarray, input: np.ndarray, op: ReduceOp = ReduceOp.SUM,
                          group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce ``input`` across ranks; rank r receives chunk r (``input`` has size x output's).

    Example (2 ranks): rank r passes ``input = [r, 10 * r]``; rank 0 gets ``[1]``, rank 1 ``[10]``.
    """
    return _outputs(resolve_group(group).reduce_scatter_tensor(output, input, op, async_op=async_op), [output])


def all_to_all(output_tensor_list: list[np.ndarray], input_tensor_list: list[np.ndarray],
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank i's ``input_tensor_list[j]`` arrives in rank j's ``output_tensor_list[i]``."""
    return _outputs(resolve_group(group).all_to_all(output_tensor_list, input_tensor_list, async_op=async_op),
                    output_tensor_list)


def all_to_all_single(output: np.ndarray, input: np.ndarray, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Work | None:
    """Split ``input`` along dim 0 (equal parts or ``input_split_sizes``); part j goes to rank j."""
    return _outputs(resolve_group(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                           async_op=async_op), [output])


def barrier(group: ProcessGroup | None = None, async_op: bool = False,
            device_ids: Sequence[int] | None = None) -> Work | None:
    """Wait until every rank of the group arrives.

    ``device_ids``: as torch's, a list of one int, this rank's GPU (its index among the GPUs the
    process sees). On ``nccl`` it must be the group's device (an error otherwise: a barrier
    on another GPU than the collectives' would order nothing); on ``mpi`` and ``local``, which
    run on the host, it is checked and ignored, so code written for torch's NCCL runs unchanged.
    """
    g = resolve_group(group)
    if device_ids is not None:
        _check_device_ids(g, device_ids)
    return _outputs(g.barrier(async_op=async_op), [])


def _check_device_ids(g: ProcessGroup, device_ids: object) -> None:
    op = "barrier"
    ok = (isinstance(device_ids, (list, tuple)) and len(device_ids) == 1 and isinstance(device_ids[0], int)
          and not isinstance(device_ids[0], bool) and device_ids[0] >= 0)
    if not ok:
        error = DistTypeError if not isinstance(device_ids, (list, tuple)) else DistValueError
        raise error(f"{where(op, g)}: device_ids must be a list of one GPU index of this rank (as torch's, e.g. "
                    f"[local_rank]), got {device_ids!r}")
    device = g.engine.device if g.backend == "nccl" and g.rank >= 0 else None
    if device is not None and device_ids[0] != device:
        raise DistValueError(f"{where(op, g)}: device_ids={list(device_ids)} is not this rank's GPU in group "
                             f"{g.name}: its collectives run on device {device}; pass device_ids=[{device}] or "
                             "leave device_ids out")


def monitored_barrier(group: ProcessGroup | None = None, timeout: float | datetime.timedelta | None = None,
                      wait_all_ranks: bool = True) -> None:
    """A barrier whose timeout (seconds, or a ``timedelta`` as torch's; None: the group's) names
    every rank that did not arrive.

    ``wait_all_ranks`` is accepted for torch compatibility; meshkit always names all of them.
    """
    resolve_group(group).monitored_barrier(timeout)


def isend(tensor: np.ndarray, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work:
    """Start sending ``tensor`` to ``dst``; wait on the Work before reusing ``tensor``."""
    g = resolve_group(group)
    return _outputs(g.isend(tensor, _group_rank(g, "isend", "dst", dst, group_dst), tag), [tensor])


def irecv(tensor: np.ndarray, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_src: int | None = None) -> Work:
    """Start receiving into ``tensor`` from ``src`` (None and no ``group_src``: any rank)."""
    g = resolve_group(group)
    peer = None if src is None and group_src is None else _group_rank(g, "irecv", "src", src, group_src)
    return _outputs(g.irecv(tensor, peer, tag), [tensor])


def send(tensor: np.ndarray, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst``; returns when ``tensor`` may be reused.

    A blocking send to this rank itself could never complete (nothing would post the
    receive) and is rejected, as torch does; use ``isend`` and ``irecv`` for that.
    """
    g = resolve_group(group)
    peer = _group_rank(g, "send", "dst", dst, group_dst)
    if peer == g.rank:
        raise DistValueError(f"{where('send', g)}: a blocking send to this rank itself (global rank "
                             f"{g.global_rank}) can never complete; use isend and irecv to send to yourself")
    g.isend(tensor, peer, tag).wait()


def recv(tensor: np.ndarray, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` (None: any rank); returns the sender's global rank.

    The message must have ``tensor``'s number of elements: anything else raises
    ``DistValueError`` naming both sizes, and ``tensor`` is not written.
    """
    g = resolve_group(group)
    if (src is not None or group_src is not None) and _group_rank(g, "recv", "src", src, group_src) == g.rank:
        raise DistValueError(f"{where('recv', g)}: a blocking recv from this rank itself (global rank "
                             f"{g.global_rank}) can never complete; use isend and irecv to send to yourself")
    work = irecv(tensor, src, group, tag, group_src)
    work.wait()
    return work.result()


@dataclasses.dataclass
class P2POp:
    """One operation of :func:`batch_isend_irecv`: ``P2POp(isend, x, peer)``, as in torch."""

    op: Callable[..., Work]
    tensor: np.ndarray
    peer: int | None = None
    group: ProcessGroup | None = None
    tag: int = 0
    group_peer: int | None = None

    def __post_init__(self) -> None:
        if self.op not in (isend, irecv):
            raise DistTypeError(f"meshkit.comm: P2POp.op must be meshkit.isend or meshkit.irecv, got {self.op!r}")
        if self.peer is None and self.group_peer is None:
            raise DistValueError("meshkit.comm: P2POp needs peer (a global rank) or group_peer")


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Post every send and receive of the list at once; return one Work per op, in order.

    All ops are posted before any is waited on, so exchanges such as a ring shift cannot
    deadlock whatever the message sizes.
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise DistTypeError("meshkit.comm: batch_isend_irecv takes a list of P2POp")
    # Engines that match sends and receives in order (NCCL) post the whole list as one group.
    engines = {id(e): e for e in (resolve_group(p.group).engine for p in p2p_op_list)
               if e.capabilities.coalesces}
    for engine in engines.values():
        cast(Coalesces, engine).start_coalescing()
    try:
        return [p.op(p.tensor, p.peer, p.group, p.tag, p.group_peer) for p in p2p_op_list]
    finally:
        for engine in engines.values():
            cast(Coalesces, engine).end_coalescing()
