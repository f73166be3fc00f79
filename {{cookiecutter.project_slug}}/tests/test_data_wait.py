"""The share of training time spent waiting for data: measured in every run, and a run that an
accelerator would spend idle, waiting for batches, says so once.

The throughput callback's clock is the test's own: it moves by a set time while a training batch
is loaded and while a step runs, and by nothing else. The share it measures is then a ratio of the
run's own counts, the same on a fast or a busy machine."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import pytest

from {{ cookiecutter.package_name }}.callbacks import (
    throughput,
)
from {{ cookiecutter.package_name }}.data import base
from {{ cookiecutter.package_name }}.recipes.train import train

from .helpers import ComposeFn, read_metrics

STEP_SECONDS = 1.0


class RunClock:
    """Stands for the `time` module in callbacks/throughput.py: the time of the run so far."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def starved_run(
    train_config: ComposeFn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    load_seconds: float,
) -> tuple[list[str], list[float], dict[str, float]]:  # fmt: skip
    """A short CPU run, counted as if it ran on an accelerator, whose every training batch takes
    `load_seconds` to load and every step STEP_SECONDS to run: its warnings, the data share of
    each window the callback measured, and the run's final metrics."""
    clock = RunClock()
    monkeypatch.setattr(throughput, "time", clock)
    loader = base.SplitDataModule.loader

    def slow_loader(self: base.SplitDataModule, split: str) -> Any:
        made = loader(self, split)
        collate = made.collate_fn

        def slow_collate(items: Any) -> Any:
            clock.now += load_seconds
            return collate(items)

        if split == "train":
            made.collate_fn = slow_collate
        return made

    batch_start = throughput.Throughput.on_train_batch_start

    def step_starts(self: throughput.Throughput, trainer: L.Trainer, *args: Any) -> None:
        batch_start(self, trainer, *args)  # the wait for this batch ends here
        clock.now += STEP_SECONDS

    shares: list[float] = []
    warn = throughput.Throughput.warn_about_data_wait

    def measured(self: throughput.Throughput, trainer: L.Trainer, share: float) -> None:
        shares.append(share)
        warn(self, trainer, share)

    monkeypatch.setattr(base.SplitDataModule, "loader", slow_loader)
    monkeypatch.setattr(throughput.Throughput, "on_train_batch_start", step_starts)
    monkeypatch.setattr(throughput.Throughput, "warn_about_data_wait", measured)
    monkeypatch.setattr(throughput, "accelerator_idles", lambda trainer: True)
    cfg = train_config(
        "trainer.max_steps=24", "trainer.log_every_n_steps=4", "trainer.val_check_interval=12",
        "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "test=false", "data.num_workers=0",
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        train(cfg)
    warnings = [r.getMessage() for r in caplog.records if "waited for data" in r.getMessage()]
    return warnings, shares, read_metrics(cfg)


# A window that an epoch's start opens counts its first batch's loading in its length but not as
# waiting: 3 of its 4 loads, 9/16 with loads three times a step.
STARVED = (3 * 3.0 / (4 * (3.0 + STEP_SECONDS)), 3.0 / (3.0 + STEP_SECONDS))


def test_a_run_starved_of_data_says_so_once(
    train_config: ComposeFn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading a batch takes three times as long as a step: 3/4 of a window is waiting."""
    warnings, shares, metrics = starved_run(train_config, monkeypatch, caplog, load_seconds=3.0)
    assert len(shares) >= 3, "the callback measured fewer than three windows"
    assert max(shares) == pytest.approx(0.75)
    assert all(STARVED[0] - 1e-9 <= share <= STARVED[1] + 1e-9 for share in shares), shares
    assert metrics["perf/data_share"] == pytest.approx(shares[-1])
    assert len(warnings) == 1, warnings
    assert f"Training waited for data {100 * shares[0]:.0f} % of the time" in warnings[0]
    assert "raise data.num_workers (now 0)" in warnings[0]


def test_a_run_fed_in_time_does_not_warn(
    train_config: ComposeFn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same run, each batch loaded in 5 % of a step's time: below the 10 % threshold."""
    warnings, shares, metrics = starved_run(train_config, monkeypatch, caplog, load_seconds=0.05)
    assert len(shares) >= 3, "the callback measured fewer than three windows"
    assert max(shares) == pytest.approx(0.05 / 1.05)
    assert all(0 < share <= 0.05 / 1.05 + 1e-9 for share in shares), shares
    assert metrics["perf/data_share"] == pytest.approx(shares[-1])
    assert warnings == []


def test_auto_workers_follow_the_cores_and_the_accelerator() -> None:
    assert base.auto_workers("cpu", 1, 32)[0] == 0
    assert base.auto_workers("cuda", 1, 2)[0] == 1
    assert base.auto_workers("cuda", 8, 64)[0] == 7
    assert base.auto_workers("cuda", 1, 64)[0] == base.MAX_AUTO_WORKERS
    assert base.auto_workers("cuda", 8, 8)[0] == 0
    workers, why = base.auto_workers("cuda", 4, 16)
    assert workers == 3 and "16 cores for 4 training process(es)" in why
