#!/usr/bin/env bash
# On the device machine (see prepare.sh): the GPU figures of docs/benchmarks.md.
#   figures.sh all [SECONDS]   # everything in order of importance, skipping what would end past
#                              # SECONDS (default 540) from the start; one call of the device tool
#                              # whose timeout_s is at least 60 more (start-up before the script)
#   figures.sh gpt2|large|rest # one part
#   figures.sh check [SECONDS] # the project's GPU tests, then GPT-2 small's bf16 bench
#   figures.sh decode|lease [SECONDS]  # generation against transformers (dynamic and static
#                              # cache), GPT-2 small, batches 1 and 8; lease: that, then the peer
#                              # rows, then the decode and language GPU tests, in one call
#   BATCHES="1 8" figures.sh decode, CHUNKS="2048 512" figures.sh chunks [SECONDS]: those only
#   figures.sh peer [SECONDS]  # ours against the nanoGPT-style peer (bench.peer) in the same
#                              # process: GPT-2 small at vocabularies 50304 (batch 32) and 256
#                              # (batch 64), a GPT at 128256 (batch 16), then GPT-2 small at 50304
#                              # with the plain loss; default 330 s: one call of timeout_s 360+
# TRAINER (gpu) and EXTRA (overrides added last to every command, so they win) let a CPU check
# the plumbing; TINY=1 sets both for tiny shapes on a CPU (minutes), e.g.
#   bash .ci/gpu/prepare.sh && TINY=1 PATH="$PWD/.venv/bin:$PATH" bash .ci/gpu/figures.sh peer 900
set -uo pipefail
part="${1:?usage: figures.sh all [SECONDS] | check [SECONDS] | gpt2 | large | rest | peer [SECONDS]}"
budget="${2:-$([ "$part" = peer ] && echo 330 || echo 540)}"
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
EXTRA="${EXTRA:-}"
if [ "${TINY:-0}" = 1 ]; then
  TRAINER=cpu
  EXTRA="model.net.n_layer=1 model.net.n_head=2 model.net.n_embd=64 data.block_size=64
    data.max_bytes=300000 model.compile=false bench.warmup=2 bench.steps=3 bench.matmul_size=128
    $EXTRA"
fi
read -r -a extra <<< "$(echo $EXTRA)"
package=lightning_hydra_project
common=("trainer=$TRAINER" logger=csv extras.print_config=false)

summarize() {  # after every run, so a call stopped at its limit still brings back what ran
  python3 .ci/gpu/summary.py "$WORK" > "$OUT/$part.md"
  tar -czf "$OUT/$part-logs.tar.gz" -C "$WORK" --exclude=runs .
}

left() { echo $((budget - (SECONDS - started))); }

doctor() {  # doctor NAME OVERRIDES...: the memory estimate for a bench run, in the background
  local name=$1 run=() setting
  shift
  for setting in "${common[@]}" "$@" "${extra[@]}"; do [[ $setting == bench.* ]] || run+=("$setting"); done
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
    "${extra[@]}" "bench.output=$WORK/$name.json" "hydra.run.dir=$WORK/runs/$name" > "$WORK/$name.log" 2>&1 \
    || echo "   failed or stopped: $(tail -n 20 "$WORK/$name.log")"
  grep -E 'step time|MFU|TFLOP|ratio|stall|consolidated|sync|async|peak|tokens/s' "$WORK/$name.log" | tail -n 12
  summarize
}

gpu_tests() {  # [FILES...] the log goes straight to $OUT: it comes back even if the call is stopped
  local seconds=$(($(left) - 20))
  local files=("$@")
  ((${#files[@]})) || files=(tests/test_fp8.py tests/test_language.py tests/test_scale_out.py tests/test_vision.py)
  if ((seconds < 60)); then
    echo "== gpu tests: skipped, $(left) s left"
    return 0
  fi
  echo "== gpu tests ($seconds s)"
  (cd .gpu/project && timeout -k 10 "$seconds" python3 -m pytest -q -p no:cacheprovider -m gpu \
    "${files[@]}" 2>&1) \
    > "$OUT/$part-gpu-tests.log"
  tail -n 15 "$OUT/$part-gpu-tests.log"
}

small=(experiment=gpt2_small)
# Against the peer: no plain loop (the peer is the plain loop to beat), a short window after a
# warm-up that holds both compilations.
versus=(experiment=gpt2_small bench.plain=false bench.warmup=5 bench.steps=30)
large=(experiment=gpt_1b bench.warmup=5 bench.steps=20)
# Generation at GPT-2 small's real size and vocabulary in bf16 weights: ours cached, ours with the
# compiled step, transformers with its dynamic and its static (compiled) cache.
decode=(experiment=gpt2_small model.net.vocab_size=50257 model.compile=false
  trainer.precision=bf16-true bench.generation=true bench.prompt_tokens=64 bench.new_tokens=128
  bench.repeats=3)
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
  decode)
    for batch in ${BATCHES:-1 8}; do
      bench 150 "decode-b$batch" "${decode[@]}" "bench.batch=$batch"
    done
    ;;
  lease)  # one lease's figures for the round of issue 43, most important first
    bench 150 decode-b1 "${decode[@]}" bench.batch=1
    bench 100 gpt2_small-v50304-b32 "${versus[@]}" model.net.vocab_size=50304 data.batch_size=32
    bench 150 decode-b8 "${decode[@]}" bench.batch=8
    bench 100 gpt-v128256-b16 "${versus[@]}" model.net.vocab_size=128256 data.batch_size=16
    bench 60 gpt2_small-v50304-b32-plain-loss "${versus[@]}" model.net.vocab_size=50304 \
      data.batch_size=32 model.net.loss_chunk_size=null bench.peer=null
    gpu_tests tests/test_compiled_decode.py tests/test_language.py
    bench 90 gpt2_small-b64 "${versus[@]}" data.batch_size=64
    ;;
  chunks)  # the chunked loss at each of CHUNKS against the peer, GPT-2 small at vocabulary 50304
    for chunk in ${CHUNKS:-2048 512}; do
      bench 100 "gpt2_small-v50304-b32-chunk$chunk" "${versus[@]}" model.net.vocab_size=50304 \
        data.batch_size=32 "model.net.loss_chunk_size=$chunk"
    done
    ;;
  peer)
    bench 100 gpt2_small-v50304-b32 "${versus[@]}" model.net.vocab_size=50304 data.batch_size=32
    bench 90 gpt2_small-b64 "${versus[@]}" data.batch_size=64
    bench 100 gpt-v128256-b16 "${versus[@]}" model.net.vocab_size=128256 data.batch_size=16
    bench 60 gpt2_small-v50304-b32-plain-loss "${versus[@]}" model.net.vocab_size=50304 \
      data.batch_size=32 model.net.loss_chunk_size=null bench.peer=null
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
wait
summarize
cat "$OUT/$part.md"
