"""The fault-injection harness (tests/killing.py) on other shapes of a run: DDP with two gloo
processes, killed once and twice{% if cookiecutter.examples != "language" %}; `max_steps` with validation inside an epoch and step
checkpoints off the epoch boundary{% endif %}{% if cookiecutter.examples == "both" %}; the language example's test stage{% endif %}."""

from __future__ import annotations

from pathlib import Path

import pytest

from .killing import (
{%- if cookiecutter.examples != "language" %}
    COMMON,
{%- endif %}
    SMALL_RUN,
    References,
    assert_same_outcome,
    batches_by_step,
    fault,
    killed_then_finished,
{%- if cookiecutter.examples == "both" %}
    outcome,
{%- endif %}
)

DDP = ["strategy=ddp", "trainer.devices=2"]


@pytest.mark.slow
def test_ddp_run_killed_in_validation_then_early_in_the_next_epoch_finishes_exactly(
    tmp_path: Path, reference_run: References
) -> None:
    """Two gloo processes, both killed (the whole process group, as when a node dies): first in
    the validation that a due step checkpoint precedes, then early in the next epoch."""
    command = [
        *SMALL_RUN, *DDP,
        *fault("validation", 1, tmp_path / "first", name="first"),
        *fault("train_step", 6, tmp_path / "second", name="second"),
    ]  # fmt: skip
    killed_then_finished(command, tmp_path / "run", kills=2)
    reference = reference_run([*SMALL_RUN, *DDP])
    assert_same_outcome(reference, tmp_path / "run")
    assert set(batches_by_step(tmp_path / "run")) == {".rank0", ".rank1"}
{%- if cookiecutter.examples != "language" %}


# Ten steps over epochs of four, a validation every 3 steps across epochs and a step checkpoint
# every 3 (always a step that a validation follows); early stopping fires at step 6.
MAX_STEPS_RUN = [
    *COMMON, "trainer.max_epochs=-1", "trainer.max_steps=10", "trainer.val_check_interval=3",
    "trainer.check_val_every_n_epoch=null", "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
    "callbacks.step_checkpoint.every_n_train_steps=3",
]  # fmt: skip
MAX_STEPS_PHASES = {
    "validation in an epoch": ("validation", 1),
    "training step across an epoch boundary": ("train_step", 5),
    "writing a step checkpoint": ("checkpoint_write", 2),
    "early stopping decided": ("early_stop", 1),
}


# Steps across epochs of four, a validation every 7 steps and a step checkpoint every 2: the save
# due at step 4, an epoch's last batch, Lightning puts off until the validation at step 7.
DEFERRED_SAVE_RUN = [
    *COMMON, "trainer.max_epochs=-1", "trainer.max_steps=10", "trainer.val_check_interval=7",
    "trainer.check_val_every_n_epoch=null", "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
    "callbacks.step_checkpoint.every_n_train_steps=2",
]  # fmt: skip


@pytest.mark.slow
def test_a_save_put_off_until_validation_is_made_by_a_run_resumed_before_it(
    tmp_path: Path, reference_run: References
) -> None:
    """Killed at step 7, before its validation: the run resumes from step 6's checkpoint, which
    must carry the save still owed from step 4 (the resumed run lacked a checkpoint file)."""
    command = [*DEFERRED_SAVE_RUN, *fault("train_step", 7, tmp_path / "fired")]
    killed_then_finished(command, tmp_path / "run")
    assert_same_outcome(reference_run(DEFERRED_SAVE_RUN), tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(MAX_STEPS_PHASES))
def test_max_steps_run_killed_in_a_phase_finishes_exactly(
    tmp_path: Path, phase: str, reference_run: References
) -> None:
    name, at = MAX_STEPS_PHASES[phase]
    command = [*MAX_STEPS_RUN, *fault(name, at, tmp_path / "fired")]
    killed_then_finished(command, tmp_path / "run")
    assert_same_outcome(reference_run(MAX_STEPS_RUN), tmp_path / "run")

{%- endif %}
{%- if cookiecutter.examples == "both" %}


LANGUAGE_RUN = [
    *COMMON, "experiment=language", "model.net.n_layer=1", "data.max_bytes=200000",
    "trainer.max_steps=12", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2", "callbacks.step_checkpoint.every_n_train_steps=4",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "at"), [("test", 1), ("validation", 2), ("fit_end", 1)])
def test_language_run_killed_in_a_phase_finishes_exactly(
    tmp_path: Path, phase: str, at: int, reference_run: References
) -> None:
    """Killed in the test stage, the resumed run's metrics.json lacked val/loss, train/loss, the
    bits per byte and the learning rates (and with them a sweep's optimized metric); killed after
    the last step (max_steps), before the finished fit was saved, it did too, and its last.ckpt
    was left mid-epoch (Lightning skips the end of an epoch that starts at max_steps)."""
    command = [*LANGUAGE_RUN, *fault(phase, at, tmp_path / "fired")]
    killed_then_finished(command, tmp_path / "run")
    assert_same_outcome(reference_run(LANGUAGE_RUN), tmp_path / "run")
    metrics = outcome(tmp_path / "run")["metrics"]
    assert {"val/loss", "train/loss", "val/bits_per_byte"} <= set(metrics)

{%- endif %}
