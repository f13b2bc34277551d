"""Context parallelism: attention over a sequence sharded across the ranks of a ``cp`` group.

:mod:`.sequence` says which tokens each rank holds (contiguous, or head-tail balanced for causal
attention) and shards and unshards; :mod:`.attention` is the local blockwise math (a block's
forward with its log-sum-exp, the exact merge, FlashAttention-2's backward); :mod:`.ring` passes
K/V blocks around the ring (:func:`ring_attention`), :mod:`.ulysses` trades sequence sharding for
head sharding with two all-to-alls (:func:`ulysses_attention`); :mod:`.arguments` checks every
rank's arguments on every rank first.

Modules: ``attention.py`` (the local math: attention on one block of keys, its merge, its
backward), ``ring.py`` (ring attention: K/V blocks travel around the ring), ``ulysses.py`` (all-to-all:
the sequence sharding traded for a head sharding), ``sequence.py`` (which tokens each rank holds),
``arguments.py`` (every rank checks every rank's q, k, v; what a forward saves for its backward).
"""

from .ring import RingAttentionContext, ring_attention, ring_attention_backward
from .ulysses import UlyssesContext, ulysses_attention, ulysses_attention_backward
from .sequence import SequenceSharding, sequence_positions, shard_sequence, unshard_sequence

__all__ = ["ring_attention", "ring_attention_backward", "RingAttentionContext", "ulysses_attention",
           "ulysses_attention_backward", "UlyssesContext", "SequenceSharding",
           "shard_sequence", "unshard_sequence", "sequence_positions"]
