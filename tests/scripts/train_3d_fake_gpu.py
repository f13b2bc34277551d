"""examples/train_3d.py --device cuda on "GPUs" that are tests/doubles/fake_cupy.py's strict arrays over the
NCCL double's device memory: its main() as a user runs it, over the MPI engine (staged or
CUDA-aware, as MESHKIT_CUDA_AWARE_MPI says). argv: the example's flags; prints each rank's device."""

import sys
from pathlib import Path

from doubles import fake_cupy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import meshkit  # noqa: E402
import train_3d  # noqa: E402
from meshkit.comm.engines import cuda_runtime  # noqa: E402

with fake_cupy.installed() as cupy:  # also the double as the CUDA runtime: 8 devices, gpu_available()
    real_train = train_3d.train

    def train(args, progress=True):
        print(f"rank {meshkit.get_rank()} on device {cupy.zeros(1).device.id}", flush=True)
        return real_train(args, progress=False)

    train_3d.train = train
    status = train_3d.main(sys.argv[1:])
    print(f"staging copies to host: {cuda_runtime.runtime().copies_to_host}", flush=True)
sys.exit(status)
