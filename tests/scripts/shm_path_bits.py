"""The bits of ordinary all_reduces and reduce_scatters of 0.3-3 M float32/float64 elements, as a
digest per call: run once with each way of moving ordinary buffers (MESHKIT_SHM_CMA 0: the segment,
2: cross-memory attach), the digests must be equal, since the host's measurement picks the way."""

import hashlib

import numpy as np

import meshkit

meshkit.init_process_group("mpi")
r, n = meshkit.get_rank(), meshkit.get_world_size()
digests = []
for count in (300_001, 1 << 20, 3 << 20):
    for dtype in (np.float32, np.float64):
        x = np.random.default_rng(r * 7 + count).standard_normal(count).astype(dtype)
        meshkit.all_reduce(x)
        y = np.random.default_rng(r * 11 + count).standard_normal((n, count // 4)).astype(dtype)
        out = np.empty(count // 4, dtype)
        meshkit.reduce_scatter_tensor(out, y)
        digests += [hashlib.sha256(x.tobytes()).hexdigest()[:16], hashlib.sha256(out.tobytes()).hexdigest()[:16]]
        assert meshkit.flight_record()[-1]["path"] == "shm"
print(f"rank {r} digests {' '.join(digests)}")
meshkit.destroy_process_group()
