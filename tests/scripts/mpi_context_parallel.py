"""Ring and Ulysses attention on real processes (cp = the world): forward and backward equal full
attention in one process, causal and not, balanced and not, a sequence that does not divide by cp."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from context_parallel_cases import inputs, reference  # noqa: E402

import meshkit  # noqa: E402
from meshkit.parallel import (SequenceSharding, ring_attention, ring_attention_backward, shard_sequence,  # noqa: E402
                              ulysses_attention, ulysses_attention_backward)

meshkit.init_process_group("mpi", timeout=60)
r, cp = meshkit.get_rank(), meshkit.get_world_size()
shape = (2, 2 * cp, 6 * cp + 1, 4)  # 6 cp + 1 tokens: neither cp nor 2 cp divides them
q, k, v, dout = inputs(shape)
for forward, backward in ((ring_attention, ring_attention_backward), (ulysses_attention, ulysses_attention_backward)):
    for causal in (False, True):
        for balanced in (False, True):
            want = reference(q, k, v, dout, causal)
            mine = [shard_sequence(x, balanced=balanced) for x in (q, k, v, dout)]
            out, ctx = forward(*mine[:3], causal=causal, balanced=balanced)
            got = (out, *backward(ctx, mine[3]))
            sharding = SequenceSharding(shape[-2], cp, balanced)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                np.testing.assert_allclose(a, sharding.shard(b, r), rtol=0, atol=1e-12,
                                           err_msg=f"{forward.__name__} causal={causal} balanced={balanced} {name}")
meshkit.destroy_process_group()
print("context parallel OK", flush=True)
