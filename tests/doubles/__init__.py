"""Test doubles: stand-ins for what the test machine lacks, strict where the real thing is.

``nccl_double`` (CuPy's NCCL module, device memory, streams and events, ranks as threads),
``fake_cupy`` (a ``cupy`` module of strict device arrays over the double's memory),
``nccl_process_double`` (the double's communicators across processes, for real multi-process
jobs), ``toy_backend`` (third-party engines written against ``meshkit.comm``'s declared engine
interface only, for the backend registry).
"""
