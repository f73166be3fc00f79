#!/usr/bin/env bash
# On the development machine, before a GPU session's first `run`: bake the default project into
# .gpu/project and download, as wheels for the device machine's Python 3.12, what its image lacks
# (Hydra, OmegaConf, torchao). Then run, through the device tool, with carry [".gpu"]:
#   bash .ci/gpu/figures.sh all 540       # the figures below in order of importance, in 540 s
#   bash .ci/gpu/figures.sh gpt2          # GPT-2 small, bf16 and FP8, batches 32 and 64
#   bash .ci/gpu/figures.sh large         # gpt_1b, bf16 and FP8
#   bash .ci/gpu/figures.sh rest          # checkpoint stalls, the project's GPU tests, gpt2_medium
# Each prints a Markdown table of its figures last; bench.json files come back under $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
installed() { .venv/bin/python -c "from importlib.metadata import version; print(version('$1'))"; }
# The versions this venv tests with; TORCHAO=torchao==X.Y.Z picks another (one that imports with
# the GPU machine's torch).
TORCHAO="${TORCHAO:-torchao==$(installed torchao)}"
rm -rf .gpu && mkdir -p .gpu/whl
mkdir -p .git/info
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
.venv/bin/cookiecutter --no-input --output-dir .gpu . > /dev/null
mv .gpu/lightning-hydra-project .gpu/project
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .gpu/whl \
  "hydra-core==$(installed hydra-core)" "omegaconf==$(installed omegaconf)" "$TORCHAO"
# Pure Python, published only as source: built here into a wheel.
.venv/bin/python -m pip wheel -q --no-deps -w .gpu/whl antlr4-python3-runtime==4.9.3
ls .gpu/whl
du -sh .gpu
