"""benchmarks/collectives.py --device cuda against the NCCL double (tests/doubles/nccl_double.py).

The double replaces CuPy's runtime (streams, events, NCCL, pinned buffers) and the benchmark's
device allocator, so the GPU path runs end to end here: meshkit's engine and the raw engines
(raw NcclCommunicator calls, hand staging through pinned buffers, mpi4py on device arrays)
are checked against NumPy at every size, as on a GPU; the times mean nothing. argv: the
benchmark's own arguments. ``BENCH_BREAK=all_gather`` breaks the double's allGather on purpose
(one element short), to show that the benchmark's result check stops a wrong answer.
"""

import os
import sys
from pathlib import Path

from doubles import nccl_double as double
import numpy as np

from meshkit.comm.engines import cuda_runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import collectives  # noqa: E402  (found through the path just added)

if os.environ.get("BENCH_BREAK") == "all_gather":
    whole = double.FakeCommunicator.allGather

    def short(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802 (NCCL's name)
        whole(self, sendbuf, recvbuf, max(count - 1, 1), datatype, stream)

    double.FakeCommunicator.allGather = short

rt = double.FakeRuntime()
cuda_runtime.set_runtime(rt)
collectives.device_zeros = lambda count, dtype: double.to_device(np.zeros(count, dtype))
status = collectives.main(sys.argv[1:])
print(f"staging: pinned={rt.pinned_allocations} to_host={rt.copies_to_host} to_device={rt.copies_to_device}",
      flush=True)
sys.exit(status)
