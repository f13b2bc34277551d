"""The shared-memory path's settings: whether it applies, its threshold, chunk and one-meeting
size, each a ``MESHKIT_SHM_*`` variable read and validated by :mod:`~meshkit.comm.env`.

Apart from comm/engines/shm.py, which needs MPI, so that the settings are read (and tested)
without starting MPI.
"""

from __future__ import annotations

import os
import platform

from .. import env
from ...launch_protocol import SURVIVE_ENV

__all__ = ["applies", "supported", "surviving", "min_bytes", "move_min_bytes", "chunk_bytes", "small_bytes",
           "DEFAULT_MIN_BYTES", "DEFAULT_MOVE_MIN_BYTES", "DEFAULT_CHUNK_BYTES", "SEGMENT_BUDGET", "DEFAULT_SMALL_BYTES",
           "SURVIVE_MIN_BYTES"]

#: all_reduce, reduce and reduce_scatter of an ordinary buffer below this many bytes go to MPI
#: (``MESHKIT_SHM_MIN_BYTES``). Measured at 2 ranks on the project's quiet 2-core machine
#: (benchmarks/collectives.py, min over 5 interleaved rounds, float32; docs/collectives.md): the
#: path's copy in and out lost to MPICH from 1 MB to 16 MB (all_reduce 1 MB 654 us against 508 us
#: over MPI, 4 MB 1.67 ms against 1.38, 16 MB 7.5 ms against 7.4) and won at 64 MB (38 ms against
#: 44; reduce_scatter 22 ms against 40), so ordinary buffers take it from 32 MiB. A buffer of
#: ``shared_buffer`` (DDP's buckets), reduced in place with no copy, takes it at every size.
DEFAULT_MIN_BYTES = 32 << 20
#: all_gather and broadcast (data moved, nothing reduced) go to MPI below this
#: (``MESHKIT_SHM_MOVE_MIN_BYTES``), which by default is the most the setting allows: in effect
#: never. MPICH moves a large message with one copy, the path with two (into the segment, out of
#: it): at 2 ranks an all_gather through the path took 1.25-1.9x MPICH's time at every size from
#: 4 KB to 64 MB (benchmarks/collectives.py, docs/collectives.md). A buffer of ``shared_buffer``
#: still gathers in place (one copy) at any size.
DEFAULT_MOVE_MIN_BYTES = 1 << 30
#: Under ``meshkit-run --survive`` both thresholds above default to this instead: there MPI is Open
#: MPI over loopback TCP (launch/fault_tolerant.py says why), not MPICH's shared memory, and the
#: path wins at every size (4 ranks, the loaded 2-core machine, benchmarks/collectives.py --stat min
#: under --survive, docs/elastic.md "Surviving failures"); ``MESHKIT_SHM_MIN_BYTES`` and
#: ``MESHKIT_SHM_MOVE_MIN_BYTES`` still decide where set.
SURVIVE_MIN_BYTES = 0
#: Most bytes of each of a rank's two buffers (``MESHKIT_SHM_CHUNK_BYTES``); the default is also
#: held to :data:`SEGMENT_BUDGET` ``/ n``. Every chunk is a meeting of all ranks, and on shared
#: cores a meeting costs a scheduling round: a 64 MB all_reduce took 0.30-0.55 s with 256 KiB or
#: 1 MiB chunks and 0.12-0.13 s with 4 or 16 MiB (loaded machine; L3 is 300 MiB, so the cache did not
#: decide it).
DEFAULT_CHUNK_BYTES = 4 << 20
#: The default chunk is at most this over the group's size: a segment (n x 2 chunks) stays under
#: 64 MiB of /dev/shm (tmpfs, counted against the machine's memory) however large the group.
SEGMENT_BUDGET = 32 << 20
#: A reduction chunk of at most this many bytes meets once, every rank reducing all of it
#: (``MESHKIT_SHM_SMALL_BYTES``): it saves a meeting and the copy-out for the price of reducing
#: n slices instead of one; DeepSpeed's shm.cpp switches at 1 MiB. Here 256 KiB, where the path's
#: fixed cost (tens of microseconds a meeting) stops dominating: it applies to shared buffers (DDP's
#: buckets), which take the path at every size; ordinary buffers start far above it.
DEFAULT_SMALL_BYTES = 256 * 1024


def supported() -> bool:
    """The memory-ordering argument holds (x86-64: TSO; comm/engines/shm_collectives.py)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def applies(size: int) -> bool:
    """Whether a group of ``size`` ranks may take the path: more than one rank, ``MESHKIT_SHM`` not
    0 (a bad value raises, naming the variable), x86-64. A ``meshkit-run --survive`` job takes it
    too: a wait notices a dead peer itself (its pid, within ``LIVENESS_INTERVAL``) and a survivor's
    revoke (comm/engines/shm.py), and the survivors' world gets new segments (comm/setup/survivors.py)."""
    return size >= 2 and env.shm_enabled() and supported()


def surviving() -> bool:
    """A ``meshkit-run --survive K`` job (``MESHKIT_SURVIVE`` set above 0 by the launcher)."""
    return os.environ.get(SURVIVE_ENV, "").strip() not in ("", "0")


def min_bytes() -> int:
    """``MESHKIT_SHM_MIN_BYTES``: collectives below it go to MPI (:data:`SURVIVE_MIN_BYTES` by default under ``--survive``)."""
    return env.shm_bytes(env.SHM_MIN_BYTES, SURVIVE_MIN_BYTES if surviving() else DEFAULT_MIN_BYTES, zero=True)


def chunk_bytes(n: int = 2) -> int:
    """``MESHKIT_SHM_CHUNK_BYTES`` where set, else :data:`DEFAULT_CHUNK_BYTES` held to
    :data:`SEGMENT_BUDGET` ``/ n`` (a multiple of 64, at least 64 KiB)."""
    default = max(64 << 10, min(DEFAULT_CHUNK_BYTES, SEGMENT_BUDGET // n // 64 * 64))
    return env.shm_bytes(env.SHM_CHUNK_BYTES, default, multiple=64)


def small_bytes() -> int:
    """``MESHKIT_SHM_SMALL_BYTES``: a reduction chunk up to it meets once."""
    return env.shm_bytes(env.SHM_SMALL_BYTES, DEFAULT_SMALL_BYTES, zero=True)


def move_min_bytes() -> int:
    """``MESHKIT_SHM_MOVE_MIN_BYTES``: all_gather and broadcast below it go to MPI (:data:`SURVIVE_MIN_BYTES` by
    default under ``--survive``)."""
    return env.shm_bytes(env.SHM_MOVE_MIN_BYTES, SURVIVE_MIN_BYTES if surviving() else DEFAULT_MOVE_MIN_BYTES, zero=True)
