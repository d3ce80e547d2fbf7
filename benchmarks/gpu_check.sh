#!/usr/bin/env bash
# The GPU checks of mplab in one command, for a session with a CUDA GPU (about 5 minutes):
#   bash benchmarks/gpu_check.sh            # results in $OUT, else ./gpu_results
# Each step's output goes to its own log and its exit code to steps.txt; a failing step does
# not stop the others.
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

step env 60 python -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-')"
step pytest_cuda 120 python -m pytest -q -k cuda tests
step bench_cuda 150 python -m mplab.bench --device cuda --quick --json "$RESULTS/bench_cuda.json" --plot "$RESULTS/bench_cuda.png"
step bench_train 150 python benchmarks/bench_train.py --device cuda --steps 20 --rounds 2 --parity-steps 100 --cuda-steps 20
echo "results in $RESULTS:"; cat "$RESULTS/steps.txt"
