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

__all__ = ["applies", "supported", "surviving", "min_bytes", "move_min_bytes", "chunk_bytes", "small_bytes", "small_min_bytes", "direct",
           "shared_min_bytes", "direct_bytes", "CMA", "DIRECT_BYTES", "DIRECT_SCRATCH_BUDGET", "SHARED_MIN_BYTES", "DEFAULT_SHARED_MIN_BYTES",
           "DEFAULT_MIN_BYTES", "DEFAULT_DIRECT_MIN_BYTES", "DEFAULT_MOVE_MIN_BYTES", "DEFAULT_CHUNK_BYTES", "SEGMENT_BUDGET", "DEFAULT_SMALL_BYTES", "DEFAULT_SMALL_MIN_BYTES", "direct_measured", "ATTACH_DEARER", "ATTACH_LARGE_BYTES",
           "SURVIVE_MIN_BYTES"]

#: all_reduce, reduce and reduce_scatter of an ordinary buffer below this many bytes go to MPI
#: (``MESHKIT_SHM_MIN_BYTES``) where the group copies through its segment (no cross-memory attach:
#: another kernel, Yama's ptrace_scope 1, ``MESHKIT_SHM_CMA=0``). Measured at 2 ranks on the
#: project's quiet 2-core machine (benchmarks/collectives.py, min over 5 interleaved rounds, float32;
#: docs/collectives.md): the copies in and out lost to MPICH from 1 MB to 16 MB (all_reduce 1 MB
#: 654 us against 508 us over MPI, 4 MB 1.67 ms against 1.38, 16 MB 7.5 ms against 7.4) and won at
#: 64 MB (38 ms against 44; reduce_scatter 22 ms against 40); the copy-in of only the others' slices
#: (2026-11-29) cut a quarter of that, which still lost at 4-16 MB on the loaded machine (4 MB 1.2-1.5
#: ms against 1.1-1.4 over MPI, 16 MB 10-24 ms against 6-25), so ordinary buffers take it from 32 MiB.
#: A buffer of ``shared_buffer`` (DDP's buckets), reduced in place with no copy, takes it at every size.
DEFAULT_MIN_BYTES = 32 << 20
#: The same threshold where cross-memory attach works between the group's ranks (shm_cma.py): the
#: all_reduce reads and writes the peers' arrays directly, the reduce_scatter reads them. At 2 ranks on
#: the loaded machine (min over 21-31 interleaved single calls, 5 runs; docs/collectives.md) it won at
#: 4 MB in 4 runs of 5 (0.92-1.04 ms against 1.11-1.40 over meshkit's MPI path) and at 16 and 64 MB in
#: all, and lost at 1 MB in all (0.37-0.64 ms against 0.28-0.51): ordinary buffers take it from 4 MiB.
#: Re-measured with the pieces moved by address (2026-11-29, load 1-5, min of 21-31 interleaved single
#: calls against raw MPICH): all_reduce 4 MiB 1.21-1.88x MPICH in 5 runs, reduce_scatter (now by
#: cross-memory attach) 1.38-1.85x, but 2 MiB only 1.17-1.41x and 3 MiB 0.96-1.43x (reduce_scatter
#: 2 MiB 1.03-1.09x): not enough to move the threshold below 4 MiB on a machine this noisy.
#: Measured quietly (2026-11-29, nothing else running, 2 ranks, min over 9 interleaved rounds of
#: benchmarks/collectives.py against raw MPICH, two runs each): all_reduce by cross-memory attach
#: 512 KiB 0.82-0.87 of MPICH's time, 768 KiB 0.72-0.81, 1 MiB 0.61-0.75, 2 MiB 0.72-0.78, 3 MiB
#: 0.80; over meshkit's MPI path 1 MiB took 1.09-1.13 of MPICH's (the nonblocking call the timeout
#: needs): so ordinary buffers take the path from 512 KiB, where the one-meeting path stops
#: (all_reduces above half of MESHKIT_SHM_SMALL_BYTES go by cross-memory attach).
DEFAULT_DIRECT_MIN_BYTES = 512 << 10
#: all_gather and broadcast (data moved, nothing reduced) go to MPI below this
#: (``MESHKIT_SHM_MOVE_MIN_BYTES``), which by default is the most the setting allows: in effect
#: never. MPICH moves a large message with one copy, the path with two (into the segment, out of
#: it): at 2 ranks an all_gather through the path took 1.25-1.9x MPICH's time at every size from
#: 4 KB to 64 MB (benchmarks/collectives.py, docs/collectives.md). By cross-memory attach the path
#: also moves one copy per block, as MPICH does (this MPICH uses the same kernel calls), and ties
#: (2026-11-29, min of 21 interleaved single calls, loaded: all_gather 4 MiB 0.43-0.51 ms pulling or
#: pushing against MPICH's 0.45, 16 MiB 2.3-2.8 against 3.0, 64 MiB 23-30 against 21.5; broadcast
#: 0.81-1.19x): that is the floor, not a win, so MPI keeps them. A buffer of ``shared_buffer`` still
#: gathers in place (one copy) at any size.
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
#: A reduction chunk of an ordinary buffer of at most this many bytes meets once, every rank
#: reducing all of it from the segment (``MESHKIT_SHM_SMALL_BYTES``): it saves a meeting for the
#: price of a copy-in of the whole chunk and n slices reduced instead of one; above it a rank copies
#: in only the others' slices, or moves the buffer by cross-memory attach. DeepSpeed's shm.cpp
#: switches at 1 MiB; here (2 ranks, loaded machine, min of 15 single calls) one meeting took 22 us
#: at 64 KB against 28 for two, and both about as long at 1 MB (219-257 us against 184-239), while
#: cross-memory attach lost at 1 MB (above): 1 MiB. Ordinary buffers take the chunked path above it
#: by default (``DEFAULT_DIRECT_MIN_BYTES``); it also bounds the one-meeting path of shm_small.py (a
#: reduce_scatter's input up to it, an all_reduce up to half of it).
DEFAULT_SMALL_BYTES = 1 << 20
#: all_reduce and reduce_scatter of an ordinary buffer from this many bytes (up to
#: ``MESHKIT_SHM_SMALL_BYTES`` and one chunk; an all_reduce up to half of it) take the one-meeting
#: path of comm/engines/shm_small.py (``MESHKIT_SHM_SMALL_MIN_BYTES``); below, MPI. At 2 ranks on the
#: loaded machine (benchmarks/collectives.py --stat min, 5-7 rounds, three runs of the final code, the
#: path from 4 KiB in two of them; docs/collectives.md) the one meeting beat meshkit's MPI path from
#: 16 KB (all_reduce 16 KB 16-33 us against 21-57, 64 KB 23-55 against 36-77; reduce_scatter 16 KB
#: in 2 runs of 3, 64 KB 33-89 against 39-133) and lost at 4-8 KB (all_reduce 15-17 us against 13-17,
#: reduce_scatter 15-32 against 13-26): below 16 KB MPICH's own few microseconds win.
DEFAULT_SMALL_MIN_BYTES = 16 << 10
#: A buffer of ``shared_buffer`` (DDP's buckets) is reduced (gathered) in place from this many bytes
#: (``MESHKIT_SHM_SHARED_MIN_BYTES``); below it MPI works on the same memory, as on any array. At 2
#: ranks on the loaded machine (min of 25-31 interleaved single calls, 3 runs; docs/collectives.md)
#: the in-place all_reduce took 62 us at 4 KB and 67 at 16 KB against 31 and 46 over meshkit's MPI
#: path, about as long at 64 KB (61-120 against 52-125), and won from 256 KB (99 against 120; 1 MB
#: 210-303 against 331-414): 64 KiB.
SHARED_MIN_BYTES = env.SHM_SHARED_MIN_BYTES
DEFAULT_SHARED_MIN_BYTES = 64 << 10
#: ``MESHKIT_SHM_CMA``: 1 (default) lets ordinary buffers move between the ranks' own arrays by
#: cross-memory attach where the kernel permits it (comm/engines/shm_cma.py); 0 copies them through
#: the segment.
CMA = env.SHM_CMA
#: Bytes of the piece a direct (cross-memory) all_reduce or reduce_scatter reads and reduces at a
#: time, per rank of the group (this rank's scratch is n x this), so that the piece read is reduced,
#: and written to the peers, while in this core's L2 (4 MiB here). At 2 ranks (loaded machine, min of
#: 21 single calls) 64 KiB pieces took 1.7 ms at 4 MB where 256 KiB and 1 MiB took 1.0 ms (a kernel
#: call per piece and peer). Again with the pieces moved by address (2026-11-29, min of 21
#: interleaved calls, load 2): at 4 MiB 64, 128, 256, 512 KiB, 1 and 2 MiB took 749, 536, 453, 450,
#: 555 and 612 us (one core's copy 336), at 64 MiB 14.1, 10.7, 9.7, 9.6, 11.1 and 12.2 ms: 256 KiB.
DIRECT_BYTES = 256 << 10
#: A rank's scratch for cross-memory attach (n pieces) stays within this: from 32 ranks on a node the
#: piece shrinks (to 64 KiB at 128 ranks), so that no rank holds more than 8 MiB for it.
DIRECT_SCRATCH_BUDGET = 8 << 20


#: Where the kernel's copy between two processes (``process_vm_readv`` of 1 MiB of a peer's segment in
#: :data:`DIRECT_BYTES` pieces) takes more than this many times a user-space copy of the same bytes
#: (measured at group creation, the ranks' mean), ordinary buffers up to :data:`ATTACH_LARGE_BYTES`
#: are copied through the segment instead. Each copy by attach pays the kernel's pinning of every 4 KiB
#: page whatever the cache holds, while the segment's copies (three of a slice's where attach has two)
#: run at the cache's speed. Measured: on the host of the first measurements the kernel's read was
#: 1.6x a user copy and attach won (4 MiB: 1.44 copies' time against 2.4 through the segment); on the
#: host of 2026-11-30 (a 32 MiB L3 holding the buffers) it was 5x, and the segment won at 1-32 MiB
#: (4 MiB all_reduce 255-267 us against 391-411 by attach, MPICH 435-470; docs/collectives.md): 2.5
#: lies between.
ATTACH_DEARER = 2.5
#: Above this, ordinary buffers go by cross-memory attach where permitted, whatever the measurement: a
#: buffer this large is read from memory, not the cache, and the page pinning costs less than the
#: segment's extra copies (64 MiB all_reduce on the 2026-11-30 host: 0.20-0.23 of MPICH's time by
#: attach, 0.31-0.51 through the segment).
ATTACH_LARGE_BYTES = 32 << 20


def direct_bytes(n: int) -> int:
    """The piece of a direct all_reduce for a group of ``n`` ranks: :data:`DIRECT_BYTES`, held to
    :data:`DIRECT_SCRATCH_BUDGET` ``/ n`` (a multiple of 64, at least 4 KiB)."""
    return max(4096, min(DIRECT_BYTES, DIRECT_SCRATCH_BUDGET // max(n, 1) // 64 * 64))


def direct() -> bool:
    """``MESHKIT_SHM_CMA``: whether ordinary buffers may move by cross-memory attach (a bad value
    raises, naming the variable and the valid values)."""
    return env.shm_cma() > 0


def direct_measured() -> bool:
    """``MESHKIT_SHM_CMA`` 1 (the default): cross-memory attach only where it measured cheaper on this
    host (:data:`ATTACH_DEARER`); 2: wherever the kernel permits it."""
    return env.shm_cma() == 1


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


def min_bytes(direct: bool = False) -> int:
    """``MESHKIT_SHM_MIN_BYTES``: collectives below it go to MPI; by default :data:`SURVIVE_MIN_BYTES`
    under ``--survive``, else :data:`DEFAULT_DIRECT_MIN_BYTES` where ``direct`` (cross-memory attach
    works), else :data:`DEFAULT_MIN_BYTES`."""
    surviving_now = surviving()
    default = SURVIVE_MIN_BYTES if surviving_now else DEFAULT_DIRECT_MIN_BYTES if direct else DEFAULT_MIN_BYTES
    said = (f"default {SURVIVE_MIN_BYTES} under --survive" if surviving_now else
            f"default {DEFAULT_DIRECT_MIN_BYTES} where cross-memory attach works, else {DEFAULT_MIN_BYTES}")
    return env.shm_bytes(env.SHM_MIN_BYTES, default, zero=True, said=said)


def chunk_bytes(n: int = 2) -> int:
    """``MESHKIT_SHM_CHUNK_BYTES`` where set, else :data:`DEFAULT_CHUNK_BYTES` held to
    :data:`SEGMENT_BUDGET` ``/ n`` (a multiple of 64, at least 64 KiB)."""
    default = max(64 << 10, min(DEFAULT_CHUNK_BYTES, SEGMENT_BUDGET // n // 64 * 64))
    return env.shm_bytes(env.SHM_CHUNK_BYTES, default, multiple=64,
                         said=f"default {DEFAULT_CHUNK_BYTES}, at most {SEGMENT_BUDGET} / the ranks, at least {64 << 10}")


def small_bytes() -> int:
    """``MESHKIT_SHM_SMALL_BYTES``: a reduction chunk up to it meets once."""
    return env.shm_bytes(env.SHM_SMALL_BYTES, DEFAULT_SMALL_BYTES, zero=True)


def small_min_bytes() -> int:
    """``MESHKIT_SHM_SMALL_MIN_BYTES``: an ordinary all_reduce or reduce_scatter from it up to
    :func:`small_bytes` meets once through the segment (:data:`SURVIVE_MIN_BYTES` by default under
    ``--survive``, where MPI is Open MPI over TCP)."""
    return env.shm_bytes(env.SHM_SMALL_MIN_BYTES, SURVIVE_MIN_BYTES if surviving() else DEFAULT_SMALL_MIN_BYTES,
                         zero=True)


def shared_min_bytes() -> int:
    """``MESHKIT_SHM_SHARED_MIN_BYTES``: a shared buffer below it goes to MPI like any array
    (:data:`SURVIVE_MIN_BYTES` by default under ``--survive``, where MPI is Open MPI over TCP)."""
    return env.shm_bytes(SHARED_MIN_BYTES, SURVIVE_MIN_BYTES if surviving() else DEFAULT_SHARED_MIN_BYTES, zero=True)


def move_min_bytes() -> int:
    """``MESHKIT_SHM_MOVE_MIN_BYTES``: all_gather and broadcast below it go to MPI (:data:`SURVIVE_MIN_BYTES` by
    default under ``--survive``)."""
    return env.shm_bytes(env.SHM_MOVE_MIN_BYTES, SURVIVE_MIN_BYTES if surviving() else DEFAULT_MOVE_MIN_BYTES, zero=True)


def check_all() -> None:
    """Read every ``MESHKIT_SHM_*_BYTES`` setting, so that a bad value is an error at
    ``init_process_group`` (comm/setup/lifecycle.py), naming the variable and its default, whether or
    not a group ever takes the path."""
    min_bytes()
    chunk_bytes()
    small_bytes()
    small_min_bytes()
    shared_min_bytes()
    move_min_bytes()
