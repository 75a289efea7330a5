#!/usr/bin/env bash
# The checks and benchmarks for a lent GPU (H200), in one run of at most 9.5 minutes (570 s,
# kills included, enforced below; on a fresh machine most of it is cold Triton compiles):
#   the single-process tests on the device (tests/test_device.py: the CPU tests' oracle
#   checks, eager and compiled, batch invariance with Triton's kernels, no synchronising
#   call, an eager CUDA-graph capture),
#   the time/memory table on CUDA (torch.cuda.max_memory_allocated, achieved bandwidth vs
#   ~4.8 TB/s), a CUDA-graph capture of a compiled training step checked against eager,
#   compile time, the extras' cost over the plain pass (entropy, top-k, ...: on this CPU
#   the exp-sum loop is compute-bound, so only a GPU tells whether they come free) with the
#   kernels they spend it in and the top-k's block sizes, and the top-k/top-p filtered
#   log-probs against NeMo-RL's sort-based algorithm; the peers side by side on the logits
#   (bench_peers: torch compiled, loss_parallel, megatron-core, Liger) and from hidden states
#   (bench_lm_head --variant cce: cut-cross-entropy's Triton kernel and torch_compile,
#   Liger's fused linear cross-entropy); where the eager path's time goes against NeMo-RL's
#   (profile_eager: wall time against its kernels' time, the top kernels). The steps
#   measured on a GPU before (CUDA graphs, compile time) come last, where a short budget
#   cuts them first.
#
#   perf/gpu.sh                      # on the GPU machine, from anywhere
#   perf/gpu.sh --device cpu --quick # dry run of the same logic on CPU (limits × 3)
#   perf/gpu.sh --only bench_peers,lm_head_peers   # some steps (preflight always runs)
#
# Every step runs under its own `timeout`, each cut to what is left of the 570 s; a step that
# fails or times out is reported and the next one runs, and the exit status is non-zero if
# any step failed. bench_tp, cuda_graphs, bench_extras and bench_filtering rewrite their
# tables as they go, so a step cut short still leaves what it measured. Results go to
# perf/results/; when $OUT is set, the files this run wrote there are packed into
# $OUT/results.tar.gz after every step (the device tool brings back 8 files at most), beside
# the log gpu_sh.log.
#
# Works on a bare machine with the image's torch: nothing is installed, PYTHONPATH points at
# the repository root (subprocesses included). The lent H200's image holds torch 2.11, older
# than the package supports: COMPILED_LOGPROB_ALLOW_OLD_TORCH=1 lets it import there with a
# warning (what fails on 2.11 is multi-rank and DTensor, which nothing here runs on CUDA; the
# results' headers name the torch they ran on). matplotlib is optional: without it the PNG
# is skipped and the tables are still written. PYTHON picks the interpreter (default: python,
# else python3).
set -uo pipefail
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
if [[ "$PYTHON" == */* ]]; then  # a path: make it absolute before changing directory
  PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"
fi
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The peers' pure-Python packages (Liger-Kernel, cut-cross-entropy), installed beforehand
# with `pip install --no-deps --target perf/site liger-kernel cut-cross-entropy megatron-core`
# and carried to the GPU machine, which may have no package index. A peer that is missing
# or fails is reported in its table; the run goes on.
if [[ -d "$ROOT/perf/site" ]]; then export PYTHONPATH="$PYTHONPATH:$ROOT/perf/site"; fi
export COMPILED_LOGPROB_ALLOW_OLD_TORCH=${COMPILED_LOGPROB_ALLOW_OLD_TORCH:-1}

DEVICE=cuda
QUICK=()
ONLY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --quick) QUICK=(--quick); shift ;;
    --only) ONLY=",$2,"; shift 2 ;;
    *) echo "unknown option $1 (use --device cpu|cuda, --quick, --only STEP,...)" >&2; exit 2 ;;
  esac
done

# Step limits in seconds on CUDA (a CPU dry run gets 3 times as long): every step is cut to
# what is left of TOTAL_S, SIGKILL grace included. Overridable from the environment.
TOTAL_S=${TOTAL_S:-570}
PREFLIGHT_S=${PREFLIGHT_S:-40}
DEVICE_TESTS_S=${DEVICE_TESTS_S:-120}
BENCH_TP_S=${BENCH_TP_S:-120}  # bench_tp starts no new case after 60 s of them
PEERS_S=${PEERS_S:-100}        # the bf16 forward and training at least (six compiles each)
LM_HEAD_PEERS_S=${LM_HEAD_PEERS_S:-60}
PROFILE_EAGER_S=${PROFILE_EAGER_S:-45} # the bf16 forward at least: eager vs NeMo-RL's, kernels
EXTRAS_S=${EXTRAS_S:-60}       # the fp32 forward case at least (its five compiles)
PROFILE_S=${PROFILE_S:-70}     # 6 compiles to profile, then 2 per block size
FILTERING_S=${FILTERING_S:-60} # likewise (four compiles per case)
CUDA_GRAPHS_S=${CUDA_GRAPHS_S:-45}
COMPILE_S=${COMPILE_S:-50}
KILL_GRACE_S=10                # SIGKILL this long after a step ignores SIGTERM
SCALE=1
[[ "$DEVICE" == cpu ]] && SCALE=3

START=$SECONDS
STAMP=$(mktemp)  # results newer than this were written by this run
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  LOG="$OUT/gpu_sh.log"
else
  LOG=$(mktemp "${TMPDIR:-/tmp}/gpu_sh.XXXXXX.log")
fi
: > "$LOG"
FAILED=()
SUMMARY=()

log() { echo "$*" | tee -a "$LOG"; }

save_results() {
  [[ -n "${OUT:-}" ]] || return 0
  local written
  written=$(cd perf/results && find . -maxdepth 1 -type f -newer "$STAMP" -printf '%P\n')
  [[ -n "$written" ]] || return 0
  # Written whole, then renamed: a run killed mid-pack leaves the previous pack.
  (cd perf/results && tar -czf "$OUT/results.tar.gz.part" $written) 2>/dev/null \
    && mv "$OUT/results.tar.gz.part" "$OUT/results.tar.gz"
}

# run_step NAME LIMIT_S COMMAND... : COMMAND under timeout, output to the terminal and the log.
# An argument @BUDGET@ becomes the seconds in which the step should finish its work: its
# limit less a minute for the case in flight and the report (two thirds of a short limit).
run_step() {
  local name=$1 limit=$(($2 * SCALE))
  shift 2
  if [[ -n "$ONLY" && "$ONLY" != *",$name,"* && "$name" != preflight ]]; then
    return 0
  fi
  local left=$((TOTAL_S * SCALE - (SECONDS - START) - KILL_GRACE_S))
  ((limit > left)) && limit=$left
  local budget=$((limit > 90 * SCALE ? limit - 60 * SCALE : limit * 2 / 3))
  set -- "${@//@BUDGET@/$budget}"
  if ((limit < 5)); then
    log "### $name: not run, the ${TOTAL_S}s budget is spent"
    FAILED+=("$name")
    SUMMARY+=("$name: NOT RUN (budget spent)")
    return 1
  fi
  local command="$*"
  command=${command//$'\n'/ }
  ((${#command} > 200)) && command="${command:0:200}…"
  log ""
  log "### $name (timeout ${limit}s, at $((SECONDS - START))s): $command"
  local t0=$SECONDS rc
  timeout -k "$KILL_GRACE_S" "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0)) status
  case $rc in
    0) status="ok" ;;
    124 | 137) status="TIMED OUT (limit ${limit}s)" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  ((rc == 0)) || FAILED+=("$name")
  SUMMARY+=("$name: $status, ${took}s")
  log "### $name: $status after ${took}s"
  save_results
  return "$rc"
}

finish() {
  log ""
  log "### summary ($DEVICE, $((SECONDS - START))s of at most $((TOTAL_S * SCALE))s)"
  for line in "${SUMMARY[@]}"; do log "  $line"; done
  log "results written by this run:"
  find perf/results -maxdepth 1 -type f -newer "$STAMP" -exec ls -l {} + 2>/dev/null | tee -a "$LOG"
  [[ -n "${OUT:-}" ]] && log "packed into $OUT/results.tar.gz, beside the log gpu_sh.log"
  save_results
  rm -f "$STAMP"
  if ((${#FAILED[@]})); then
    log "FAILED: ${FAILED[*]}"
    exit 1
  fi
  log "all steps passed"
  exit 0
}

PREFLIGHT='
import os, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda available:",
      torch.cuda.is_available(), "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
import compiled_logprob
where = os.path.dirname(os.path.dirname(os.path.abspath(compiled_logprob.__file__)))
print("compiled_logprob", compiled_logprob.__version__, "from", where)
assert os.path.samefile(where, sys.argv[1]), f"compiled_logprob comes from {where}, not this checkout {sys.argv[1]}"
try:
    import matplotlib
    print("matplotlib", matplotlib.__version__)
except ImportError:
    print("matplotlib missing: the PNG plot is skipped, the tables are written")
assert sys.argv[2] == "cpu" or torch.cuda.is_available(), "no CUDA device: pass --device cpu"
'
# Run from perf/ (as the benchmarks are) so that only PYTHONPATH can find the package.
if ! run_step preflight "$PREFLIGHT_S" bash -c 'cd perf && exec "$0" -c "$1" "$2" "$3"' \
    "$PYTHON" "$PREFLIGHT" "$ROOT" "$DEVICE"; then
  log "preflight failed: nothing else can run"
  finish
fi
if [[ "$DEVICE" == cuda* ]] && command -v nvidia-smi > /dev/null; then
  timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 \
    | tee -a "$LOG" || true
fi

# Correctness first: the CPU tests' oracle checks with the calls on the device.
run_step device_tests "$DEVICE_TESTS_S" env COMPILED_LOGPROB_TEST_DEVICE="$DEVICE" \
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_device.py
# TP = 2 (gloo) is CPU-only; on CUDA the memory is measured in process, case by case.
run_step bench_tp "$BENCH_TP_S" "$PYTHON" perf/bench_tp.py --device "$DEVICE" \
  --time-budget @BUDGET@ ${QUICK[@]+"${QUICK[@]}"}
run_step bench_peers "$PEERS_S" "$PYTHON" perf/bench_peers.py --device "$DEVICE" \
  --time-budget @BUDGET@ ${QUICK[@]+"${QUICK[@]}"}
if [[ "$DEVICE" == cuda* ]]; then
  run_step lm_head_peers "$LM_HEAD_PEERS_S" "$PYTHON" perf/bench_lm_head.py --device "$DEVICE" \
    --variant cce --seq 8192 --hidden 2048 --dtype bfloat16 --steps 5
fi
run_step profile_eager "$PROFILE_EAGER_S" "$PYTHON" perf/profile_eager.py --device "$DEVICE" \
  --time-budget @BUDGET@ ${QUICK[@]+"${QUICK[@]}"}
run_step bench_extras "$EXTRAS_S" "$PYTHON" perf/bench_extras.py --device "$DEVICE" \
  --time-budget @BUDGET@ ${QUICK[@]+"${QUICK[@]}"}
run_step profile_extras "$PROFILE_S" "$PYTHON" perf/profile_extras.py --device "$DEVICE" \
  ${QUICK[@]+"${QUICK[@]}"}
run_step bench_filtering "$FILTERING_S" "$PYTHON" perf/bench_filtering.py --device "$DEVICE" \
  --time-budget @BUDGET@ ${QUICK[@]+"${QUICK[@]}"}
run_step cuda_graphs "$CUDA_GRAPHS_S" "$PYTHON" perf/cuda_graphs.py --device "$DEVICE" ${QUICK[@]+"${QUICK[@]}"}
if [[ "$DEVICE" == cuda* ]]; then
  run_step compile_check "$COMPILE_S" "$PYTHON" perf/compile_check.py --device "$DEVICE" --quick
fi
finish
