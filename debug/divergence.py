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
import os
from pathlib import Path
from typing import Any

from ..comm import DistValueError
from ..comm._seams import RECORD_FORMAT

__all__ = ["Finding", "load_records", "analyze", "report"]

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
    """Every ``rank<N>.json`` flight record in ``directory``, by rank.

    Raises:
        DistValueError: the folder does not exist, holds no record, or a file is not one.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise DistValueError(f"meshkit.debug: analyze: DIR={str(directory)!r} is not a folder; pass the folder "
                             "MESHKIT_TRACE_DIR named")
    records = {}
    for path in sorted(folder.glob("rank*.json")):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DistValueError(f"meshkit.debug: analyze: {path} is not a flight record: {exc}") from None
        if not isinstance(document, dict) or document.get("format") != RECORD_FORMAT:
            raise DistValueError(f"meshkit.debug: analyze: {path} is not a flight record (its format is not "
                                 f"{RECORD_FORMAT!r})")
        records[int(document["rank"])] = document
    if not records:
        raise DistValueError(f"meshkit.debug: analyze: no flight record (rank<N>.json) in {str(directory)!r}; "
                             "ranks write theirs there when a collective times out or fails with "
                             "MESHKIT_TRACE_DIR set")
    return records


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


def _name(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


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
                                                f"MISMATCH: {_name(members)} called {signature} as call #{seq} on "
                                                f"group {name} (ranks {list(ranks)}) where "
                                                f"{_name(by_signature[majority[0]])} called {majority[0]}: the "
                                                f"{what}"))
            else:
                listing = "; ".join(f"{_name(m)}: {s}" for s, m in by_signature.items())
                findings.append(Finding("mismatch", tuple(sorted(entered)), op, name, seq,
                                        f"MISMATCH: call #{seq} on group {name} (ranks {list(ranks)}) differs "
                                        f"between its ranks: {listing}"))
        # stuck: entered after the others had given up on the call
        ends = {r: e["t_end"] for r, e in entered.items() if e["t_end"] is not None and e["state"] != "completed"}
        for r, e in sorted(entered.items()):
            others = [t for o, t in ends.items() if o != r]
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
            last = _last(records[r])
            blocked = last is not None and last["state"] != "completed" and last["ranks"] is not None
            if blocked and tuple(last["ranks"]) != ranks:
                other = tuple(last["ranks"])
                # order: r waits in a call that some rank which entered this one never reached
                behind = [o for o in entered if o in other and last["seq"] not in calls.get(other, {}).get(o, {})]
                if behind:
                    pair = frozenset([r, *behind])
                    if pair not in ordered:
                        ordered.add(pair)
                        findings.append(Finding(
                            "order", tuple(sorted(pair)), op, name, seq,
                            f"ORDER: {_name(sorted(pair))} called collectives in different orders: "
                            f"{_name(behind)} entered {where} first, while rank {r} entered {last['op']} "
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
                                    f"MISSING: {_name(missing)} never entered {where}: " + "; ".join(notes)))
    findings.sort(key=lambda f: _KINDS.index(f.kind))  # stable: groups stay in order within a kind
    return findings


def report(directory: str | os.PathLike[str]) -> str:
    """What ``python -m meshkit.debug analyze DIR`` prints."""
    records = load_records(directory)
    world = max(d["world_size"] for d in records.values())
    lines = [f"meshkit.debug: flight records of ranks {sorted(records)} (world of {world}) in {directory}"]
    absent = [r for r in range(world) if r not in records]
    if absent:
        lines.append(f"no record from {_name(absent)}")
    findings = analyze(records)
    for record in sorted(records.values(), key=lambda d: d["rank"]):
        if record.get("reason"):
            lines.append(f"rank {record['rank']} wrote its record after: {record['reason'].splitlines()[0]}")
    lines += [f.text for f in findings] or ["no divergence: every group's calls were completed or failed alike "
                                            "on every rank that wrote a record"]
    return "\n".join(lines)
