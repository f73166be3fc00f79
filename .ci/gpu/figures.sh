#!/usr/bin/env bash
# On the device machine (see prepare.sh): the GPU figures of docs/benchmarks.md for one part.
# TRAINER (gpu) and EXTRA (overrides added to every command) let a CPU check the plumbing.
set -uo pipefail
part="${1:?usage: figures.sh gpt2|large|rest}"
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

bench() {  # bench NAME OVERRIDES...: one bench.json, and the doctor's estimate beside it
  local name=$1
  shift
  echo "== $name: $*"
  python3 -c "from $package.bench import main; main()" "${common[@]}" "$@" \
    "bench.output=$WORK/$name.json" "hydra.run.dir=$WORK/runs/$name" > "$WORK/$name.log" 2>&1 \
    || { tail -n 20 "$WORK/$name.log"; return 0; }
  local run=() setting
  for setting in "${common[@]}" "$@"; do [[ $setting == bench.* ]] || run+=("$setting"); done
  python3 -c "from $package.doctor import main; main()" --json "${run[@]}" \
    > "$WORK/$name.doctor.json" 2> /dev/null
  tail -n 22 "$WORK/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__)'
case "$part" in
  gpt2)
    for batch in 32 64; do
      bench "gpt2_small-bf16-b$batch" experiment=gpt2_small "data.batch_size=$batch"
      bench "gpt2_small-fp8-b$batch" experiment=gpt2_small "data.batch_size=$batch" model.fp8=tensorwise
    done
    ;;
  large)
    bench gpt_1b-bf16 experiment=gpt_1b bench.warmup=5 bench.steps=20
    bench gpt_1b-fp8 experiment=gpt_1b bench.warmup=5 bench.steps=20 model.fp8=tensorwise
    ;;
  rest)
    bench gpt2_medium-bf16 experiment=gpt2_medium bench.warmup=5 bench.steps=20 bench.plain=false
    bench checkpoints experiment=gpt2_small strategy=model_parallel \
      trainer.strategy.data_parallel_size=1 trainer.devices=1 data.batch_size=16 \
      bench.checkpointing=true bench.warmup=2 bench.steps=12 bench.save_every=3
    (cd .gpu/project && timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu 2>&1) \
      > "$WORK/gpu-tests.log"
    tail -n 15 "$WORK/gpu-tests.log"
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
python3 .ci/gpu/summary.py "$WORK" | tee "$OUT/$part.md"
tar -czf "$OUT/$part-logs.tar.gz" -C "$WORK" --exclude=runs .
