"""Fuzzing the door for checkpoints a user did not write: a checkpoint that train wrote, mutated
at random as bytes (its zip's directory and entries) or inside its pickle, then rebuilt as eval,
predict, export and serve rebuild it; and a folder of shards (torch.distributed.checkpoint) with
its `.metadata`, `meta.pt` or a shard mutated, read whole; the run's config a checkpoint
stores, mutated as values; and the files a sweep reads back from its jobs' folders. Whatever the case: a result or one
ConfigError line (tests/fuzzing.py), and nothing the file names is ever run."""

from __future__ import annotations

import io
import json
import random
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from {{ cookiecutter.package_name }}.checkpointing.door import (
    read_checkpoint,
)
from {{ cookiecutter.package_name }}.checkpointing.door.shard_metadata import (
    META,
    METADATA,
)
from {{ cookiecutter.package_name }}.checkpointing.trained import (
    rebuild,
)
from {{ cookiecutter.package_name }}.sweeps.summary import (
    collect_jobs,
    failures,
    write_summary,
)

from .fuzzing import (
    CASES,
    door_holds,
    must_refuse,
    mutate_bytes,
    mutate_json,
    remove,
    write_case,
)
from .helpers import PACKAGE, compose_config, run_cli

QUIET = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's default example, trained for two batches."""
    cwd = tmp_path_factory.mktemp("trained")
    result = run_cli(
        "-m", PACKAGE, *QUIET, "trainer.max_epochs=1", "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "test=false", "run_name=fuzz", cwd=cwd,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "logs" / "train" / "runs" / "fuzz" / "checkpoints" / "last.ckpt"


def with_entry_mutated(valid: bytes, rng: random.Random) -> bytes:
    """The same zip with one entry's bytes mutated (most often the pickle, `data.pkl`)."""
    source = zipfile.ZipFile(io.BytesIO(valid))
    names = source.namelist()
    pickles = [name for name in names if name.endswith("data.pkl")]
    target = rng.choice(pickles) if pickles and rng.random() < 0.7 else rng.choice(names)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as written:
        for info in source.infolist():
            data = source.read(info)
            written.writestr(info, mutate_bytes(data, rng) if info.filename == target else data)
    return out.getvalue()


def test_checkpoint_files(checkpoint: Path, tmp_path: Path) -> None:
    valid = checkpoint.read_bytes()
    path = tmp_path / "last.ckpt"
    cfg = compose_config("eval", [f"ckpt_path={path}"], tmp_path)
    rng = random.Random(8)
    for case in range(CASES):
        mutated = with_entry_mutated(valid, rng) if case % 3 else mutate_bytes(valid, rng)
        kind = write_case(path, mutated, rng, valid)
        door_holds(
            lambda: rebuild(cfg.ckpt_path, False, cfg.data, cfg.model),
            f"case {case} ({kind})",
            must_refuse(kind, own_file=False),
        )
    remove(path)
    path.write_bytes(valid)
    rebuild(cfg.ckpt_path, False, cfg.data, cfg.model)  # the intact file still rebuilds


def test_stored_configs(checkpoint: Path, tmp_path: Path) -> None:
    """The run's config that a checkpoint stores (what eval, predict, export and serve build the
    model and data from), a value at any depth swapped for an odd one or a key dropped."""
    valid = torch.load(checkpoint, map_location="cpu", weights_only=True)
    path = tmp_path / "last.ckpt"
    cfg = compose_config("eval", [f"ckpt_path={path}"], tmp_path)
    rng = random.Random(13)
    for case in range(CASES):
        torch.save({**valid, "run_config": mutate_json(valid["run_config"], rng)}, path)
        door_holds(lambda: rebuild(cfg.ckpt_path, False, cfg.data, cfg.model), f"case {case}")


def write_sharded(path: Path) -> None:
    """A folder of shards as strategy=model_parallel writes one (here from one process)."""
    weights = {"net.weight": torch.randn(4, 3), "net.bias": torch.randn(4)}
    optimizer = {"param_groups": [{"lr": 0.1, "params": ["net.weight", "net.bias"]}]}
    dcp.save({"state_dict": weights, "optimizer_0": optimizer}, checkpoint_id=path, no_dist=True)
    torch.save({"global_step": 3, "epoch": 0}, path / META)


def test_folders_of_shards(tmp_path: Path) -> None:
    valid = tmp_path / "valid.ckpt"
    write_sharded(valid)
    names = sorted(path.name for path in valid.iterdir())
    folder = tmp_path / "last.ckpt"
    shutil.copytree(valid, folder)
    rng = random.Random(9)
    for case in range(CASES):
        name = METADATA if case % 2 else rng.choice(names)
        good = (valid / name).read_bytes()
        kind = write_case(folder / name, mutate_bytes(good, rng), rng, good)
        door_holds(
            lambda: read_checkpoint(folder),
            f"{name} case {case} ({kind})",
            must_refuse(kind, own_file=True),
        )
        remove(folder / name)
        shutil.copy(valid / name, folder / name)
    read_checkpoint(folder)  # the intact folder still reads


def write_sweep(folder: Path) -> dict[str, bytes]:
    """A sweep's folder as its jobs leave it: per job, Hydra's overrides, the job's status and
    its metrics. Returns each file's valid bytes by its path in the folder."""
    files = {}
    for job, status in enumerate(["COMPLETED", "FAILED", "COMPLETED"]):
        record = {"status": status} | ({"reason": "loss is NaN"} if status == "FAILED" else {})
        files |= {
            f"{job}/.hydra/overrides.yaml": f"- model.optimizer.lr=0.00{job + 1}\n- seed=1\n",
            f"{job}/job_status.json": json.dumps(record),
            f"{job}/metrics.json": json.dumps({"val/loss": 0.5 + job, "val/acc": 0.25}),
        }
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return {name: text.encode() for name, text in files.items()}


def test_sweep_folders(tmp_path: Path) -> None:
    """The files a sweep reads back from its jobs' folders to write its summary and its one
    error line (sweeps/summary.py), each mutated as bytes or as values, or an odd file in its
    place: the summary is written and the line is made whatever a job left."""
    folder = tmp_path / "sweep"
    valid = write_sweep(folder)
    rng = random.Random(14)
    for case in range(CASES):
        name = rng.choice(sorted(valid))
        good = valid[name]
        if name.endswith(".json") and case % 2:
            changed = mutate_json(json.loads(good), rng)
            mutated = json.dumps(changed).encode("utf-8", "surrogatepass")
        else:
            mutated = mutate_bytes(good, rng)
        kind = write_case(folder / name, mutated, rng, good)

        def door() -> None:
            rows = collect_jobs(folder)
            assert len(rows) == 3, f"a job's row went missing: {rows}"
            write_summary(folder, rows, "val/loss")
            failures([row for row in rows if row["status"] != "COMPLETED"] or rows, 3, folder)

        door_holds(door, f"{name} case {case} ({kind}): {mutated[:120]!r}")
        remove(folder / name)
        (folder / name).write_bytes(good)
