"""benchmarks/collectives.py: the CPU path's output, the command line, and the GPU path end to
end against the NCCL double (tests/doubles/nccl_double.py; ``--device cuda`` on a real GPU is run by
benchmarks/gpu_check.sh); every other benchmark's ``--help`` and a tiny run. Only that each path
runs and checks its results is tested here, never a timing. Every benchmark runs with
DeprecationWarnings as errors (``PYTHONWARNINGS``, which meshkit-run's ranks inherit): a
benchmark written against an old spelling of the API fails here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_survive import needs_ulfm

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
BENCH = BENCHMARKS / "collectives.py"


@pytest.fixture(autouse=True)
def deprecations_are_errors(monkeypatch):
    """Every benchmark process (and each rank under meshkit-run) turns a DeprecationWarning into
    an error, as ``python -W error::DeprecationWarning`` does."""
    monkeypatch.setenv("PYTHONWARNINGS", "error::DeprecationWarning")
#: A short sweep: 8 B, 512 B, 32 KB, 64 KB, few calls, one round.
QUICK = ["--min-bytes", "8", "--max-bytes", "64K", "--step-factor", "64", "--iters", "2", "--warmup", "1",
         "--rounds", "1", "--no-progress"]
SIZES = ["8", "512", "32K", "64K"]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]


def table_rows(out: str, op: str) -> dict[str, list[str]]:
    """Size -> the cells of ``op``'s table row (time, algbw, busbw per engine, then the ratio)."""
    rows = {}
    for line in out.splitlines():
        line = re.sub(r"^\[rank0\]: ", "", line)
        cells = line.split()
        if len(cells) > 3 and cells[0] == op and cells[1] in SIZES:
            rows[cells[1]] = [c for c in cells[3:] if c != "|"]
    return rows


def run_bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The benchmark as one process (MPI singleton), for the command line's checks."""
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_cpu_path_keeps_its_tables_summaries_and_json(mpirun, tmp_path):
    out_json = tmp_path / "cpu.json"
    out = mpirun(BENCH, 2, *QUICK, "--ops", "all_reduce,all_to_all", "--engines", "meshkit,mpi4py",
                 "--json", str(out_json)).stdout
    assert ("# all_reduce: 2 ranks, float32, time = median over rounds of the slowest rank's mean per call"
            in out), out
    assert ("#             op     size      count | time(us) algbw(GB/s) busbw(GB/s) | time(us) algbw(GB/s) "
            "busbw(GB/s) | meshkit/mpi4py") in out, out
    for op in ("all_reduce", "all_to_all"):
        rows = table_rows(out, op)
        assert sorted(rows) == sorted(SIZES), out
        assert all(len(cells) == 7 for cells in rows.values()), rows  # 2 x (time, algbw, busbw) + ratio
        assert re.search(rf"# {op} summary \(meshkit vs mpi4py\): worst time ratio at >= 64K: [\d.]+ at 64K "
                         r"\(target <= 1.05: (met|MISSED)\); worst excess at <= 4K: [+-][\d.]+ us at \d+ "
                         r"\(target <= 10 us: (met|MISSED)\)", out), out
    data = json.loads(out_json.read_text())
    assert "device" not in data["metadata"] and data["metadata"]["engines"] == ["meshkit", "mpi4py"]
    assert len(data["rows"]) == 2 * len(SIZES) * 2
    assert all(r["time_us"] > 0 for r in data["rows"])


def test_device_cuda_without_a_gpu_is_a_usage_error():
    proc = run_bench("--device", "cuda", *QUICK, env={"CUDA_VISIBLE_DEVICES": ""})  # no GPU, even on a GPU host
    assert proc.returncode == 2, proc
    assert "error: --device cuda needs a GPU that CuPy can use, and there is none here (" in proc.stderr, proc.stderr
    assert "use --device cpu" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "invalid --device 'tpu'; valid devices are ['cpu', 'cuda']"),
    (["--backend", "nccl"], "invalid --backend 'nccl' with --device cpu; valid backends are ['mpi']"),
    (["--device", "cuda", "--backend", "gloo"],
     "invalid --backend 'gloo' with --device cuda; valid backends are ['nccl', 'mpi']"),
    (["--device", "cuda", "--dtype", "int16"],
     "invalid --dtype 'int16' with --backend nccl; NCCL reduces ['int8'"),
])
def test_invalid_device_backend_and_dtype_are_usage_errors(args, message):
    proc = run_bench(*args, *QUICK)
    assert proc.returncode == 2, proc
    assert message in proc.stderr, proc.stderr


def double_run(mpirun, n: int, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, dict]:
    out_json = tmp_path / "gpu.json"
    out = mpirun("bench_cuda_double.py", n, "--device", "cuda", *QUICK, *args, "--json", str(out_json), env=env,
                 timeout=240).stdout
    return out, json.loads(out_json.read_text())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_nccl_path_runs_and_checks_every_op_on_the_double(mpirun, tmp_path, mode):
    out, data = double_run(mpirun, 1, tmp_path, "--mode", mode)
    meta = data["metadata"]
    assert (meta["device"], meta["backend"], meta["mode"], meta["reference"]) == ("cuda", "nccl", mode, "nccl")
    assert meta["engines"] == ["meshkit", "nccl"] and meta["world_size"] == 1
    for op in OPS:
        assert f"# {op}: 1 ranks, float32 on cuda (nccl, {mode}), time = " in out, out
        rows = table_rows(out, op)
        assert sorted(rows) == sorted(SIZES) and all(len(c) == 7 for c in rows.values()), out
        assert re.search(rf"# {op} summary \(meshkit vs nccl\): worst excess at < 1M: [+-][\d.]+ us at \d+K? "
                         r"\(target <= 15 us: (met|MISSED)\)", out), out
    assert {(r["op"], r["engine"]) for r in data["rows"]} == {(op, e) for op in OPS for e in ("meshkit", "nccl")}
    assert all(r["time_us"] > 0 for r in data["rows"])


@pytest.mark.parametrize("aware", ["0", "1"])
def test_cuda_mpi_path_runs_and_checks_every_op_on_the_double(mpirun, tmp_path, aware):
    out, data = double_run(mpirun, 2, tmp_path, "--backend", "mpi", env={"MESHKIT_CUDA_AWARE_MPI": aware})
    engines = ["meshkit", "mpi4py-staged"] + (["mpi4py-cuda"] if aware == "1" else [])
    ref = engines[-1]
    meta = data["metadata"]
    assert (meta["backend"], meta["reference"], meta["engines"], meta["cuda_aware_mpi"]) == (
        "mpi", ref, engines, aware == "1")
    for op in OPS:
        rows = table_rows(out, op)
        assert sorted(rows) == sorted(SIZES) and all(len(c) == 3 * len(engines) + 1 for c in rows.values()), out
        assert f"# {op} summary (meshkit vs {ref}): worst excess at < 1M: " in out, out
    assert all(r["time_us"] > 0 for r in data["rows"]) and len(data["rows"]) == len(OPS) * len(SIZES) * len(engines)
    staging = re.findall(r"staging: pinned=(\d+) to_host=(\d+) to_device=(\d+)", out)
    assert len(staging) == 2 and all(int(h) > 0 for _, h, _ in staging), out  # the checks and mpi4py-staged


def test_a_wrong_result_stops_the_cuda_benchmark(mpirun, tmp_path):
    proc = mpirun("bench_cuda_double.py", 1, "--device", "cuda", *QUICK, "--ops", "all_gather", "--json",
                  str(tmp_path / "x.json"), env={"BENCH_BREAK": "all_gather"}, check=False, timeout=120)
    assert proc.returncode != 0
    assert "RuntimeError: meshkit.bench: meshkit all_gather of 8 bytes gave a wrong result on ranks [0]" in (
        proc.stdout + proc.stderr), proc.stdout + proc.stderr
    assert not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------- checkpoint.py
CHECKPOINT_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoint.py"


def test_checkpoint_benchmark_times_every_candidate_and_writes_json(mpirun, tmp_path):
    out_json = tmp_path / "ck.json"
    out = mpirun(CHECKPOINT_BENCH, 2, "--mb", "1", "--arrays", "3", "--rounds", "2", "--no-progress",
                 "--dir", str(tmp_path / "ck"), "--json", str(out_json)).stdout
    rows = json.loads(out_json.read_text())["rows"]
    torch_rows = ["torch DCP save", "torch DCP load"] if _torch_dcp_importable() else []
    assert [r["candidate"] for r in rows] == ["np.save", "np.save+fsync", "meshkit save", "async_save (blocking)",
                                              "np.load", "meshkit load", *torch_rows]
    assert all(r["seconds"] > 0 and len(r["all"]) == 2 for r in rows)
    assert {r["candidate"]: r["baseline"] for r in rows if r["ratio"] is not None} == {
        "meshkit save": "np.save", "async_save (blocking)": "np.save", "meshkit load": "np.load",
        **{name: "np.save" if name.endswith("save") else "np.load" for name in torch_rows}}
    assert re.search(r"meshkit load\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+np.load", out), out
    assert ("note: torch DCP is not compared: torch is not importable" in out) == (not torch_rows), out


def _torch_dcp_importable() -> bool:
    try:
        import torch.distributed.checkpoint as tdcp
    except ImportError:
        return False
    return hasattr(tdcp, "save")


# --------------------------------------------------------------------------- pipeline.py
PIPELINE_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline.py"


def test_pipeline_benchmark_reports_bubbles_and_peak_activations(mpirun, tmp_path):
    out_json = tmp_path / "pp.json"
    out = mpirun(PIPELINE_BENCH, 2, "--microbatches", "2,4", "--forward-ms", "0.5", "--rounds", "2", "--no-progress",
                 "--json", str(out_json)).stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4),
                                                                  ("interleaved", 2), ("interleaved", 4),
                                                                  ("zbh1", 2), ("zbh1", 4), ("zbv", 2), ("zbv", 4)]
    by = {(r["schedule"], r["microbatches"]): r for r in rows}
    # zero bubble: the formula is the simulation's with F = B = W; ZB-H1 holds min(p, m) on each stage (F to W),
    # ZB-V's rank r holds stages r and 2p - 1 - r (the peaks of zbv_order on 2 ranks, 4 microbatches)
    assert by[("zbh1", 4)]["bubble_formula"] == pytest.approx(1 / 13)
    assert by[("zbv", 4)]["bubble_formula"] == pytest.approx(1 / 25)
    assert by[("zbh1", 4)]["peak_activations"] == {"0": 2, "1": 2}
    assert by[("zbv", 4)]["peak_activations"] == {"0": 4, "1": 3, "2": 2, "3": 1}
    assert by[("1f1b", 4)]["peak_activations"] == {"0": 2, "1": 1}  # min(p - s, m)
    assert by[("gpipe", 4)]["peak_activations"] == {"0": 4, "1": 4}
    assert by[("gpipe", 4)]["bubble_formula"] == pytest.approx(1 / 5)
    assert by[("interleaved", 4)]["bubble_formula"] == pytest.approx(1 / 9)
    assert all(r["step_s"] >= r["ideal_s"] for r in rows)  # sleeping stages: never faster than their compute
    assert "peak activations per stage" in out
    # m == p: interleaved runs every forward first, and the row says what that means
    assert by[("interleaved", 2)]["note"].startswith("m == p: every forward first")
    assert not by[("interleaved", 4)]["note"]
    assert "(m == p: every forward first (Megatron-LM); bubble formula unchanged, each stage holds all m)" in out
    pytest.importorskip("matplotlib")
    png = tmp_path / "pp.png"
    subprocess.run([sys.executable, str(PIPELINE_BENCH), "--plot-from", str(out_json), "--plot", str(png)], check=True,
                   capture_output=True, timeout=120)
    assert png.stat().st_size > 0  # three panels: bubble, step time vs ideal, peak activations per stage


# --------------------------------------------------------------------------- dtensor.py
DTENSOR_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "dtensor.py"


def test_dtensor_benchmark_times_every_transition_and_op_and_writes_json(mpirun, tmp_path):
    out_json = tmp_path / "dt.json"
    out = mpirun(DTENSOR_BENCH, 2, "--min-bytes", "4K", "--max-bytes", "8K", "--rounds", "1", "--iters", "2",
                 "--warmup", "1", "--no-progress", "--json", str(out_json)).stdout
    rows = json.loads(out_json.read_text())["rows"]
    redistribute = [(r["transition"], r["bytes"]) for r in rows if r["section"] == "redistribute"]
    assert redistribute == [(t, b) for t in ("S0->R", "P->R", "P->S0", "S0->S1", "R->S0") for b in (4096, 8192)]
    assert all(r["redistribute_us"] > 0 and r["collective_us"] > 0 and r["floor_us"] > 0
               for r in rows if r["section"] == "redistribute")
    assert [r["ratio"] is None for r in rows if r["section"] == "redistribute"] == [False] * 8 + [True] * 2
    assert all(r["ratio_floor"] > 0 for r in rows if r["section"] == "redistribute")
    assert [r["op"] for r in rows if r["section"] == "overhead"] == ["add", "tanh", "matmul", "sum", "transpose",
                                                                      "reshape"]
    assert all(r["dtensor_us"] > 0 and r["numpy_us"] > 0 for r in rows if r["section"] == "overhead")
    assert re.search(r"R->S0\s+4K\s+[\d.]+\s+[\d.]+\s+local\s+[\d.]+\s+[\d.]+", out), out
    assert "coll+caller us" in out
    assert "(target: overhead < 20 us)" in out
    checks = [(r["case"], r["block"]) for r in rows if r["section"] == "checks"]
    assert checks == [(c, b) for b in ([8, 8], [1024, 128]) for c in (
        "distribute_tensor(src_data_rank=None)", "distribute_tensor(src_data_rank=0)", "from_local(no shape=)",
        "from_local(shape=) + first redistribute")]
    assert all(r["checked_us"] > 0 and r["unchecked_us"] > 0 for r in rows if r["section"] == "checks")
    assert "construction checks: checked beside the same construction without the check" in out


# --------------------------------------------------------------------------- every benchmark: --help, tiny runs
HELPED = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    """Every benchmark's ``--help``, run in one process (tests/scripts/benchmark_helps.py) with
    DeprecationWarnings as errors: script name -> its exit code, stdout and stderr."""
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "scripts" / "benchmark_helps.py"),
                           *(str(BENCHMARKS / s) for s in HELPED)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {r["script"]: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("script", HELPED)
def test_every_benchmark_prints_its_help(helps, script):
    got = helps[script]
    assert got["code"] == 0 and got["out"].startswith(f"usage: {script}"), got


def test_a_deprecated_spelling_in_a_benchmark_fails_it(tmp_path):
    """The fixture's filter reaches the benchmark's process: the check of the checks."""
    script = tmp_path / "old.py"
    script.write_text("import warnings\nwarnings.warn('old spelling', DeprecationWarning)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "DeprecationWarning: old spelling" in proc.stderr, proc


def test_ddp_benchmark_runs_every_section_through_the_protocol(mpirun, tmp_path):
    out_json = tmp_path / "ddp.json"
    out = mpirun(BENCHMARKS / "ddp.py", 2, "--cases", "20x4K", "--hidden", "16,16", "--batch", "8", "--caps",
                 "0.001,25", "--rounds", "1", "--iters", "2", "--warmup", "1", "--no-progress", "--json",
                 str(out_json)).stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["section"] for r in rows} == {"sync", "sweep"}, rows
    assert "1. gradient sync" in out and "2. overlap" in out and "3. bucket-size sweep" in out, out


def test_memory_benchmark_measures_every_strategy_through_the_protocol(tmp_path):
    out_json = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "memory.py"), "--params", "20K", "--worlds", "1,2",
                           "--no-progress", "--json", str(out_json)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["strategy"], r["world_size"]) for r in rows] == [(s, n) for s in ("ddp", "zero1", "zero2", "zero3")
                                                                for n in (1, 2)]
    assert all(r["ratio"] == pytest.approx(1, abs=1e-3) for r in rows), rows  # the ZeRO paper's formulas


def test_sharded_and_mesh_benchmarks_run(mpirun, tmp_path):
    mpirun(BENCHMARKS / "sharded.py", 2, "--hidden", "8,8", "--batch", "8", "--samples", "64", "--rounds", "2",
           "--steps", "5", "--warmup", "1", "--no-progress", "--json", str(tmp_path / "sharded.json"))
    assert json.loads((tmp_path / "sharded.json").read_text())["rows"]
    mpirun(BENCHMARKS / "mesh.py", 2, "--engine", "mpi", "--ndims", "1", "--repeats", "1", "--warmup", "0",
           "--no-progress", "--json", str(tmp_path / "mesh.json"))
    assert json.loads((tmp_path / "mesh.json").read_text())["rows"]


def test_elastic_benchmark_kills_a_rank_and_reports_every_phase(tmp_path):
    """benchmarks/elastic.py at its smallest: one repeat of 2 ranks, a rank killed from outside after a
    checkpoint; both runs pass --check (the script exits otherwise) and every phase has a figure."""
    out_json = tmp_path / "elastic.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "elastic.py"), "--nproc", "2", "--strategy", "ddp",
                             "--steps", "8", "--save-every", "4", "--kill-after", "4", "--repeats", "1",
                             "--json", str(out_json)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for phase in ("detection", "teardown", "relaunch", "imports", "rendezvous", "checkpoint load", "first step"):
        assert re.search(rf"^ *{phase} +\d+\.\d{{3}} ", result.stdout, re.M), result.stdout
    assert re.search(r"killed / uninterrupted wall time: \d+\.\d\dx", result.stdout), result.stdout
    (entry,) = json.loads(out_json.read_text())["restarts"]
    assert entry["rank"] == 1 and entry["complete"] and entry["ranks_after"] == 2, entry


@needs_ulfm
def test_survive_benchmark_pairs_each_survive_run_with_a_plain_one(tmp_path):
    """benchmarks/survive.py at its smallest, no failure: a plain and a ``--survive`` fsdp run of 2 ranks,
    both checked against single-process training (the script exits otherwise), the paired ratios and
    the buddy copy reported, the runs in the JSON."""
    out_json = tmp_path / "survive.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "survive.py"), "--nproc", "2", "--strategy", "fsdp",
                             "--hidden", "32", "--steps", "4", "--kill-at", "2", "--repeats", "1", "--no-killed",
                             "--json", str(out_json)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for what in ("mean", "median", "fastest"):
        assert re.search(rf"^paired {what} step / plain's, median \[min, max\] over repeats: survive "
                         r"\d+\.\d{3}x \[\d+\.\d{3}, \d+\.\d{3}\]$", result.stdout, re.M), result.stdout
    assert re.search(r"^buddy copy: \d+ bytes a rank; one exchange ", result.stdout, re.M), result.stdout
    assert "SIGKILLed" not in result.stdout
    runs = json.loads(out_json.read_text())
    assert len(runs["plain"]) == len(runs["survive"]) == 1 and "killed" not in runs, runs
    assert all(r["diff"] <= 1e-10 for r in runs["plain"] + runs["survive"]), runs


def test_survive_benchmark_pools_the_pairs_of_several_invocations(tmp_path):
    """``--pool`` reads --json outputs, pools their pairs per strategy and rank count, and prints the
    median ratio, its quartiles and a bootstrap interval (seeded: the same files print the same
    figures); a file that is not one is a clear error."""
    def run(step: float) -> dict:
        return {"step_s": step, "step_median_s": step, "step_min_s": step}

    for name, (strategy, ratios) in {"a": ("fsdp", [1.0, 1.2]), "b": ("fsdp", [1.1]), "c": ("ddp", [0.9])}.items():
        doc = {"args": {"strategy": strategy, "nproc": "2"}, "plain": [run(1.0)] * len(ratios),
               "survive": [run(r) for r in ratios]}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    files = sorted(str(p) for p in tmp_path.glob("*.json"))
    command = [sys.executable, str(BENCHMARKS / "survive.py"), "--pool", *files]
    first, again = (subprocess.run(command, capture_output=True, text=True, timeout=60) for _ in range(2))
    assert first.returncode == 0 and first.stdout == again.stdout, first.stdout + first.stderr
    assert "ddp on 2 ranks, 1 pairs: mean 0.900 [0.90-0.90] (0.900-0.900)" in first.stdout, first.stdout
    fsdp = re.search(r"^fsdp on 2 ranks, 3 pairs: mean 1\.100 \[(\S+)-(\S+)\] \((\S+)-(\S+)\);", first.stdout, re.M)
    assert fsdp is not None, first.stdout
    q1, q3, low, high = map(float, fsdp.groups())
    assert q1 <= 1.1 <= q3 and 1.0 <= low <= 1.1 <= high <= 1.2, fsdp.groups()
    (tmp_path / "bad.json").write_text("{}")
    bad = subprocess.run([*command, str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "bad.json: not a --json output of this benchmark" in bad.stderr, bad.stderr


# --------------------------------------------------------------------------- expert_parallel.py
EP_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "expert_parallel.py"


def test_expert_parallel_benchmark_times_the_layer_and_raw_alltoallv(mpirun, tmp_path):
    out_json = tmp_path / "ep.json"
    out = mpirun(EP_BENCH, 2, "--tokens", "16,64", "--dim", "8", "--experts", "4", "--iters", "2", "--rounds", "2",
                 "--capacity-factor", "0.5", "--no-progress", "--json", str(out_json)).stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [16, 64]
    for r in rows:
        assert r["ranks"] == 2 and r["dropped"] > 0  # capacity 0.5: half the assignments go
        assert r["meshkit/mpi4py"] == pytest.approx(r["meshkit_s"] / r["mpi4py_s"])
        assert all(len(r["all_s"][e]) == 2 for e in ("meshkit", "exchange", "mpi4py"))
    assert "meshkit/mpi4py exchange/mpi4py" in out


def test_expert_parallel_benchmark_rejects_experts_not_divisible_by_the_ranks(mpirun):
    proc = mpirun(EP_BENCH, 2, "--experts", "3", check=False)
    assert proc.returncode != 0 and "--experts 3 must be a positive multiple of the 2 ranks" in proc.stdout + proc.stderr
def test_context_parallel_benchmark_times_compute_comm_and_the_ring(mpirun, tmp_path):
    """benchmarks/context_parallel.py at its smallest: both phases, every figure there (no timing asserted)."""
    out_json = tmp_path / "cp.json"
    out = mpirun(BENCHMARKS / "context_parallel.py", 2, "--seq", "16", "--heads", "2", "--head-dim", "4", "--rounds",
                 "1", "--warmup", "0", "--no-progress", "--json", str(out_json)).stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["phase"] for r in rows] == ["forward", "backward"], rows
    assert all(r["compute_s"] > 0 and r["comm_s"] > 0 and r["ring_s"] > 0 and 0 <= r["hidden"] <= 1 for r in rows)
    assert all(r["exposed_s"] >= 0 and 0 <= r["hidden_by_waits"] <= 1 for r in rows), rows
    assert "hidden by waits" in out and re.search(r"forward\s+2(\s+[\d.]+){4}\s+\d+%\s+[\d.]+\s+\d+%", out), out


# --------------------------------------------------------------------------- scaling.py
def test_scaling_benchmark_writes_measured_beside_predicted_with_exact_memory(tmp_path):
    """benchmarks/scaling.py at its smallest (1 and 2 ranks, ddp and fsdp, strong scaling, one step
    in each of two interleaved rounds; at 2 ranks also train_3d's tp2, pp2 gpipe and pp2 1f1b):
    one record per configuration, memory predicted byte for byte, and the
    acceptance figures printed. No timing is asserted (a shared 2-core machine)."""
    out_json = tmp_path / "scaling.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "scaling.py"), "--worlds", "1,2", "--strategies",
                           "ddp,fsdp", "--modes", "strong", "--hidden", "32,32", "--batch", "16", "--steps", "1",
                           "--warmup", "1", "--rounds", "2", "--microbatches", "2", "--calib-repeats", "1",
                           "--json", str(out_json)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    rows = data["rows"]
    assert [(r["config"], r["ranks"]) for r in rows] == [
        ("ddp dp1 tp1 pp1", 1), ("fsdp dp1 tp1 pp1", 1), ("ddp dp2 tp1 pp1", 2), ("fsdp dp2 tp1 pp1", 2),
        ("ddp dp1 tp2 pp1 whole-pass", 2), ("ddp dp1 tp1 pp2 gpipe mb2 whole-pass", 2),
        ("ddp dp1 tp1 pp2 1f1b mb2 whole-pass", 2)], rows
    for r in rows:
        assert r["measured_step_s"] > 0 and r["predicted_step_s"] > 0, r
        assert len(r["measured_rounds_s"]) == 2, r  # one median a round, their median reported
        assert r["measured_step_s"] == pytest.approx(sum(r["measured_rounds_s"]) / 2), r
        assert isinstance(r["measured_bytes"], int) and r["measured_bytes"] == r["predicted_bytes"], r
    assert rows[3]["measured_bytes"] * 2 == rows[1]["measured_bytes"]  # fsdp shards over 2 ranks
    assert rows[4]["measured_bytes"] < rows[0]["measured_bytes"]  # tp holds about half of each block pair
    assert (rows[5]["pp"], rows[5]["tp"], rows[5]["schedule"], rows[5]["line"]) == (2, 1, "gpipe", "pp")
    assert data["metadata"]["summary"]["memory_mismatches"] == 0
    assert re.search(r"^Spearman\(predicted, measured step time\): -?\d\.\d{3} over 7 configurations", proc.stdout,
                     re.M), proc.stdout
    assert "planner's pick within 10% of the fastest measured: " in proc.stdout
    assert (tmp_path / "scaling_calib_2.json").exists()


def test_scaling_interleaves_the_steps_of_its_configurations_from_a_rotating_start():
    """scaling.py's ``_timed``: every model's warm-up steps first, then one timed step of each model
    in turn from model ``first`` on (a round's rotation), each step's time the slowest rank's; per
    model, the median of its steps and the largest rank's held bytes."""
    sys.path.insert(0, str(BENCHMARKS))
    import scaling

    import meshkit
    from meshkit.comm import local

    def body():
        rank = meshkit.get_rank()
        log = []

        class Fake:
            def __init__(self, name, seconds, held):
                self.name, self.seconds, self.held = name, seconds, held

            def zero_grad(self):
                pass

            def step(self):
                time.sleep(self.seconds if rank == 1 else 0.0)  # rank 1 is the slowest: its time counts

            def memory_report(self):
                return {"params": self.held + rank, "grads": 1, "optimizer_state": 2, "comm_buffers": 99}

        built = [(Fake(name, seconds, held), lambda model, k: log.append((model.name, k)))
                 for name, seconds, held in (("a", 0.001, 10), ("b", 0.02, 20), ("c", 0.001, 30))]
        out = scaling._timed(built, steps=2, warmup=1, first=1)
        return log, out

    (log, out), (log1, out1) = local.run(body, 2, timeout=60)
    assert log == log1 == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("b", 2), ("c", 2), ("a", 2)]
    assert out == out1
    assert [held for _, held in out] == [10 + 1 + 1 + 2, 20 + 1 + 1 + 2, 30 + 1 + 1 + 2]  # rank 1's, the largest
    assert out[1][0] >= 0.02 > out[0][0] and out[2][0] < 0.02  # b's steps slept on rank 1: the slowest rank's time


def test_scaling_configurations_of_tp_and_pp():
    """Which tp and pp meshes scaling.py runs at 2 and 4 ranks, and that a bad --rounds is refused."""
    sys.path.insert(0, str(BENCHMARKS))
    import scaling
    assert [c.name() for c in scaling.configurations_3d(2, ["ddp", "zero1"], 4)] == [
        "ddp dp1 tp2 pp1 whole-pass", "ddp dp1 tp1 pp2 gpipe mb4 whole-pass", "ddp dp1 tp1 pp2 1f1b mb4 whole-pass"]
    four = {(c.pp, c.dp, c.tp, c.strategy, c.schedule if c.pp > 1 else None)
            for c in scaling.configurations_3d(4, ["ddp", "zero1", "zero2", "fsdp", "hsdp"], 4)}
    assert {(1, 2, 2, s, None) for s in ("ddp", "zero1", "zero2", "fsdp")} <= four  # dp2 x tp2, train_3d's strategies
    assert {(2, 2, 1, s, "1f1b") for s in ("ddp", "zero1", "zero2", "fsdp")} <= four  # dp2 x pp2
    assert {(2, 1, 2, "ddp", "1f1b"), (2, 1, 2, "ddp", "gpipe"), (1, 1, 4, "ddp", None)} <= four
    assert all(pp > 1 or tp > 1 for pp, _, tp, *_ in four)
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "scaling.py"), "--rounds", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "argument --rounds: must be >= 1, got 0" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- two_level.py
def test_two_level_benchmark_compares_two_and_one_level_machines_on_simulated_nodes(tmp_path):
    """benchmarks/two_level.py at its smallest (4 ranks on 2 simulated nodes, one round of two
    steps): a two-level machine (levels 'local' of 2 and 'node' of 4) and a one-level one, every
    flat and hybrid configuration beside both predictions, memory exact, the figures printed with
    the oversubscription noted. No timing is asserted (a shared 2-core machine)."""
    out_json = tmp_path / "two_level.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "two_level.py"), "--hidden", "32,32", "--batch", "16",
                           "--steps", "2", "--warmup", "1", "--rounds", "1", "--calib-repeats", "1",
                           "--json", str(out_json)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out_json.read_text())
    meta, rows = data["metadata"], data["rows"]
    assert [(lv["name"], lv["size"]) for lv in meta["two_level"]["levels"]] == [("local", 2), ("node", 4)]
    assert [(lv["name"], lv["size"]) for lv in meta["one_level"]["levels"]] == [("dp", 4)]
    assert "dim 0 'node' (size 2) crosses hosts" in meta["describe"] and "dim 1 'local' (size 2):" in meta["describe"]
    configs = ["ddp dp4", "zero1 dp4", "zero2 dp4", "fsdp dp4", "hsdp dp1x4", "hsdp dp2x2", "hsdp dp4x1"]
    assert [(r["mode"], r["config"]) for r in rows] == [(m, f"{c} tp1 pp1") for m in ("strong", "weak")
                                                        for c in configs], rows
    for r in rows:
        assert r["measured_step_s"] > 0 and r["predicted_step_s"] > 0 and r["predicted_one_level_s"] > 0, r
        assert r["measured_bytes"] == r["predicted_bytes"] and r["hybrid"] == r["config"].startswith("hsdp"), r
    s = meta["summary"]
    assert s["memory_mismatches"] == 0 and s["records"] == 14
    assert re.search(r"^two-level machine: Spearman\(predicted, measured\) flat -?\d\.\d{3}, hybrid -?\d\.\d{3}, "
                     r"all -?\d\.\d{3}", proc.stdout, re.M), proc.stdout
    assert proc.stdout.count("planner's pick within 10% of the fastest measured: ") == 2, proc.stdout
    cores = len(os.sched_getaffinity(0))
    assert s["oversubscribed"] == (cores < 4)
    if cores < 4:  # said beside the figures
        assert f"(4 ranks on {cores} cores oversubscribe them" in proc.stdout, proc.stdout


def test_stores_benchmark_runs_every_configuration_and_writes_json_and_a_plot(tmp_path):
    """benchmarks/stores.py at its smallest: one round of the three configurations (the baseline
    checked out from git, this tree open and with a secret); every figure there (no timing asserted)."""
    out = tmp_path / "stores.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "stores.py"), "--rounds", "1", "--calls", "5", "--json",
                           str(out), "--plot", "--no-progress"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["figure"] for r in rows] == ["set", "get", "add", "get 1 MiB", "rendezvous", "exchange", "barrier"]
    assert all(r[f"{c}_s"] > 0 and len(r[f"{c}_rounds_s"]) == 1 for r in rows for c in ("baseline", "open", "secret"))
    assert out.with_suffix(".png").stat().st_size > 0
