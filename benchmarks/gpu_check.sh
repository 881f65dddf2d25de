#!/usr/bin/env bash
# Every GPU check of asyncroll in one bounded run, each step writing under one output folder.
#
#   bash benchmarks/gpu_check.sh                      # install .[gpu,dev] into .venv-gpu, run all
#   bash benchmarks/gpu_check.sh --python python3 --steps tests,parity   # a python that has vllm
#   bash benchmarks/gpu_check.sh --list               # the steps, their limits and outputs
#   bash benchmarks/gpu_check.sh --dry-run            # print each step's command, run nothing
#   bash benchmarks/gpu_check.sh --python python3 --steps torch   # a GPU with torch, no vLLM
#   bash benchmarks/gpu_check.sh --vllm 0.33.0 --venv .venv-gpu-0.33  # another supported vLLM
#
# Steps (in this order; --steps picks some, comma-separated):
#   install     a fresh venv with the CUDA vllm wheel: `make VENV=$VENV EXTRA=gpu install`
#               (the newest supported vLLM), then `vllm==VERSION` with --vllm VERSION (one of
#               benchmarks/vllm_compat.py CHECKED: each supported release, one venv each)
#   compat      benchmarks/vllm_compat.py --installed: what asyncroll uses, against the
#               installed vLLM's own sources (no GPU needed; refuses an unsupported version)
#   torch       benchmarks/gpu_check_torch.py, the trainer side with the machine's own CUDA torch
#               (no vLLM, no network): token_logprobs and policy_loss in bf16/fp32 against
#               float64 at a 152k vocabulary, their GPU memory against the bound, wrap_lora
#               training steps, the codec with CUDA tensors. --wheelhouse DIR: wheels of
#               asyncroll's dependencies the machine lacks (msgspec, ...; see that script)
#   tests       pytest -m gpu and every real-vLLM test (tests/vllm, the engine conformance, and
#               tests/test_training.py's top-p tie test against vLLM's CUDA kernel) on CUDA, on
#               vLLM's default model runner there: Model Runner V2 (the only one from 0.34)
#   runner_v1   (vLLM < 0.34) the same tests on Model Runner V1, VLLM_USE_V2_MODEL_RUNNER=0;
#               on 0.34 it passes at once, saying V1 is gone
#   parity      the weight-parity conformance on CUDA: in-process engine, `vllm serve` over the
#               shared folder and over NCCL, every tensor perturbed, tied and untied heads
#   throughput  benchmarks/vllm_throughput.py on a ~1B random-weight Llama in bfloat16: tokens/s
#               against vLLM's own LLM.generate, and update_weights latency for those weights
#   memory      benchmarks/memory_profile.py on the real engine, GPU memory recorded
#   demo        benchmarks/demo_overlap.py: the demo on GPU, step time against the ideal max(G, T)
#
# Each step runs under `timeout` (its limit: --list) and writes its log and tables to
# OUT/<step>/; OUT/summary.md has one row per step (status, seconds, where its output is). Every
# step but compat checks for CUDA first and fails at once, saying so, where there is none.
# Exit status: 0 when every step ran passed, 1 otherwise, 2 for bad arguments.
#
# The default run is estimated at 25 minutes on one H200 after the install, plus runner_v1 (the
# tests again) on vLLM < 0.34 (not yet run on a GPU); a lease of 10 minutes a call runs it in
# calls: `--steps compat,tests`, `--steps runner_v1`, `--steps parity`, then
# `--steps throughput,memory,demo`. Each supported vLLM is one install (--vllm, --venv).
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ALL_STEPS=(install compat torch tests runner_v1 parity throughput memory demo)
declare -A LIMIT_S=([install]=900 [compat]=120 [torch]=240 [tests]=420 [runner_v1]=420 [parity]=300 [throughput]=420 [memory]=240 [demo]=420)
declare -A WHAT=(
  [install]="a fresh venv with .[gpu,dev] (--vllm: that supported release)"
  [compat]="what asyncroll uses, against the installed vLLM's sources"
  [torch]="trainer side on CUDA torch alone: logprobs, loss, memory, LoRA, codec"
  [tests]="pytest -m gpu + the real-vLLM tests on CUDA (Model Runner V2)"
  [runner_v1]="the same tests on Model Runner V1 (vLLM < 0.34)"
  [parity]="weight parity on CUDA (in-process, HTTP, NCCL)"
  [throughput]="~1B bf16 Llama: tokens/s vs LLM.generate, update_weights latency"
  [memory]="memory profile on the real engine, GPU memory recorded"
  [demo]="demo overlap on GPU: step time vs max(G, T)"
)

OUT="$ROOT/gpu-check-out"
VENV="$ROOT/.venv-gpu"
PY=""
STEPS=""
WHEELHOUSE=""
VLLM=""
DRY=0
# The supported vLLM releases: the ones benchmarks/vllm_compat.py checks.
CHECKED="$(sed -n 's/^CHECKED = (\(.*\))$/\1/p' "$ROOT/benchmarks/vllm_compat.py" | tr -d '",')"

usage() { sed -n '2,41p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --wheelhouse) WHEELHOUSE="$(cd "$2" && pwd)"; shift 2 ;;
    --vllm) VLLM="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --list)
      for s in "${ALL_STEPS[@]}"; do printf '%-11s %4ss  %s\n' "$s" "${LIMIT_S[$s]}" "${WHAT[$s]}"; done
      exit 0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if [ -n "$VLLM" ] && ! [[ " $CHECKED " == *" $VLLM "* ]]; then
  echo "gpu_check: --vllm $VLLM is not a supported release; supported: $CHECKED" >&2; exit 2
fi
if [ -z "$STEPS" ]; then
  # A given --python already has vllm: nothing to install.
  if [ -n "$PY" ]; then STEPS="compat,torch,tests,runner_v1,parity,throughput,memory,demo"
  else STEPS="$(IFS=,; echo "${ALL_STEPS[*]}")"; fi
fi
IFS=, read -r -a CHOSEN <<< "$STEPS"
for s in "${CHOSEN[@]}"; do
  [ -n "${LIMIT_S[$s]:-}" ] || { echo "gpu_check: no step '$s'; steps: ${ALL_STEPS[*]}" >&2; exit 2; }
done
[ -n "$PY" ] || PY="$VENV/bin/python"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# Run a step's command from a folder, or with --dry-run only print it (CI checks the printed
# benchmark arguments against each benchmark's own parser).
run_in() {
  local dir="$1"; shift
  if [ "$DRY" = 1 ]; then echo "gpu_check: would run in $dir: $*"; return 0; fi
  (cd "$dir" && "$@")
}

# A clear, early failure without CUDA, instead of a step that fails half-way in vLLM's start.
# Checked once per run (after install, the only step that changes the venv): each later step
# replays the answer instead of starting a python that imports torch and vllm again.
require_cuda() {
  [ "$DRY" = 0 ] || return 0
  if [ -f "$OUT/.require_cuda.rc" ]; then
    cat "$OUT/.require_cuda.log"
    return "$(cat "$OUT/.require_cuda.rc")"
  fi
  local rc=0
  check_cuda > "$OUT/.require_cuda.log" 2>&1 || rc=$?
  cat "$OUT/.require_cuda.log"
  echo "$rc" > "$OUT/.require_cuda.rc"
  return "$rc"
}

check_cuda() {
  if ! command -v "$PY" >/dev/null 2>&1 && [ ! -x "$PY" ]; then
    echo "gpu_check: no python at '$PY': run the install step first, or give --python" >&2
    return 1
  fi
  "$PY" - <<'PYCODE'
import sys
try:
    import torch
except Exception as exc:
    sys.exit(f"gpu_check: torch is not importable ({type(exc).__name__}: {exc}): install .[gpu]")
if not torch.cuda.is_available():
    sys.exit("gpu_check: this step needs a CUDA GPU, and torch.cuda.is_available() is False")
try:
    import vllm  # noqa: F401
except Exception as exc:
    sys.exit(f"gpu_check: vllm is not importable ({type(exc).__name__}: {exc}): install .[gpu]")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, vllm {vllm.__version__}")
PYCODE
}

step_install() {
  if [ "$DRY" = 0 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: install needs a CUDA GPU machine (no nvidia-smi here): the CUDA vllm wheel" \
      "must never go into a CPU machine's venv" >&2
    return 1
  fi
  [ "$DRY" = 1 ] || rm -rf "$VENV"
  run_in "$ROOT" make VENV="$VENV" EXTRA=gpu install || return 1
  if [ -n "$VLLM" ]; then run_in "$ROOT" "$VENV/bin/python" -m pip install -q "vllm==$VLLM"; fi
}

step_compat() {
  # Reads the installed vLLM's files; needs no GPU, downloads nothing.
  run_in "$ROOT" "$PY" benchmarks/vllm_compat.py --versions --installed
}

step_torch() {
  # Needs no vLLM: the script checks CUDA (and the dependencies it can import) itself.
  run_in "$ROOT" "$PY" benchmarks/gpu_check_torch.py --out "$1" \
    ${WHEELHOUSE:+--wheelhouse "$WHEELHOUSE"}
}

step_tests() {
  require_cuda || return 1
  run_in "$ROOT" "$PY" -m pytest -q -m "gpu or vllm" tests/vllm tests/test_engine_conformance.py \
    tests/test_training.py --junitxml="$1/junit.xml" -p no:cacheprovider
}

step_runner_v1() {
  require_cuda || return 1
  local version
  version="$(run_in "$ROOT" "$PY" -c 'import vllm; print(vllm.__version__)')" || return 1
  if [ "$DRY" = 0 ] && [ "$(printf '%s\n0.34\n' "$version" | sort -V | head -n 1)" = 0.34 ]; then
    echo "gpu_check: vllm $version has no Model Runner V1 (removed in 0.34): nothing to run"
    return 0
  fi
  VLLM_USE_V2_MODEL_RUNNER=0 run_in "$ROOT" "$PY" -m pytest -q -m "gpu or vllm" tests/vllm \
    tests/test_engine_conformance.py tests/test_training.py --junitxml="$1/junit.xml" \
    -p no:cacheprovider
}

step_parity() {
  require_cuda || return 1
  run_in "$ROOT" "$PY" -m pytest -q tests/vllm -k "parity or nccl" \
    --junitxml="$1/junit.xml" -p no:cacheprovider
}

step_throughput() {
  require_cuda || return 1
  # ~1.1B parameters: Llama shapes of a 1B model, random weights built locally
  run_in "$ROOT/benchmarks" "$PY" vllm_throughput.py --hidden 2048 --layers 16 --heads 16 \
    --kv-heads 8 --intermediate 5632 --vocab 32000 --dtype bfloat16 --prompts 256 --n 8 \
    --max-new-tokens 256 --reps 2 --rounds 1 --update-reps 5 --out "$1"
}

step_memory() {
  require_cuda || return 1
  run_in "$ROOT/benchmarks" "$PY" memory_profile.py --engine vllm --quick --out "$1"
}

step_demo() {
  require_cuda || return 1
  run_in "$ROOT/benchmarks" "$PY" demo_overlap.py --steps 20 --out "$1"
}

SUMMARY="$OUT/summary.md"
{
  echo "# asyncroll GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "Device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)"
  else
    echo "Device: no nvidia-smi on this machine"
  fi
  echo
  echo "| step | status | seconds | output |"
  echo "|---|---|---|---|"
} > "$SUMMARY"

failed=0
for s in "${CHOSEN[@]}"; do
  dir="$OUT/$s"
  mkdir -p "$dir"
  echo "== gpu_check: $s (at most ${LIMIT_S[$s]} s): ${WHAT[$s]}"
  start=$(date +%s)
  # `timeout` runs the step in a child shell of this script, so the step functions are exported
  export -f "step_$s" require_cuda check_cuda run_in
  export ROOT PY VENV DRY WHEELHOUSE OUT VLLM
  timeout --kill-after=30 "${LIMIT_S[$s]}" bash -c "step_$s \"\$1\"" _ "$dir" > "$dir/log.txt" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  case $rc in
    0) status=passed ;;
    124|137) status="timed out after ${LIMIT_S[$s]} s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  [ $rc -eq 0 ] || failed=1
  echo "| $s | $status | $secs | $s/ |" >> "$SUMMARY"
  echo "   $status in $secs s; log: $dir/log.txt"
  [ $rc -eq 0 ] || tail -n 5 "$dir/log.txt" | sed 's/^/   | /'
done
echo
cat "$SUMMARY"
exit $failed
