#!/usr/bin/env bash
# DDP over one or more nodes with torchrun: run this on every node with the same MASTER_ADDR
# (node 0's address), RUN_NAME and NNODES, and NODE_RANK 0..NNODES-1. torchrun starts one
# process per device; Lightning reads torchrun's environment and starts none of its own. All
# processes write to logs/train/runs/<RUN_NAME made a safe folder name, as run_name= is>.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 RUN_NAME=gpt2 scripts/torchrun.sh experiment=gpt2_small
#   NPROC_PER_NODE=2 TRAINER=cpu scripts/torchrun.sh          # two CPU processes (gloo), to try it
#
# Under a Kubernetes PyTorchJob (Kubeflow training operator) the operator's PET_NNODES,
# PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR and PET_MASTER_PORT are read; under SkyPilot,
# SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK, SKYPILOT_NUM_GPUS_PER_NODE and the first address of
# SKYPILOT_NODE_IPS. Variables set explicitly win.
set -euo pipefail
first() { for value in "$@"; do if [ -n "$value" ]; then echo "$value"; return; fi; done; }
GPUS=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
SKYPILOT_HEAD=$(printf '%s\n' "${SKYPILOT_NODE_IPS:-}" | head -n 1)
NNODES=$(first "${NNODES:-}" "${PET_NNODES:-}" "${SKYPILOT_NUM_NODES:-}" 1)
NODE_RANK=$(first "${NODE_RANK:-}" "${PET_NODE_RANK:-}" "${SKYPILOT_NODE_RANK:-}" 0)
NPROC_PER_NODE=$(first "${NPROC_PER_NODE:-}" "${PET_NPROC_PER_NODE:-}" \
  "${SKYPILOT_NUM_GPUS_PER_NODE:-}" "$GPUS")
MASTER_ADDR=$(first "${MASTER_ADDR:-}" "${PET_MASTER_ADDR:-}" "$SKYPILOT_HEAD" 127.0.0.1)
MASTER_PORT=$(first "${MASTER_PORT:-}" "${PET_MASTER_PORT:-}" 29500)
TRAINER=${TRAINER:-gpu}
RUN_NAME=${RUN_NAME:-torchrun-$(date +%Y-%m-%d_%H-%M)}
QUOTED_NAME=${RUN_NAME//\'/\\\'}  # a Hydra string in single quotes: commas, spaces, = as written

export TORCHRUN_AGENT_PID=$$  # exec keeps it: the agent's, which its workers check they are under
exec torchrun \
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
  -m {{ cookiecutter.package_name }} \
  strategy=ddp trainer="$TRAINER" trainer.devices="$NPROC_PER_NODE" trainer.num_nodes="$NNODES" \
  run_name="'$QUOTED_NAME'" "$@"
