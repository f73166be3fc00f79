#!/usr/bin/env bash
# On the device machine (see prepare.sh): the GPU figures of docs/benchmarks.md.
#   figures.sh all [SECONDS]   # everything in order of importance, skipping what would end past
#                              # SECONDS (default 540) from the start; one call of the device tool
#                              # whose timeout_s is at least 60 more (start-up before the script)
#   figures.sh gpt2|large|rest # one part
#   figures.sh check [SECONDS] # the project's GPU tests, then GPT-2 small's bf16 bench
# TRAINER (gpu) and EXTRA (overrides added to every command) let a CPU check the plumbing.
set -uo pipefail
part="${1:?usage: figures.sh all [SECONDS] | check [SECONDS] | gpt2 | large | rest}"
budget="${2:-540}"
started=$SECONDS
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/.gpu/out}"  # the device tool brings back 8 files: all of a part's go in 3
WORK="/tmp/gpu-figures/$part"
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
if [ -d .gpu/whl ] && ! python3 -c 'import hydra' 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/.gpu/project/src:$PWD/.gpu/project${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
TRAINER="${TRAINER:-gpu}"
read -r -a extra <<< "${EXTRA:-}"
package=lightning_hydra_project
common=("trainer=$TRAINER" logger=csv extras.print_config=false "${extra[@]}")

summarize() {  # after every run, so a call stopped at its limit still brings back what ran
  python3 .ci/gpu/summary.py "$WORK" > "$OUT/$part.md"
  tar -czf "$OUT/$part-logs.tar.gz" -C "$WORK" --exclude=runs .
}

left() { echo $((budget - (SECONDS - started))); }

doctor() {  # doctor NAME OVERRIDES...: the memory estimate for a bench run, in the background
  local name=$1 run=() setting
  shift
  for setting in "${common[@]}" "$@"; do [[ $setting == bench.* ]] || run+=("$setting"); done
  python3 -c "from $package.recipes.doctor import main; main()" --json "${run[@]}" \
    > "$WORK/$name.doctor.json" 2> "$WORK/$name.doctor.log" &
}

bench() {  # bench SECONDS NAME OVERRIDES...: one bench.json, if SECONDS are left for it
  local need=$1 name=$2
  shift 2
  if (($(left) < need)); then
    echo "== $name: skipped, $(left) s left of $budget"
    return 0
  fi
  echo "== $name: $* ($(left) s left)"
  timeout "$(($(left) > 1 ? $(left) : 1))" python3 -c "from $package.recipes.bench import main; main()" "${common[@]}" "$@" \
    "bench.output=$WORK/$name.json" "hydra.run.dir=$WORK/runs/$name" > "$WORK/$name.log" 2>&1 \
    || echo "   failed or stopped: $(tail -n 20 "$WORK/$name.log")"
  grep -E 'step time|MFU|TFLOP|ratio|stall|consolidated|sync|async|peak' "$WORK/$name.log" | tail -n 12
  summarize
}

gpu_tests() {  # the log goes straight to $OUT: it comes back even if the call is stopped
  local seconds=$(($(left) - 20))
  if ((seconds < 60)); then
    echo "== gpu tests: skipped, $(left) s left"
    return 0
  fi
  echo "== gpu tests ($seconds s)"
  (cd .gpu/project && timeout -k 10 "$seconds" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_fp8.py tests/test_language.py tests/test_scale_out.py tests/test_vision.py 2>&1) \
    > "$OUT/$part-gpu-tests.log"
  tail -n 15 "$OUT/$part-gpu-tests.log"
}

small=(experiment=gpt2_small)
large=(experiment=gpt_1b bench.warmup=5 bench.steps=20)
medium=(experiment=gpt2_medium bench.warmup=5 bench.steps=20 bench.plain=false)
stalls=(experiment=gpt2_small strategy=model_parallel trainer.strategy.data_parallel_size=1
  trainer.devices=1 data.batch_size=16 model.compile=false bench.checkpointing=true
  bench.warmup=2 bench.steps=12 bench.save_every=3)

nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv,noheader || true
python3 -c 'import torch, lightning, torchao; print("torch", torch.__version__, "lightning", lightning.__version__, "torchao", torchao.__version__)'
case "$part" in
  all)
    doctor gpt2_small-bf16-b64 "${small[@]}" data.batch_size=64
    doctor gpt2_small-fp8-b64 "${small[@]}" data.batch_size=64 model.fp8=tensorwise
    doctor gpt_1b-bf16 "${large[@]}"
    doctor gpt_1b-fp8 "${large[@]}" model.fp8=tensorwise
    doctor gpt2_medium-bf16 "${medium[@]}"
    bench 60 gpt2_small-bf16-b64 "${small[@]}" data.batch_size=64
    bench 60 gpt2_small-fp8-b64 "${small[@]}" data.batch_size=64 model.fp8=tensorwise
    bench 90 gpt_1b-bf16 "${large[@]}"
    bench 90 gpt_1b-fp8 "${large[@]}" model.fp8=tensorwise
    bench 60 checkpoints "${stalls[@]}"
    gpu_tests
    bench 60 gpt2_medium-bf16 "${medium[@]}"
    ;;
  gpt2)
    for batch in 32 64; do
      doctor "gpt2_small-bf16-b$batch" "${small[@]}" "data.batch_size=$batch"
      doctor "gpt2_small-fp8-b$batch" "${small[@]}" "data.batch_size=$batch" model.fp8=tensorwise
      bench 0 "gpt2_small-bf16-b$batch" "${small[@]}" "data.batch_size=$batch"
      bench 0 "gpt2_small-fp8-b$batch" "${small[@]}" "data.batch_size=$batch" model.fp8=tensorwise
    done
    ;;
  large)
    doctor gpt_1b-bf16 "${large[@]}"
    doctor gpt_1b-fp8 "${large[@]}" model.fp8=tensorwise
    bench 0 gpt_1b-bf16 "${large[@]}"
    bench 0 gpt_1b-fp8 "${large[@]}" model.fp8=tensorwise
    ;;
  check)  # after a change to the plumbing: the GPU tests, then one bench against the table
    gpu_tests
    bench 60 gpt2_small-bf16-b64 "${small[@]}" data.batch_size=64
    ;;
  rest)
    doctor gpt2_medium-bf16 "${medium[@]}"
    bench 60 checkpoints "${stalls[@]}"
    gpu_tests
    bench 60 gpt2_medium-bf16 "${medium[@]}"
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
wait
summarize
cat "$OUT/$part.md"
