"""A ported torch script: ``fn`` defined in the script itself, spawned under the ``__main__`` guard.

argv[1]: the number of processes. Each rank prints its rank and the all_reduce of the ranks.
"""

import sys

import numpy as np

import meshkit



class Scale:  # a type of this file in args: unpickled in the processes from __mp_main__
    def __init__(self, factor: float) -> None:
        self.factor = factor


def run(rank: int, scale: Scale) -> None:
    meshkit.init_process_group()
    x = np.array([float(rank) * scale.factor])
    meshkit.all_reduce(x)
    print(f"rank {rank} of {meshkit.get_world_size()}: sum {x[0]:g}, main {__name__}", flush=True)
    meshkit.destroy_process_group()


if __name__ == "__main__":
    meshkit.spawn(run, args=(Scale(10.0),), nprocs=int(sys.argv[1]))
    print("spawn returned", flush=True)
