"""Fault cases on real processes; prints each rank's error as 'Name: message' (case in argv[1])."""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import meshkit

case = sys.argv[1]
# "raise": the others wait in a barrier far longer than the test allows, unless the job is ended.
meshkit.init_process_group("mpi", timeout=120 if case == "raise" else 1.5)
rank = meshkit.get_rank()


def report(fn):
    try:
        fn()
        print("no error", flush=True)
    except meshkit.DistError as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)


# Rank 1 skips the collective; afterwards every rank meets in a barrier on MPI_COMM_WORLD (not
# meshkit's communicator, where the timed-out call is still pending), so that no rank leaves, and
# ends the job, before the others have reported.
if case == "skip-barrier":
    if rank != 1:
        report(meshkit.barrier)
elif case == "skip-all-reduce":
    if rank != 1:
        report(lambda: meshkit.all_reduce(np.ones(4)))
        last = meshkit.flight_record()[-1]
        print("RECORD", last["op"], last["seq"], last["state"], flush=True)
        report(lambda: meshkit.all_reduce(np.ones(4)))  # the group is unusable after a timeout
elif case == "monitored":
    if rank != 1:
        report(lambda: meshkit.monitored_barrier(timeout=1.0))
elif case == "detail-skip":
    if rank != 1:
        report(lambda: meshkit.all_reduce(np.ones(4)))
elif case == "mismatch":
    report(lambda: meshkit.all_reduce(np.ones(4 + (rank == 1))))
elif case == "raise":
    if rank == 2:
        time.sleep(0.5)
        raise ValueError("rank 2 gives up")
    meshkit.barrier()
MPI.COMM_WORLD.Barrier()
sys.stdout.flush()
# A collective that timed out is still pending inside MPI, and MPI_Finalize would wait for it:
# leave without finalizing, as a job that caught a timeout must.
os._exit(0)
