"""State dicts stay current (issue 23.1) and hold what torch's do (23.9); replicated copies agree
and read-only destinations are named (23.8)."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_state_cases as cases
from meshkit.comm import local


@pytest.mark.parametrize("how", cases.SAVES)
@pytest.mark.parametrize("pattern", cases.PATTERNS)
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("kind", cases.KINDS)
def test_resuming_equals_training_on_however_the_state_dict_was_built(kind, opt, pattern, how, tmp_path):
    got = local.run(lambda: cases.resume(kind, opt, pattern, how, tmp_path), 4 if kind == "hsdp" else 2)[0]
    cases.check(got, opt, tmp_path, f"{kind} {opt} {pattern} {how}")


def test_resuming_a_state_dict_built_once_on_real_processes(tmp_path):
    from conftest import launch
    launch("mpi_checkpoint_resume.py", 2, str(tmp_path), "first", timeout=120)
    proc = launch("mpi_checkpoint_resume.py", 2, str(tmp_path), "resume", timeout=120)
    assert proc.stdout.count("RESUMED OK") == 2, proc.stdout
