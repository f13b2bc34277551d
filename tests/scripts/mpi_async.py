"""Async cases on real processes (case in argv[1]); prints RESULT/ORDER lines for the test."""

import sys

import test_async

import meshkit

meshkit.init_process_group("mpi", timeout=30)
if sys.argv[1] == "policy":
    print("POLICY", repr(test_async.waiting_policy()), flush=True)
elif sys.argv[1] == "progress":
    print("RESULT", repr(test_async.progress_while_computing()), flush=True)
elif sys.argv[1] == "chain":
    print("CHAIN", repr(test_async.queued_chain_progresses()), flush=True)
else:
    test_async.interleaved()
    print("ORDER OK", flush=True)
meshkit.destroy_process_group()
