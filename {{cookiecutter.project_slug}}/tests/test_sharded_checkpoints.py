"""Checkpoints as folders of shards (`strategy=model_parallel`): written in the background, never
taken for complete before they are, resumed exactly after a kill mid-write and on another number
of processes, read by eval and export, and never a way to run code."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import resource
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from {{ cookiecutter.package_name }}.checkpointing.door import (
    META,
    METADATA,
    read_checkpoint,
)
from {{ cookiecutter.package_name }}.checkpointing.saving import (
    newest_valid_checkpoint,
)
from {{ cookiecutter.package_name }}.checkpointing.sharded import (
    publish,
    remove,
    staging_folder,
)
from {{ cookiecutter.package_name }}.checkpointing.trained import (
    file_digest,
)
from {{ cookiecutter.package_name }}.errors import ConfigError

from .helpers import PACKAGE, run_cli
from .killing import (
    COMMON,
    References,
    assert_equal,
    assert_same_outcome,
    fault,
    finish,
    read_last,
    run,
    run_dir,
    signal_group,
    start,
)

MODEL_PARALLEL = [
    "strategy=model_parallel", "trainer.strategy.data_parallel_size=2", "trainer.devices=2",
]  # fmt: skip
# The language model under FSDP2 on two gloo processes: a validation every 4 steps, each followed
# by a step checkpoint, early stopping at step 8 of 12; every checkpoint a folder of shards.
SHARDED_RUN = [
    *COMMON, "experiment=language", "model.net.n_layer=2", "data.max_bytes=200000",
    "trainer.max_steps=12", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2", "callbacks.step_checkpoint.every_n_train_steps=4",
    *MODEL_PARALLEL,
]  # fmt: skip


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def write_sharded(path: Path, step: int = 3) -> dict[str, torch.Tensor]:
    """A folder of shards as the strategy writes one (here from one process)."""
    weights = {"net.weight": torch.randn(4, 3), "net.bias": torch.randn(4)}
    dcp.save({"state_dict": weights}, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": step, "epoch": 0}, path / META)
    return weights


WEIGHTS = {"net.weight": torch.ones(4, 3)}


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_folder_of_shards_reads_whole(tmp_path: Path) -> None:
    weights = write_sharded(tmp_path / "last.ckpt")
    checkpoint = read_checkpoint(tmp_path / "last.ckpt")
    assert checkpoint["global_step"] == 3
    assert_equal(weights, checkpoint["state_dict"], "state_dict")


def hostile_metadata(folder: Path, marker: Path) -> None:
    (folder / METADATA).write_bytes(pickle.dumps(RunsCode(marker)))


def hostile_value(folder: Path, marker: Path) -> None:
    """A value that is not a tensor (as an optimizer's hyperparameters are stored) which runs code
    when unpickled: torch.distributed.checkpoint loads these with weights_only=False."""
    remove(folder)
    state = {"param_groups": [{"lr": RunsCode(marker), "params": ["net.weight"]}]}
    dcp.save({"state_dict": WEIGHTS, "optimizer_0": state}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 3}, folder / META)


def edit_shard_index(folder: Path, edit: Callable[[Any], None]) -> None:
    metadata = pickle.loads((folder / METADATA).read_bytes())
    for info in metadata.storage_data.values():
        edit(info)
    (folder / METADATA).write_bytes(pickle.dumps(metadata))


def shard_outside(folder: Path, marker: Path) -> None:
    edit_shard_index(folder, lambda info: setattr(info, "relative_path", "../secret.distcp"))


def shard_missing(folder: Path, marker: Path) -> None:
    for shard in folder.glob("*.distcp"):
        shard.unlink()


def shard_truncated(folder: Path, marker: Path) -> None:
    for shard in folder.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:-9])


def shard_overwritten(folder: Path, marker: Path) -> None:
    """A shard of the same size whose bytes are noise, as a failing disk leaves one."""
    remove(folder)
    state = {"param_groups": [{"lr": 0.1, "params": ["net.weight"]}]}
    dcp.save({"state_dict": WEIGHTS, "optimizer_0": state}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 3}, folder / META)
    for shard in folder.glob("*.distcp"):
        shard.write_bytes(random.Random(0).randbytes(shard.stat().st_size))


def shard_a_link(folder: Path, marker: Path) -> None:
    for shard in folder.glob("*.distcp"):
        outside = folder.parent / f"elsewhere-{shard.name}"
        shard.replace(outside)
        shard.symlink_to(outside)


def metadata_a_link(folder: Path, marker: Path) -> None:
    outside = folder.parent / "elsewhere.metadata"
    (folder / METADATA).replace(outside)
    (folder / METADATA).symlink_to(outside)


def storage_meta_falls_back(folder: Path, marker: Path) -> None:
    """A `.metadata` that torch's reader fails on (a string where an object belongs), beside a
    rank-local `__0.metadata` that runs code: torch's loader falls back to that one and reads it
    with a bare pickle.load."""
    metadata = pickle.loads((folder / METADATA).read_bytes())
    real = pickle.dumps(metadata)
    metadata.storage_meta = "x"
    (folder / METADATA).write_bytes(pickle.dumps(metadata))
    fallback = pickle.loads(real)
    fallback.payload = RunsCode(marker)
    (folder / f"__0{METADATA}").write_bytes(pickle.dumps(fallback))


def extra_attribute(folder: Path, marker: Path) -> None:
    metadata = pickle.loads((folder / METADATA).read_bytes())
    metadata.extra = "a value torch never writes"
    (folder / METADATA).write_bytes(pickle.dumps(metadata))


def shard_offset_text(folder: Path, marker: Path) -> None:
    edit_shard_index(folder, lambda info: setattr(info, "offset", "0"))


def transforms(folder: Path, marker: Path) -> None:
    edit_shard_index(folder, lambda info: setattr(info, "transform_descriptors", ["zstd"]))


HOSTILE = {
    "storage-meta-text-with-rank-local-fallback": (storage_meta_falls_back, r"holds a str at storage_meta"),
    "extra-attribute": (extra_attribute, r"gives the top attributes a checkpoint never has"),
    "offset-as-text": (shard_offset_text, r"holds a str at storage_data\['state_dict\.net\.\w+'\]\.offset"),
    "transforms": (transforms, r"asks for transforms \['zstd'\]"),
    "metadata-runs-code": (hostile_metadata, r"\.metadata names posix\.system"),
    "value-runs-code": (hostile_value, r"holds optimizer_0\.param_groups\.0\.lr in a form that does not load as plain values"),
    "shard-overwritten": (shard_overwritten, r"does not load as plain values \(damaged"),
    "shard-a-link": (shard_a_link, r"shard __0_0\.distcp is a symbolic link"),
    "metadata-a-link": (metadata_a_link, r"\.metadata is a symbolic link"),
    "shard-outside-folder": (shard_outside, r"names '\.\./secret\.distcp', not a file in"),
    "shard-missing": (shard_missing, r"shard __0_0\.distcp is missing"),
    "shard-truncated": (shard_truncated, r"shard __0_0\.distcp is \d+ bytes, not \d+"),
}  # fmt: skip


def poison(folder: Path, marker: Path) -> None:
    """The tester's recipe: a real folder of shards whose `.metadata` torch fails to read, with
    a rank-local `__0.metadata` that runs code."""
    storage_meta_falls_back(folder, marker)


@pytest.mark.slow
def test_a_poisoned_folder_runs_nothing_through_any_command(
    tmp_path: Path, reference_run: References
) -> None:
    """Every way a folder of shards reaches the project: eval, predict, export, a new run's
    ckpt_path and init_from, the base weights that a LoRA checkpoint names, read_checkpoint, and
    a run that resumes from its own folder. None runs the payload; each refuses in one line,
    and the resumed run puts the folder aside and goes on from the checkpoint before."""
    reference = run_dir(reference_run(SHARDED_RUN))
    poisoned = tmp_path / "poisoned.ckpt"
    shutil.copytree(reference / "checkpoints" / "last.ckpt", poisoned)
    marker = tmp_path / "ran"
    poison(poisoned, marker)

    lora = tmp_path / "lora.ckpt"
    stored = read_last(reference / "checkpoints" / "last.ckpt")
    torch.save(
        {
            "state_dict": {},
            "run_config": stored["run_config"],
            "base_weights": {"path": str(poisoned), "sha256": file_digest(poisoned)},
        },
        lora,
    )
    commands = {
        "eval": ([f"ckpt_path={poisoned}", "trainer=cpu", "logger=none"], "evaluate"),
        "predict": ([f"ckpt_path={poisoned}", "prompt=def ", "trainer=cpu"], "predict"),
        "export": ([f"ckpt_path={poisoned}", "format=checkpoint"], "export"),
        "train ckpt_path": ([*COMMON, "experiment=language", f"ckpt_path={poisoned}"], "train"),
        "train init_from": ([*COMMON, "experiment=language", f"init_from={poisoned}"], "train"),
        "LoRA base weights": ([f"ckpt_path={lora}", "trainer=cpu", "logger=none"], "evaluate"),
    }
    for name, (args, entry) in commands.items():
        code, output = run(args, tmp_path / name.replace(" ", "-"), entry=entry)
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert code == 1 and len(errors) == 1, f"{name}:\n{output[-3000:]}"
        assert "not a readable sharded checkpoint" in errors[0], errors[0]
        assert not marker.exists(), f"{name} ran the payload"
    with pytest.raises(ConfigError, match="holds a str at storage_meta"):
        read_checkpoint(poisoned)

    resumed = tmp_path / "resumed"
    shutil.copytree(reference_run(SHARDED_RUN), resumed)
    folder = run_dir(resumed)
    (folder / "metrics.json").unlink()
    last = folder / "checkpoints" / "last.ckpt"
    poison(last, marker)
    os.utime(last, None)  # the newest
    code, output = run(SHARDED_RUN, resumed)
    assert code == 0, output[-3000:]
    assert not marker.exists(), "resuming ran the payload"
    assert (folder / "checkpoints" / "last.ckpt.corrupt").is_dir(), "put aside, not deleted"
    assert re.search(
        r"last\.ckpt is unreadable \(its \.metadata holds a str at storage_meta", output
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_or_damaged_folder_runs_nothing_and_is_one_line(
    tmp_path: Path, case: str
) -> None:
    damage, reason = HOSTILE[case]
    before = tmp_path / "checkpoints" / "step0000002.ckpt"
    write_sharded(before, step=2)
    os.utime(before, (1, 1))
    folder = tmp_path / "checkpoints" / "last.ckpt"
    write_sharded(folder)
    (tmp_path / "checkpoints" / "secret.distcp").write_bytes(pickle.dumps(RunsCode(tmp_path)))
    marker = tmp_path / "ran"
    damage(folder, marker)
    with pytest.raises(ConfigError, match=r"not a readable sharded checkpoint") as error:
        read_checkpoint(folder)
    assert "\n" not in str(error.value) and re.search(reason, str(error.value)), error.value
    assert not marker.exists()
    assert newest_valid_checkpoint(folder.parent) == before, "the run resumes from the one before"
    assert (folder.parent / "last.ckpt.corrupt").is_dir(), "moved aside, not deleted"


def test_only_complete_folders_are_resumed_from(tmp_path: Path) -> None:
    """A kill leaves the staging folder, or one without the `.metadata` written last; neither is
    taken for a checkpoint."""
    ckpt_dir = tmp_path / "checkpoints"
    write_sharded(ckpt_dir / "step0000004.ckpt", step=4)
    staging = staging_folder(ckpt_dir / "last.ckpt")
    write_sharded(staging, step=8)
    incomplete = ckpt_dir / "step0000008.ckpt"
    write_sharded(incomplete, step=8)
    (incomplete / METADATA).unlink()
    assert newest_valid_checkpoint(ckpt_dir) == ckpt_dir / "step0000004.ckpt"
    assert not staging.exists()
    assert (ckpt_dir / "step0000008.ckpt.corrupt").is_dir()


def test_publishing_over_a_checkpoint_keeps_the_previous_one(tmp_path: Path) -> None:
    last = tmp_path / "last.ckpt"
    write_sharded(last, step=4)
    staging = staging_folder(last)
    write_sharded(staging, step=8)
    publish(staging, last)
    assert read_checkpoint(last)["global_step"] == 8
    assert read_checkpoint(tmp_path / "last-previous.ckpt")["global_step"] == 4
    assert not staging.exists()


@pytest.mark.slow
def test_killed_while_shards_are_written_in_the_background_finishes_exactly(
    tmp_path: Path, reference_run: References
) -> None:
    """The second save's shards are on disk but its `.metadata` is not: the folder stays under
    its staging name, the run resumes from the save before, and ends as if never killed."""
    cwd = tmp_path / "run"
    command = [*SHARDED_RUN, *fault("shard_write", 2, tmp_path / "fired")]
    code, output = run(command, cwd)
    assert code == -signal.SIGKILL, f"the fault did not fire:\n{output[-3000:]}"
    checkpoints = run_dir(cwd) / "checkpoints"
    assert list(checkpoints.glob(".*.tmp-shards")), "the interrupted save is under its staging name"
    for folder in checkpoints.glob("*.ckpt"):
        assert (folder / METADATA).is_file(), f"{folder.name} looks complete but is not"
    code, output = run(command, cwd)
    assert code == 0, output[-3000:]
    assert_same_outcome(reference_run(SHARDED_RUN), cwd)
    assert (run_dir(cwd) / "checkpoints" / "last.ckpt" / METADATA).is_file()


@pytest.mark.slow
def test_sigterm_saves_a_whole_folder_in_the_background_and_the_same_command_finishes_exactly(
    tmp_path: Path, reference_run: References
) -> None:
    """A preemption's save is asynchronous too: the run must not exit before it is complete."""
    cwd = tmp_path / "run"
    command = [*SHARDED_RUN, *fault("train_step", 6, tmp_path / "fired", "SIGTERM", True)]
    code, output = run(command, cwd)
    saved = re.search(r"SIGTERM at step (\d+): saved", output)
    assert code == 143 and saved, output[-3000:]
    last = run_dir(cwd) / "checkpoints" / "last.ckpt"
    assert read_checkpoint(last)["global_step"] == int(saved[1]) < 12
    code, output = run(command, cwd)
    assert code == 0, output[-3000:]
    assert_same_outcome(reference_run(SHARDED_RUN), cwd)


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_one_process_and_evaluates_as_one_file(
    tmp_path: Path, reference_run: References
) -> None:
    """Two processes' shards load into one process exactly; eval reads the folder, and export
    turns it into one file that evaluates the same."""
    sharded = run_dir(reference_run(SHARDED_RUN)) / "checkpoints" / "last.ckpt"
    one_process = [arg for arg in SHARDED_RUN if arg not in MODEL_PARALLEL[1:]] + [
        "trainer.strategy.data_parallel_size=1",
        "trainer.devices=1",
        f"ckpt_path={sharded}",
    ]
    code, output = run(one_process, tmp_path / "one")
    assert code == 0, output[-3000:]
    expected, got = (
        read_last(sharded),
        read_last(run_dir(tmp_path / "one") / "checkpoints" / "last.ckpt"),
    )
    assert got["global_step"] == expected["global_step"]
    assert_equal(expected["state_dict"], got["state_dict"], "state_dict")
    assert_equal(expected["optimizer_states"], got["optimizer_states"], "optimizer_states")

    code, output = run([f"ckpt_path={sharded}", "format=checkpoint"], tmp_path, entry="export")
    assert code == 0, output[-3000:]
    (single,) = (tmp_path / "logs" / "export" / "runs").glob("*/model.ckpt")
    losses = []
    for checkpoint in (sharded, single):
        code, output = run(
            [f"ckpt_path={checkpoint}", "trainer=cpu", "logger=csv"], tmp_path / str(len(losses)),
            entry="evaluate",
        )  # fmt: skip
        assert code == 0, output[-3000:]
        (metrics,) = (tmp_path / str(len(losses)) / "logs" / "eval" / "runs").glob("*/metrics.json")
        losses.append(json.loads(metrics.read_text())["test/loss"])
    assert losses[0] == losses[1]
    code, output = run(
        [f"ckpt_path={sharded}", "prompt=def ", "max_new_tokens=8", "trainer=cpu"],
        tmp_path / "predict", entry="predict",
    )  # fmt: skip
    assert code == 0, output[-3000:]


@pytest.mark.slow
def test_the_checkpoint_bench_measures_each_way_of_saving(tmp_path: Path) -> None:
    """The figures are machine-dependent; what is checked is that each mode saved as often as
    asked, wrote a whole checkpoint, and that the stall never exceeds the write."""
    output = tmp_path / "checkpointing.json"
    bench = ["-c", f"from {PACKAGE}.recipes.bench import main; main()", "experiment=language"]
    result = run_cli(
        *bench, "trainer=cpu", *MODEL_PARALLEL[:1], "trainer.strategy.data_parallel_size=1",
        "trainer.devices=1", "bench.checkpointing=true", "bench.warmup=2", "bench.steps=6",
        "bench.save_every=2", "model.net.n_layer=1", f"bench.output={output}",
        f"hydra.run.dir={tmp_path}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())
    for mode in ("consolidated", "sync", "async"):
        assert results[mode]["saves"] == 4, mode
        assert results[mode]["checkpoint_bytes"] > 1e6, mode
        assert 0 < results[mode]["stall_median_s"] <= results[mode]["write_median_s"], mode
        assert 0 <= results[mode]["wait_median_s"] <= results[mode]["stall_median_s"], mode
    assert "stall/save" in result.stdout
    assert not list(tmp_path.glob("bench-checkpoints-*")), "the measured checkpoints are removed"

    refused = run_cli(*bench, "trainer=cpu", "bench.checkpointing=true", cwd=tmp_path)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        "error: bench.checkpointing=true measures the checkpoints of strategy=model_parallel: "
        "add it."
    ]


@pytest.mark.parametrize("wait", [0.0, 1.4])
def test_the_checkpoint_bench_says_when_its_stall_was_mostly_waiting_for_a_write(
    wait: float,
) -> None:
    """On a GPU, saves 3 steps apart each waited for the previous 3.5 s write: a stall that
    measured the save interval, not the save."""
    from {{ cookiecutter.package_name }}.recipes.bench.checkpointing import (
        report,
    )

    row = {"saves": 4, "stall_median_s": 1.5, "wait_median_s": wait, "write_median_s": 3.5,
           "fit_wall_s": 11.7, "checkpoint_bytes": 1e9}  # fmt: skip
    results = {"command": "bench", "save_every": 3, "consolidated": row, "sync": row, "async": row}
    assert ("Raise bench.save_every" in report(results)) == (wait > 0.75)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_shards_that_cannot_be_written_are_one_line_and_every_rank_exits(
    tmp_path: Path, mode: str
) -> None:
    """A file-size limit (`ulimit -f`) below a shard's size: both ranks' writes fail with EFBIG
    (in the background, or in the step). One `error:` line naming the checkpoint, no staging
    folder left, and no process of the run alive once the command has returned."""
    process = start([*SHARDED_RUN, f"trainer.strategy.checkpoint={mode}"], tmp_path)
    limit = 400 * 1024  # set before the command has imported torch, let alone started a rank
    resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (limit, limit))
    code, output = finish(process)
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        pass
    else:
        signal_group(process.pid, signal.SIGKILL)
        raise AssertionError(f"a process of the run outlived the command:\n{output[-3000:]}")
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "File too large" in errors[0] and ".ckpt (" in errors[0], errors
    assert "tmp-shards" not in errors[0], "the line names the checkpoint, not its staging folder"
    checkpoints = run_dir(tmp_path) / "checkpoints"
    assert not list(checkpoints.glob(".*")), list(checkpoints.iterdir())
