"""``python -m meshkit.debug analyze DIR``: name the divergence in the flight records of DIR."""

from __future__ import annotations

import argparse
import sys

from ..comm import DistValueError
from .divergence import report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshkit.debug",
                                     description="Debugging tools for meshkit jobs (see docs/hangs.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    analyze = commands.add_parser("analyze", help="read the rank<N>.json flight records that the ranks wrote to "
                                  "MESHKIT_TRACE_DIR and name the divergence (ranks and op)")
    analyze.add_argument("directory", metavar="DIR", help="the folder MESHKIT_TRACE_DIR named")
    args = parser.parse_args(argv)
    try:
        print(report(args.directory))
    except DistValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
