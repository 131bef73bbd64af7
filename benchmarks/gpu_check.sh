#!/usr/bin/env bash
# The GPU worker's check, in one run: a bare CUDA image's own python3 (torch, transformers, peft; no prefect,
# pydantic, s3fs, gcsfs), the repository root as the working directory, $OUT a folder for the outputs.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh        # also runs on a CPU-only machine: CPU figures, CUDA tests skipped
#
# Steps, each printed as PASS/FAIL with its time (its log in $OUT/<step>.log):
#   env        python, torch, CUDA, transformers, peft versions; the GPU seen
#   devices    `extract-lora --device cuda:99` / `--device gpu9` refused in one line (InvalidDevice, exit 2)
#   tests      the device and GPU tests (the CUDA ones run only where CUDA is present): pytest --noconftest;
#   lora_tests SVD extraction and re-factoring per device against PEFT (tests/merge_engine/lora/test_device_paths.py)
#   merge      a tiny verl FSDP2 run (2 ranks, gloo) written here, merged by `python3 -m merge_engine merge`
#   validate   validate_model of the merge against the run's reference on the default device (cuda when present)
#   bench      benchmarks/gpu.py (SVD extraction new/full x GPU/CPU, validation forward) within $BENCH_BUDGET_S
# Large files (the benchmark's two ~2 GB models) go to $WORK (default /tmp/stepmerge-gpu-check), not $OUT.
# Exit status: the number of failed steps.
set -u
OUT=${OUT:?set OUT to a folder for the outputs}
WORK=${WORK:-/tmp/stepmerge-gpu-check}
PY=${PYTHON:-python3}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-120}
BENCH_ARGS=${BENCH_ARGS:-}  # e.g. "--layers 1 --hidden 256 --intermediate 512 --vocab 512 --heads 4" for a quick try
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
       STEPMERGE_CACHE_DIR="$WORK/cache" PYTHONUNBUFFERED=1
failed=0
started_all=$(date +%s)

step() {  # step NAME TIMEOUT_S COMMAND...: run it, log to $OUT/NAME.log, print PASS/FAIL
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s.%N)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$? t=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")
    if [ $rc -eq 0 ]; then
        echo "PASS $name (${t} s)"
    else
        echo "FAIL $name (exit $rc$([ $rc -eq 124 ] && echo ', timed out'), ${t} s); last lines of $OUT/$name.log:"
        tail -n 25 "$OUT/$name.log" | sed 's/^/    /'
        failed=$((failed + 1))
    fi
    return $rc
}

step env 60 $PY -c "
import sys, torch, transformers, peft
print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda,
      '| transformers', transformers.__version__, '| peft', peft.__version__)
print('GPU:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none', '| CPU threads', torch.get_num_threads())
" && sed 's/^/    /' "$OUT/env.log"

step devices 120 bash -c "
for name in cuda:99 gpu9; do
    $PY -m merge_engine extract-lora --base-model '$WORK/none' --finetuned '$WORK/none2' --rank 8 \
        --target-dir '$WORK/never' --device \$name 2> '$WORK/device.err'
    rc=\$?; cat '$WORK/device.err'
    [ \$rc -eq 2 ] && grep -q '^stepmerge: error: InvalidDevice: --device' '$WORK/device.err' \
        && [ \$(wc -l < '$WORK/device.err') -eq 1 ] || exit 1
done"

if $PY -c "import pytest" 2>/dev/null; then
    step tests 240 $PY -m pytest --noconftest -p no:cacheprovider -q -rs -k "device or gpu or cuda" \
        tests/merge_engine/test_devices.py tests/merge_engine/validate/test_device_forward.py \
        tests/merge_engine/lora/test_lowrank.py
    grep -E "passed|failed|SKIPPED|error" "$OUT/tests.log" | tail -n 6 | sed 's/^/    /'
    # SVD extraction and re-factoring on each device against PEFT's truth: its folder's own conftest only
    step lora_tests 180 $PY -m pytest --confcutdir=tests/merge_engine/lora -p no:cacheprovider -q -rs \
        tests/merge_engine/lora/test_device_paths.py
    grep -E "passed|failed|SKIPPED|error" "$OUT/lora_tests.log" | tail -n 3 | sed 's/^/    /'
else
    echo "FAIL tests (pytest is not installed for $PY)"; failed=$((failed + 1))
fi

rm -rf "$WORK/run" "$WORK/ref" "$WORK/merged"
if step write_run 240 $PY -m synthetic_runs fsdp --out "$WORK/run" --references "$WORK/ref" --steps 1 \
        --world-size 2 --strategy fsdp2; then
    if step merge 180 $PY -m merge_engine merge --backend fsdp --local_dir "$WORK/run/global_step_1/actor" \
            --target_dir "$WORK/merged"; then
        sed 's/^/    /' "$OUT/merge.log" | tail -n 2
        step validate 180 $PY -c "
from merge_engine.validate.model import validate_model
report = validate_model('$WORK/merged', '$WORK/ref/global_step_1/hf')
print(report.text())
raise SystemExit(0 if report.ok else 1)
" && grep -E "load|forward|logits" "$OUT/validate.log" | sed 's/^/    /'
    fi
fi

step bench $((BENCH_BUDGET_S + 240)) $PY -m benchmarks.gpu --work "$WORK/bench" --budget-s "$BENCH_BUDGET_S" \
    --json "$OUT/gpu.json" $BENCH_ARGS
sed -n '/^SVD extraction/,$p' "$OUT/bench.log" | grep -v -E "Loading weights|Writing model" | sed 's/^/    /'

echo "gpu_check: $failed failed step(s) in $(( $(date +%s) - started_all )) s; logs and gpu.json in $OUT"
exit $failed
