"""Every rank must pass the same arguments to a mesh construction; `agree` checks it, collectively.

Building a mesh is collective: ranks that pass different meshes, shapes or dim names would build
groups that do not match, or, worse, the same groups under different names (rank 0's ``"dp"`` is
rank 3's ``"tp"``): a silently wrong mesh. `agree` compares every rank's validated arguments with
one small object all-gather (a digest each) over the group that builds (comm's one agreement,
:func:`meshkit.comm._seams.agree`; a second, of the values, only once they differ), and raises on every rank,
naming what differs and which ranks passed what. A rank whose arguments were invalid sends its
error instead of a digest, so the others raise too rather than wait for it in the next collective.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..comm import DistValueError, ProcessGroup
from ..comm._seams import agree as comm_agree, by_ranks
from . import errors

__all__ = ["agree"]

#: how a message calls several values of an argument ("ranks passed different meshes")
_PLURAL = {"mesh": "meshes", "mesh_shape": "mesh shapes", "device_type": "device types", "layout": "layouts",
           "name": "names", "pattern": "patterns"}


def _show(value: Any) -> str:
    return repr(value.tolist()) if isinstance(value, np.ndarray) else repr(value)


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
    digest = None if error is not None else \
        hashlib.blake2b(repr(sorted(shown.items())).encode(), digest_size=16).hexdigest()

    def differ(g: ProcessGroup, digests: list[str]) -> str | None:
        if len(set(digests)) == 1:
            return None
        described: dict[int, str] = {}

        def differences(g: ProcessGroup, calls: list[dict[str, str]]) -> str:
            differing = [name for name in shown if len({c[name] for c in calls}) > 1]
            described.update({g.ranks[i]: ", ".join(f"{name} {c[name]}" for name in differing)
                              for i, c in enumerate(calls)})
            labels = " and ".join(_PLURAL.get(name, name) for name in differing)
            return (f"ranks passed different {labels} to {op}; it is collective, so every rank must pass the same: "
                    f"{by_ranks(described.items())}")

        # every rank saw the digests differ: all take part in a second exchange, of the values, to name them
        comm_agree(g, shown, compare=differences,
                   error=lambda message: errors.MeshMismatchError(f"{errors.prefix(op)}{message}", calls=described))
        return None

    comm_agree(group, digest, problem=None if error is None else (str(error.args[0]) if error.args else str(error)),
               own=None if error is None else errors.convert(op, error), compare=differ,
               error=lambda message: DistValueError(f"{errors.prefix(op)}{message}"),
               invalid=lambda failed: f"{op} failed on other ranks ({by_ranks(failed)}); it is collective, so every "
                                      "rank raises")
