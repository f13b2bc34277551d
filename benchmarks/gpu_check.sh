#!/usr/bin/env bash
# meshkit on a real GPU: versions, the GPU tests, and the collectives benchmark (issue 13, point 6).
#
# Run from the repository root on the GPU machine:
#
#     OUT=/some/folder bash benchmarks/gpu_check.sh
#
# It uses `python3` (the interpreter that has CuPy, NCCL and mpi4py; PYTHON=... picks another) and
# installs nothing: meshkit is imported from this checkout (a `meshkit` link to it on PYTHONPATH).
# mpiexec (2-rank run, MPI tests): $MESHKIT_MPIEXEC, else the mpich wheel's next to python3 or in
# its scripts folders, else PATH. The single-rank NCCL runs need no mpiexec (MPI singleton).
# Steps (each goes on after a failure; a status table comes last):
#   1. nvidia-smi -L; python, NumPy, CuPy, CUDA, NCCL, mpi4py/MPI, torch, pytest versions;
#   2. the GPU tests, one pytest process per file (tests/test_nccl.py, tests/test_mpi_device.py,
#      tests/test_device_mesh_cuda.py; the tests that need a real GPU run there, the rest on the double);
#   3. benchmarks/collectives.py --device cuda: --backend nccl at world size 1 (sync, then async)
#      and --backend mpi at 2 ranks sharing the GPU (MPI engine on CuPy buffers, staged), 8 B to
#      256 MB, about 3-4 minutes in all.
# Results (JSON and output per benchmark, and this whole log) go to $OUT when it is set, else a
# temp folder. Exit status 1 if any step failed.

set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
PY=${PYTHON:-python3}
OUTDIR=${OUT:-$(mktemp -d /tmp/meshkit-gpu-check.XXXXXX)}
mkdir -p "$OUTDIR"
exec > >(tee -a "$OUTDIR/gpu_check.log") 2>&1

STATUS=()
FAILED=0
section() { printf '\n========== %s  (%s UTC)\n' "$1" "$(date -u +%H:%M:%S)"; }
record() {  # record NAME RC
    STATUS+=("$(printf '%-44s %s' "$1" "$([ "$2" -eq 0 ] && echo ok || echo "FAILED (exit $2)")")")
    [ "$2" -eq 0 ] || FAILED=$((FAILED + 1))
}

# meshkit from this checkout: the repository root IS the package, so a link named meshkit to it.
SHIM=$(mktemp -d /tmp/meshkit-shim.XXXXXX)
ln -s "$REPO" "$SHIM/meshkit"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"

# mpiexec for meshkit-run (python3 -m meshkit.launch), as said above.
if [ -z "${MESHKIT_MPIEXEC:-}" ]; then
    for dir in "$($PY -c 'import sys,os;print(os.path.dirname(sys.executable))')" \
               "$($PY -c 'import sysconfig;print(sysconfig.get_path("scripts"))')" \
               "$($PY -c 'import sysconfig,os;print(sysconfig.get_path("scripts",os.name+"_user"))' 2>/dev/null)"; do
        if [ -n "$dir" ] && [ -x "$dir/mpiexec" ]; then export MESHKIT_MPIEXEC="$dir/mpiexec"; break; fi
    done
fi
if [ -z "${MESHKIT_MPIEXEC:-}" ] && command -v mpiexec >/dev/null; then export MESHKIT_MPIEXEC=$(command -v mpiexec); fi

section "1. machine and versions"
echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git')), results: $OUTDIR"
echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi -L; record "nvidia-smi -L" $?
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
echo "mpiexec: ${MESHKIT_MPIEXEC:-NOT FOUND (set MESHKIT_MPIEXEC)}"
$PY - <<'EOF'
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
    from meshkit.comm.mpi import cuda_aware_mpi
    return (f"mpi4py {mpi4py.__version__}, {MPI.Get_library_version().splitlines()[0].strip()}, "
            f"CUDA-aware: {cuda_aware_mpi()}")
show("mpi", mpi)
show("torch", lambda: importlib.import_module("torch").__version__)
show("pytest", lambda: importlib.import_module("pytest").__version__)
show("hypothesis", lambda: importlib.import_module("hypothesis").__version__)
show("meshkit", lambda: importlib.import_module("meshkit").__file__)
def gpu():
    from meshkit.comm import cuda_runtime
    return f"meshkit sees a GPU: {cuda_runtime.gpu_available()}"
show("meshkit gpu", gpu)
EOF
record "versions (python3)" $?

section "2. GPU tests (one pytest process per file)"
for f in tests/test_nccl.py tests/test_mpi_device.py tests/test_device_mesh_cuda.py; do
    echo "--- $PY -m pytest -q -rs $f"
    timeout 600 $PY -m pytest -q -rs -p no:cacheprovider "$f"
    record "pytest $f" $?
done

section "3. benchmarks/collectives.py --device cuda"
COMMON=(--min-bytes 8 --max-bytes 256M --no-progress)
BENCH_LOGS=()
run_bench() {  # run_bench NAME TIMEOUT COMMAND...   (its output also in $OUTDIR/<name>.txt)
    local name=$1 limit=$2; shift 2
    local log="$OUTDIR/$(echo "$name" | tr -c 'A-Za-z0-9=\n' '_').txt"
    echo "--- $*"
    timeout "$limit" "$@" 2>&1 | tee "$log"
    record "$name" "${PIPESTATUS[0]}"
    BENCH_LOGS+=("$log")
}
run_bench "collectives nccl n=1 sync" 240 \
    $PY benchmarks/collectives.py --device cuda --backend nccl "${COMMON[@]}" \
    --json "$OUTDIR/collectives-cuda-nccl-n1.json"
run_bench "collectives nccl n=1 async" 180 \
    $PY benchmarks/collectives.py --device cuda --backend nccl --mode async --step-factor 4 --rounds 3 \
    "${COMMON[@]}" --json "$OUTDIR/collectives-cuda-nccl-n1-async.json"
run_bench "collectives mpi n=2 (CuPy buffers)" 300 \
    $PY -m meshkit.launch -n 2 --timeout 280 benchmarks/collectives.py --device cuda --backend mpi \
    --step-factor 4 --rounds 3 "${COMMON[@]}" --json "$OUTDIR/collectives-cuda-mpi-n2.json"

section "summary"
for log in "${BENCH_LOGS[@]}"; do
    echo "$(basename "$log" .txt):"
    grep -h -e "summary (meshkit vs" -e "Error" "$log" | sed 's/^\[rank0\]: //'
done
echo
printf '%s\n' "${STATUS[@]}"
echo "results and this log: $OUTDIR"
rm -rf "$SHIM"
exit $((FAILED > 0))
