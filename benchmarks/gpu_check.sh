#!/usr/bin/env bash
# The GPU checks of mplab in one command, for a session with a CUDA GPU (at most 5 minutes:
# each step has a time limit, and the limits add up to 300 s):
#   bash benchmarks/gpu_check.sh            # results in $OUT, else ./gpu_results
# Each step's output goes to its own log and its exit code to steps.txt; a failing step does
# not stop the others. The bench runs first: its record, bench_<gpu>_<date>.json (the same as
# bench_cuda.json, "meta" included), is a reference result to copy into data/reference/ as is.
set -u
cd "$(dirname "$0")/.."
RESULTS="${OUT:-gpu_results}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
: > "$RESULTS/steps.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, record its exit code
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee -a "$RESULTS/steps.txt"
  timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$RESULTS/steps.txt"
  tail -n 30 "$RESULTS/$name.log"
}

step env 20 python -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-')"
step bench_cuda 90 python -m mplab.bench --device cuda --quick --json "$RESULTS/bench_cuda.json" --plot "$RESULTS/bench_cuda.png"
# the reference file's name: bench_<gpu>_<date>.json, from the record's own meta
step reference_name 15 python -c "import json, shutil, sys; from mplab.bench import reference_filename; out = sys.argv[1]; name = reference_filename(json.load(open(f'{out}/bench_cuda.json'))); shutil.copy(f'{out}/bench_cuda.json', f'{out}/{name}'); print(name)" "$RESULTS"
step bench_lesson 30 python -m mplab.bench --device cuda --lesson --json "$RESULTS/lesson_cuda.json"
step pytest_cuda 45 python -m pytest -q -k cuda tests
step lab_cuda 40 python benchmarks/lab_check.py --device cuda --json "$RESULTS/lab_cuda.json"
step bench_train 50 python benchmarks/bench_train.py --device cuda --steps 20 --rounds 2 --parity-steps 100 --cuda-steps 20
step fp8_matmul 10 python benchmarks/bench_fp8_gpu.py --json "$RESULTS/fp8_matmul.json"
echo "results in $RESULTS:"; cat "$RESULTS/steps.txt"
