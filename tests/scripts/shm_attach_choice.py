"""Which way ordinary buffers move (comm/engines/shm.py): each rank prints the measured cost of the
kernel's copy between processes over a user-space copy, and the size up to which ordinary buffers
copy through the segment; then a 4 MiB and a 40 MiB all_reduce of float64, checked exactly."""

import numpy as np

import meshkit
from meshkit.comm._seams import current_world

meshkit.init_process_group("mpi")
rank, n = meshkit.get_rank(), meshkit.get_world_size()
channel = current_world().default_group.engine.channel
ratio = "none" if channel.attach_ratio is None else f"{channel.attach_ratio:.6f}"
for count in (1 << 19, 5 << 20):  # 4 MiB (under ATTACH_LARGE_BYTES) and 40 MiB (over it)
    x = np.arange(count, dtype=np.float64) * (rank + 1)
    meshkit.all_reduce(x)
    assert np.array_equal(x, np.arange(count, dtype=np.float64) * (n * (n + 1) // 2)), (rank, count)
    path = meshkit.flight_record()[-1]["path"]
    print(f"rank {rank}: {count * 8} bytes by {path}")
print(f"rank {rank}: attach {'on' if channel.direct is not None else 'off'} ratio {ratio} "
      f"segment up to {channel.attach_above}")
meshkit.destroy_process_group()
