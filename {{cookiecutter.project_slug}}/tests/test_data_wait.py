"""The share of training time spent waiting for data: measured in every run, and a run that an
accelerator would spend idle, waiting for batches, says so once."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from {{ cookiecutter.package_name }}.callbacks import (
    throughput,
)
from {{ cookiecutter.package_name }}.data import base
from {{ cookiecutter.package_name }}.recipes.train import train

from .helpers import ComposeFn, read_metrics


def starved_run(
    train_config: ComposeFn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    seconds: float,
) -> tuple[list[str], dict[str, float]]:  # fmt: skip
    """A short CPU run whose every training batch takes `seconds` more to load, counted as if it
    ran on an accelerator."""
    loader = base.SplitDataModule.loader

    def slow_loader(self: base.SplitDataModule, split: str) -> Any:
        made = loader(self, split)
        collate = made.collate_fn

        def slow_collate(items: Any) -> Any:
            time.sleep(seconds)
            return collate(items)

        if split == "train" and seconds:
            made.collate_fn = slow_collate
        return made

    monkeypatch.setattr(base.SplitDataModule, "loader", slow_loader)
    monkeypatch.setattr(throughput, "accelerator_idles", lambda trainer: True)
    cfg = train_config(
        "trainer.max_steps=24", "trainer.log_every_n_steps=4", "trainer.val_check_interval=12",
        "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "test=false", "data.num_workers=0",
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        train(cfg)
    warnings = [r.getMessage() for r in caplog.records if "waited for data" in r.getMessage()]
    return warnings, read_metrics(cfg)


def test_a_run_starved_of_data_says_so_once(
    train_config: ComposeFn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    warnings, metrics = starved_run(train_config, monkeypatch, caplog, seconds=0.4)
    assert len(warnings) == 1, warnings
    assert "raise data.num_workers (now 0)" in warnings[0]
    assert metrics["perf/data_share"] > 0.3


def test_a_run_fed_in_time_does_not_warn(
    train_config: ComposeFn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same run, its data in memory: a small share, no warning (the threshold is 10 %; a tiny model's
    in-memory batches measured 5-17 % on two busy cores, hence the larger wait above)."""
    monkeypatch.setattr(throughput.Throughput, "__init__", with_threshold(0.5))
    warnings, metrics = starved_run(train_config, monkeypatch, caplog, seconds=0.0)
    assert warnings == []
    assert 0 <= metrics["perf/data_share"] < 0.5


def with_threshold(threshold: float) -> Any:
    init = throughput.Throughput.__init__

    def patched(self: throughput.Throughput, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.data_wait_warning = threshold

    return patched


def test_auto_workers_follow_the_cores_and_the_accelerator() -> None:
    assert base.auto_workers("cpu", 1, 32)[0] == 0
    assert base.auto_workers("cuda", 1, 2)[0] == 1
    assert base.auto_workers("cuda", 8, 64)[0] == 7
    assert base.auto_workers("cuda", 1, 64)[0] == base.MAX_AUTO_WORKERS
    assert base.auto_workers("cuda", 8, 8)[0] == 0
    workers, why = base.auto_workers("cuda", 4, 16)
    assert workers == 3 and "16 cores for 4 training process(es)" in why
