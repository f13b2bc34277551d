"""An ``nccl`` world over the strict double (tests/doubles/nccl_double.py), ranks as threads.

One home for what five test files each wrote: :func:`fake_runtime` makes the double the CUDA runtime
(tests/conftest.py's ``fake_gpu`` fixture holds it for a test), :func:`on_nccl` runs a function on
thread-ranks of an ``nccl`` world over it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import meshkit
from doubles import nccl_double as double
from meshkit.comm import local
from meshkit.comm.engines import cuda_runtime

__all__ = ["fake_runtime", "on_nccl"]


@contextlib.contextmanager
def fake_runtime(runtime: Any = None) -> Iterator[Any]:
    """``runtime`` (a fresh ``double.FakeRuntime()`` if None) is the CUDA runtime inside the block;
    the previous one is back after it. Yields the double's module."""
    previous = cuda_runtime.set_runtime(runtime if runtime is not None else double.FakeRuntime())
    try:
        yield double
    finally:
        cuda_runtime.set_runtime(previous)


def on_nccl(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 30, runtime: Any = None,
            **kwargs: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``n`` thread-ranks, each in an ``nccl`` world (the group's timeout:
    ``timeout``); their results, or the first rank's error. With ``runtime``, that runtime is the CUDA
    runtime for the run (else the one installed, e.g. by the ``fake_gpu`` or ``cupy`` fixture)."""
    def main():
        meshkit.init_process_group("nccl", timeout=timeout)
        return fn(*args, **kwargs)

    if runtime is None:
        return local.run(main, n, init=False)
    with fake_runtime(runtime):
        return local.run(main, n, init=False)
