"""Each rank prints a few lines to stdout and stderr, naming its MPI rank and its arguments."""

import os
import sys

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
size = MPI.COMM_WORLD.Get_size()
print(f"hello from {rank} of {size}")
print(f"args {sys.argv[1:]} of {rank}")
print(f"env {os.environ.get('MESHKIT_LAUNCHED')} {os.environ.get('MESHKIT_WORLD_SIZE')} of {rank}")
print(f"two\nlines of {rank}", file=sys.stderr)
sys.stdout.write(f"partial of {rank}")  # no newline: written at exit
