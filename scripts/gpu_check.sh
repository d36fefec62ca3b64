#!/usr/bin/env bash
# The GPU check: one call on a GPU machine, in under 8 minutes, from the repository root.
#
#   KVLAB_COMMIT=<sha> bash scripts/gpu_check.sh OUTDIR
#
# 1. installs from wheels/ (scripts/fetch_wheels.sh, carried with the call) what the machine lacks:
#    transformers 5.24 and the notebook runner (nbval, nbclient, ipykernel, ...);
# 2. runs every solution notebook through nbval on the GPU (KVLAB_DEVICE, default cuda);
# 3. runs the report at full size: OUTDIR/report.json and OUTDIR/report.png (its sections include
#    chapter 8's bf16 and int8 weights, the compiled decode at several batch sizes, and chapter 7's
#    prefill floor, so the first GPU run records them);
# 4. with the time left, runs every chapter (converted to .ipynb) through nbval in quick mode, so
#    the chapters' CUDA paths (peak memory, memory deltas, the GPU grids) execute too.
# Logs: OUTDIR/gpu_check.log (environment, install, summary), solutions.log, report.log,
# chapters.log. At most 8 flat files: what the device tool brings back.
# Exit status 0 only if every stage passed. KVLAB_COMMIT names the commit: the copy on the GPU
# machine has no .git.
#
# On the device tool (wheels/ fetched first; see book/results.md and README):
#   run(command="KVLAB_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_check.sh $OUT", carry=["wheels"],
#       timeout_s=540)      # with the commit pasted in: the command runs there, not here
# then: bash scripts/import_results.sh <files_at>/report.json
#
# CPU dry run (tests/test_report.py): KVLAB_DEVICE=cpu KVLAB_QUICK=1 KVLAB_SKIP_INSTALL=1, with
# KVLAB_CHECK_SOLUTIONS / KVLAB_CHECK_CHAPTERS naming small notebooks ("none" skips a stage).
# Other knobs: KVLAB_CHECK_DEADLINE (seconds for everything, default 460), KVLAB_REPORT_BUDGET
# (the report's --budget), KVLAB_CHECK_WORKERS (parallel notebooks when pytest-xdist is there), PYTHON.
set -uo pipefail

OUT=${1:?usage: bash scripts/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
: > "$LOG"
PY=${PYTHON:-python3}
DEADLINE=${KVLAB_CHECK_DEADLINE:-460}
export KVLAB_DEVICE=${KVLAB_DEVICE:-cuda}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1    # no network there: never wait on a timeout
unset MPLBACKEND                                  # kernels need matplotlib's inline backend
QUICK=${KVLAB_QUICK:-0}
STATUS=()
FAILED=0

log() { echo "[gpu_check ${SECONDS}s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE - SECONDS)); }
stage() {  # stage NAME SECONDS LOGFILE COMMAND... : run with a time cap, record the outcome
    local name=$1 cap=$2 file=$3; shift 3
    if [ "$cap" -lt 10 ]; then
        log "$name: skipped, only ${cap}s left"; STATUS+=("$name: skipped (no time left)"); FAILED=1; return
    fi
    log "$name: start (cap ${cap}s) -> $(basename "$file")"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$cap" "$@" >> "$file" 2>&1
    rc=$?
    [ "$rc" -eq 124 ] && log "$name: TIMED OUT after ${cap}s"
    log "$name: exit $rc in $((SECONDS - t0))s"
    STATUS+=("$name: $([ "$rc" -eq 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - t0))s")
    [ "$rc" -eq 0 ] || FAILED=1
}
notebooks() {  # notebooks SPEC DEFAULT...: the list a KVLAB_CHECK_* variable asks for
    local spec=$1; shift
    if [ "$spec" = none ]; then return; fi
    if [ -n "$spec" ]; then echo "$spec"; else echo "$@"; fi
}
nbval_args() {
    local args=(-q -p no:cacheprovider --nbval-lax --nbval-cell-timeout=300)
    local workers=${KVLAB_CHECK_WORKERS:-4}
    if [ "$workers" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
        args+=(-n "$workers" --dist loadfile)
    fi
    echo "${args[@]}"
}

# --- 0. the machine -------------------------------------------------------------------------------
log "device $KVLAB_DEVICE, quick=$QUICK, deadline ${DEADLINE}s, commit ${KVLAB_COMMIT:-(unset)}, out $OUT"
{ command -v nvidia-smi >/dev/null && nvidia-smi; "$PY" --version; uname -a; nproc; } >> "$LOG" 2>&1

# --- 1. install what the machine lacks -------------------------------------------------------------
if [ "${KVLAB_SKIP_INSTALL:-0}" = 1 ]; then
    log "install: skipped (KVLAB_SKIP_INSTALL=1)"
elif [ ! -d wheels ]; then
    log "install: no wheels/ here (run scripts/fetch_wheels.sh and carry wheels/); using what is installed"
else
    stage install 120 "$LOG" "$PY" -m pip install --no-index --find-links wheels --no-cache-dir \
        --no-compile --root-user-action=ignore -q -r scripts/gpu_requirements.txt
fi
# One Python start (importing torch is slow): the versions, then whether the machine is ready.
if ! "$PY" - >> "$LOG" 2>&1 <<'EOF'
import importlib.metadata as md
import os

for name in ("torch", "transformers", "tokenizers", "huggingface-hub", "nbval", "nbclient",
             "ipykernel", "jupyter_client", "ipywidgets", "pytest", "pytest-xdist", "matplotlib"):
    try:
        print(f"  {name:16s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name:16s} (not installed)")
import torch, transformers
dev = torch.device(os.environ["KVLAB_DEVICE"])
assert transformers.__version__.startswith("5.24"), f"transformers {transformers.__version__}: the book needs 5.24"
assert dev.type != "cuda" or torch.cuda.is_available(), "torch sees no CUDA GPU"
print("ready:", torch.__version__, transformers.__version__, dev)
EOF
then
    log "the machine is not ready (see above): stopping"
    exit 2
fi

# --- 2. every solution notebook, through nbval ----------------------------------------------------
# shellcheck disable=SC2046
SOLUTIONS=$(notebooks "${KVLAB_CHECK_SOLUTIONS:-}" solutions/lab*.ipynb)
if [ -n "$SOLUTIONS" ]; then
    cap=$(( $(left) - 250 ))
    if [ "$cap" -gt 180 ]; then cap=180; fi
    # shellcheck disable=SC2086
    stage solutions "$cap" "$OUT/solutions.log" "$PY" -m pytest $(nbval_args) $SOLUTIONS
fi

# --- 3. the report, alone on the machine (its timings are the recorded ones) ---------------------
budget=$(( $(left) - 110 ))
if [ "$budget" -gt 200 ]; then budget=200; fi
REPORT_ARGS=()
if [ "$QUICK" = 1 ]; then
    REPORT_ARGS=(--quick)
    if [ "$budget" -gt 40 ]; then budget=40; fi
fi
budget=${KVLAB_REPORT_BUDGET:-$budget}
stage report $((budget + 60)) "$OUT/report.log" "$PY" -m kvlab.report --device "$KVLAB_DEVICE" \
    "${REPORT_ARGS[@]}" --budget "$budget" --out "$OUT/report.json" --figure "$OUT/report.png"

# --- 4. every chapter, quick, with the time left --------------------------------------------------
CHAPTERS=$(notebooks "${KVLAB_CHECK_CHAPTERS:-}" book/ch*.md)
if [ -n "$CHAPTERS" ]; then
    NBDIR=$(mktemp -d "${TMPDIR:-/tmp}/kvlab-chapters.XXXXXX")
    # shellcheck disable=SC2086
    "$PY" scripts/myst_to_ipynb.py $CHAPTERS --out-dir "$NBDIR" >> "$OUT/chapters.log" 2>&1
    # shellcheck disable=SC2086
    stage chapters $(( $(left) - 5 )) "$OUT/chapters.log" \
        env KVLAB_QUICK=1 "$PY" -m pytest $(nbval_args) --rootdir "$NBDIR" "$NBDIR"
    rm -rf "$NBDIR"
fi

# --- summary ---------------------------------------------------------------------------------------
log "summary ($SECONDS s in all):"
for s in "${STATUS[@]}"; do log "  $s"; done
tail -n 3 "$OUT"/solutions.log "$OUT"/chapters.log 2>/dev/null | tee -a "$LOG"
exit $FAILED
