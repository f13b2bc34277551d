"""meshkit-run -n N mpi_chrome_trace.py PATH: a few collectives, then export_chrome_trace(PATH)."""

import sys

import numpy as np

import meshkit

meshkit.init_process_group("mpi")
x = np.ones(8, np.float64)
meshkit.all_reduce(x)
meshkit.broadcast(x, src=0)
meshkit.debug.export_chrome_trace(sys.argv[1])
meshkit.destroy_process_group()
