"""Reading the flight records that ranks wrote to ``MESHKIT_TRACE_DIR``, and naming the divergence.

When a collective times out (or fails: a mismatch, a peer's failure) and ``MESHKIT_TRACE_DIR``
is set, each rank writes ``rank<N>.json`` there. :func:`analyze` reads them all and, for each
group, finds the first call that not every member completed (its *frontier*), then says why:

* ``mismatch``: the ranks that entered it called different things (op, shapes or dtype); the
  ranks named are those in the minority (all of them where no call has a majority);
* ``order``: a rank that did not enter it waits in a call of another group that a rank which did
  enter it never reached: the two called those collectives in opposite orders;
* ``stuck``: a rank entered it only after the others had given up on it (it was stuck before the
  call, e.g. in compute, for longer than the timeout);
* ``missing``: a rank never entered it and waits in nothing (or wrote no record at all: it
  exited, crashed, or was still stuck when the job ended).

Times are each rank's wall clock (``time.time()``): comparable across ranks as far as the
hosts' clocks agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import unicodedata
from pathlib import Path
from typing import Any

from ..comm import DistValueError
from ..comm._seams import RECORD_FORMAT, NotRegular, TooLarge, name_ranks, positive_setting, read_bounded

__all__ = ["Finding", "load_records", "check_record", "analyze", "report", "printable", "max_record_bytes",
           "MAX_RECORD_ENV", "MAX_RECORD_BYTES"]

#: The order findings are listed in, within one group's frontier (the cause first).
_KINDS = ("mismatch", "order", "stuck", "missing")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One divergence: ``kind`` (mismatch, order, stuck, missing), the global ``ranks`` it names,
    the ``op``, ``group`` name and call number ``seq`` it is about, and the sentence that says it."""

    kind: str
    ranks: tuple[int, ...]
    op: str
    group: str
    seq: int
    text: str


def load_records(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every ``rank<N>.json`` flight record in ``directory``, by rank, each checked for form.

    The folder may be shared with other users (``MESHKIT_TRACE_DIR`` on a shared disk), so a
    record is read only if it is a regular file (a FIFO would wait for a writer, ``/dev/zero``
    never end), at most :func:`max_record_bytes` of it, and only if every field the analysis
    reads has the type and range a rank writes (:func:`check_record`): a record of the format
    with fields missing or of other types is refused here, never half-analysed. The time is
    linear in the records' size.

    Raises:
        DistValueError: the folder does not exist or holds no record; a file is not a flight
            record (not a regular file, too large, not JSON, another format, a field of the
            wrong type or range); two files hold one rank's record; records of worlds of two
            sizes. Each names the file and what is wrong.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise DistValueError(f"meshkit.debug: analyze: DIR={str(directory)!r} is not a folder; pass the folder "
                             "MESHKIT_TRACE_DIR named")
    limit = max_record_bytes()
    records: dict[int, dict[str, Any]] = {}
    paths: dict[int, Path] = {}
    for path in sorted(folder.glob("rank*.json")):
        document = _parse(path, _read_record(path, limit))
        if not isinstance(document, dict) or document.get("format") != RECORD_FORMAT:
            raise DistValueError(f"meshkit.debug: analyze: {path} is not a flight record (its format is not "
                                 f"{RECORD_FORMAT!r})")
        try:
            check_record(document)
        except ValueError as exc:
            raise DistValueError(f"meshkit.debug: analyze: {path} is not a valid flight record: {exc}") from None
        rank = document["rank"]
        if rank in records:
            raise DistValueError(f"meshkit.debug: analyze: {paths[rank]} and {path} both hold the record of rank "
                                 f"{rank}; keep the one of the job to analyse")
        if records:
            first = next(iter(records))
            if document["world_size"] != records[first]["world_size"]:
                raise DistValueError(f"meshkit.debug: analyze: {path} says a world of {document['world_size']} "
                                     f"ranks, but {paths[first]} one of {records[first]['world_size']}: records of "
                                     "two jobs? Analyse a folder holding one job's records")
        records[rank], paths[rank] = document, path
    if not records:
        raise DistValueError(f"meshkit.debug: analyze: no flight record (rank<N>.json) in {str(directory)!r}; "
                             "ranks write theirs there when a collective times out or fails with "
                             "MESHKIT_TRACE_DIR set")
    return records


#: The variable that sets :func:`max_record_bytes`.
MAX_RECORD_ENV = "MESHKIT_DEBUG_MAX_RECORD_BYTES"
#: A record's default cap. A rank's record holds its last 64 calls, each naming its group's
#: ranks (about 7 bytes a rank): a world of 16k ranks whose every call is on the world group
#: writes 64 x 16k x 7 = 7 MB; 16 MiB holds that twice over. Larger worlds: set the variable.
MAX_RECORD_BYTES = 16 << 20


def max_record_bytes() -> int:
    """``MESHKIT_DEBUG_MAX_RECORD_BYTES``: the most bytes of one rank's record that ``meshkit.debug``
    reads (a ``rank<N>.json`` file, or a rank's answer to the debug server's ``/all``); default
    :data:`MAX_RECORD_BYTES`.

    Raises:
        DistValueError: the variable is not a positive whole number of bytes, naming it.
    """
    return int(positive_setting(MAX_RECORD_ENV, MAX_RECORD_BYTES, integer=True, where="meshkit.debug",
                                valid=f"a positive number of bytes (default {MAX_RECORD_BYTES}: 16 MiB)"))


def _read_record(path: Path, limit: int) -> bytes:
    """The bytes of the record at ``path``, if it is a regular file of at most ``limit`` bytes; it is
    opened without blocking (a FIFO swapped in after the check does not wait for a writer)."""
    try:
        return read_bounded(path, limit)
    except NotRegular as exc:
        raise DistValueError(f"meshkit.debug: analyze: {path} is not a regular file ({exc.kind}); a flight record is "
                             "a file a rank wrote") from None
    except TooLarge:
        raise DistValueError(f"meshkit.debug: analyze: {path} is larger than {limit} bytes ({MAX_RECORD_ENV}); "
                             "set that variable higher to read it") from None
    except OSError as exc:
        raise DistValueError(f"meshkit.debug: analyze: {path} cannot be read: {exc}") from None


def _parse(path: Path, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise DistValueError(f"meshkit.debug: analyze: {path} is not a flight record: its JSON is nested too "
                             "deeply") from None
    except ValueError as exc:  # (UnicodeDecodeError too)
        raise DistValueError(f"meshkit.debug: analyze: {path} is not a flight record: {exc}") from None


#: An entry's states (:data:`meshkit.comm.debug.RECORD_FIELDS`; ``rejected``: arguments refused).
_STATES = ("completed", "failed", "rejected", "scheduled", "started", "timed_out")
#: MPI's ranks are C ints; sequence numbers count calls (int64).
_MAX_WORLD, _MAX_SEQ = 2 ** 31 - 1, 2 ** 63 - 1


def _shown(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _is_int(v: Any, low: int, high: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def check_record(doc: dict[str, Any]) -> None:
    """Check that a flight record (a parsed ``rank<N>.json``) has the form a rank writes
    (:func:`meshkit.comm._seams.flight_document`): every field the analysis reads present, of
    its type and in range (ranks inside the world, a world a C int can count). Linear in its size.

    Raises:
        ValueError: the first field that is not, named (``entry 3: 'seq' must be ...``).
    """
    for field in ("rank", "world_size", "groups", "entries"):
        if field not in doc:
            raise ValueError(f"it has no {field!r}")
    world = doc["world_size"]
    if not _is_int(world, 1, _MAX_WORLD):
        raise ValueError(f"'world_size' must be an int in 1..{_MAX_WORLD}, got {_shown(world)}")
    if not _is_int(doc["rank"], 0, world - 1):
        raise ValueError(f"'rank' must be an int in 0..{world - 1} (its world_size less one), got "
                         f"{_shown(doc['rank'])}")
    for field in ("reason", "backend"):
        if field in doc and not isinstance(doc[field], str):
            raise ValueError(f"{field!r} must be a str, got {_shown(doc[field])}")
    if "time" in doc and not _is_time(doc["time"]):
        raise ValueError(f"'time' must be a finite number, got {_shown(doc['time'])}")
    if not isinstance(doc["groups"], list):
        raise ValueError(f"'groups' must be a list, got {type(doc['groups']).__name__}")
    for i, g in enumerate(doc["groups"]):
        if not isinstance(g, dict):
            raise ValueError(f"group {i} must be a JSON object, got {_shown(g)}")
        for field in ("name", "ranks"):
            if field not in g:
                raise ValueError(f"group {i} has no {field!r}")
        if not isinstance(g["name"], str):
            raise ValueError(f"group {i}: 'name' must be a str, got {_shown(g['name'])}")
        if not _ranks(g["ranks"], world):
            raise ValueError(f"group {i}: 'ranks' must be a list of distinct ints in 0..{world - 1}, got "
                             f"{_shown(g['ranks'])}")
    if not isinstance(doc["entries"], list):
        raise ValueError(f"'entries' must be a list, got {type(doc['entries']).__name__}")
    for i, e in enumerate(doc["entries"]):
        if not isinstance(e, dict):
            raise ValueError(f"entry {i} must be a JSON object, got {_shown(e)}")
        try:
            _check_entry(e, world)
        except KeyError as exc:
            raise ValueError(f"entry {i} has no {exc.args[0]!r}") from None
        except ValueError as exc:
            raise ValueError(f"entry {i}: {exc}") from None


def _is_time(t: Any) -> bool:
    """Seconds, as a rank's clock gives them: a finite float, or an int a float holds exactly."""
    return (isinstance(t, float) and math.isfinite(t)) or _is_int(t, -(2 ** 53), 2 ** 53)


def _ranks(v: Any, world: int) -> bool:
    return isinstance(v, list) and all(_is_int(r, 0, world - 1) for r in v) and len(set(v)) == len(v)


def _check_entry(e: dict[str, Any], world: int) -> None:
    """One entry's fields (KeyError: one is missing)."""
    if not _is_int(e["seq"], -1, _MAX_SEQ):
        raise ValueError(f"'seq' must be an int in -1..2**63-1, got {_shown(e['seq'])}")
    for field in ("group", "op"):
        if not isinstance(e[field], str):
            raise ValueError(f"{field!r} must be a str, got {_shown(e[field])}")
    if e["state"] not in _STATES:
        raise ValueError(f"'state' must be one of {list(_STATES)}, got {e['state']!r}"[:200])
    shapes = e["shapes"]
    if not isinstance(shapes, list) or not all(
            isinstance(s, list) and all(_is_int(n, 0, _MAX_SEQ) for n in s) for s in shapes):
        raise ValueError(f"'shapes' must be a list of lists of ints, got {_shown(shapes)}")
    for field in ("dtype", "error"):
        if e[field] is not None and not isinstance(e[field], str):
            raise ValueError(f"{field!r} must be null or a str, got {_shown(e[field])}")
    for field in ("t_scheduled", "t_start", "t_end"):
        if e[field] is not None and not _is_time(e[field]):
            raise ValueError(f"{field!r} must be null or a finite number, got {_shown(e[field])}")
    if e["ranks"] is not None and not _ranks(e["ranks"], world):
        raise ValueError(f"'ranks' must be null or a list of distinct ints in 0..{world - 1} (the world's ranks), "
                         f"got {_shown(e['ranks'])}")


#: Characters shown escaped when ``analyze`` prints text from a record: control characters
#: (terminal escape sequences start with ESC), format characters (bidirectional overrides),
#: surrogates, unassigned and private-use code points, line and paragraph separators.
_HIDDEN = frozenset(("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"))
_NOT_PLAIN = re.compile(r"[^\x20-\x7e]")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on, or that would hide or reorder text,
    written as its Python escape (``\\x1b``, ``\\u202e``); one line (a newline is ``\\n``)."""
    return _NOT_PLAIN.sub(lambda m: m[0].encode("unicode_escape").decode("ascii")
                          if unicodedata.category(m[0]) in _HIDDEN else m[0], text)


def _signature(entry: dict[str, Any]) -> str:
    shapes = ", ".join(str(tuple(s)) for s in entry["shapes"])
    dtype = f", dtype={entry['dtype']}" if entry["dtype"] else ""
    return f"{entry['op']}(shapes=[{shapes}]{dtype})"


def _differs(a: dict[str, Any], b: dict[str, Any]) -> str:
    """What differs between two calls, in words (op, shape/size, dtype)."""
    parts = []
    if a["op"] != b["op"]:
        parts.append("op")
    if a["shapes"] != b["shapes"]:
        parts.append("shape/size")
    if a["dtype"] != b["dtype"]:
        parts.append("dtype")
    if not parts:
        return "arguments differ"
    return f"{parts[0]} differs" if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]} differ"


def _last(document: dict[str, Any]) -> dict[str, Any] | None:
    """The rank's latest collective (numbered, not rejected) entry."""
    calls = [e for e in document["entries"] if e["seq"] >= 0 and e["state"] != "rejected"]
    return calls[-1] if calls else None



def analyze(records: dict[int, dict[str, Any]]) -> list[Finding]:
    """The divergences these ranks' flight records show (see the module docstring), cause first."""
    groups: dict[tuple[int, ...], str] = {}
    for document in records.values():
        for g in document["groups"]:
            groups.setdefault(tuple(g["ranks"]), g["name"])
    calls: dict[tuple[int, ...], dict[int, dict[int, dict[str, Any]]]] = {}  # group -> rank -> seq -> entry
    for rank, document in records.items():
        for e in document["entries"]:
            if e["seq"] >= 0 and e["state"] != "rejected" and e["ranks"] is not None:
                calls.setdefault(tuple(e["ranks"]), {}).setdefault(rank, {})[e["seq"]] = e
    frontiers: dict[tuple[int, ...], int] = {}
    for ranks, by_rank in calls.items():
        done = [max((s for s, e in by_rank.get(r, {}).items() if e["state"] == "completed"), default=-1)
                for r in ranks if r in records]
        seq = min(done) + 1
        if any(seq in by_rank.get(r, {}) or any(e["state"] != "completed" for e in by_rank.get(r, {}).values())
               for r in ranks if r in records):
            frontiers[ranks] = seq
    findings: list[Finding] = []
    ordered: set[frozenset[int]] = set()
    lasts = {r: _last(d) for r, d in records.items()}  # (looked up per group below: once each)
    for ranks, seq in sorted(frontiers.items()):
        name = groups.get(ranks, f"group{list(ranks)}")
        by_rank = calls[ranks]
        entered = {r: by_rank[r][seq] for r in ranks if seq in by_rank.get(r, {})}
        op = next(iter(entered.values()))["op"] if entered else "?"
        where = f"{op} #{seq} on group {name} (ranks {list(ranks)})"
        # mismatch: the callers disagree
        by_signature: dict[str, list[int]] = {}
        for r, e in entered.items():
            by_signature.setdefault(_signature(e), []).append(r)
        if len(by_signature) > 1:
            largest = max(len(v) for v in by_signature.values())
            majority = [s for s, v in by_signature.items() if len(v) == largest]
            if len(majority) == 1:
                reference = entered[by_signature[majority[0]][0]]
                for signature, members in by_signature.items():
                    if signature != majority[0]:
                        what = _differs(entered[members[0]], reference)
                        findings.append(Finding("mismatch", tuple(members), entered[members[0]]["op"], name, seq,
                                                f"MISMATCH: {name_ranks(members)} called {signature} as call #{seq} on "
                                                f"group {name} (ranks {list(ranks)}) where "
                                                f"{name_ranks(by_signature[majority[0]])} called {majority[0]}: the "
                                                f"{what}"))
            else:
                listing = "; ".join(f"{name_ranks(m)}: {s}" for s, m in by_signature.items())
                findings.append(Finding("mismatch", tuple(sorted(entered)), op, name, seq,
                                        f"MISMATCH: call #{seq} on group {name} (ranks {list(ranks)}) differs "
                                        f"between its ranks: {listing}"))
        # stuck: entered after the others had given up on the call
        ends = sorted((e["t_end"], r) for r, e in entered.items()
                      if e["t_end"] is not None and e["state"] != "completed")[:2]  # the others' earliest, below
        for r, e in sorted(entered.items()):
            others = [t for t, o in ends if o != r][:1]
            start = e["t_start"] or e["t_scheduled"]
            if others and start is not None and start >= min(others):
                previous = [p for s, p in by_rank[r].items() if s < seq and p["t_end"] is not None]
                since = f" {start - previous[-1]['t_end']:.2f} s after its call #{previous[-1]['seq']} completed" \
                    if previous else ""
                findings.append(Finding("stuck", (r,), e["op"], name, seq,
                                        f"STUCK: rank {r} entered {where} only{since}, "
                                        f"{start - min(others):.2f} s after the others had given up on it: it was "
                                        "stuck before the call (in compute, or elsewhere outside meshkit)"))
        # the members that never entered the call
        absent = [r for r in ranks if r not in entered]
        missing: list[int] = []
        notes: list[str] = []
        for r in absent:
            if r not in records:
                missing.append(r)
                notes.append(f"rank {r} wrote no flight record (it exited, crashed, or was still busy when the "
                             "job ended)")
                continue
            last = lasts[r]
            blocked = last is not None and last["state"] != "completed" and last["ranks"] is not None
            if blocked and tuple(last["ranks"]) != ranks:
                other = tuple(last["ranks"])
                members = set(other)
                # order: r waits in a call that some rank which entered this one never reached
                behind = [o for o in entered if o in members and last["seq"] not in calls.get(other, {}).get(o, {})]
                if behind:
                    pair = frozenset([r, *behind])
                    if pair not in ordered:
                        ordered.add(pair)
                        findings.append(Finding(
                            "order", tuple(sorted(pair)), op, name, seq,
                            f"ORDER: {name_ranks(sorted(pair))} called collectives in different orders: "
                            f"{name_ranks(behind)} entered {where} first, while rank {r} entered {last['op']} "
                            f"#{last['seq']} on group {last['group']} (ranks {last['ranks']}) first; each waits "
                            "for the other"))
                    continue
                missing.append(r)
                notes.append(f"rank {r} was waiting in {last['op']} #{last['seq']} on group {last['group']} "
                             f"(ranks {last['ranks']}) instead")
                continue
            missing.append(r)
            done = [e for s, e in sorted(by_rank.get(r, {}).items()) if e["state"] == "completed"]
            after = f"its last call on the group was #{done[-1]['seq']} {done[-1]['op']}, completed" if done else \
                "it made no call on the group"
            notes.append(f"rank {r}: {after}; nothing in flight after it (it skipped the call, or was stuck "
                         "before it until the job ended)")
        if missing:
            findings.append(Finding("missing", tuple(missing), op, name, seq,
                                    f"MISSING: {name_ranks(missing)} never entered {where}: " + "; ".join(notes)))
    findings.sort(key=lambda f: _KINDS.index(f.kind))  # stable: groups stay in order within a kind
    return findings


def report(directory: str | os.PathLike[str]) -> str:
    """What ``python -m meshkit.debug analyze DIR`` prints: each line :func:`printable` (text from
    the records, such as op and group names, cannot move the cursor or recolour the terminal)."""
    records = load_records(directory)
    world = next(iter(records.values()))["world_size"]  # (load_records checked that they agree)
    lines = [f"meshkit.debug: flight records of {_ranks_text(_runs(sorted(records)))} (world of {world}) in "
             f"{directory}"]
    ranks = sorted(records)
    absent = [(a + 1, b - 1) for a, b in zip([-1, *ranks], [*ranks, world]) if b - a > 1]  # never one rank at a time
    if absent:
        lines.append(f"no record from {_ranks_text(absent)}")
    findings = analyze(records)
    for record in sorted(records.values(), key=lambda d: d["rank"]):
        if record.get("reason"):
            lines.append(f"rank {record['rank']} wrote its record after: {(record['reason'].splitlines() or [''])[0]}")
    lines += [f.text for f in findings] or ["no divergence: every group's calls were completed or failed alike "
                                            "on every rank that wrote a record"]
    return "\n".join(printable(line) for line in lines)


def _runs(ranks: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ranks as runs ``(first, last)`` of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return runs


def _ranks_text(runs: list[tuple[int, int]]) -> str:
    """``rank 3``, ``ranks 2..2147483646``, ``ranks [0, 1, 5..9]``: runs of three or more as ``a..b``."""
    parts: list[str] = []
    for a, b in runs:
        parts += [f"{a}..{b}"] if b - a >= 2 else [str(r) for r in range(a, b + 1)]
    if len(parts) == 1 and ".." not in parts[0]:
        return f"rank {parts[0]}"
    return f"ranks {parts[0]}" if len(parts) == 1 else f"ranks [{', '.join(parts)}]"
