#!/usr/bin/env bash
# The TP benchmark on a lent GPU (H200), in one short run (< 5 minutes):
#   the time/memory table on CUDA (torch.cuda.max_memory_allocated, achieved bandwidth vs
#   ~4.8 TB/s), compile time, and a CUDA-graph capture of a compiled training step.
#
#   perf/gpu.sh                      # on the GPU machine, from the repository root
#   perf/gpu.sh --device cpu --quick # dry run of the same logic on CPU
#
# Works on a bare machine with the image's torch: installs the package without dependencies
# (matplotlib is optional there: without it the PNG is skipped, the tables are still written).
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
QUICK=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --quick) QUICK=(--quick); shift ;;
    *) echo "unknown option $1 (use --device cpu|cuda, --quick)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python}
"$PYTHON" -c "import compiled_logprob" 2>/dev/null || "$PYTHON" -m pip install -q -e . --no-deps
"$PYTHON" - <<EOF
import torch
print("torch", torch.__version__, "| cuda available:", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
assert "$DEVICE" == "cpu" or torch.cuda.is_available(), "no CUDA device: pass --device cpu"
EOF

# CUDA runs have no memory subprocess cost worth skipping; TP=2 (gloo) is CPU-only.
timeout 240 "$PYTHON" perf/bench_tp.py --device "$DEVICE" "${QUICK[@]}"
timeout 60 "$PYTHON" perf/cuda_graphs.py --device "$DEVICE" "${QUICK[@]}"
if [[ "$DEVICE" == cuda* ]]; then
  timeout 90 "$PYTHON" perf/compile_check.py --device "$DEVICE" --quick
fi
ls -l perf/results/
