"""Prints what a rank sees before importing anything: is NumPy loaded, and the thread limits."""

import os
import sys

print("numpy imported before the script:", "numpy" in sys.modules)
print("OPENBLAS_NUM_THREADS =", os.environ.get("OPENBLAS_NUM_THREADS"))
print("OMP_NUM_THREADS =", os.environ.get("OMP_NUM_THREADS"))
