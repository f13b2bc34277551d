"""``--help`` of every benchmark named in argv, all in this one process (a process each costs a second
or more of start-up on a loaded machine): each script runs as ``__main__`` with ``sys.argv = [script,
"--help"]`` and its folder first on ``sys.path``, as ``python SCRIPT --help`` would run it. Prints one
JSON line per script: its name, the exit code, and what it wrote to stdout and stderr.
"""

import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path

real_stdout = sys.stdout
for path in map(Path, sys.argv[1:]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [str(path), "--help"]
    sys.path.insert(0, str(path.parent))
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 (reported as the script's failure)
            traceback.print_exc()
            code = 1
    sys.path.remove(str(path.parent))
    print(json.dumps({"script": path.name, "code": code, "out": out.getvalue(), "err": err.getvalue()}),
          file=real_stdout, flush=True)
