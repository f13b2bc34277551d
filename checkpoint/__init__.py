"""Sharded, resharding, crash-safe, checksummed checkpoints (torch.distributed.checkpoint's names).

``get_state_dict`` / ``set_state_dict`` give any strategy's model and optimizer state as views
of its own memory, with keys that do not depend on the strategy or the world size;
``save`` / ``async_save`` / ``load`` write and read them, each rank its own pieces, and
``CheckpointManager`` keeps numbered checkpoints. A checkpoint saved by any strategy at any
world size loads into any other. The format is in :mod:`meshkit.checkpoint.format`.
"""

from .errors import CheckpointError
from .reader import load
from .manager import CheckpointManager
from .writer import async_save, save
from .state_dict import get_state_dict, set_state_dict

__all__ = ["save", "load", "async_save", "CheckpointManager", "CheckpointError", "get_state_dict", "set_state_dict"]
