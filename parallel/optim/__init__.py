"""Optimizers, as ``torch.optim``: elementwise updates of whole parameters or of any flat shard of them.

:mod:`.optimizers` holds :class:`SGD` and :class:`AdamW` (state per parameter name, so ZeRO and
FSDP step their shards with the same code); :mod:`.clip` holds :func:`clip_grad_norm_` (over
arrays, DTensors and the sharded strategies' pieces).

Modules: ``optimizers.py`` (``SGD``, ``AdamW``), ``clip.py`` (``clip_grad_norm_``).
"""

from .clip import clip_grad_norm_
from .optimizers import SGD, AdamW, Optimizer

__all__ = ["SGD", "AdamW", "Optimizer", "clip_grad_norm_"]
