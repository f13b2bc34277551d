"""Sharded state: the boxes of global arrays each rank holds, the currency of checkpoints.

A strategy (:mod:`meshkit.parallel`) describes its parameters and optimizer state as
:class:`ShardedArray` boxes and :class:`StepCount` step counts; a checkpoint
(:mod:`meshkit.checkpoint`) writes and reads those, whoever made them. The vocabulary lives in a
package of its own, below both, so that checkpoint's file I/O (writer, reader, plan, format,
blocks, leaves) imports no strategy: only ``checkpoint/state_dict.py``, the bridge that asks a
strategy for its state, knows ``parallel`` (``tests/test_structure.py`` checks). It is not in
``tensor`` because a step count is an optimizer's, and a box is any rank's piece of any array
(a flat shard's, a DTensor's), not a DTensor. It depends on ``comm`` alone (its error types).

``__all__`` is the user API (what ``get_state_dict`` returns holds these);
``meshkit.state._seams`` has what ``parallel`` and ``checkpoint`` share beyond it.

Modules: ``boxes.py`` (``ShardedArray``: each rank's boxes of a global array; ``StepCount``; box
arithmetic), ``_seams.py``.
"""

from .boxes import ShardedArray, StepCount

__all__ = ["ShardedArray", "StepCount"]
