"""Learning-rate schedules: each option of the `scheduler` group, and any torch scheduler named by
`_target_`, trains a few real steps of the default model with the learning rate that its formula
gives at every step (read back from LearningRateMonitor's CSV rows); a wrong argument is one line
naming the class's arguments, before anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig

from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.recipes.train import train
from {{ cookiecutter.package_name }}.run.schedule import (
    check_schedule,
)

from .helpers import PACKAGE, ComposeFn, run_cli

EPOCHS, BATCHES = 3, 4  # 12 optimizer steps, 4 an epoch
STEPS = EPOCHS * BATCHES
SHORT_RUN = [
    f"trainer.max_epochs={EPOCHS}", "trainer.max_steps=-1", f"trainer.limit_train_batches={BATCHES}",
    "trainer.limit_val_batches=1", "trainer.val_check_interval=null",
    "trainer.check_val_every_n_epoch=1", "trainer.log_every_n_steps=1", "test=false",
    "callbacks.early_stopping=null", "logger=none",
{%- if cookiecutter.examples == "language" %}
    "model.net.n_layer=1", "data.max_bytes=200000",
{%- endif %}
]  # fmt: skip


class RecordRates(Callback):
    """Writes the learning rate of each parameter group as the optimizer steps with it."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        rates = [group["lr"] for group in optimizer.param_groups]
        with self.path.open("a") as handle:
            handle.write(json.dumps([trainer.global_step, rates]) + "\n")


RECORDER = f"{__name__}.RecordRates"


def learning_rates(train_config: ComposeFn, *overrides: str) -> tuple[DictConfig, list[float]]:
    """The config, and the learning rate of each optimizer step of a short real run of it (every
    parameter group has the same)."""
    path = Path(train_config(*overrides).paths.output_dir).parent / "rates.jsonl"
    cfg = train_config(
        *SHORT_RUN, *overrides, f"allowed_targets=[{RECORDER}]",
        f"+callbacks.rates._target_={RECORDER}", f"+callbacks.rates.path={path}",
    )  # fmt: skip
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"])
    by_step: dict[int, float] = {}
    for line in path.read_text().splitlines():
        step, rates = json.loads(line)
        assert len(set(rates)) == 1, f"the parameter groups' rates differ: {rates}"
        by_step[step] = rates[0]
    assert sorted(by_step) == list(range(STEPS)), sorted(by_step)
    return cfg, [by_step[step] for step in range(STEPS)]


def assert_follows(got: list[float], expected: list[float]) -> None:
    assert got == pytest.approx(expected, rel=1e-5), list(zip(got, expected, strict=True))
    assert len(set(expected)) > 1 or len(set(got)) == 1, "a schedule that changes nothing"


def test_the_models_own_cosine_warms_up_then_decays_to_its_floor(train_config: ComposeFn) -> None:
    cfg, rates = learning_rates(
        train_config, "model.scheduler.warmup_steps=3", "model.scheduler.min_lr_ratio=0.2"
    )
    base = cfg.model.optimizer.lr

    def factor(step: int) -> float:
        if step < 3:
            return (step + 1) / 3
        progress = (step - 3) / (STEPS - 3)
        return 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * progress))

    assert_follows(rates, [base * factor(step) for step in range(STEPS)])


def test_scheduler_cosine_replaces_the_models_values(train_config: ComposeFn) -> None:
    cfg, rates = learning_rates(train_config, "scheduler=cosine")
    base = cfg.model.optimizer.lr
    assert cfg.model.scheduler.warmup_steps == 0
    expected = [
        base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / STEPS))) for step in range(STEPS)
    ]
    assert_follows(rates, expected)


def test_scheduler_onecycle_rises_to_max_lr_then_anneals(train_config: ComposeFn) -> None:
    cfg, rates = learning_rates(train_config, "scheduler=onecycle")
    peak = cfg.model.optimizer.lr
    start, end = peak / 25.0, peak / 25.0 / 10000.0
    turn = 0.3 * STEPS - 1  # the step at which the rise ends

    def anneal(high: float, low: float, part: float) -> float:
        return low + (high - low) / 2 * (math.cos(math.pi * part) + 1)

    expected = [
        anneal(start, peak, step / turn) if step <= turn
        else anneal(peak, end, (step - turn) / (STEPS - 1 - turn))
        for step in range(STEPS)
    ]  # fmt: skip
    assert_follows(rates, expected)


def test_scheduler_step_multiplies_by_gamma_every_step_size_epochs(train_config: ComposeFn) -> None:
    cfg, rates = learning_rates(train_config, "scheduler=step", "model.scheduler.step_size=1")
    base = cfg.model.optimizer.lr
    expected = [base * 0.5 ** (step // BATCHES) for step in range(STEPS)]
    assert_follows(rates, expected)


def test_scheduler_step_per_optimizer_step(train_config: ComposeFn) -> None:
    overrides = ["model.scheduler.interval=step", "model.scheduler.step_size=5"]
    cfg, rates = learning_rates(train_config, "scheduler=step", *overrides)
    base = cfg.model.optimizer.lr
    assert_follows(rates, [base * 0.5 ** (step // 5) for step in range(STEPS)])


def test_scheduler_plateau_lowers_the_rate_when_the_monitored_metric_stalls(
    train_config: ComposeFn,
) -> None:
    """An improvement must beat the best by 10, and patience is 0: the first validation sets the
    best, and each later epoch's end (on the run's own monitored metric) halves the rate."""
    stalls = [
        "model.scheduler.patience=0",
        "+model.scheduler.threshold=10",
        "+model.scheduler.threshold_mode=abs",
    ]
    cfg, rates = learning_rates(train_config, "scheduler=plateau", *stalls)
    assert cfg.model.scheduler.monitor == cfg.monitor.metric
    base = cfg.model.optimizer.lr
    expected = [base * 0.5 ** max(0, step // BATCHES - 1) for step in range(STEPS)]
    assert_follows(rates, expected)


def test_scheduler_constant_keeps_the_optimizers_rate(train_config: ComposeFn) -> None:
    cfg, rates = learning_rates(train_config, "scheduler=constant")
    assert cfg.model.scheduler is None
    assert rates == pytest.approx([cfg.model.optimizer.lr] * STEPS, rel=1e-6)


def test_any_torch_scheduler_by_target_with_its_own_arguments(train_config: ComposeFn) -> None:
    """ExponentialLR takes no total_steps: only schedulers whose signature takes it get it."""
    node = "{_target_:torch.optim.lr_scheduler.ExponentialLR,_partial_:true,gamma:0.8}"
    cfg, rates = learning_rates(train_config, "scheduler=constant", f"model.scheduler={node}")
    base = cfg.model.optimizer.lr
    assert_follows(rates, [base * 0.8**step for step in range(STEPS)])


BAD_SCHEDULES = {
    "an argument the class does not take": (
        ["model.scheduler._target_=torch.optim.lr_scheduler.StepLR"],
        "StepLR takes no warmup_steps, min_lr_ratio; its arguments are step_size, gamma=0.1",
    ),
    "a missing argument": (["scheduler=step", "~model.scheduler.step_size"], "StepLR needs step_size"),
    "plateau without a metric": (["scheduler=plateau", "~model.scheduler.monitor"], "steps on a metric"),
    "an unknown interval": (["scheduler=step", "model.scheduler.interval=often"], "use step"),
    "no _partial_": (["scheduler=step", "model.scheduler._partial_=false"], "_partial_ must be true"),
    "epochs that a run counted in steps lacks": (
        ["scheduler=onecycle", "model.scheduler.interval=epoch", "trainer.max_epochs=-1", "trainer.max_steps=10"],
        "needs the number of epochs",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_SCHEDULES))
def test_a_wrong_schedule_is_refused_in_the_validation_phase(
    train_config: ComposeFn, case: str
) -> None:
    overrides, says = BAD_SCHEDULES[case]
    with pytest.raises(ConfigError, match=r"model\.scheduler") as refused:
        check_schedule(train_config(*overrides))
    assert says in str(refused.value)


def test_a_wrong_schedule_argument_is_one_error_line_and_writes_nothing(tmp_path: Path) -> None:
    result = run_cli(
        "-m", PACKAGE, "trainer=cpu", "model.scheduler._target_=torch.optim.lr_scheduler.StepLR",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "its arguments are step_size, gamma=0.1" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not [path for path in tmp_path.rglob("*") if path.is_file()], "nothing is written"
