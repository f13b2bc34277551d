"""Control messages: no code from outside runs in a rank.

The typed wire format of comm/control.py (round trips, what it refuses, malformed and hostile
bytes, bounds, property tests); the store engine reading it (a pickled notice posted into a
running world, forged exchange answers and payloads: no code runs, every rank fails cleanly or
the world goes on); object collectives on a group whose peers are not authenticated (plain data
travels, a class of one's own is refused on every rank naming MESHKIT_JOB_SECRET, a forged
pickle is refused) and on authenticated ones (pickle, as before); and one env:// world of real
processes attacked through its TCPStore.

The store-engine tests run the ranks as threads over an :class:`OpenStore` (a HashStore that says
it is not authenticated: a TCPStore without the job's secret, in one process) with the strict
NCCL double, as tests/test_init_methods.py does; the attacker writes the world's keys directly.
"""

from __future__ import annotations

import ast
import math
import os
import re
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import meshkit
from doubles import nccl_double as double
from conftest import SCRIPTS
from meshkit.comm import control, local
from meshkit.comm.engines import cuda_runtime
from meshkit.comm.control import ControlMessageError, decode, encode
from meshkit.comm.debug import Call, DebugLevel, fingerprint
from meshkit.comm.level_state import Switch
from meshkit.comm.notices import BROKEN, LEFT, Notice
from meshkit.comm.reduce_op import ReduceOp
from meshkit.comm.groups.world import local_context

#: The prefix of a world's keys in its rendezvous store (comm/setup/init_methods.py's PREFIX).
WORLD = "meshkit/world/"


class Plant:
    """A pickle that creates ``path`` when it is unpickled: proof that code from the store ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class OpenStore(meshkit.HashStore):
    """A HashStore that says what a TCPStore without the job's secret says: anyone may write it."""

    @property
    def authenticated(self) -> bool:
        return False


class Mine:
    """A class of one's own: pickle carries it, the typed format does not."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mine) and other.value == self.value


def same(a, b) -> bool:
    """Equal and of exactly the same types all the way down (floats by their bits: NaN, -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes() and a.flags.writeable
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


# --------------------------------------------------------------------------- the codec: what it carries
CALL = fingerprint("all_to_all", np.dtype(np.float32), None, None, None, ((1, 2), (2, 1)))
CARRIED = [
    None, True, False, 0, -1, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 3**200, 1.5, -0.0, math.inf, math.nan,
    "", "rank 3", "h\u00e9\u4e16\U0001f600", "lone \udc80 surrogate", b"", b"\x00\xff", bytearray(b"ab"),
    [], (), [1, 2, 3], (1, "a", None), [[[]]], tuple(range(128)), [2**70, 1], (True, 1),
    {}, {"a": 1, 2: [3], (1, 2): {"x": None}, None: b"", 1.5: True},
    np.arange(6.0).reshape(2, 3), np.zeros((0, 5), np.int8), np.array(True), np.arange(4, dtype=">i4"),
    np.array([1 + 2j], np.complex64), np.asfortranarray(np.arange(6).reshape(2, 3)), np.arange(10)[::3],
    np.float32(3.5), np.int64(-7), np.bool_(True), np.uint16(9),
    Notice(BROKEN, 1, (0, 1), 17, "RuntimeError: boom", (((0, 1), 18),), True),
    Notice(BROKEN, 3, (0, 1, 2, 3), 4, "rank 1 died", failed=(1,)), Notice(LEFT, 0, detail="it ended"),
    CALL, fingerprint("all_reduce", np.dtype(np.float64), (4, 2), ReduceOp.SUM, None, None), Call("barrier"),
    Switch(DebugLevel.DETAIL, (((0, 1), 3), ((1,), 0))),
    (17, CALL), ("ok", [(3, CALL), (-1, None)]), ("timeout", [2, 3]), ("error", "it failed"),
]


@pytest.mark.parametrize("value", CARRIED, ids=[f"{i}-{type(v).__name__}" for i, v in enumerate(CARRIED)])
def test_every_carried_value_comes_back_equal_and_of_the_same_type(value):
    back = decode(encode(value), what="a test")
    if isinstance(value, np.ndarray):  # any layout goes, C order comes back
        value = value.copy(order="C")
    assert same(back, value), (back, value)


def test_the_messages_meshkit_sends_all_travel():
    """Every payload of an engine's exchange and every notice (comm/: execution, levels,
    breakpoints, lifecycle, split, nccl's bootstrap, monitored_barrier, objects' _OverExchange)."""
    payloads = [(5, CALL), int(DebugLevel.OFF), Switch(DebugLevel.INFO, ()), None, "rank 1 has no terminal",
                "meshkit.comm: init_process_group ... disagrees", (3, 7), (None, 2), "GPU-00000001",
                tuple(np.int8(v).item() for v in range(-128, 0)), os.urandom(128), np.array([12], np.int64),
                np.zeros(9, np.uint8), [np.zeros(3, np.uint8)] * 4]
    for p in payloads:
        assert same(decode(encode(p), what="x"), p)
    assert decode(encode(Switch(DebugLevel.DETAIL, ())), what="x").level is DebugLevel.DETAIL
    from meshkit.comm.levels import _Switch  # the old name still imports, the same class
    assert _Switch is Switch


@pytest.mark.parametrize("value, named", [
    (Mine(1), r"a value of type test_control_messages.Mine \(it carries None, bool, int, float, str, bytes, list, "
              r"tuple, dict, NumPy arrays and scalars of plain dtypes, and meshkit's own notices and calls\)"),
    (DebugLevel.DETAIL, r"a value of type meshkit.comm.debug.DebugLevel \(a subclass of int: it would come back "
                        r"as a plain int, so it is refused\)"),
    (namedtuple("P", "x")(1), r"a value of type test_control_messages.P \(a subclass of tuple"),
    ({1, 2}, r"a value of type set \(it carries"),
    (np.array([1], object), r"a NumPy array of dtype object \(only bool, integer, float and complex dtypes travel\)"),
    (np.array(["a"]), r"a NumPy array of dtype <U1"),
    (np.zeros(2, [("a", "<i4")]), r"a NumPy array of dtype \[\('a', '<i4'\)\]"),
    (np.zeros(2, "M8[s]"), r"a NumPy array of dtype datetime64\[s\]"),
    (np.ma.array([1]), r"a value of type numpy.ma.MaskedArray"),
    ([{"deep": Mine(2)}], r"a value of type test_control_messages.Mine"),
])
def test_what_it_cannot_carry_is_a_type_error_naming_the_type(value, named):
    with pytest.raises(meshkit.DistTypeError, match=r"^meshkit.comm: a control message cannot carry " + named):
        encode(value)


def test_nesting_is_bounded_both_ways_and_the_bound_is_a_variable(monkeypatch):
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(meshkit.DistTypeError, match=r"a value nested deeper than 100 levels "
                                                    r"\(MESHKIT_CONTROL_MAX_DEPTH\)"):
        encode(cycle)
    deep = bytes([control.FORMAT]) + b"l\x01\x00\x00\x00" * 150 + b"N"
    with pytest.raises(ControlMessageError, match=r"it nests deeper than 100 levels \(MESHKIT_CONTROL_MAX_DEPTH\)"):
        decode(deep, what="a deep one")
    bomb = bytes([control.FORMAT]) + b"l\x01\x00\x00\x00" * 100_000 + b"N"  # far past any stack
    with pytest.raises(ControlMessageError, match="nests deeper"):
        decode(bomb, what="a bomb")
    try:
        monkeypatch.setenv("MESHKIT_CONTROL_MAX_DEPTH", "200")
        control.max_depth.cache_clear()
        assert decode(deep, what="x") is not None
        monkeypatch.setenv("MESHKIT_CONTROL_MAX_DEPTH", "deep")
        control.max_depth.cache_clear()
        with pytest.raises(meshkit.DistValueError, match=r"MESHKIT_CONTROL_MAX_DEPTH='deep' is not valid; valid "
                                                         r"values are integers 1..500"):
            encode(1)
    finally:
        control.max_depth.cache_clear()


# --------------------------------------------------------------------------- the codec: hostile bytes
F = bytes([control.FORMAT])
MALFORMED = [
    (b"", r"it is empty"),
    (pickle.dumps(Plant("/nonexistent/never")), r"it is a pickle, which control messages never are \(refused, not "
                                                r"unpickled\)"),
    (b"{}", r"its first byte is 0x7b, not meshkit's format byte 0xc1"),
    (F, r"it ends in the middle of a value \(truncated\)"),
    (F + b"i\x01\x02", r"truncated"),
    (F + b"N" + b"N", r"1 bytes follow the value"),
    (F + b"Z", r"unknown tag 0x5a at byte 1"),
    (F + b"s\xff\xff\xff\xff", r"a str of length 4294967295 at byte 1, but only 0 bytes remain"),
    (F + b"l\xff\xff\xff\x7f" + b"N" * 10, r"a list of length 2147483647 at byte 1, but only 10 bytes remain"),
    (F + b"d\x06\x00\x00\x00" + b"N" * 10, r"a dict of length 6 at byte 1, but only 10 bytes remain"),
    (F + b"u\x02\x00\x00\x00" + b"\x00" * 15, r"a sequence of ints of length 2 at byte 1, but only 15 bytes remain"),
    (F + b"s\x02\x00\x00\x00\xc3\x28", r"UnicodeDecodeError"),
    (F + b"d\x01\x00\x00\x00v\x00\x00\x00\x00N", r"a dict key of type list, which is not hashable"),
    (F + b"a\xff\x01", r"unknown dtype code 255"),
    (F + b"a\x00\x41", r"an array of 65 dimensions at byte 1 \(at most 64\)"),
    (F + b"a" + bytes([control._DTYPE_CODE["<f8"]]) + b"\x01" + struct.pack("<qQ", 2**40, 2**43),
     r"an array of 8796093022208 bytes at byte 1, but only 0 bytes remain"),
    (F + b"a" + bytes([control._DTYPE_CODE["<f8"]]) + b"\x01" + struct.pack("<qQ", 3, 8) + b"\x00" * 8,
     r"an array of shape \(3,\) and dtype float64 at byte 1 says it holds 8 bytes, not 24"),
    (F + b"a" + bytes([control._DTYPE_CODE["<f8"]]) + b"\x01" + struct.pack("<qQ", -1, 0), r"an array of shape "
                                                                                         r"\(-1,\)"),
    (F + b"R\x09\x00\x00\x00\x00", r"unknown record tag 9"),
    (encode(Notice(LEFT, 0)).replace(b"i" + b"\x00" * 8, b"s\x04\x00\x00\x00four", 1),
     r"a Notice whose field sender is 'four' \(type str\), which it cannot be"),
    (encode(Notice(LEFT, 0)).replace(b"left", b"lost"), r"a Notice whose field kind is 'lost'"),
    (encode(Switch(DebugLevel.OFF, ())).replace(b"i" + b"\x00" * 8, b"i\x07" + b"\x00" * 7, 1),
     r"a Switch whose field level is 7"),
    (F + b"R\x02" + struct.pack("<I", len(encode(Call("x"))) - 6) + encode(Call("x"))[7:] + b"N",
     rf"a Call at byte 1 says it holds {len(encode(Call('x'))) - 6} bytes, its fields take "
     rf"{len(encode(Call('x'))) - 7}"),
]


@pytest.mark.parametrize("data, fault", MALFORMED, ids=[f"{i}" for i in range(len(MALFORMED))])
def test_malformed_bytes_are_one_error_naming_the_channel_and_the_fault(data, fault, tmp_path):
    with pytest.raises(ControlMessageError, match=r"^meshkit.comm: store key 'k' of rank 3: not a control message "
                                                  r"meshkit wrote \(\d+ bytes\): .*" + fault):
        decode(data, what="store key 'k' of rank 3")
    assert isinstance(ControlMessageError("x"), meshkit.DistBackendError)


def test_a_small_message_never_makes_a_large_allocation():
    """Counts and lengths are checked against the bytes that remain before anything is made."""
    hostile = [F + b"l\xff\xff\xff\xff", F + b"b\xff\xff\xff\xff", F + b"I\xff\xff\xff\xff",
               F + b"u\xff\xff\xff\x1f", F + b"a" + bytes([control._DTYPE_CODE["|u1"]]) + b"\x02" +
               struct.pack("<qqQ", 2**31, 2**31, 2**62)]
    tracemalloc.start()
    try:
        for data in hostile:
            with pytest.raises(ControlMessageError, match="remain"):
                decode(data, what="x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    arr = decode(encode(np.zeros((0, 2**40), np.uint8)), what="x")  # no elements: nothing to allocate
    assert arr.shape == (0, 2**40)


def test_decoding_never_unpickles_anything(tmp_path):
    marker = tmp_path / "ran"
    for data in (pickle.dumps(Plant(marker)), F + pickle.dumps(Plant(marker)), F + b"b" + struct.pack(
            "<I", len(pickle.dumps(Plant(marker)))) + pickle.dumps(Plant(marker))):
        try:
            decode(data, what="x")
        except ControlMessageError:
            pass
    assert not marker.exists()


# --------------------------------------------------------------------------- the codec: properties
_DTYPES = [np.dtype(c) for c in "?bBhHiIlLqQefdFD"] + [np.dtype(">f8"), np.dtype(">i2")]
_LEAVES = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | st.binary(max_size=12)
           | hnp.arrays(st.sampled_from(_DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)))
_KEYS = st.none() | st.booleans() | st.integers() | st.text(max_size=6) | st.tuples(st.integers(), st.text(max_size=3))
VALUES = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
                      | st.dictionaries(_KEYS, inner, max_size=3), max_leaves=8)


@given(VALUES)
@settings(max_examples=100)
def test_property_every_value_round_trips(value):
    assert same(decode(encode(value), what="x"), value)


def _only_the_codecs_error(data: bytes) -> None:
    try:
        decode(data, what="x")
    except ControlMessageError:
        pass


@given(st.binary(max_size=64) | st.binary(max_size=64).map(lambda b: F + b))
@settings(max_examples=200)
def test_property_random_bytes_raise_nothing_but_the_codecs_error(data):
    _only_the_codecs_error(data)


@given(VALUES, st.data())
@settings(max_examples=100)
def test_property_truncated_and_mutated_messages_raise_nothing_but_the_codecs_error(value, data):
    wire = encode(value)
    cut = data.draw(st.integers(0, len(wire) - 1))
    _only_the_codecs_error(wire[:cut])
    at = data.draw(st.integers(0, len(wire) - 1))
    byte = data.draw(st.integers(0, 255))
    _only_the_codecs_error(wire[:at] + bytes([byte]) + wire[at + 1:])
    _only_the_codecs_error(wire[:at] + wire[at + 1:])


def test_records_are_rebuilt_once_and_served_again():
    """A Call decoded twice from the same bytes is one object (detail mode sends the same few)."""
    wire = encode((4, CALL))
    first, second = decode(wire, what="x")[1], decode(wire, what="x")[1]
    assert first == CALL and first is second


# --------------------------------------------------------------------------- the store engine, ranks as threads
def _world(fn, n, store, *, timeout=10):
    def main():
        rank = local_context().rank
        meshkit.init_process_group("nccl", store=store, world_size=n, rank=rank, timeout=timeout)
        try:
            return fn(rank)
        finally:
            meshkit.destroy_process_group()
    return local.run(main, n, init=False)


def _outcome(fn):
    """``(error or None, seconds)`` of ``fn()``."""
    began = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (the test reads it)
        return exc, time.monotonic() - began
    return None, time.monotonic() - began


def _forge(store, member, value, *, limit=5.0) -> str:
    """The attacker: once group rank 1 has written its payload of an exchange of the world group
    that group rank 0 has not answered, overwrite rank ``member``'s payload, or (``member`` given as
    ``"all"``) write the answer before rank 0 does. Returns the exchange's keys' base."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for c in range(1, 64):
            base = f"{WORLD}gw/x{c}"
            if store.check([f"{base}/1"]) and not store.check([f"{base}/all"]):
                store.set(f"{base}/{member}", value)
                return base
        time.sleep(0.001)
    raise AssertionError("rank 1 never started an exchange")


def _until_gone(store, key, limit=5.0) -> None:
    """Wait until rank 1 has read (and deleted) a forged answer, so that rank 0's does not replace it first."""
    deadline = time.monotonic() + limit
    while store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_pickled_notice_posted_into_a_running_world_runs_no_code(fake_gpu, tmp_path):
    """The attack: an outsider posts a pickled notice to rank 1 of a running world.
    Before, rank 1 unpickled it while its barrier stalled (the file appeared). Now rank 1's
    barrier fails naming the key, rank 0 learns of it at its next call, and a new world on the
    same store works."""
    marker, store = tmp_path / "ran", OpenStore()

    def body(rank):
        meshkit.barrier()
        if rank == 0:
            n = store.add(f"{WORLD}n/1/count", 1)  # the outsider, between two collectives
            store.set(f"{WORLD}n/1/{n}", pickle.dumps(Plant(marker)))
            time.sleep(0.3)  # rank 1 stalls in the barrier, reading its notices
        first = _outcome(meshkit.barrier)
        second = _outcome(meshkit.barrier)
        return first, second

    (first0, second0), (first1, second1) = _world(body, 2, store)
    assert not marker.exists(), "a pickle from the store ran in a rank"
    assert isinstance(first1[0], ControlMessageError), first1
    assert str(first1[0]).startswith("meshkit.comm: rank 1: the notice in rendezvous store key 'n/1/1' (posted by "
                                     "another rank of this world): not a control message meshkit wrote"), first1
    assert "it is a pickle, which control messages never are" in str(first1[0])
    assert "a process outside this job may have written to the rendezvous store" in str(first1[0])
    assert first0[0] is None  # its barrier had completed: rank 1 had arrived
    assert isinstance(second0[0], meshkit.DistError) and second0[1] < 5, second0  # told, not left waiting
    assert "rank 1" in str(second0[0]), second0
    assert isinstance(second1[0], meshkit.DistError), second1
    assert _world(lambda rank: meshkit.barrier() or rank, 2, store) == [0, 1]  # the job's traffic goes on


def test_notices_read_beside_a_malformed_one_come_at_the_next_read():
    from meshkit.comm.engines.store_engine import _Channel
    store = OpenStore()
    channel = _Channel(store, 1, 2, 0, None)
    real = Notice(LEFT, 0, detail="a real one")
    for value in (b"garbage", encode(real), encode(("not", "a notice"))):
        store.set(f"n/1/{store.add('n/1/count', 1)}", value)
    with pytest.raises(ControlMessageError, match=r"^meshkit.comm: rank 1: the notice in rendezvous store key 'n/1/1' "
                                                  r".*its first byte is 0x67"):
        channel.notices()
    assert channel.notices() == [real]
    assert store.num_keys() == 1  # each key read is deleted: only the counter is left
    with pytest.raises(ControlMessageError, match=r"key 'n/1/3' .*: a control message, but a tuple, not a notice"):
        store.set("n/1/3", encode(("not", "a notice")))
        channel.read = 2
        channel.notices()


def test_a_forged_exchange_answer_runs_no_code_and_fails_cleanly(fake_gpu, tmp_path):
    """An outsider writes group rank 0's answer to an exchange (a monitored barrier) before rank 0
    does: a pickle (no code runs), then a well-formed answer of the wrong shape. Rank 1 raises,
    naming the key and rank 0; rank 0 learns of it at its next call."""
    marker = tmp_path / "ran"
    for forged, fault in ((pickle.dumps(("ok", [Plant(marker), Plant(marker)])), r"it is a pickle"),
                          (encode(("ok", [None])), r"\('ok', \[None\]\) is not an answer of a group of 2")):
        store = OpenStore()

        def body(rank, forged=forged, store=store):
            meshkit.barrier()
            if rank == 0:  # the outsider answers rank 1's exchange; rank 0 comes once rank 1 read it
                _until_gone(store, _forge(store, "all", forged) + "/all")
            return _outcome(lambda: meshkit.monitored_barrier(timeout=5)), _outcome(meshkit.barrier)

        (mine0, next0), (mine1, next1) = _world(body, 2, store)
        assert not marker.exists()
        assert isinstance(mine1[0], ControlMessageError), mine1
        assert str(mine1[0]).startswith("meshkit.comm: rank 1: the answer of exchange gw/x"), mine1
        assert "(written by group rank 0, rank 0)" in str(mine1[0]) and "outside this job" in str(mine1[0])
        assert re.search(fault, str(mine1[0])), mine1
        assert mine0[0] is None, mine0
        assert isinstance(next0[0], meshkit.DistError) and next0[1] < 5, next0


def test_a_forged_payload_fails_the_exchange_on_every_rank(fake_gpu, tmp_path):
    """An outsider overwrites rank 1's payload before rank 0 reads it: rank 0 refuses it and its
    answer makes both ranks raise the same error, naming the key and rank 1."""
    marker, store = tmp_path / "ran", OpenStore()

    def body(rank):
        meshkit.barrier()
        if rank == 0:  # the outsider replaces rank 1's payload; then rank 0 comes and reads it
            _forge(store, 1, pickle.dumps(Plant(marker)))
        return _outcome(lambda: meshkit.monitored_barrier(timeout=5))

    outcomes = _world(body, 2, store)
    assert not marker.exists()
    for error, took in outcomes:
        assert isinstance(error, meshkit.DistBackendError) and took < 5, (error, took)
        assert re.search(r"rank 0: the payload of exchange gw/x\d+ in rendezvous store key 'gw/x\d+/1' "
                                       r"\(written by group rank 1, rank 1\): not a control message meshkit wrote "
                                       r"\(\d+ bytes\): it is a pickle", str(error)), error


# --------------------------------------------------------------------------- object collectives
def _all_four(rank, n, obj):
    """Every object collective once with ``obj`` (rank 0's or each rank's), their results."""
    everyone = [None] * n
    meshkit.all_gather_object(everyone, obj(rank))
    sent = [obj(1)] if rank == 1 else [None]
    meshkit.broadcast_object_list(sent, src=1)
    gathered = [None] * n if rank == 0 else None
    meshkit.gather_object(obj(rank), gathered, dst=0)
    mine = [None]
    meshkit.scatter_object_list(mine, [obj(r) for r in range(n)] if rank == 1 else None, src=1)
    return everyone, sent, gathered, mine


def test_object_collectives_carry_plain_data_where_peers_are_not_authenticated(fake_gpu):
    """Over a store without the job's secret, what meshkit's own callers send (tuples, dicts, str,
    None, NumPy arrays) travels in the typed format."""
    def plain(r):
        return {"rank": r, "host": f"h{r}", "spec": [("w", (2, 3), "float32", None)], "grad": np.arange(3.0) * r}

    def body(rank):
        assert not meshkit.comm._seams.current_world().default_group.engine.capabilities.authenticated_peers
        return _all_four(rank, 3, plain)

    for rank, (everyone, sent, gathered, mine) in enumerate(_world(body, 3, OpenStore())):
        assert same(everyone, [plain(r) for r in range(3)]) and same(sent, [plain(1)]) and same(mine, [plain(rank)])
        assert same(gathered, [plain(r) for r in range(3)] if rank == 0 else None)


def test_a_class_of_ones_own_is_refused_on_every_rank_naming_the_secret(fake_gpu):
    def body(rank):
        outcomes = []
        for call in (lambda: meshkit.all_gather_object([None] * 2, Mine(rank) if rank == 1 else rank),
                     lambda: meshkit.broadcast_object_list([Mine(1)] if rank == 1 else [None], src=1),
                     lambda: meshkit.scatter_object_list([None], [1, Mine(2)] if rank == 1 else None, src=1)):
            outcomes.append(_outcome(call)[0])
        everyone = [None] * 2
        meshkit.all_gather_object(everyone, ("still", rank))  # the calls stayed paired
        return outcomes, everyone

    for rank, (outcomes, everyone) in enumerate(_world(body, 2, OpenStore())):
        assert everyone == [("still", 0), ("still", 1)]
        for error in outcomes:
            assert isinstance(error, meshkit.ObjectCollectiveError), error
            assert re.search(rf"^meshkit.comm: rank {rank}: \w+: .*could not be sent in meshkit's typed format on "
                             r"(ranks \[1\]|the source, rank 1)|the source, rank 1, could not send", str(error)), error
            assert ("the typed format cannot carry a value of type test_control_messages.Mine" in str(error)
                    and "this group's peers are not authenticated" in str(error)
                    and "set MESHKIT_JOB_SECRET to the same secret on every rank, e.g. from `python -c 'import "
                        "secrets; print(secrets.token_hex(32))'`" in str(error)), error


def test_a_forged_pickle_is_refused_without_unpickling_and_the_others_are_told(fake_gpu, tmp_path, monkeypatch):
    """Rank 1's object arrives tagged as a pickle (what a forger writes into the store): no rank
    of an unauthenticated group unpickles it; each raises, breaking the group, so the next call
    fails at once."""
    from meshkit.comm import objects
    marker, real = tmp_path / "ran", objects._dump

    def forged(obj, pickles):
        if local_context().rank == 1:
            return real(Plant(marker), True)
        return real(obj, pickles)
    monkeypatch.setattr(objects, "_dump", forged)

    def body(rank):
        got = _outcome(lambda: meshkit.all_gather_object([None] * 2, rank))
        return got, _outcome(meshkit.barrier)

    for rank, ((error, _), (after, took)) in enumerate(_world(body, 2, OpenStore())):
        assert isinstance(error, ControlMessageError), error
        assert str(error).startswith(f"meshkit.comm: rank {rank}: all_gather_object: the object from rank 1 is a "
                                     "pickle, refused without unpickling it: this group's peers are not authenticated")
        assert isinstance(after, meshkit.DistError) and took < 5, (after, took)
    assert not marker.exists()


def test_forged_sizes_allocate_nothing_and_fail_every_rank_at_once(fake_gpu):
    """An outsider answers the sizes step of all_gather_object claiming 1 TiB: rank 1 refuses it
    before allocating, and rank 0, waiting for rank 1 in the next step, is told at once. The sizes
    travel beside the group's call fingerprint (comm/groups/call_fingerprint.py), which the forger copies
    (it can read the ranks' own messages in an open store)."""
    store = OpenStore()

    def body(rank):
        meshkit.barrier()
        if rank == 0:
            fp = meshkit.comm._seams.current_world().default_group.queue.sequence.value
            forged = encode(("ok", [np.array([1 << 40, fp], np.int64), np.array([5, fp], np.int64)]))
            _until_gone(store, _forge(store, "all", forged) + "/all")
        return _outcome(lambda: meshkit.all_gather_object([None] * 2, rank))

    (error0, took0), (error1, _) = _world(body, 2, store, timeout=30)
    assert isinstance(error1, ControlMessageError), error1
    assert re.search(r"rank 1: all_gather_object: rank 0 announced 1099511627776 bytes, more than any store carries "
                     r"\(16777216\); a process outside this job", str(error1)), error1
    assert isinstance(error0, meshkit.RankFailedError) and took0 < 10, (error0, took0)


@pytest.mark.parametrize("store", [meshkit.HashStore, None], ids=["authenticated store", "local engine"])
def test_authenticated_groups_pickle_as_before(fake_gpu, store):
    def body(rank):
        group = meshkit.comm._seams.current_world().default_group
        assert group.engine.capabilities.authenticated_peers
        return _all_four(rank, 2, Mine)

    results = _world(body, 2, store()) if store else local.run(lambda: body(meshkit.get_rank()), 2)
    for rank, (everyone, sent, gathered, mine) in enumerate(results):
        assert everyone == [Mine(0), Mine(1)] and sent == [Mine(1)] and mine == [Mine(rank)]
        assert gathered == ([Mine(0), Mine(1)] if rank == 0 else None)


def test_every_engine_answers_whether_its_peers_are_authenticated():
    from meshkit.comm.engines.engine import EngineCapabilities
    from meshkit.comm.engines.local_engine import LocalEngine
    from meshkit.comm.engines.store_engine import create_world_engine
    assert EngineCapabilities().authenticated_peers is False  # an engine says so only if it knows
    assert LocalEngine.capabilities.authenticated_peers
    mpi = ast.parse((Path(meshkit.comm.__file__).parent / "engines" / "mpi.py").read_text())  # importing it would start MPI
    declared = next(n.value for c in mpi.body if isinstance(c, ast.ClassDef) and c.name == "MPIEngine"
                    for n in c.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "capabilities")
    assert "authenticated_peers=True" in ast.unparse(declared)
    assert create_world_engine(meshkit.HashStore(), 0, 1, 0).capabilities.authenticated_peers
    assert not create_world_engine(OpenStore(), 0, 1, 0).capabilities.authenticated_peers
    assert create_world_engine(meshkit.PrefixStore("p", meshkit.HashStore()), 0, 1, 0).capabilities.authenticated_peers


# --------------------------------------------------------------------------- real processes: env://
def test_an_env_world_of_processes_attacked_through_its_store_runs_no_code(tmp_path, monkeypatch):
    """The reproduction: two processes meet over env:// without a job secret; the outsider
    (this process) connects to MASTER_PORT and posts a pickled notice to rank 1. No code runs;
    rank 1's barrier fails naming the key, rank 0's next one names rank 1. Before the attack, the
    world's object collectives carried plain objects and refused, on every rank, one the typed
    format cannot carry, naming MESHKIT_JOB_SECRET."""
    monkeypatch.delenv("MESHKIT_JOB_SECRET", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MESHKIT_JOB_SECRET", "LOCAL_RANK", "MESHKIT_LAUNCHED")}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               MESHKIT_TEST_NCCL_FILE=str(tmp_path / "nccl-double"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "control_attack.py"), str(tmp_path)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    marker = tmp_path / "ran"
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the world never formed"
            time.sleep(0.01)
        client = meshkit.TCPStore("127.0.0.1", port, timeout=10)
        outsider = meshkit.PrefixStore("meshkit/world", client)
        n = outsider.add("n/1/count", 1)
        outsider.set(f"n/1/{n}", pickle.dumps(Plant(marker)))
        client.close()
        (tmp_path / "attacked").touch()
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert not marker.exists(), "a pickle from the store ran in a rank"
    assert re.search(r"^BARRIER2 ControlMessageError meshkit.comm: rank 1: the notice in rendezvous store key "
                     r"'n/1/1' \(posted by another rank of this world\): not a control message meshkit wrote \(\d+ "
                     r"bytes\): it is a pickle", outputs[1], re.M), outputs[1]
    assert re.search(r"^BARRIER2 ok$", outputs[0], re.M), outputs[0]
    assert re.search(r"^BARRIER3 RankFailedError .*rank 1 stopped using group world", outputs[0], re.M), outputs[0]
    for out in outputs:
        assert re.search(r"^WORLD2 ok$", out, re.M), out  # the failed world's store server was closed
        assert re.search(r"^OBJECTS ok$", out, re.M), out
        assert re.search(r"^REFUSED ObjectCollectiveError .*could not be sent in meshkit's typed format on ranks \[1\] "
                         r"\(rank 1: the typed format cannot carry a value of type __main__.Mine .*set "
                         r"MESHKIT_JOB_SECRET to the same secret on every rank", out, re.M), out


def test_a_notice_counter_raised_by_an_outsider_costs_seconds_not_the_timeout(monkeypatch):
    """A counter raised with no notice behind it: the reader names it within the grace, skips
    that range, and reads the notices posted after it."""
    from meshkit.comm.engines import store_engine
    monkeypatch.setattr(store_engine, "_NOTICE_GRACE_S", 0.2)
    store = OpenStore()
    store.set_timeout(60)
    channel = store_engine._Channel(store, 1, 2, 0, None)
    store.add("n/1/count", 1000)
    began = time.monotonic()
    with pytest.raises(ControlMessageError, match=r"rank 1: the notice counter 'n/1/count' says 1000, but key 'n/1/1' "
                                                  r"was not written within 0.2 s of it"):
        channel.notices()
    assert time.monotonic() - began < 5
    real = Notice(LEFT, 0, detail="after the forged range")
    store_engine._Channel(store, 0, 2, 0, None).notify([1], real)
    assert channel.notices() == [real]


def test_a_malformed_typed_object_names_the_sender(fake_gpu, monkeypatch):
    from meshkit.comm import objects
    real = objects._dump
    monkeypatch.setattr(objects, "_dump", lambda obj, pickles: (np.frombuffer(b"C\xc1Z", np.uint8), 3)
                        if local_context().rank == 1 else real(obj, pickles))
    outcomes = _world(lambda rank: _outcome(lambda: meshkit.all_gather_object([None] * 2, rank))[0], 2, OpenStore())
    for rank, error in enumerate(outcomes):
        assert isinstance(error, ControlMessageError), error
        assert str(error).startswith(f"meshkit.comm: rank {rank}: all_gather_object: the object from rank 1: not a "
                                     "control message meshkit wrote (2 bytes): unknown tag 0x5a at byte 1"), error


def test_join_makes_the_list_of_messages_without_decoding_them():
    parts = [encode((3, CALL)), encode(None), encode({"a": [1, 2]})]
    assert same(decode(control.join(parts), what="x"), [(3, CALL), None, {"a": [1, 2]}])
    with pytest.raises(meshkit.DistTypeError, match="an item is not a control message"):
        control.join([b"\x80not one"])


def test_leaving_deletes_the_unread_notices_and_not_one_key_per_forged_number():
    from meshkit.comm.engines.store_engine import create_world_engine
    store = OpenStore()
    engine = create_world_engine(store, 0, 1, 0)
    for i in (1, 2, 3):
        store.set(f"n/0/{store.add('n/0/count', 1)}", encode(Notice(LEFT, 1)))
    engine.notices()  # reads 1..3
    store.set(f"n/0/{store.add('n/0/count', 1)}", encode(Notice(LEFT, 1)))  # 4, never read
    store.add("n/0/count", 10**9)  # an outsider's
    began = time.monotonic()
    engine.flush(1.0)
    # one delete for the forged counter: the unread notice 4 below it is left over (a leak, not a hang)
    assert time.monotonic() - began < 1 and store.num_keys() == 1, store.num_keys()
    engine2 = create_world_engine(store2 := OpenStore(), 0, 1, 0)
    store2.set(f"n/0/{store2.add('n/0/count', 1)}", encode(Notice(LEFT, 1)))
    engine2.flush(1.0)
    assert store2.num_keys() == 0


def test_from_locals_check_carries_plain_data_where_peers_are_not_authenticated(fake_gpu):
    """from_local's check sent Placement objects through all_gather_object, which a world whose
    store is open refuses to pickle: it sends plain data, and a bad block is named on every rank."""
    from meshkit import tensor

    def body(rank):
        mesh = meshkit.init_device_mesh("cuda", (3,))
        block = double.to_device(np.zeros((2 if rank else 1, 2)))  # rank 0's block is not torch.chunk's cut
        with pytest.raises(meshkit.DistValueError, match=r"rank 0's local has shape \(1, 2\) but global shape "
                                                         r"\(5, 2\) with placements \(Shard\(dim=0\),\) gives it "
                                                         r"\(2, 2\)"):
            tensor.DTensor.from_local(block, mesh, [tensor.Shard(0)], shape=(5, 2), run_check=True)
        good = double.to_device(np.zeros((2 if rank < 2 else 1, 2)))
        return tensor.DTensor.from_local(good, mesh, [tensor.Shard(0)], shape=(5, 2), run_check=True).shape

    assert _world(body, 3, OpenStore()) == [(5, 2)] * 3
