"""Prints the MPICH selection file a rank was given, its Iallreduce rules, and an 8 KB all_reduce."""

import json
import os

import numpy as np

import meshkit

path = os.environ.get("MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE")
print("selection file:", path)
if path:
    with open(path) as f:
        print("iallreduce rules:", list(json.load(f)["collective=iallreduce"]["comm_type=intra"]))
meshkit.init_process_group("mpi")
x = np.full(1024, meshkit.get_rank() + 1.0, dtype=np.float32)  # 4 KB: recursive doubling once retuned
meshkit.all_reduce(x)
n = meshkit.get_world_size()
print("all_reduce ok:", bool((x == n * (n + 1) / 2).all()))
