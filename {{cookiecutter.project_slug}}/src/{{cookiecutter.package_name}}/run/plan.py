"""The run plan: what the validation phase (`run.checks.check_config`) decides from the composed
config, once, as typed values: the machine, the strategy and whether it shards the model, where
the run starts and its folder. The steps after it take the plan, or the part of it they need,
never the raw config. No torch here (the settings checks, imported at every start, use
`strategy_of`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Lightning's name for FSDP2 (`ModelParallelStrategy`), and ours, which subclasses it.
MODEL_PARALLEL = ("modelparallel", "shardedcheckpointstrategy")


@dataclass(frozen=True)
class Machine:
    """The accelerator and precision a run uses, resolved from `auto` and checked against this
    machine before the run writes anything."""

    accelerator: str
    precision: str


@dataclass(frozen=True)
class Strategy:
    """`trainer.strategy`, named (`auto`, `ddp`) or configured (a `_target_` node)."""

    kind: str  # auto, ddp, ddp_spawn, fsdp, model_parallel, or the name Lightning was given
    shards: bool  # weights, gradients and optimizer state divided among the devices (FSDP1/2)
    model_parallel: bool  # FSDP2, whose module must shard itself and whose checkpoints are shards


def strategy_of(strategy: Any) -> Strategy:
    """The one place that tells, from the config's `trainer.strategy`, which strategy a run uses
    and whether it shards the model."""
    name = str(strategy).lower()
    model_parallel = any(word in name.replace("_", "") for word in MODEL_PARALLEL)
    fsdp = "fsdp" in name and not model_parallel
    if model_parallel:
        kind = "model_parallel"
    elif fsdp:
        kind = "fsdp"
    elif "ddp" in name:
        kind = "ddp_spawn" if "spawn" in name else "ddp"
    else:
        kind = str(strategy) if isinstance(strategy, str) else name
    return Strategy(kind, fsdp or model_parallel, model_parallel)


@dataclass(frozen=True)
class StartPlan:
    """Where a run starts: its own newest checkpoint (`resume`), another run's (`ckpt_path`),
    another run's weights (`init_from`), or nothing; and the limits a checkpoint is held to."""

    run_dir: Path
    resume: bool
    extend: bool
    ckpt_path: Path | None
    init_from: Path | None
    trust_checkpoint: bool
    max_epochs: int | None
    max_steps: int | None
    continues_shards: bool  # a folder of shards continues under strategy=model_parallel only

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"


@dataclass(frozen=True)
class TrackedJob:
    """What names a job's tracker runs (W&B, MLflow): its run folder, its command and the
    `run_name` given to it, if any."""

    run_dir: Path
    command: str
    run_name: str | None


@dataclass(frozen=True)
class RunPlan:
    machine: Machine
    strategy: Strategy
    start: StartPlan
    run_dir: Path
    seed: int | None
    matmul_precision: str | None
    test: bool
    model_shards_itself: bool  # the LightningModule applies FSDP2 in configure_model()
    tracked: TrackedJob
