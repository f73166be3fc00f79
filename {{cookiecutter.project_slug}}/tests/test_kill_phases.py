"""Fault injection: a run SIGKILLed in each phase — triggered by the phase's own hook, never by a
sleep — and then the same command again finishes exactly as an uninterrupted run does (bitwise
weights and optimizer state, the same batches, checkpoint files and metrics.json)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .killing import SMALL_RUN, References, assert_same_outcome, fault, killed_then_finished

# phase, occurrence (for `train_step`, the step): see tests/faults.py.
PHASES = {
    "sanity check": ("sanity_check", 1),
    "training step mid-epoch": ("train_step", 2),
    "training step that a validation follows": ("train_step", 4),
    "writing the first checkpoint": ("checkpoint_write", 1),
    "writing the third checkpoint": ("checkpoint_write", 3),
    "validation, a step checkpoint due before it": ("validation", 1),
{%- if cookiecutter.examples != "language" %}
    "end of a training epoch": ("epoch_end", 1),
{%- endif %}
    "early stopping decided": ("early_stop", 1),
    "end of fit": ("fit_end", 1),
    "test": ("test", 1),
    "test finished, metrics.json not written": ("test_end", 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(PHASES))
def test_killed_in_a_phase_the_same_command_finishes_exactly(
    tmp_path: Path, phase: str, reference_run: References
) -> None:
    name, at = PHASES[phase]
    killed_then_finished([*SMALL_RUN, *fault(name, at, tmp_path / "fired")], tmp_path / "run")
    assert_same_outcome(reference_run(SMALL_RUN), tmp_path / "run")


@pytest.mark.slow
def test_killed_twice_in_a_row_the_same_command_finishes_exactly(
    tmp_path: Path, reference_run: References
) -> None:
    """In a validation whose step checkpoint was due before it, then early in the next epoch
    (before this change, every later run failed: early stopping's metric was missing)."""
    command = [
        *SMALL_RUN,
        *fault("validation", 1, tmp_path / "first", name="first"),
        *fault("train_step", 6, tmp_path / "second", name="second"),
    ]
    killed_then_finished(command, tmp_path / "run", kills=2)
    assert_same_outcome(reference_run(SMALL_RUN), tmp_path / "run")


@pytest.mark.slow
def test_repeated_kills_leave_no_more_step_checkpoints_than_save_top_k(
    tmp_path: Path, reference_run: References
) -> None:
    """Lightning keeps the checkpoint a run resumed from for ever; after a loop of kills the step
    checkpoints piled up past `save_top_k=2`."""
    every_2 = ["callbacks.step_checkpoint.every_n_train_steps=2"]
    kills = [
        override
        for step in (3, 6, 7)
        for override in fault("train_step", step, tmp_path / f"k{step}", name=f"k{step}")
    ]
    command = [*SMALL_RUN, *every_2, *kills]
    killed_then_finished(command, tmp_path / "run", kills=3)
    assert_same_outcome(reference_run([*SMALL_RUN, *every_2]), tmp_path / "run")
