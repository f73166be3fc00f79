"""Checkpoints and run directories: atomic writes, unreadable checkpoints set aside, finished runs
not trained again. Kills and signals in every phase: test_kill_*.py and test_stop_signals.py."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing import (
    saving,
)
from {{ cookiecutter.package_name }}.checkpointing.saving import (
    NonFiniteWeightsError,
    atomic_torch_save,
    newest_valid_checkpoint,
)
from {{ cookiecutter.package_name }}.errors import TrainingError
from {{ cookiecutter.package_name }}.recipes.train import train
from {{ cookiecutter.package_name }}.run.names import run_name

from .helpers import PACKAGE, ComposeFn, run_cli

QUICK = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]
{%- if cookiecutter.examples == "language" %}

SHORT_RUN = [
    "model.net.n_layer=1", "data.max_bytes=200000", "trainer.max_steps=4",
    "trainer.val_check_interval=2",
]  # fmt: skip
# A step that a validation follows.
VALIDATION_STEP = 2
# The stopping limit of a run extended once it has finished, and the steps it ends at.
LIMITS = ("trainer.max_steps=4", "trainer.max_steps=8")
STEPS = (4, 8)
{%- else %}

SHORT_RUN = ["trainer.max_epochs=1", "trainer.limit_train_batches=3"]
# A step that a validation follows: the epoch's last.
VALIDATION_STEP = 3
LIMITS = ("trainer.max_epochs=1", "trainer.max_epochs=2")
STEPS = (3, 6)
{%- endif %}


def test_run_names_follow_the_overrides() -> None:
    assert run_name(None, "") == "default"
    assert run_name(None, "experiment=big,trainer=gpu") == "experiment=big,trainer=gpu"
    assert run_name("my-run", "experiment=big") == "my-run"
    slashed = run_name(None, "hydra/launcher=joblib,x='a b'")
    assert slashed.startswith("hydra_launcher=joblib,x=_a_b_-") and "/" not in slashed
    assert slashed != run_name(None, "hydra_launcher=joblib,x=_a_b_")
    long_name = run_name(None, "model.optimizer.lr=0.001," * 20)
    assert len(long_name) == 100
    assert long_name != run_name(None, "model.optimizer.lr=0.002," * 20)


@pytest.mark.parametrize("hostile", ["..", ".", "../../etc", "a/../../b", ".hidden", "x" * 300])
def test_a_run_name_stays_one_folder_inside_runs(hostile: str) -> None:
    name = run_name(hostile, "")
    assert "/" not in name and not name.startswith(".") and 0 < len(name) <= 100


def test_distinct_run_names_give_distinct_folders() -> None:
    names = ["日本語", "中文字", "ü", "ö", "a b", "a_b", "a/b"]
    names += [run_name(name, "") for name in names if run_name(name, "") != name]  # look-alikes
    names += ["x" * 300, run_name("x" * 300, "")]
    assert len({run_name(name, "") for name in names}) == len(names)


def test_unreadable_newest_checkpoint_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    older, newer = tmp_path / "step0000010.ckpt", tmp_path / "last.ckpt"
    torch.save({"global_step": 10}, older)
    torch.save({"global_step": 20}, newer)
    newer.write_bytes(newer.read_bytes()[:100])
    os.utime(older, (time.time() - 60, time.time() - 60))
    assert newest_valid_checkpoint(tmp_path) == older
    assert (tmp_path / "last.ckpt.corrupt").is_file(), "kept for inspection, never deleted"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert str(newer) in warning and str(older) in warning


def test_finished_run_is_not_trained_again(train_config: ComposeFn) -> None:
    cfg = train_config(*SHORT_RUN, "trainer.limit_val_batches=2", "trainer.limit_test_batches=2")
    first = train(cfg)
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    written = last.stat().st_mtime_ns
    assert train(cfg) == pytest.approx(first)
    assert last.stat().st_mtime_ns == written


def test_a_finished_run_is_extended_by_a_higher_limit_and_extend_true(tmp_path: Path) -> None:
    """The same run directory trains on from its finished checkpoint to the new limit; without
    extend=true the new limit is refused with a line that names the setting."""
    base = [*QUICK, "run_name=grow", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            *(o for o in SHORT_RUN if not o.startswith(("trainer.max_epochs", "trainer.max_steps")))]  # fmt: skip
    last = tmp_path / "logs" / "train" / "runs" / "grow" / "checkpoints" / "last.ckpt"
    first = run_cli("-m", PACKAGE, *base, LIMITS[0], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert torch.load(last, weights_only=True)["global_step"] == STEPS[0]

    refused = run_cli("-m", PACKAGE, *base, LIMITS[1], cwd=tmp_path)
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert LIMITS[1] in line and "extend=true" in line

    written = []
    for _ in range(2):  # extended, then the same command again: nothing more to train or test
        extended = run_cli("-m", PACKAGE, *base, LIMITS[1], "extend=true", cwd=tmp_path)
        assert extended.returncode == 0, extended.stderr[-3000:]
        assert torch.load(last, weights_only=True)["global_step"] == STEPS[1]
        metrics_file = last.parents[1] / "metrics.json"
        metrics = json.loads(metrics_file.read_text())
        assert math.isfinite(metrics["test/loss"]) and math.isfinite(metrics["val/loss"])
        written.append((last.stat().st_mtime_ns, metrics_file.stat().st_mtime_ns, metrics))
    assert written[1] == written[0], "the finished extended run was left as it was"
    assert "already finished" in extended.stdout + extended.stderr

    run_files = [last, last.parents[1] / "metrics.json", last.parents[1] / "run_overrides.json"]
    before = [path.read_bytes() for path in run_files]
    lower = run_cli("-m", PACKAGE, *base, LIMITS[0], "extend=true", cwd=tmp_path)
    assert lower.returncode == 1
    (line,) = lower.stderr.strip().splitlines()
    assert line.startswith(f"error: {LIMITS[0]} with extend=true") and "already trained" in line
    assert [path.read_bytes() for path in run_files] == before, "the run was left as it was"


def test_a_run_started_from_a_checkpoint_gets_its_own_directory(tmp_path: Path) -> None:
    """`ckpt_path=` is part of the run's name: the command that adds it to a finished run's
    command starts from that checkpoint in a new folder, instead of finding the finished run."""
    base = [*QUICK, *SHORT_RUN, "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
    first = run_cli("-m", PACKAGE, *base, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    runs = tmp_path / "logs" / "train" / "runs"
    (finished,) = runs.iterdir()
    started = run_cli(
        "-m", PACKAGE, *base, f"ckpt_path={finished / 'checkpoints' / 'last.ckpt'}", cwd=tmp_path
    )
    assert started.returncode == 0, started.stderr[-3000:]
    console = started.stdout + started.stderr
    assert "already finished" not in console and "Starting from ckpt_path=" in console
    assert len(list(runs.iterdir())) == 2


def test_step_checkpoints_can_follow_the_clock(train_config: ComposeFn) -> None:
    """The time-based interval that `step_checkpoint.yaml` documents composes, passes the target
    allowlist and saves: at one microsecond every step saves but those that a validation follows
    (the run's last step among them), and the two newest stay."""
    cfg = train_config(
        *SHORT_RUN,
        "test=false",
        "callbacks.step_checkpoint.every_n_train_steps=null",
        "+callbacks.step_checkpoint.train_time_interval={_target_:datetime.timedelta,microseconds:1}",
    )
    train(cfg)
    folder = Path(cfg.paths.output_dir) / "checkpoints"
    last = torch.load(folder / "last.ckpt", weights_only=True)["global_step"]
    kept = sorted(int(path.stem.removeprefix("step")) for path in folder.glob("step*.ckpt"))
    assert len(kept) == 2 and kept[-1] == last - 1


@pytest.mark.parametrize(
    ("saver", "warned"),
    [
        (f"{PACKAGE}.callbacks.RunCheckpoint", True),  # Lightning's ModelCheckpoint, as to this
        (f"{PACKAGE}.callbacks.StepCheckpoint", False),
    ],
)
def test_a_save_that_a_validation_follows_is_named_and_step_checkpoints_wait(
    train_config: ComposeFn, caplog: pytest.LogCaptureFixture, saver: str, warned: bool
) -> None:
    """Lightning resumes a checkpoint taken at a step that a validation follows as if that
    validation had run; ExactResume names any such save, and StepCheckpoint makes none."""
    cfg = train_config(
        *SHORT_RUN, "test=false", f"callbacks.step_checkpoint._target_={saver}",
        f"callbacks.step_checkpoint.every_n_train_steps={VALIDATION_STEP}",
    )  # fmt: skip
    train(cfg)
    named = [r for r in caplog.records if "which a validation follows" in r.getMessage()]
    assert bool(named) == warned
    kept = sorted(p.name for p in (Path(cfg.paths.output_dir) / "checkpoints").glob("step*.ckpt"))
    assert (f"step{VALIDATION_STEP:07d}.ckpt" in kept) == warned


def test_random_states_survive_a_checkpoint_and_load_lazily(tmp_path: Path) -> None:
    """Lightning's lazy loader (FSDP) reads every tensor a checkpoint holds."""
    from lightning.fabric.utilities.load import _lazy_load, _materialize_tensors

    from {{ cookiecutter.package_name }}.callbacks.exact_resume import (
        random_states,
        set_random_states,
    )

    path = tmp_path / "states.ckpt"
    torch.save({"random_states": random_states()}, path)
    expected = torch.rand(3)
    set_random_states(_materialize_tensors(_lazy_load(path))["random_states"])
    set_random_states(torch.load(path, weights_only=True)["random_states"])
    assert torch.equal(torch.rand(3), expected)


def test_a_checkpoint_save_on_a_full_disk_names_the_file(tmp_path: Path) -> None:
    """torch reports a write that ran out of space as a RuntimeError ("unexpected pos"); the save
    finds the OSError behind it and reports it as one line naming the checkpoint."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip("needs root to mount a small filesystem")
    try:
        path = tiny / "checkpoints" / "last.ckpt"
        with pytest.raises(TrainingError) as raised:
            atomic_torch_save({"weights": torch.zeros(64 * 1024)}, path)
        cause = raised.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
        assert str(raised.value) == (
            f"cannot write {path} (No space left on device): free space there, or write "
            "elsewhere with paths.log_dir=<folder>. The checkpoints written before it are kept."
        )
        assert list(path.parent.iterdir()) == [], "no partial or temporary file is left"
    finally:
        subprocess.run(["umount", str(tiny)], check=True)


SAVE_ERRORS = {
    errno.EFBIG: "file-size limit (ulimit -f) takes no file this large",
    errno.EIO: "check it (dmesg)",
    errno.ENAMETOOLONG: "give a shorter run_name",
    errno.EMFILE: "ulimit -n",
    errno.EACCES: "make it writable",
    errno.EROFS: "read-only",
}


@pytest.mark.parametrize("code", list(SAVE_ERRORS), ids=errno.errorcode.get)
@pytest.mark.parametrize("stage", ["writing", "renaming"])
def test_every_error_a_save_meets_is_one_line_naming_the_checkpoint(
    code: int, stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not its temporary file; the checkpoint written before stays, and nothing else is left."""
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"global_step": 1}, path)

    def failing(first: object, second: object, *args: object, **kwargs: object) -> None:
        """Fails as the system call would, naming the temporary file (and the target)."""
        if stage == "writing":  # torch.save(obj, file): the open temporary file
            raise OSError(code, os.strerror(code), str(getattr(second, "name", second)))
        raise OSError(code, os.strerror(code), str(first), None, str(second))

    if stage == "writing":
        monkeypatch.setattr(saving.torch, "save", failing)
    else:
        monkeypatch.setattr(Path, "replace", failing)
    with pytest.raises(TrainingError) as raised:
        atomic_torch_save({"global_step": 2}, path)
    monkeypatch.undo()
    line = str(raised.value)
    assert line.startswith(f"cannot write {path} ({os.strerror(code)}): "), line
    assert SAVE_ERRORS[code] in line and ".tmp" not in line and "\n" not in line, line
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_checkpoint_writes_are_atomic_and_keep_the_previous_one(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"global_step": 1}, path)
    atomic_torch_save({"global_step": 2}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 2
    assert torch.load(tmp_path / "last-previous.ckpt", weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-previous.ckpt", "last.ckpt"]


def test_interrupted_write_leaves_the_old_checkpoint_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"global_step": 1}, path)

    def dies_mid_write(obj: object, file: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_leftover_temporary_file_of_a_killed_save_is_ignored_and_removed(tmp_path: Path) -> None:
    good = tmp_path / "last.ckpt"
    torch.save({"global_step": 3}, good)
    leftover = tmp_path / ".last.ckpt.tmp-12345"
    leftover.write_bytes(b"\x80\x02half a checkpoint")
    assert newest_valid_checkpoint(tmp_path) == good
    assert not leftover.exists()


def test_checkpoint_with_non_finite_weights_is_never_written(tmp_path: Path) -> None:
    from {{ cookiecutter.package_name }}.checkpointing.saving import (
        AtomicCheckpointIO,
    )

    path = tmp_path / "last.ckpt"
    finite, broken = {"w": torch.ones(2)}, {"w": torch.tensor([1.0, torch.nan])}
    atomic_torch_save({"state_dict": finite}, path)
    with pytest.raises(NonFiniteWeightsError, match="w"):
        AtomicCheckpointIO().save_checkpoint({"state_dict": broken}, path)
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["w"], torch.ones(2))


class NcclLikeStrategy:
    """Collectives that refuse a tensor off the process's device, as NCCL does (gloo, which the
    CPU tests run, takes any): on an H200, two saves failed with "No backend type associated with
    device type cpu"."""

    root_device = torch.device("meta")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        assert tensor.device == self.root_device, tensor.device
        return torch.zeros((2, *tensor.shape))

    def reduce(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        assert tensor.device == self.root_device, tensor.device
        return torch.zeros(())


def test_metric_states_are_gathered_on_the_processs_device() -> None:
    from types import SimpleNamespace

    from torchmetrics import MeanMetric

    from {{ cookiecutter.package_name }}.callbacks.exact_resume import (
        ExactResume,
    )

    module = torch.nn.Module()
    module.train_loss = MeanMetric()  # FSDP leaves a metric's states on the CPU
    module.train_loss.update(torch.tensor(3.0))
    callback = ExactResume()
    callback.training_metrics = {"train_loss"}
    trainer = SimpleNamespace(strategy=NcclLikeStrategy(), world_size=2)
    states = callback.metric_states(trainer, module)  # type: ignore[arg-type]
    assert states["train_loss"]["mean_value"].shape == (2,)


def test_the_non_finite_check_of_a_sharded_save_reduces_on_the_processs_device(
    tmp_path: Path,
) -> None:
    from typing import Any, cast

    from {{ cookiecutter.package_name }}.run.strategies import (
        ShardedCheckpointStrategy,
    )

    strategy = cast(Any, NcclLikeStrategy())
    ShardedCheckpointStrategy.refuse_non_finite(strategy, {"w": torch.ones(2)}, tmp_path / "ck")


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent workers", "workers"])
def test_the_training_loader_draws_its_order_at_the_first_batch(persistent: bool) -> None:
    """Lightning makes the iterator of a resumed run's first epoch before it sets that epoch on
    the sampler, and `ExactResume` sets the samples to skip after it too: loader processes that
    drew the order when the iterator was made trained a resumed epoch on epoch 0's batches."""
    from torch.utils.data import TensorDataset

    from {{ cookiecutter.package_name }}.data.base import (
        FirstBatchLoader,
        ResumableSampler,
    )

    data = TensorDataset(torch.arange(48))
    sampler = ResumableSampler(data, num_replicas=1, rank=0, seed=7)
    loader = FirstBatchLoader(
        data, batch_size=4, sampler=sampler, drop_last=True, num_workers=2,
        persistent_workers=persistent,
    )  # fmt: skip
    for epoch, skipped in ((0, 0), (3, 2), (4, 0)):
        iterator = iter(loader)
        sampler.set_epoch(epoch)
        sampler.skip = skipped * 4
        got = torch.cat([batch for (batch,) in iterator])
        expected = torch.tensor(list(sampler))[skipped * 4 :]
        assert torch.equal(got, expected), f"epoch {epoch}: {got} != {expected}"
