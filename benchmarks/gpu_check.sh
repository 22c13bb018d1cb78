#!/usr/bin/env bash
# The GPU checks, as one prepared run that fits in 10 minutes on one H200 (docs/gpu.md):
#   (a) the tests marked `gpu` (CUDA tensors, NCCL at world size 1, gloo with CUDA tensors),
#   (b) parity of stages 0-3 on CUDA against plain single-GPU training, fp32 and bf16 (figures kept),
#   (c) stage 2 + CPU optimizer offload, bf16, the largest GPT whose states fit host memory,
#   (d) the same model and tokens without offload, for the ratio.
# Everything it writes goes under $OUT (default ./gpu_check_out): gpu_check.log, gpu_check.json and
# each step's own log and JSON. A failing step is recorded and the next one still runs; the exit status
# is non-zero when any step failed.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh                      # on the GPU machine
#   GPU_CHECK_DRY_RUN=1 OUT=/tmp/out bash benchmarks/gpu_check.sh  # the same steps, tiny, on a CPU
#
# Wheels in .whl/ (packages the GPU machine lacks, see docs/gpu.md) are installed into a private
# directory on PYTHONPATH first; nothing is fetched from the network.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_check_out}"
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
PYTHON="${PYTHON:-python3}"
# Seconds per step; together under the 10 minutes one command may run on the GPU machine.
TIMEOUT_TESTS="${GPU_CHECK_TIMEOUT_TESTS:-150}"
TIMEOUT_PARITY="${GPU_CHECK_TIMEOUT_PARITY:-80}"
TIMEOUT_OFFLOAD="${GPU_CHECK_TIMEOUT_OFFLOAD:-210}"
TIMEOUT_PLAIN="${GPU_CHECK_TIMEOUT_PLAIN:-110}"
# The offload benchmark's largest model, billions of parameters: 1.4 takes the 1.3B GPT, whose build,
# initialisation and three steps fit TIMEOUT_OFFLOAD; the largest that fits host memory (about 5B on the
# GPU machine) takes longer than one command may run there.
MAX_PARAMS="${GPU_CHECK_MAX_PARAMS:-1.4}"

mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
STATUS_FILE="$OUT/steps.tsv"
: >"$STATUS_FILE"
STARTED=$SECONDS

log() {
    printf '[%4ds] %s\n' "$((SECONDS - STARTED))" "$*" | tee -a "$LOG"
}

# run_step NAME TIMEOUT COMMAND...: runs COMMAND under a timeout, its output in $OUT/NAME.log and
# gpu_check.log; records NAME, exit status and seconds in steps.tsv. Never aborts the script.
run_step() {
    local name="$1" limit="$2"
    shift 2
    local began=$SECONDS rc=0
    log "step $name: $* (timeout ${limit}s)"
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    tail -n 40 "$OUT/$name.log" >>"$LOG"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - began))" >>"$STATUS_FILE"
    log "step $name: exit $rc after $((SECONDS - began))s"
}

install_wheels() {
    local wheels=("$REPO"/.whl/*.whl)
    if [[ ! -e "${wheels[0]}" ]]; then
        log "no wheels in .whl/: using the packages installed on this machine"
        return
    fi
    local target="$OUT/.deps"
    log "installing ${#wheels[@]} wheels from .whl/ into $target"
    if ! "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$target" "${wheels[@]}" >>"$LOG" 2>&1; then
        # No pip there: a wheel is a zip archive of what pip would put in site-packages.
        log "pip failed or is missing: unpacking the wheels instead"
        "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$target" "${wheels[@]}" >>"$LOG" 2>&1
    fi
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
}

environment() {
    log "repository $REPO, commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    log "dry run: $DRY_RUN"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1 || true
    fi
    "$PYTHON" - >>"$LOG" 2>&1 <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version())
for name in ("pydantic", "safetensors", "psutil", "tqdm", "numpy", "xxhash", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # noqa: BLE001 - a report, not a check
        print(name, "MISSING:", error)
EOF
}

summary() {
    "$PYTHON" - "$OUT" "$DRY_RUN" "$((SECONDS - STARTED))" <<'EOF'
import json, pathlib, sys
out, dry_run, seconds = pathlib.Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
steps = [dict(zip(("step", "exit", "seconds"), line.split("\t"))) for line in
         (out / "steps.tsv").read_text().splitlines() if line]
for step in steps:
    step["exit"], step["seconds"] = int(step["exit"]), int(step["seconds"])
parity = [json.loads(line) for line in (out / "parity.jsonl").read_text().splitlines()] \
    if (out / "parity.jsonl").exists() else []
offload = json.loads((out / "offload_summary.json").read_text()) if (out / "offload_summary.json").exists() else None
result = dict(dry_run=dry_run, seconds=seconds, steps=steps, passed=all(s["exit"] == 0 for s in steps),
              parity=parity, offload=offload)
(out / "gpu_check.json").write_text(json.dumps(result, indent=2))
print(json.dumps({k: result[k] for k in ("dry_run", "seconds", "passed", "steps")}, indent=2))
EOF
}

main() {
    cd "$REPO"
    install_wheels
    export PYTHONPATH="$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    environment
    local bench=("$PYTHON" benchmarks/gpu_offload.py)
    local size=(--max-params "$MAX_PARAMS")
    if [[ "$DRY_RUN" == "1" ]]; then
        export GPU_CHECK_DRY_RUN=1
        bench+=(--dry-run)
    elif ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        log "no CUDA device: run on the GPU machine, or set GPU_CHECK_DRY_RUN=1"
        exit 2
    fi
    local pytest=("$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_gpu.py)
    rm -f "$OUT/parity.jsonl"
    run_step tests "$TIMEOUT_TESTS" env ZEROSHARD_GPU_REPORT="$OUT/parity.jsonl" \
        "${pytest[@]}" -k "not parity" --junitxml="$OUT/tests.xml"
    run_step parity "$TIMEOUT_PARITY" env ZEROSHARD_GPU_REPORT="$OUT/parity.jsonl" \
        "${pytest[@]}" -k parity --junitxml="$OUT/parity.xml"
    run_step offload "$TIMEOUT_OFFLOAD" "${bench[@]}" "${size[@]}" --mode offload --out "$OUT/offload.json"
    if [[ -f "$OUT/offload.json" ]]; then
        run_step plain "$TIMEOUT_PLAIN" "${bench[@]}" --mode plain --like "$OUT/offload.json" --out "$OUT/plain.json"
        local runs=("$OUT/offload.json")
        [[ -f "$OUT/plain.json" ]] && runs+=("$OUT/plain.json")
        "$PYTHON" benchmarks/gpu_offload.py --summarize "${runs[@]}" --out "$OUT/offload_summary.json" >>"$LOG" 2>&1 || true
    else
        printf 'plain\t%s\t0\n' 1 >>"$STATUS_FILE"
        log "step plain: skipped, the offload run wrote no JSON"
    fi
    summary | tee -a "$LOG"
    awk -F'\t' '$2 != 0 { failed = 1 } END { exit failed }' "$STATUS_FILE"
}

main "$@"
