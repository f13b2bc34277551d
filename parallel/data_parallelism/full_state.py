"""Full state dicts of sharded strategies: gathered from flat shards, checked, loaded into them.

A full state dict is per parameter name and independent of the world size, in the one shape
of every state dict (:mod:`meshkit.parallel.strategy`)::

    {"model": {name: array},
     "optim": {"state": {name: {key: array shaped as the parameter}}, "step": {name: int}, "hyper": {...}}}

``state_dict()`` has the same keys (without ``"hyper"``, the optimizer's settings, which a load
may leave out), with this rank's pieces instead of full arrays: a full state dict loads into any
strategy's ``state_dict()`` (a checkpoint of one loads into the other, both ways).

Its arrays are NumPy arrays on every rank, whatever the model's library (a CuPy model's are
copied to the host, ``.get()``), and DTensor parameters give their global arrays: a full state
dict is what a user saves with ``np.savez`` or compares with a single-process run, the same on
every rank. It is a :class:`FullStateDict`: reading ``sd["params"]`` or ``sd["optimizer"]``, the
keys of earlier releases, still works for one release and warns (``DeprecationWarning`` naming
``"model"``, ``"optim"``); :func:`current_shape` lets a load take such a dict too (0.2's
``{"params", "optim"}`` included), warning alike.

Loading is strict by default: every parameter and, once the optimizer has stepped, the state
and step count of every parameter must be there, with the model's names and sizes and the
optimizer's hyperparameter and state keys; hyperparameters go through the optimizer's own
validation. ``strict=False`` is the explicit opt-out: what is missing keeps its current value
and unknown entries are ignored (sizes and hyperparameter values are still checked). Either way
a load is all or nothing on every rank: every rank checks its state dict and a digest of it,
and one exchange (:func:`meshkit.comm._seams.agree`) tells every rank whether some rank's is invalid or differs from
the others' (e.g. two checkpoint files), in which case all raise and nothing is loaded.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from ...comm import DistValueError, ProcessGroup
from ...comm._seams import agree, by_ranks
from ..arrays import array_namespace, is_array, to_host
from ..checks import where
from .dtensors import BlockLayout
from .flat import FlatLayout
from ..optim.optimizers import Optimizer
from .protocol import deprecated

__all__ = ["FullStateDict", "full_array", "gather_state_dict", "current_shape", "renamed_optimizer_key",
           "check_state_dict",
           "state_dict_digest", "agree_on_load", "load_state_dict_into"]

_TOP, _OPT = {"model", "optim"}, {"step", "state", "hyper"}
#: The keys of earlier releases -> today's: 0.1's "optimizer" (renamed "optim", get_state_dict's name),
#: 0.2's "params" (renamed "model", so that the full and the sharded state dicts are one shape).
_RENAMED = {"optimizer": "optim", "params": "model"}


class FullStateDict(dict):
    """``{"model": ..., "optim": ...}``, a dict whose ``["params"]`` and ``["optimizer"]`` (the
    keys of earlier releases) still read ``["model"]`` and ``["optim"]`` for one release, with a
    ``DeprecationWarning`` naming the new key.

    Only reading by those names is kept (``sd["params"]``, ``sd.get("params")``): iteration,
    ``in`` and copies see the real keys, so a copy written back loads as the new form.
    """

    def __getitem__(self, key: Any) -> Any:
        if key in _RENAMED and not dict.__contains__(self, key):
            deprecated(f'full_state_dict()["{key}"]', f'read full_state_dict()["{_RENAMED[key]}"]')
            key = _RENAMED[key]
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        if key in _RENAMED and not dict.__contains__(self, key):
            deprecated(f'full_state_dict().get("{key}")', f'read full_state_dict()["{_RENAMED[key]}"]')
            key = _RENAMED[key]
        return dict.get(self, key, default)


def full_array(value: Any, block: BlockLayout | None = None) -> np.ndarray:
    """``value`` as a new NumPy array of the whole parameter, never a view of ``value``: a DTensor
    parameter's block (``block`` its layout; collective over its mesh) gathered to the global
    array, a CuPy array copied to the host (``.get()``)."""
    host = to_host(block.wrap(value).full_tensor() if block is not None else value)
    if isinstance(value, np.ndarray) and np.may_share_memory(host, value):
        host = host.copy()  # the strategy's own memory (a full_tensor over Replicate is the block itself)
    return host


def current_shape(sd: Any, stacklevel: int = 4) -> Any:
    """``sd`` with the keys of earlier releases renamed (``"params"`` -> ``"model"``, ``"optimizer"``
    -> ``"optim"``), warning once per old key; else ``sd`` itself."""
    if not isinstance(sd, Mapping):
        return sd
    old = [k for k in _RENAMED if k in sd.keys() and _RENAMED[k] not in sd.keys()]
    for key in old:
        deprecated(f'a full state dict with the key "{key}"', f'name it "{_RENAMED[key]}", as full_state_dict() does',
                   stacklevel=stacklevel)
    return {_RENAMED[k] if k in old else k: v for k, v in sd.items()} if old else sd


#: 0.2's name of :func:`current_shape` (which renamed "optimizer" only).
renamed_optimizer_key = current_shape
_PREFIX = re.compile(r"^meshkit\.parallel: rank \d+: ")  # of the optimizer's own message, quoted in ours


def gather_state_dict(layouts: Sequence[FlatLayout], shards: dict[str, Any], optimizer: Optimizer,
                      group: ProcessGroup, blocks: Mapping[str, BlockLayout]) -> FullStateDict:
    """Full per-parameter state from every rank's flat shards, as NumPy arrays (collective over
    ``group``, and over the meshes of the DTensor parameters whose layouts are ``blocks``)."""
    params: dict[str, Any] = {}
    steps: dict[str, int] = {}
    state: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        for name, value in layout.views(layout.gather_full(shards[layout.key], group)).items():
            params[name] = full_array(value, blocks.get(name))
        for key, flat in sorted(optimizer.state.get(layout.key, {}).items()):
            for name, value in layout.views(layout.gather_full(flat, group)).items():
                state.setdefault(name, {})[key] = full_array(value, blocks.get(name))
        if layout.key in optimizer.steps:
            steps.update({name: optimizer.steps[layout.key] for name in layout.names})
    return FullStateDict(model=params, optim={"state": state, "step": steps, "hyper": dict(optimizer.hyper)})


def _keys(what: str, got: Any, expected: set[str], strict: bool, differ: str = "") -> str | None:
    """What is wrong with the keys of mapping ``got``: not a mapping, or (if strict) missing/extra keys."""
    if not isinstance(got, Mapping):
        return f"{what} must be a dict, got {type(got).__name__}"
    missing, extra = sorted(expected - set(got)), sorted(set(got) - expected)
    if strict and (missing or extra):
        differ = differ or f"keys differ from {sorted(expected)}"
        return f"{what}: {differ}: missing {missing}, unexpected {extra} (strict=True)"
    return None


def _hyper(optimizer: Optimizer, given: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer's hyperparameters with the known ones of ``given``, validated by the optimizer."""
    merged = {**optimizer.hyper, **{k: v for k, v in given.items() if k in optimizer._HYPER}}
    return optimizer._validated(**merged)


def check_state_dict(layouts: Sequence[FlatLayout], sd: Any, optimizer: Optimizer, strict: bool) -> str | None:
    """What is wrong with state dict ``sd`` for these layouts and this optimizer, or None (local)."""
    names = {n: (lay, i) for lay in layouts for i, n in enumerate(lay.names)}
    problem = _keys("the state dict", sd, _TOP, strict)
    if problem:
        return problem
    params = sd.get("model", {})
    problem = _keys("state_dict['model']", params, set(names), strict, "parameters differ from the model's")
    if problem:
        return problem
    for name, value in params.items():
        if name in names:
            lay, i = names[name]
            if not is_array(value) or value.dtype.kind not in "fciu":
                return f"state_dict['model'][{name!r}] must be a numeric array, got {type(value).__name__}"
            if tuple(value.shape) != lay.shapes[i]:
                return (f"state_dict['model'][{name!r}] has shape {tuple(value.shape)}, expected the model's "
                        f"{lay.shapes[i]}")
    if "optim" not in sd:
        return None
    opt = sd["optim"]
    # "hyper" may be left out (state_dict()'s shape: the optimizer keeps its settings)
    problem = _keys("state_dict['optim']", opt, _OPT if isinstance(opt, Mapping) and "hyper" in opt
                    else _OPT - {"hyper"}, strict)
    if problem:
        return problem
    hyper_given = opt.get("hyper", optimizer.hyper)
    problem = _keys("state_dict['optim']['hyper']", hyper_given, set(optimizer._HYPER), strict)
    if problem:
        return f"{problem}: a state dict of another optimizer than {type(optimizer).__name__}?"
    try:
        hyper = _hyper(optimizer, hyper_given)
    except (TypeError, ValueError) as exc:
        return f"state_dict['optim']['hyper'] is invalid: {_PREFIX.sub('', str(exc))}"
    steps, state = opt.get("step", {}), opt.get("state", {})
    for what, mapping in (("step", steps), ("state", state)):
        if not isinstance(mapping, Mapping):
            return f"state_dict['optim'][{what!r}] must be a dict keyed by parameter name, got {type(mapping).__name__}"
        extra = sorted(set(mapping) - set(names))
        if strict and extra:
            return f"state_dict['optim'][{what!r}] has unexpected parameters {extra} (strict=True)"
    for name, count in steps.items():
        if name in names and (isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer))
                              or count < 0):
            return f"state_dict['optim']['step'][{name!r}]={count!r} must be an int >= 0"
    keys = set(optimizer._state_keys(hyper))
    for name, st in state.items():
        if name not in names:
            continue
        problem = _keys(f"state_dict['optim']['state'][{name!r}]", st, keys, strict)
        if problem:
            return problem
        lay, i = names[name]
        for key, arr in st.items():
            if key in keys and (not is_array(arr) or arr.dtype.kind != "f" or arr.size != lay.size_of(i)):
                got = f"{arr.dtype} array of {arr.size} elements" if is_array(arr) else type(arr).__name__
                return (f"state_dict['optim']['state'][{name!r}][{key!r}] must be a floating-point array of "
                        f"{lay.size_of(i)} elements (the parameter's size), got {got}")
    if strict:
        with_state = {n for n, st in state.items() if st} if keys else set(steps)
        for what, have in (("step", set(steps)), ("state", with_state)):
            if have and have != set(names):
                return (f"state_dict['optim'][{what!r}] covers {sorted(have)} but not "
                        f"{sorted(set(names) - have)} (strict=True: all parameters or none)")
        if set(steps) != with_state:
            return (f"state_dict['optim'] has step counts for {len(steps)} parameters but state for "
                    f"{len(with_state)} (strict=True: both or neither)")
    for lay in layouts:
        counts = sorted({int(steps[n]) for n in lay.names if n in steps})
        if len(counts) > 1:
            return (f"state_dict['optim']['step'] has different counts {counts} for parameters of the flat "
                    f"shard {lay.key!r} ({list(lay.names)}), which share one count")
    return None


def state_dict_digest(sd: Any, strict: bool) -> str:
    """A short digest of a state dict's structure and values (CRC32 of each array's bytes)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(strict).encode())

    def feed(obj: Any) -> None:
        if isinstance(obj, Mapping):
            for key in sorted(obj, key=repr):
                h.update(repr(key).encode())
                feed(obj[key])
        elif is_array(obj):
            host = to_host(obj)  # explicit: a digest reads every byte (once per load, not per step)
            h.update(f"{host.dtype.str}{host.shape}".encode())
            h.update(zlib.crc32(np.ascontiguousarray(host)).to_bytes(4, "little"))
        else:
            h.update(repr(obj).encode())

    feed(sd)
    return h.hexdigest()


def agree_on_load(group: ProcessGroup, who: str, problem: str | None, digest: str | None) -> None:
    """Raise on every rank of ``group`` if some rank's state dict is invalid or differs (collective)."""
    def differ(g: ProcessGroup, digests: list[str]) -> str | None:
        if len(set(digests)) == 1:
            return None
        return (f"nothing was loaded; the state dicts differ across ranks: "
                f"{by_ranks(zip(g.ranks, digests), ' passed one with digest ')}; "
                "every rank must load the same state dict (the same checkpoint)")

    agree(group, digest, problem=problem, compare=differ,
          error=lambda message: DistValueError(f"{where(who, group)}: {message}"),
          invalid=lambda bad: (f"nothing was loaded; invalid state dict on {by_ranks(bad)}. Fix the state dict; "
                               "strict=False loads a partial one (what is missing keeps its current value)"))


def load_state_dict_into(layouts: Sequence[FlatLayout], sd: Mapping[str, Any], shards: dict[str, Any],
                         optimizer: Optimizer, shard: int, strict: bool) -> None:
    """Write this rank's shard of a checked full state dict into ``shards`` and the optimizer."""
    params = sd.get("model", {})
    for layout in layouts:
        layout.write_shard(shards[layout.key], shard, params)
    if "optim" not in sd:
        return
    opt = sd["optim"]
    hyper = _hyper(optimizer, opt.get("hyper", {}))
    keys = optimizer._state_keys(hyper)
    steps, state = opt.get("step", {}), opt.get("state", {})
    for layout in layouts:
        given = {n: state[n] for n in layout.names if state.get(n)}
        if keys and given:
            held = optimizer.state.get(layout.key, {})
            like = shards[layout.key]
            new = {}
            for key in keys:  # in place where held: a state dict's views of the arrays see the load
                arr = held[key] if key in held else array_namespace(like).zeros(layout.shard_size, like.dtype)
                layout.write_shard(arr, shard, {n: st[key] for n, st in given.items() if key in st})
                new[key] = arr
            optimizer.state[layout.key] = new
        elif strict:
            for arr in optimizer.state.get(layout.key, {}).values():
                arr[...] = 0  # no state given: zero state at step 0 (below) steps as none, and views stay valid
        counts = {int(steps[n]) for n in layout.names if n in steps}
        if counts:
            optimizer.steps[layout.key] = counts.pop()
        elif strict:
            optimizer.steps.pop(layout.key, None)
    for key, value in hyper.items():
        setattr(optimizer, key, value)
