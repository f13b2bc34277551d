"""Every rank must pass the same arguments to a mesh construction; `agree` checks it, collectively.

Building a mesh is collective: ranks that pass different meshes, shapes or dim names would build
groups that do not match, or, worse, the same groups under different names (rank 0's ``"dp"`` is
rank 3's ``"tp"``): a silently wrong mesh. `agree` compares every rank's validated arguments with
one small object all-gather (a digest each) over the group that builds, and raises on every rank,
naming what differs and which ranks passed what. A rank whose arguments were invalid sends its
error instead of a digest, so the others raise too rather than wait for it in the next collective.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..comm import DistValueError, ProcessGroup, all_gather_object
from . import errors

__all__ = ["agree"]

#: how a message calls several values of an argument ("ranks passed different meshes")
_PLURAL = {"mesh": "meshes", "mesh_shape": "mesh shapes", "device_type": "device types", "layout": "layouts",
           "name": "names", "pattern": "patterns"}


def _show(value: Any) -> str:
    return repr(value.tolist()) if isinstance(value, np.ndarray) else repr(value)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _by_value(values: dict[int, str]) -> dict[str, list[int]]:
    """Global ranks grouped by the value they sent, groups in order of their first rank."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(values):
        groups.setdefault(values[rank], []).append(rank)
    return groups


def agree(group: ProcessGroup, op: str, args: dict[str, Any] | None, error: Exception | None = None) -> None:
    """Raise on every rank of ``group`` unless every rank passed the same valid ``args``.

    Collective over ``group``: every member calls it, with its arguments or its error.

    Args:
        group: the group the construction is collective over.
        op: the function, for messages (``"init_device_mesh"``, ``"DeviceMesh.flatten"``).
        args: this rank's validated arguments, ``{argument name: value}``, in a canonical form
            (ints, strs, tuples, ndarrays) so that equal arguments print equal.
        error: this rank's validation error instead (``args`` is then ignored): a plain or
            meshkit error whose message has no prefix.

    Raises:
        DistValueError, DistTypeError (the converted ``error``): on a rank whose arguments were
            invalid. DistValueError naming those ranks and their errors: on the other ranks.
        MeshMismatchError: the ranks' arguments differ; the message names the arguments that
            differ and which ranks passed which value.

    Example (4 ranks; rank 3 passes ``mesh_dim_names=("tp", "dp")``, the others ``("dp", "tp")``),
    every rank raises::

        meshkit.mesh: rank 0: init_device_mesh: ranks passed different mesh_dim_names to
        init_device_mesh; it is collective, so every rank must pass the same: ranks [0, 1, 2]:
        mesh_dim_names ('dp', 'tp'); rank 3: mesh_dim_names ('tp', 'dp')
    """
    shown = {name: _show(value) for name, value in (args or {}).items()}
    if error is not None:
        mine: tuple[str, str] = ("error", str(error.args[0]) if error.args else str(error))
    else:
        mine = ("digest", hashlib.blake2b(repr(sorted(shown.items())).encode(), digest_size=16).hexdigest())
    everyone: list[Any] = [None] * group.size
    all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise errors.convert(op, error) from None
    failed = {group.ranks[i]: text for i, (kind, text) in enumerate(everyone) if kind == "error"}
    if failed:
        listing = "; ".join(f"{_ranks(ranks)}: {text}" for text, ranks in _by_value(failed).items())
        raise DistValueError(f"{errors.prefix(op)}{op} failed on other ranks ({listing}); it is collective, "
                             "so every rank raises")
    if len({digest for _, digest in everyone}) == 1:
        return
    calls: list[Any] = [None] * group.size  # every rank saw the digests differ: all take part
    all_gather_object(calls, shown, group=group)
    differing = [name for name in shown if len({c[name] for c in calls}) > 1]
    described = {group.ranks[i]: ", ".join(f"{name} {c[name]}" for name in differing) for i, c in enumerate(calls)}
    listing = "; ".join(f"{_ranks(ranks)}: {text}" for text, ranks in _by_value(described).items())
    labels = " and ".join(_PLURAL.get(name, name) for name in differing)
    raise errors.MeshMismatchError(f"{errors.prefix(op)}ranks passed different {labels} to {op}; it is collective, "
                                   f"so every rank must pass the same: {listing}", calls=described)
