"""``python -m meshkit.debug analyze DIR``: name the divergence in the flight records of DIR.

Exit status 0 with the findings on standard output; 2 with the reason on standard error when DIR
holds no readable record or a file that is not a valid one (see :func:`~.divergence.load_records`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..comm import DistValueError
from .divergence import printable, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshkit.debug",
                                     description="Debugging tools for meshkit jobs (see docs/hangs.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    analyze = commands.add_parser("analyze", help="read the rank<N>.json flight records that the ranks wrote to "
                                  "MESHKIT_TRACE_DIR and name the divergence (ranks and op)")
    analyze.add_argument("directory", metavar="DIR", help="the folder MESHKIT_TRACE_DIR named")
    args = parser.parse_args(argv)
    try:
        text = report(args.directory)
    except DistValueError as exc:  # (its text names files and fields of the records: printable too)
        _print("\n".join(printable(line) for line in str(exc).splitlines()), sys.stderr)
        return 2
    _print(text, sys.stdout)
    return 0


def _print(text: str, stream: Any) -> None:
    """``text`` on ``stream``, any character its encoding lacks written as an escape (a non-UTF-8
    terminal must not turn a record's text into a UnicodeEncodeError)."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    print(text.encode(encoding, "backslashreplace").decode(encoding), file=stream)


if __name__ == "__main__":
    sys.exit(main())
