"""The fault-injection harness (tests/killing.py) on other shapes of a run: DDP with two gloo
processes, killed once and twice{% if cookiecutter.examples != "language" %}; `max_steps` with validation inside an epoch and step
checkpoints off the epoch boundary; uncommon shapes (validation every other epoch, gradient
accumulation, skipped non-finite steps, DDP ranks agreeing only at epoch ends){% endif %}{% if cookiecutter.examples == "both" %}; the language example's test stage{% endif %}."""

from __future__ import annotations

{% if cookiecutter.examples != "language" %}import signal
{% endif %}from pathlib import Path

import pytest
{% if cookiecutter.examples != "language" %}import torch
{% endif %}
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
{%- if cookiecutter.examples != "language" %}
    run,
    run_dir,
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


# The harness's runs without its early stopping, which would end these before their kills.
NO_EARLY_STOP = [arg for arg in COMMON if "early_stopping" not in arg]
# Four batches an epoch, a validation every second epoch, a step checkpoint every 3 steps: the
# one due at step 12 falls on the last batch of an epoch that no validation follows.
EVERY_OTHER_EPOCH = [
    *NO_EARLY_STOP, "trainer.max_epochs=5", "trainer.limit_train_batches=4",
    "trainer.check_val_every_n_epoch=2", "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2", "callbacks.step_checkpoint.every_n_train_steps=3",
]  # fmt: skip
# Eight batches an epoch in windows of two, a step checkpoint every 4 steps (each at an epoch's
# last batch, which a validation follows) or every 3.
ACCUMULATING = [
    *NO_EARLY_STOP, "trainer.max_epochs=4", "trainer.limit_train_batches=8",
    "trainer.accumulate_grad_batches=2", "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
]  # fmt: skip
UNCOMMON = {
    "a save due at the last batch of an epoch no validation follows, killed twice": (
        EVERY_OTHER_EPOCH, [("train_step", 13), ("train_step", 15)]
    ),
    "the same with DataLoader workers, killed once": (
        [*EVERY_OTHER_EPOCH, "data.num_workers=2"], [("train_step", 13)]
    ),
    "a save put off past a validation, inside an accumulation window": (
        [*ACCUMULATING, "callbacks.step_checkpoint.every_n_train_steps=4"], [("train_batch", 10)]
    ),
    "accumulation, killed in a window": (
        [*ACCUMULATING, "callbacks.step_checkpoint.every_n_train_steps=3"], [("train_batch", 29)]
    ),
    "a save put off until validation, made once, killed twice": (
        [*NO_EARLY_STOP, "trainer.max_epochs=-1", "trainer.max_steps=16",
         "trainer.limit_train_batches=4", "trainer.val_check_interval=3",
         "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=2",
         "trainer.limit_test_batches=2", "callbacks.step_checkpoint.every_n_train_steps=4"],
        [("train_step", 5), ("train_step", 11)],
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(UNCOMMON))
def test_a_run_of_an_uncommon_shape_killed_finishes_exactly(
    tmp_path: Path, case: str, reference_run: References
) -> None:
    """Shapes a hostile tester found resuming inexactly: extra steps or other batches after an
    epoch-end save, gradients lost to a save inside an accumulation window, or checkpoint files
    missing or left over."""
    shape, kills = UNCOMMON[case]
    assert_kills_finish_exactly(shape, kills, tmp_path, reference_run)


def assert_kills_finish_exactly(
    shape: list[str], kills: list[tuple[str, int]], tmp_path: Path, reference_run: References
) -> None:
    """The run killed at each (phase, step) in turn, run again after each kill, ends as the
    uninterrupted run of `shape` does."""
    faults = [
        arg
        for number, (phase, at) in enumerate(kills)
        for arg in fault(phase, at, tmp_path / f"fired{number}", name=f"kill{number}")
    ]
    killed_then_finished([*shape, *faults], tmp_path / "run", kills=len(kills))
    assert_same_outcome(reference_run(shape), tmp_path / "run")


# Three epochs of four batches, two loader processes (persistent), a validation and a step
# checkpoint at every epoch's end, no early stopping.
EPOCHS_WITH_WORKERS = [
    *NO_EARLY_STOP, "trainer.max_epochs=3", "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
    "callbacks.step_checkpoint.every_n_train_steps=4", "data.num_workers=2",
]  # fmt: skip


def test_a_run_with_loader_processes_resumed_at_epoch_ends_finishes_exactly(
    tmp_path: Path, reference_run: References
) -> None:
    """Killed in the first step after epoch 0's checkpoints, then in epoch 2's first: each run
    resumes from the checkpoints of an epoch's end. Lightning makes the loader's iterator before
    it sets the resumed epoch on the sampler, and loader processes drew their order then: every
    resumed epoch trained on epoch 0's batches (a hostile tester's digits run ended at step 285,
    not 380, every weight and the test accuracy different)."""
    kills = [("train_step", 5), ("train_step", 9)]
    assert_kills_finish_exactly(EPOCHS_WITH_WORKERS, kills, tmp_path, reference_run)


@pytest.mark.slow
def test_steps_skipped_for_non_finite_values_count_across_a_kill(tmp_path: Path) -> None:
    """max_skipped counts the whole run: four skipped steps over two processes still stop it."""
    allowed = [
        arg.replace("]", ",tests.faults.NanGradientAt]") if arg.startswith("allowed_targets=")
        else arg
        for arg in NO_EARLY_STOP
    ]  # fmt: skip
    shape = [
        *allowed, "trainer.max_epochs=4", "trainer.limit_train_batches=8",
        "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
        "callbacks.step_checkpoint.every_n_train_steps=5", "callbacks.non_finite.action=skip",
        "callbacks.non_finite.max_skipped=2", "+callbacks.nan._target_=tests.faults.NanGradientAt",
        "+callbacks.nan.steps=[2,3,20,21]",
    ]  # fmt: skip
    code, output = run(shape, tmp_path / "reference")
    assert code == 1 and "4 training steps had a non-finite" in output, output[-3000:]
    command = [*shape, *fault("train_step", 11, tmp_path / "fired")]
    code, output = run(command, tmp_path / "run")
    assert code == -signal.SIGKILL, output[-3000:]
    code, output = run(command, tmp_path / "run")
    assert code == 1 and "4 training steps had a non-finite" in output, output[-3000:]


@pytest.mark.slow
def test_sigterm_under_ddp_stops_where_the_ranks_agree_only_at_epoch_ends(
    tmp_path: Path, reference_run: References
) -> None:
    """Five batches an epoch: the ranks agree on a signal every 10 steps, always an epoch's end,
    where no checkpoint resumes exactly. Agreed at step 20, they save at step 21 (the signal was
    ignored for the rest of training)."""
    shape = [
        *NO_EARLY_STOP, *DDP, "trainer.max_epochs=8", "trainer.limit_train_batches=5",
        "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
        "callbacks.step_checkpoint.every_n_train_steps=4",
    ]  # fmt: skip
    command = [*shape, *fault("train_step", 12, tmp_path / "fired", "SIGTERM", whole_group=True)]
    code, output = run(command, tmp_path / "run")
    assert code == 143, output[-3000:]
    last = run_dir(tmp_path / "run") / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 21
    code, output = run(command, tmp_path / "run")
    assert code == 0, output[-3000:]
    assert_same_outcome(reference_run(shape), tmp_path / "run")


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
