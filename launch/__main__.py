"""``python -m meshkit.launch -n N script.py ARGS``: the same as ``meshkit-run``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
