#!/usr/bin/env bash
# The GPU checks of mplab in one command, for a session with a CUDA GPU (at most 5 minutes:
# each step has a time limit, and the limits add up to 300 s):
#   bash benchmarks/gpu_check.sh            # results in $OUT, else ./gpu_results
# Each step's output goes to its own log and its exit code to steps.txt; a failing step does
# not stop the others. The bench runs first: its record, bench_<gpu>_<date>.json (the same as
# bench_cuda.json, "meta" included), is a reference result to copy into data/reference/ as is.
# Without CUDA (the rehearsal, benchmarks/rehearse_gpu.sh) it is a dry run: the steps marked
# `gpu` say "skipped: no CUDA", the rest run as they would on the GPU.
# The GPU image has no torchao (benchmarks/gpu_image.txt): wheels in .whl/ (made by
# `bash benchmarks/rehearse_gpu.sh --wheels`) are installed first, for this run only.
set -u
cd "$(dirname "$0")/.."
RESULTS="${OUT:-gpu_results}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
: > "$RESULTS/steps.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/mplab-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/mplab-site"
fi
CUDA=$(python -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

step() {  # step NAME SECONDS [gpu] COMMAND...: run with a time limit, record its exit code
  local name=$1 limit=$2; shift 2
  if [ "$1" = gpu ]; then
    shift
    if [ "$CUDA" != 1 ]; then
      echo "$name skipped: no CUDA" | tee -a "$RESULTS/steps.txt"
      return
    fi
  fi
  echo "== $name: $*" | tee -a "$RESULTS/steps.txt"
  timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$RESULTS/steps.txt"
  tail -n 30 "$RESULTS/$name.log"
}

step env 20 python -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__, torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-')"
step bench_cuda 90 gpu python -m mplab.bench --device cuda --quick --json "$RESULTS/bench_cuda.json" --plot "$RESULTS/bench_cuda.png"
# the reference file's name: bench_<gpu>_<date>.json, from the record's own meta
step reference_name 15 gpu python -c "import json, shutil, sys; from mplab.bench import reference_filename; out = sys.argv[1]; name = reference_filename(json.load(open(f'{out}/bench_cuda.json'))); shutil.copy(f'{out}/bench_cuda.json', f'{out}/{name}'); print(name)" "$RESULTS"
step bench_lesson 30 gpu python -m mplab.bench --device cuda --lesson --json "$RESULTS/lesson_cuda.json"
# every test module collects (the optional packages' tests skip, naming them); the CUDA ones
# run. The image has no pytest-xdist: one process, without the project's -n 2.
step pytest_cuda 45 python -m pytest -q -o addopts=-ra -p no:cacheprovider -k cuda tests
step lab_cuda 40 gpu python benchmarks/lab_check.py --device cuda --json "$RESULTS/lab_cuda.json"
step bench_train 50 gpu python benchmarks/bench_train.py --device cuda --steps 20 --rounds 2 --parity-steps 100 --cuda-steps 20
step fp8_matmul 10 python benchmarks/bench_fp8_gpu.py --json "$RESULTS/fp8_matmul.json"
echo "results in $RESULTS:"; cat "$RESULTS/steps.txt"
