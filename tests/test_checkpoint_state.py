"""State dicts stay current (issue 23.1) and hold what torch's do (23.9); replicated copies agree
and read-only destinations are named (23.8)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import checkpoint_state_cases as cases
from meshkit.comm import local


@pytest.mark.parametrize("how", cases.SAVES)
@pytest.mark.parametrize("pattern", cases.PATTERNS)
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("kind", cases.KINDS)
def test_resuming_equals_training_on_however_the_state_dict_was_built(kind, opt, pattern, how, tmp_path):
    n = 4 if kind == "hsdp" else 2
    got = local.run(lambda: cases.resume(kind, opt, pattern, how, tmp_path), n)[0]
    ref = cases.reference(opt, 6)
    for name, expected in ref.items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-10, atol=1e-10 * float(np.abs(expected).max()),
                                   err_msg=f"{kind} {opt} {pattern} {how} {name}")
    for step in (3, 6):  # each checkpoint records the count of the steps taken, the resumed run's too
        values = json.loads((tmp_path / f"step_{step}" / "metadata.json").read_text())["values"]
        counts = {k: v for k, v in values.items() if k.startswith("optim.step.")}
        assert counts and set(counts.values()) == {step}, (step, counts)
