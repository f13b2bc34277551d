"""Sharded, resharding, crash-safe, checksummed checkpoints (torch.distributed.checkpoint's names).

``get_state_dict`` / ``set_state_dict`` give any strategy's model and optimizer state as views
of its own memory, with keys that do not depend on the strategy or the world size;
``save`` / ``async_save`` / ``load`` write and read them, each rank its own pieces, and
``CheckpointManager`` keeps numbered checkpoints. A checkpoint saved by any strategy at any
world size loads into any other. The format is in :mod:`meshkit.checkpoint.format`.

Modules: ``state_dict.py`` (``get_state_dict``/``set_state_dict``), ``leaves.py`` (flat keys and this
rank's boxes), ``plan.py`` (who writes which box), ``format.py`` (the files), ``blocks.py`` (checksum
blocks), ``writer.py`` (``save``, ``async_save``, the commit), ``reader.py`` (``load``), ``manager.py``
(``CheckpointManager``), ``cleanup.py`` (what a crashed save left), ``errors.py``.
"""

from .errors import CheckpointError
from .reader import load
from .manager import CheckpointManager
from .writer import async_save, save
from .state_dict import get_state_dict, set_state_dict

__all__ = ["save", "load", "async_save", "CheckpointManager", "CheckpointError", "get_state_dict", "set_state_dict"]
