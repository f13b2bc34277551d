#!/usr/bin/env bash
# meshkit's GPU acceptance run: the one command that answers each of its points on real
# hardware (1-8: benchmarks/gpu_acceptance.py; 9: this script), then runs every GPU test and the
# GPU benchmark.
#
# WHAT HAS RUN ON HARDWARE: steps 1-5 on one H200 (2026-11-30, PYTHON=python3, the mpich and mpi4py
# wheels installed into that python; docs/gpus.md has the results). Multi-GPU checks: never. On CPU
# its logic runs in CI: the acceptance checks over the strict double (`python
# benchmarks/gpu_acceptance.py --point all --dry-run-double`) and this script's reporting on
# made-up pytest outputs (tests/test_gpu_check.py, through --report-only).
#
# Run from the repository root on the GPU machine:
#
#     OUT=/some/folder bash benchmarks/gpu_check.sh
#     bash benchmarks/gpu_check.sh --report-only DIR    # only the verdict of DIR (see below)
#
# Setup: a venv `python3 -m venv --system-site-packages` ($MESHKIT_GPU_VENV, default /tmp/meshkit-gpu-venv; the
# system's CuPy and NCCL stay visible) with mpich, mpi4py, pytest, pytest-timeout, hypothesis and
# ml_dtypes installed by pip (not `pip --target`, which drops the mpich wheel's libmpi.so.12); with
# MESHKIT_WHEELS=DIR pip installs from the wheels in DIR only (a machine without network).
# PYTHON=... skips the venv and uses that interpreter as it is. Where python3 is itself a venv's (an
# image whose python is PyTorch's venv), the new venv also sees that venv's packages (a .pth file).
# meshkit is imported from this checkout (a `meshkit` link to it on PYTHONPATH); mpiexec is the
# venv's (the mpich wheel's), else $MESHKIT_MPIEXEC, else PATH.
# Steps (each goes on after a failure):
#   0. the venv; 1. nvidia-smi -L and the versions of python, NumPy, CuPy, CUDA, NCCL, MPI;
#   2. benchmarks/gpu_acceptance.py --point all: points 1-8, each check in its own
#      worker with its negative control; one-GPU checks, then multi-GPU checks where >= 2 GPUs
#      are visible (else SKIP with the reason);
#   3. the GPU tests (the tests that run on a GPU, one pytest process each); one whose every test
#      skipped is SKIP (the reasons pytest gave), not ok: it verified nothing. The files that check
#      the doubles (tests/doubles/nccl_double.py, tests/doubles/fake_cupy.py) against the real CuPy run too, against
#      this machine's, but only a failure of theirs is recorded: passing, they verified no GPU;
#   4. benchmarks/collectives.py --device cuda, sizes up to $GPU_CHECK_MAX_BYTES (default 256M):
#      meshkit's NCCL engine vs raw NcclCommunicator at 1 rank, sync and async; the MPI engine on
#      CuPy buffers at 2 ranks; benchmarks/ddp.py only if it takes --device (it does not yet: SKIP
#      with the reason);
#   5. the examples --device cuda --check, each against single-process training: train_mlp's every
#      strategy and train_tp over NCCL at one rank, train_3d with CuPy arrays over MPI at 2 and 4
#      ranks sharing one GPU;
#   Where CuPy sees no GPU (no CuPy, no driver, none visible), steps 1, 3, 4 and 5 record SKIP with
#   the reason instead of running what needs one (a machine without nvidia-smi is not a failure),
#   so the run ends NOT VERIFIED, never FAIL or PASS;
#   then the verdict: one line per point (`POINT n: PASS|FAIL|SKIP (reason)`; steps 0, 3, 4
#      and 5 are point 9), then `VERDICT: PASS|FAIL|NOT VERIFIED (...)`.
# GPU_CHECK_STEPS="2" (or "3 4", ...) runs only those steps, appending to the results already in
# $OUT, for machines that limit one command's time (on one H200 with GPU_CHECK_MAX_BYTES=64M:
# steps 1, 3 and 5 took about 2.5 minutes, 2 and 4 about 2); the
# verdict always comes last.
# Results: $OUT (else a temp folder): results.jsonl (one record per check and step), a log per
# pytest file and benchmark, the benchmarks' JSON, this whole log, and all of them again in
# gpu-check.tar.gz (one file to bring back). Exit status: 0 when every point passed, 1 when one
# failed, 2 when nothing failed but some point was not verified.
# --report-only DIR: record every DIR/pytest-*.log (exit status in the .rc beside it) as step 3
# does, then print step 5 for DIR/results.jsonl; runs nothing else (how the tests check it).

set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
ACCEPT=benchmarks/gpu_acceptance.py

section() { printf '\n========== %s  (%s UTC)\n' "$1" "$(date -u +%H:%M:%S)"; }
# record NAME POINT STATUS DETAIL: one step's outcome into results.jsonl (and a line here)
record() { "$PY" "$ACCEPT" --results "$RESULTS" --record "$1" "$2" "$3" "$4"; }
# record_status NAME POINT EXIT: ok when EXIT is 0
record_status() {
    if [ "$3" -eq 0 ]; then record "$1" "$2" PASS ""; else record "$1" "$2" FAIL "exit $3"; fi
}
# record_pytest NAME LOG RC: PASS / FAIL / SKIP (reasons) from pytest's own output
record_pytest() { "$PY" "$ACCEPT" --results "$RESULTS" --pytest-outcome "$1" "$2" "$3" 9; }
verdict() {
    section "verdict"
    "$PY" "$ACCEPT" --verdict "$RESULTS"
}

if [ "${1:-}" = "--report-only" ]; then
    DIR=${2:?usage: gpu_check.sh --report-only DIR}
    PY=${PYTHON:-python3}
    RESULTS=$DIR/results.jsonl
    for log in "$DIR"/pytest-*.log; do
        [ -e "$log" ] || continue
        name=$(basename "$log" .log)
        record_pytest "pytest ${name#pytest-}" "$log" "$(cat "${log%.log}.rc")"
    done
    verdict
    exit $?
fi

OUTDIR=${OUT:-$(mktemp -d /tmp/meshkit-gpu-check.XXXXXX)}
mkdir -p "$OUTDIR"
RESULTS=$OUTDIR/results.jsonl
STEPS=" ${GPU_CHECK_STEPS:-0 1 2 3 4 5} "
if [ -z "${GPU_CHECK_STEPS:-}" ]; then : >"$RESULTS"; fi
step() { [[ $STEPS == *" $1 "* ]]; }  # step N: was it asked for
exec > >(tee -a "$OUTDIR/gpu_check.log") 2>&1

section "0. setup"
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
    echo "PYTHON=$PY: no venv, nothing installed"
    if step 0; then record "setup" 9 PASS "PYTHON=$PY as it is"; fi
else
    VENV=${MESHKIT_GPU_VENV:-/tmp/meshkit-gpu-venv}
    PIP_FROM=()
    if [ -n "${MESHKIT_WHEELS:-}" ]; then PIP_FROM=(--no-index --find-links "$MESHKIT_WHEELS"); fi
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv --system-site-packages "$VENV"
        # python3 may itself be a venv's (an image whose python is PyTorch's venv): a venv made from
        # it sees the base interpreter's packages, not that venv's (its CuPy). A .pth file adds that
        # venv's site-packages after the new venv's own (whose mpich and mpi4py then come first).
        parent=$(python3 -c 'import sys, sysconfig
if sys.prefix != sys.base_prefix:
    print("\n".join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))))')
        if [ -n "$parent" ]; then
            own=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
            echo "$parent" >"$own/meshkit-gpu-check-parent.pth"
            echo "python3 is a venv's ($(python3 -c 'import sys; print(sys.prefix)')): its packages added to $VENV"
        fi
    fi
    PY=$VENV/bin/python
    "$PY" -m pip install -q "${PIP_FROM[@]}" mpich mpi4py pytest pytest-timeout hypothesis ml_dtypes
    rc=$?
    if step 0; then record_status "setup (venv $VENV: mpich mpi4py pytest hypothesis ml_dtypes)" 9 $rc; fi
fi

# meshkit from this checkout: the repository root IS the package, so a link named meshkit to it.
SHIM=$(mktemp -d /tmp/meshkit-shim.XXXXXX)
ln -s "$REPO" "$SHIM/meshkit"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
trap 'rm -rf "$SHIM"' EXIT

# The GPUs CuPy can use here: "N reason" (0 and why where none: no CuPy, no driver, none visible).
GPU_PROBE=$("$PY" - <<'EOF' 2>/dev/null
try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    print(n, f"{n} GPU(s) visible" if n else "CuPy sees no GPU")
except Exception as exc:  # any failure to reach a GPU means: none
    print(0, f"{type(exc).__name__}: {str(exc).split(':')[0]}".splitlines()[0])
EOF
)
GPUS=${GPU_PROBE%% *}
case $GPUS in '' | *[!0-9]*) GPUS=0 GPU_PROBE="0 the probe did not run ($PY)" ;; esac
NO_GPU="no GPU visible (${GPU_PROBE#* })"
echo "GPUs: ${GPU_PROBE#* }"

# mpiexec for meshkit-run (python -m meshkit.launch): the one next to the interpreter (the mpich wheel's).
if [ -z "${MESHKIT_MPIEXEC:-}" ]; then
    for dir in "$(dirname "$PY")" "$("$PY" -c 'import sysconfig;print(sysconfig.get_path("scripts"))')"; do
        if [ -x "$dir/mpiexec" ]; then export MESHKIT_MPIEXEC="$dir/mpiexec"; break; fi
    done
fi
if [ -z "${MESHKIT_MPIEXEC:-}" ] && command -v mpiexec >/dev/null; then
    MESHKIT_MPIEXEC=$(command -v mpiexec)
    export MESHKIT_MPIEXEC
fi

if step 1; then
section "1. machine and versions"
echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git')), results: $OUTDIR"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
if ! command -v nvidia-smi >/dev/null; then
    record "nvidia-smi -L" 9 SKIP "nvidia-smi not found: no NVIDIA driver here"
else
    nvidia-smi -L
    rc=$?
    if [ "$rc" -ne 0 ] && [ "$GPUS" -eq 0 ]; then
        record "nvidia-smi -L" 9 SKIP "exit $rc: $NO_GPU"
    else
        record_status "nvidia-smi -L" 9 $rc
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
fi
echo "mpiexec: ${MESHKIT_MPIEXEC:-NOT FOUND (set MESHKIT_MPIEXEC)}"
"$PY" - <<'EOF'
import importlib, platform, sys
print(f"python {platform.python_version()} at {sys.executable}")
def show(name, fn):
    try:
        print(f"{name}: {fn()}")
    except Exception as exc:  # report and go on: every line is informative
        print(f"{name}: UNAVAILABLE ({type(exc).__name__}: {exc})")
show("numpy", lambda: importlib.import_module("numpy").__version__)
show("cupy", lambda: importlib.import_module("cupy").__version__)
def cuda():
    import cupy
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    return (f"runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}, {rt.getDeviceCount()} device(s), "
            f"device 0 {props['name'].decode() if isinstance(props['name'], bytes) else props['name']}")
show("cuda", cuda)
def nccl():
    from cupy.cuda import nccl
    return f"{nccl.get_version()} (built against {nccl.get_build_version()}), available={nccl.available}"
show("nccl", nccl)
def mpi():
    from mpi4py import MPI
    import mpi4py
    from meshkit.comm.engines.mpi import cuda_aware_mpi
    return (f"mpi4py {mpi4py.__version__}, {MPI.Get_library_version().splitlines()[0].strip()}, "
            f"CUDA-aware: {cuda_aware_mpi()}")
show("mpi", mpi)
for name in ("ml_dtypes", "torch", "pytest", "hypothesis"):
    show(name, lambda name=name: importlib.import_module(name).__version__)
show("meshkit", lambda: importlib.import_module("meshkit").__file__)
EOF
record_status "versions" 9 $?
fi

if step 2; then
section "2. points 1-8 (benchmarks/gpu_acceptance.py)"
timeout 3000 "$PY" "$ACCEPT" --point all --results "$RESULTS"
echo "(gpu_acceptance.py exit $?)"
fi

# The tests that run on a GPU (each skips without one); the files whose other tests check the doubles
# against the real CuPy and NCCL modules (here: this machine's, which CI does not have, e.g. cuda13).
GPU_TESTS=(tests/test_nccl.py::test_on_real_gpus tests/test_mpi_device.py::test_real_cupy_arrays_over_mpi_on_a_real_gpu)
DOUBLE_FILES=(tests/test_nccl.py tests/test_nccl_strict.py tests/test_cupy_strictness.py)

# run_bench NAME TIMEOUT COMMAND...: one benchmark or example run, its output also in $OUTDIR/<name>.txt
run_bench() {
    local name=$1 limit=$2 log
    shift 2
    log="$OUTDIR/$(echo "$name" | tr -c 'A-Za-z0-9=\n' '_').txt"
    echo "--- $*"
    timeout "$limit" "$@" 2>&1 | tee "$log"
    record_status "$name" 9 "${PIPESTATUS[0]}"
    grep -h -e "summary (meshkit vs" "$log" | sed 's/^\[rank0\]: //'
}

if step 3 && [ "$GPUS" -eq 0 ]; then
section "3. GPU tests (one pytest process per test that needs a GPU)"
record "pytest (the GPU tests)" 9 SKIP "$NO_GPU: ${GPU_TESTS[*]} not run"
elif step 3; then
section "3. GPU tests (one pytest process per test that needs a GPU)"
for t in "${GPU_TESTS[@]}"; do
    name=$(basename "${t%%::*}" .py)__${t##*::}
    log="$OUTDIR/pytest-$name.log"
    echo "--- $PY -m pytest -q -rs $t"
    timeout 600 "$PY" -m pytest -q -rs -p no:cacheprovider "$t" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    echo "$rc" >"${log%.log}.rc"
    record_pytest "pytest $t" "$log" "$rc"
done
# the doubles against this machine's CuPy: a failure counts, a pass verified nothing of the GPU
DESELECT=()
for t in "${GPU_TESTS[@]}"; do DESELECT+=(--deselect "$t"); done
log="$OUTDIR/doubles.log"
echo "--- $PY -m pytest -q ${DOUBLE_FILES[*]} (over the doubles)"
timeout 600 "$PY" -m pytest -q -rs -p no:cacheprovider "${DESELECT[@]}" "${DOUBLE_FILES[@]}" >"$log" 2>&1
rc=$?
tail -n 3 "$log"
if [ "$rc" -eq 0 ]; then
    echo "(over the doubles: passed, not recorded: it verified nothing of the GPU)"
else
    record "pytest over the doubles" 9 FAIL "exit $rc: $(tail -n 1 "$log") (see doubles.log)"
fi
fi

if step 4 && [ "$GPUS" -eq 0 ]; then
section "4. benchmarks --device cuda"
record "collectives (the --device cuda benchmarks)" 9 SKIP "$NO_GPU: not run"
elif step 4; then
section "4. benchmarks --device cuda"
COMMON=(--min-bytes 8 --max-bytes "${GPU_CHECK_MAX_BYTES:-256M}" --no-progress)
run_bench "collectives nccl n=1 sync" 240 \
    "$PY" benchmarks/collectives.py --device cuda --backend nccl "${COMMON[@]}" \
    --json "$OUTDIR/collectives-cuda-nccl-n1.json"
run_bench "collectives nccl n=1 async" 180 \
    "$PY" benchmarks/collectives.py --device cuda --backend nccl --mode async --step-factor 4 --rounds 3 \
    "${COMMON[@]}" --json "$OUTDIR/collectives-cuda-nccl-n1-async.json"
run_bench "collectives mpi n=2 (CuPy buffers)" 300 \
    "$PY" -m meshkit.launch -n 2 --timeout 280 benchmarks/collectives.py --device cuda --backend mpi \
    --step-factor 4 --rounds 3 "${COMMON[@]}" --json "$OUTDIR/collectives-cuda-mpi-n2.json"
if "$PY" benchmarks/ddp.py --help 2>/dev/null | grep -q -- "--device"; then
    run_bench "ddp --device cuda n=1" 300 "$PY" benchmarks/ddp.py --device cuda --no-progress \
        --json "$OUTDIR/ddp-cuda-n1.json"
else
    record "ddp benchmark" 9 SKIP "benchmarks/ddp.py takes no --device: the DDP benchmark runs on CPU only"
fi
fi

# The examples as a user runs them with --device cuda, each --check'ed against single-process training
# on the global batch: NCCL at one rank per GPU (train_mlp's every strategy, train_tp), and CuPy arrays
# over MPI with several ranks sharing one GPU (train_3d, whose engine is "mpi").
if step 5 && [ "$GPUS" -eq 0 ]; then
section "5. the examples --device cuda --check"
record "examples (--device cuda --check)" 9 SKIP "$NO_GPU: not run"
elif step 5; then
section "5. the examples --device cuda --check"
LAUNCH=("$PY" -m meshkit.launch)
for strategy in ddp zero1 zero2 fsdp hsdp; do
    run_bench "train_mlp $strategy n=1 nccl" 120 "$PY" examples/train_mlp.py --device cuda --check \
        --strategy "$strategy" --steps 20
done
run_bench "train_mlp fsdp float32 adamw n=1 nccl" 120 "$PY" examples/train_mlp.py --device cuda --check \
    --strategy fsdp --dtype float32 --optimizer adamw --steps 20
run_bench "train_tp n=1 nccl" 120 "$PY" examples/train_tp.py --mesh 1x1 --device cuda --check --steps 10
run_bench "train_3d 1x2x1 n=2 mpi (one GPU shared)" 180 "${LAUNCH[@]}" -n 2 --timeout 170 \
    examples/train_3d.py --mesh 1x2x1 --device cuda --check --steps 5
run_bench "train_3d 2x1x2 fsdp n=4 mpi (one GPU shared)" 180 "${LAUNCH[@]}" -n 4 --timeout 170 \
    examples/train_3d.py --mesh 2x1x2 --dp fsdp --device cuda --check --steps 5
fi

verdict
status=$?
tar czf "$OUTDIR/gpu-check.tar.gz" -C "$OUTDIR" --exclude=gpu-check.tar.gz . 2>/dev/null
echo "results and this log: $OUTDIR (all of it in $OUTDIR/gpu-check.tar.gz)"
exit $status
