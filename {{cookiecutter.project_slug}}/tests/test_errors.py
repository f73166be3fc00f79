"""Bad input gets one clear error, exit code 1, and changes nothing already written; a NaN never
reaches the weights or a checkpoint."""

from __future__ import annotations

import errno
import os
import pickle
import random
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from {{ cookiecutter.package_name }}.checkpointing import (
    saving as checkpoints_module,
)
from {{ cookiecutter.package_name }}.checkpointing.saving import (
    newest_valid_checkpoint,
)
from {{ cookiecutter.package_name }}.checkpointing.trained import (
    load_base_weights,
)
from {{ cookiecutter.package_name }}.cli import _run
from {{ cookiecutter.package_name }}.errors import (
    ConfigError,
    TrainingError,
)
from {{ cookiecutter.package_name }}.recipes.evaluate import (
    evaluate,
)
from {{ cookiecutter.package_name }}.recipes.export import (
    export as run_export,
)
from {{ cookiecutter.package_name }}.recipes.predict import (
    predict as run_prediction,
)
from {{ cookiecutter.package_name }}.recipes.train import train
from {{ cookiecutter.package_name }}.run.names import (
    gpus_per_node,
)
from {{ cookiecutter.package_name }}.run.settings import (
    check_run_settings,
)
from {{ cookiecutter.package_name }}.sweeps.summary import (
    launches_ddp_subprocesses,
)

from .helpers import PACKAGE, ComposeFn, checkpoints, compose_config, run_cli
{%- if cookiecutter.examples == "language" %}

SHORT_RUN = [
    "model.net.n_layer=1", "data.max_bytes=200000", "trainer.max_steps=8",
    "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "test=false",
]  # fmt: skip
MISSING_DATA = ("data.source=/no/such/corpus", "data.source=/no/such/corpus")
UNREADABLE_DATA = "data.source={dir}/unreadable/train.txt"
UNREADABLE_WORDS = "cannot read"
UNREADABLE_FILES = ("train.txt",)
SHARDING_ADVICE = "strategy=model_parallel"  # the language model shards itself (FSDP2)
{%- else %}

SHORT_RUN = [
    "trainer.max_epochs=1", "trainer.limit_train_batches=8", "trainer.limit_val_batches=2",
    "test=false",
]  # fmt: skip
MISSING_DATA = ("data=mnist data.data_dir=/no/such/folder data.download=false", "data.data_dir")
UNREADABLE_DATA = "data=mnist data.data_dir={dir}/unreadable data.download=false"
UNREADABLE_WORDS = "cannot be read"
UNREADABLE_FILES = tuple(
    f"{split}-{kind}"
    for split in ("train", "t10k")
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")
)
SHARDING_ADVICE = "strategy=fsdp"  # the ConvNet has no configure_model for FSDP2
{%- endif %}
# A file that the kernel refuses to read, even to root (reading it fails with EIO).
UNREADABLE_FILE = Path("/proc/self/mem")


def fails_with(
    task: Any, cfg: DictConfig, capsys: pytest.CaptureFixture[str], *fragments: str
) -> str:
    """Run as the command line does: one line on stderr, exit code 1."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _run(task, cfg)
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in path.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture
def written(tmp_path: Path) -> Path:
    """A folder of files that earlier runs wrote; no failing command may change it."""
    folder = tmp_path / "earlier"
    folder.mkdir()
    other_weights = {"layer.weight": torch.ones(2, 2)}
    torch.save({"state_dict": other_weights}, folder / "other_model.ckpt")
    (folder / "corrupt.ckpt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    (folder / "text.ckpt").write_text("root:x:0:0:root:/root:/bin/bash\n" * 20)
    (folder / "random.ckpt").write_bytes(random.Random(0).randbytes(4096))
    (folder / "empty.ckpt").write_bytes(b"")
    torch.save({"state_dict": {}, "extra": Path("needs/unpickling")}, folder / "pickled.ckpt")
    good = folder / "truncated.ckpt"
    weights = {"w": torch.zeros(1000)}
    torch.save({"state_dict": weights}, good)
    good.write_bytes(good.read_bytes()[:200])
    torch.save({"state_dict": weights}, folder / "no_run_config.ckpt")
    evil_data = {"_target_": "os.system", "command": "touch pwned"}
    run_config = {"data": evil_data, "model": dict(evil_data)}
    torch.save({"state_dict": weights, "run_config": run_config}, folder / "evil_run_config.ckpt")
    torch.save([weights], folder / "a_list.ckpt")
    torch.save({"state_dict": [torch.zeros(1)]}, folder / "weights_in_a_list.ckpt")
    not_tensors = {"w": "zeros"}
    torch.save({"state_dict": not_tensors}, folder / "weights_not_tensors.ckpt")
    diverged = {"w": torch.tensor([0.0, float("nan")]), "v": torch.tensor([float("inf")])}
    torch.save({"state_dict": diverged, "run_config": dict()}, folder / "diverged.ckpt")
    torch.save({"state_dict": weights, "run_config": "data: []"}, folder / "run_config_text.ckpt")
    no_model = {"state_dict": weights, "run_config": dict(data=dict())}
    torch.save(no_model, folder / "run_config_no_model.ckpt")
    for name, value in (("interpolation", "${nonexistent.key}"), ("missing_value", "???")):
        stored = dict(data=dict(size=value), model=dict())
        checkpoint = {"state_dict": weights, "run_config": stored}
        torch.save(checkpoint, folder / f"run_config_{name}.ckpt")
    (folder / "unreadable").mkdir()
    for name in UNREADABLE_FILES:
        (folder / "unreadable" / name).symlink_to(UNREADABLE_FILE)
    (folder / "plain_pickle.ckpt").write_bytes(pickle.dumps(dict(state_dict=dict()), protocol=4))
    (folder / "loop_a.ckpt").symlink_to(folder / "loop_b.ckpt")
    (folder / "loop_b.ckpt").symlink_to(folder / "loop_a.ckpt")
    write_checkpoints_of_this_model(folder, tmp_path / "composed")
    return folder


def write_checkpoints_of_this_model(folder: Path, run_dir: Path) -> None:
    """Checkpoints of the default model, each with its config as train stores it, but with one
    thing wrong: a weight of another shape, a weight too many, a config claiming a model of
    terabytes (refused before anything is allocated), a network that the config builds as
    a `functools.partial` (so the model holds none of the weights), more epochs done than a run's
    limit; and the model's weights as a folder of shards."""
    cfg = compose_config("train", [*SHORT_RUN], run_dir)
    weights = dict(instantiate(cfg.model).state_dict())
    stored = {part: OmegaConf.to_container(cfg[part], resolve=True) for part in ("data", "model")}
    first = next(iter(weights))
    resized = {**weights, first: torch.zeros(*weights[first].shape, 2)}
    torch.save({"state_dict": resized, "run_config": stored}, folder / "other_shape.ckpt")
    extra = {**weights, "extra.weight": torch.zeros(2)}
    torch.save({"state_dict": extra, "run_config": stored}, folder / "extra_weight.ckpt")
    net = {**stored["model"]["net"], "_partial_": True}
    model = {**stored["model"], "net": net}
    partial = {**stored, "model": model}
    torch.save({"state_dict": weights, "run_config": partial}, folder / "partial_net.ckpt")
    net = stored["model"]["net"]
    claim = {"channels": [32, 2_000_000_000]} if "channels" in net else {"n_embd": 2**24}
    huge_net = {**net, **claim}
    huge = {**stored, "model": dict(stored["model"], net=huge_net)}
    torch.save({"state_dict": weights, "run_config": huge}, folder / "huge_claim.ckpt")
    swapped = {**stored, "model": stored["data"], "data": stored["model"]}
    torch.save({"state_dict": weights, "run_config": swapped}, folder / "swapped_configs.ckpt")
    fit_loop = dict(epoch_progress=dict(current=dict(completed=50)))
    past = {"state_dict": weights, "run_config": stored, "loops": dict(fit_loop=fit_loop)}
    torch.save(past, folder / "past_the_limits.ckpt")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"state_dict": weights}, checkpoint_id=folder / "shards.ckpt", no_dist=True)
    meta = {"run_config": stored, "epoch": 0, "global_step": 2}
    torch.save(meta, folder / "shards.ckpt" / "meta.pt")


TRAIN_CASES = {
    "missing ckpt_path": (["ckpt_path={dir}/nope.ckpt"], ["does not exist"]),
    "corrupt ckpt_path": (["ckpt_path={dir}/corrupt.ckpt"], ["not a readable checkpoint"]),
    "truncated ckpt_path": (["ckpt_path={dir}/truncated.ckpt"], ["not a readable checkpoint"]),
    "ckpt_path of another model": (["ckpt_path={dir}/other_model.ckpt"], ["another model"]),
    "ckpt_path needing full unpickling": (["ckpt_path={dir}/pickled.ckpt"], ["trust_checkpoint=true"]),
    "_target_ outside the allowlist": (["model.net._target_=os.system"], ["not allowed", "allowed_targets"]),
    "_target_ that does not exist": (["model.net._target_=torch.nn.NoSuchLayer"], ["model.net", "NoSuchLayer"]),
    "batch size of the wrong type": (["data.batch_size=many"], ["data.batch_size", "whole number"]),
    "batch size zero": (["data.batch_size=0"], ["data.batch_size"]),
    "negative worker count": (["data.num_workers=-2"], ["data.num_workers"]),
    "worker count a word": (["data.num_workers=many"], ["data.num_workers='many'", "or auto"]),
{%- if cookiecutter.examples != "vision" %}
    "context of 0": (["experiment=language", "data.block_size=0"], ["data.block_size=0", "1 or more"]),
    "model context shorter than the data's": (["experiment=language", "model.net.block_size=64"], ["data.block_size=128", "model.net.block_size=64"]),
    "held-out shares leaving no text": (["experiment=language", "data.test_fraction=0.99"], ["data.test_fraction=0.99", "nothing to train on"]),
    "a model narrower than one": (["experiment=language", "model.net.n_embd=0"], ["n_embd=0", "1 or more"]),
    "a vocabulary smaller than the data's": (["experiment=language", "model.net.vocab_size=10"], ["model.net.vocab_size=10", "256 or more"]),
    "a batch larger than the text": (["experiment=language", "data.batch_size=1000000"], ["no batch", "data.batch_size=1000000"]),
{%- endif %}
{%- if cookiecutter.examples != "language" %}
    "held-out share above 1": (["experiment=digits", "data.val_fraction=1.5"], ["data.val_fraction=1.5", "fraction"]),
    "nothing held out to validate on": (["experiment=digits", "data.val_fraction=0"], ["data.val_fraction=0", "above 0"]),
    "too few samples held out to validate on": (["experiment=digits", "data.val_fraction=0.0001"], ["data.val_fraction=0.0001", "holds none"]),
    "a batch larger than the data set": (["experiment=digits", "data.batch_size=100000"], ["no batch", "data.batch_size=100000"]),
    "validating after more batches than an epoch has": (["experiment=digits", "trainer.val_check_interval=100000"], ["val_check_interval=100000", "check_val_every_n_epoch=null"]),
    "a split seed that is a word": (["experiment=digits", "data.split_seed=abc"], ["data.split_seed='abc'", "whole number"]),
    "a convolution zero wide": (["experiment=digits", "model.net.channels=[32,0]"], ["model.net.channels=[32, 0]", "1 or more"]),
    "a network for colour images on grey ones": (["experiment=digits", "model.net.in_channels=3"], ["model.net.in_channels=3", "1 channel(s)"]),
{%- endif %}
    "negative weight decay": (["model.optimizer.weight_decay=-1"], ["model.optimizer.weight_decay=-1", "0 or more"]),
{%- if cookiecutter.examples != "vision" %}
    "unknown checkpoint mode": (["experiment=language", "strategy=model_parallel", "trainer.strategy.data_parallel_size=1", "trainer.strategy.checkpoint=zip"], ["checkpoint=zip", "async, sync, consolidated"]),
{%- endif %}
    "unknown precision": (["trainer.precision=fp8"], ["not one of"]),
    "fp16 on CPU": (["trainer.precision=16-mixed"], ["bf16-mixed or 32-true"]),
    "unknown NaN policy": (["callbacks.non_finite.action=ignore"], ["stop or skip"]),
    "missing data path": (MISSING_DATA[0].split(), [MISSING_DATA[1]]),
    "unreadable data file": (UNREADABLE_DATA.split(), [UNREADABLE_WORDS, "unreadable"]),
    "ckpt_path a folder": (["ckpt_path={dir}"], ["is a folder", ".ckpt"]),
    "ckpt_path a list": (["ckpt_path={dir}/a_list.ckpt"], ["ckpt_path=", "holds a list"]),
    "ckpt_path with NaN weights": (["ckpt_path={dir}/diverged.ckpt"], ["ckpt_path=", "NaN or infinite", "w, v"]),
    "ckpt_path a loop of links": (["ckpt_path={dir}/loop_a.ckpt"], ["loop_a.ckpt", "loop of links"]),
    "ckpt_path of this model past the run's epochs": (["ckpt_path={dir}/past_the_limits.ckpt", "trainer.max_epochs=3"], ["trainer.max_epochs=3", "has trained 50 epochs", "init_from="]),
    "ckpt_path a folder of shards, without model_parallel": (["ckpt_path={dir}/shards.ckpt"], ["folder of shards", "strategy=model_parallel", "init_from="]),
    "a peak TFLOP/s that is a word": (["callbacks.throughput.peak_tflops=abc"], ["callbacks.throughput.peak_tflops='abc'", "positive"]),
    "a negative peak TFLOP/s": (["callbacks.throughput.peak_tflops=-5"], ["peak_tflops=-5", "positive"]),
    "model_parallel sizes that are not the processes": (["strategy=model_parallel", "trainer.strategy.data_parallel_size=2", "trainer.devices=3"], ["data_parallel_size=2", "trainer.devices=3"]),
    "model_parallel on CPU without data_parallel_size": (["strategy=model_parallel", "trainer.devices=2"], ["data_parallel_size set"]),
    "model_parallel with no data-parallel processes": (["strategy=model_parallel", "trainer.strategy.data_parallel_size=0"], ["data_parallel_size=0"]),
    "tensor parallelism, which the models do not do": (["strategy=model_parallel", "trainer.strategy.data_parallel_size=1", "trainer.strategy.tensor_parallel_size=2", "trainer.devices=2"], ["tensor_parallel_size=2", "FSDP2"]),
    "init_from missing": (["init_from={dir}/nope.ckpt"], ["init_from=", "does not exist"]),
    "init_from a list": (["init_from={dir}/a_list.ckpt"], ["init_from=", "holds a list"]),
    "init_from without tensors": (["init_from={dir}/weights_not_tensors.ckpt"], ["init_from=", "no state_dict"]),
    "init_from with NaN weights": (["init_from={dir}/diverged.ckpt"], ["init_from=", "NaN or infinite"]),
    "init_from of another model": (["init_from={dir}/other_model.ckpt"], ["init_from=", "another model"]),
    "compile given a number": (["model.compile=0.5"], ["model.compile=0.5", "true or false"]),
    "a callback's switch given a word": (["callbacks.model_checkpoint.save_last=yes"], ["save_last='yes'", "true or false or link"]),
    "a trainer switch given a number": (["trainer.deterministic=1"], ["trainer.deterministic=1", "or warn"]),
    "fast_dev_run a word": (["trainer.fast_dev_run=some"], ["trainer.fast_dev_run='some'", "number of batches"]),
    "a callback given a word": (["callbacks.early_stopping=maybe"], ["callbacks.early_stopping='maybe'", "=null to turn it off"]),
    "a process a CPU device, far too many": (["trainer=cpu", "trainer.devices=100000"], ["trainer.devices=100000", "cores"]),
    "far too many loader processes": (["data.num_workers=1000"], ["data.num_workers=1000", "cores"]),
    "a metric the model does not log": (["monitor.metric=val/nope"], ["monitor.metric=val/nope", "val/loss", "set monitor.metric"]),
    "an unknown matmul precision": (["matmul_precision=banana"], ["matmul_precision='banana'", "highest, high"]),
    "negative seed": (["seed=-1"], ["seed=-1", "from 0"]),
    "negative learning rate": (["model.optimizer.lr=-0.1"], ["model.optimizer.lr=-0.1", "positive"]),
    "zero learning rate": (["model.optimizer.lr=0"], ["model.optimizer.lr=0", "positive"]),
    "infinite learning rate": (["model.optimizer.lr=inf"], ["model.optimizer.lr=inf", "finite"]),
    "learning rate a word": (["model.optimizer.lr=fast"], ["model.optimizer.lr='fast'"]),
    "no learning rate": (["model.optimizer.lr=null"], ["model.optimizer.lr=None", "positive"]),
    "a learning-rate floor below 0": (["model.scheduler.min_lr_ratio=-1"], ["min_lr_ratio=-1", "from 0 to 1"]),
    "a learning-rate floor above the peak": (["model.scheduler.min_lr_ratio=2"], ["min_lr_ratio=2", "from 0 to 1"]),
    "warm-up steps a word": (["model.scheduler.warmup_steps=abc"], ["warmup_steps='abc'", "whole number"]),
    "negative warm-up steps": (["model.scheduler.warmup_steps=-1"], ["warmup_steps=-1"]),
    "a dropout that is not a probability": (["model.net.dropout=nan"], ["model.net.dropout=nan", "probability"]),
    "zero devices": (["trainer.devices=0"], ["trainer.devices=0", "count of 1 or more"]),
    "devices a word": (["trainer.devices=many"], ["trainer.devices='many'"]),
    "a negative device index": (["trainer.devices=[-1]"], ["trainer.devices=[-1]", "device indices"]),
    "no device index": (["trainer.devices=[]"], ["trainer.devices=[]", "device indices"]),
    "max_epochs below -1": (["trainer.max_epochs=-5"], ["trainer.max_epochs=-5", "-1 or more"]),
    "max_steps below -1": (["trainer.max_steps=-3"], ["trainer.max_steps=-3"]),
    "no epochs": (["trainer.max_epochs=0"], ["trainer.max_epochs=0", "trains nothing"]),
    "a monitored metric that validation does not log": (["monitor.metric=val/nothing"], ["monitor.metric=val/nothing", "val/loss"]),
    "a monitored metric that training does not log": (["monitor.metric=train/nothing"], ["monitor.metric=train/nothing", "val/loss"]),
    "no steps": (["trainer.max_steps=0"], ["trainer.max_steps=0", "trains nothing"]),
    "full-width numerals": (["trainer.max_epochs='\uff11\uff10'"], ["trainer.max_epochs", "ASCII numerals"]),
    "logging every 0 steps": (["trainer.log_every_n_steps=0"], ["trainer.log_every_n_steps=0"]),
    "accumulating 0 batches": (["trainer.accumulate_grad_batches=0"], ["accumulate_grad_batches=0"]),
    "negative gradient clip": (["trainer.gradient_clip_val=-1"], ["gradient_clip_val=-1"]),
    "batch limit above 1.0": (["trainer.limit_train_batches=1.5"], ["limit_train_batches=1.5", "fraction"]),
    "negative batch limit": (["trainer.limit_val_batches=-2"], ["limit_val_batches=-2"]),
    "no training batches": (["trainer.limit_train_batches=0"], ["limit_train_batches=0", "trains nothing"]),
    "no validation batches": (["trainer.limit_val_batches=0.0"], ["limit_val_batches=0.0", "validates nothing"]),
    "validating every 0 batches": (["trainer.val_check_interval=0"], ["val_check_interval=0", "1 or more"]),
    "validating every 1.5 epochs": (["trainer.val_check_interval=1.5"], ["val_check_interval=1.5", "fraction"]),
{%- if cookiecutter.examples != "language" %}
    "model_parallel for a model without configure_model": (["strategy=model_parallel", "trainer.strategy.data_parallel_size=1", "trainer.devices=1"], ["strategy=model_parallel needs", "ImageClassifier has none"]),
{%- endif %}
}  # fmt: skip


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_bad_train_input_gets_one_clear_error(
    case: str, train_config: ComposeFn, written: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides, fragments = TRAIN_CASES[case]
    before = snapshot(written)
    cfg = train_config(*SHORT_RUN, *(o.format(dir=written) for o in overrides))
    fails_with(train, cfg, capsys, *fragments)
    assert snapshot(written) == before, "a failing command changed files it did not own"
    assert not checkpoints(cfg), "nothing was trained"


def test_a_list_of_gpu_indices_is_taken_as_that_many_devices(train_config: ComposeFn) -> None:
    one, two = train_config("trainer.devices=[3]"), train_config("trainer.devices=[0,1]")
    for cfg in (one, two):
        check_run_settings(cfg)
        cfg.trainer.accelerator = "gpu"
    assert (gpus_per_node(_root_=one), gpus_per_node(_root_=two)) == (1, 2)
    assert not launches_ddp_subprocesses(one) and launches_ddp_subprocesses(two)


def test_a_slurm_job_needs_a_number_of_gpus_not_auto(tmp_path: Path) -> None:
    result = run_cli(
        "-m", PACKAGE, "-m", "hydra/launcher=slurm", "trainer=gpu", "trainer.devices=auto",
        "seed=1", cwd=tmp_path,
    )  # fmt: skip
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "trainer.devices=<GPUs per node>" in line, result.stderr
    assert not list(tmp_path.iterdir()), "nothing written"


def test_a_slurm_sweep_where_no_cluster_answers_is_one_line_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("sinfo", "sbatch", "squeue", "sacct"):  # as on a machine outside the cluster
        (tools / tool).write_text(
            "#!/bin/sh\necho 'slurm_load_partitions: Unable to contact slurm controller' >&2\n"
            "exit 1\n"
        )
        (tools / tool).chmod(0o755)
    path = f"{tools}{os.pathsep}{os.environ['PATH']}"
    work = tmp_path / "work"
    work.mkdir()
    result = run_cli(
        "-m", PACKAGE, "-m", "hydra/launcher=slurm", "trainer=cpu", "seed=11,12", cwd=work,
        env={"PATH": path},
    )  # fmt: skip
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "no SLURM cluster answers here" in line, result.stderr
    assert "Unable to contact slurm controller" in line
    assert not list(work.iterdir()), "nothing written"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine with no GPU")
def test_gpu_asked_for_without_one(
    train_config: ComposeFn, capsys: pytest.CaptureFixture[str]
) -> None:
    fails_with(train, train_config(*SHORT_RUN, "trainer=gpu"), capsys, "trainer=cpu")


EVAL_CASES = {
    "missing checkpoint": ("{dir}/nope.ckpt", ["does not exist"]),
    "corrupt checkpoint": ("{dir}/corrupt.ckpt", ["not a readable checkpoint"]),
    "a text file": ("{dir}/text.ckpt", ["not a readable checkpoint"]),
    "random bytes": ("{dir}/random.ckpt", ["not a readable checkpoint"]),
    "an empty file": ("{dir}/empty.ckpt", ["not a readable checkpoint"]),
    "a folder": ("{dir}", ["is a folder"]),
    "a folder holding no checkpoint": ("{dir}/unreadable", ["holds no checkpoint"]),
    "a device that never ends": ("/dev/zero", ["not a regular file"]),
    "checkpoint from elsewhere": ("{dir}/no_run_config.ckpt", ["no run_config"]),
    "a list, not a checkpoint": ("{dir}/a_list.ckpt", ["holds a list"]),
    "weights in a list": ("{dir}/weights_in_a_list.ckpt", ["no state_dict of named tensors"]),
    "weights that are not tensors": ("{dir}/weights_not_tensors.ckpt", ["no state_dict of named tensors"]),
    "NaN and infinite weights": ("{dir}/diverged.ckpt", ["NaN or infinite", "w, v"]),
    "run_config as text": ("{dir}/run_config_text.ckpt", ["malformed run_config"]),
    "run_config without a model": ("{dir}/run_config_no_model.ckpt", ["malformed run_config"]),
    "run_config with a dangling interpolation": ("{dir}/run_config_interpolation.ckpt", ["holds an interpolation or resolver", "not written by train"]),
    "run_config with a missing value": ("{dir}/run_config_missing_value.ckpt", ["holds a missing value (???)"]),
    "checkpoint naming code outside the allowlist": ("{dir}/evil_run_config.ckpt", ["os.system", "not allowed"]),
    "a loop of symbolic links": ("{dir}/loop_a.ckpt", ["loop of links"]),
    "a pickle, not a PyTorch checkpoint": ("{dir}/plain_pickle.ckpt", ["not a readable checkpoint (weights_only=True refused it)"]),
    "a name longer than the file system allows": ("{dir}/" + "a" * 300 + ".ckpt", ["longer than the file system allows"]),
    "a weight of another shape": ("{dir}/other_shape.ckpt", ["another model", "other shape"]),
    "a weight too many": ("{dir}/extra_weight.ckpt", ["another model", "unexpected: extra.weight"]),
    "a stored config claiming a model of terabytes": ("{dir}/huge_claim.ckpt", ["another model", "other shape"]),
    "a network built as a partial, holding no weights": ("{dir}/partial_net.ckpt", []),
    "the data config where the model's should be": ("{dir}/swapped_configs.ckpt", ["data._target_ in the run_config stored in ckpt_path=", "not a LightningDataModule"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_bad_eval_input_gets_one_clear_error(
    case: str,
    eval_config: ComposeFn,
    written: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    path, fragments = EVAL_CASES[case]
    before = snapshot(written)
    fails_with(evaluate, eval_config(f"ckpt_path={path.format(dir=written)}"), capsys, *fragments)
    assert snapshot(written) == before
    assert not (tmp_path / "pwned").exists(), "the checkpoint's code ran"


def test_adapters_naming_a_base_that_is_no_checkpoint_are_refused_without_reading_it(
    tmp_path: Path,
) -> None:
    """A fine-tuning checkpoint names the file of its frozen base weights, and eval, predict and
    export hash that file: a pipe or a device would block or never end, a folder that holds
    no shards would be hashed whole."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    (tmp_path / "folder").mkdir()
    for base in (pipe, Path("/dev/zero"), tmp_path / "folder"):
        named = {"path": str(base), "sha256": "0" * 64}
        checkpoint = {"base_weights": named}
        refusals: list[str] = []

        def load(checkpoint: dict[str, Any] = checkpoint, refusals: list[str] = refusals) -> None:
            try:
                load_base_weights(None, checkpoint, tmp_path / "adapters.ckpt")  # type: ignore[arg-type]
            except ConfigError as error:
                refusals.append(str(error))

        reader = threading.Thread(target=load, daemon=True)
        reader.start()
        reader.join(timeout=30)
        assert not reader.is_alive(), f"reading {base} did not end"
        assert len(refusals) == 1 and "is not a checkpoint" in refusals[0], refusals


SWITCHES_OF_COMMANDS = {
    "train": ["trust_checkpoint=maybe"],
    "eval": ["trust_checkpoint=maybe"],
    "predict": ["trust_checkpoint=maybe", "trainer=cpu", "prompt=x", "inputs=null"],
    "export": ["trust_checkpoint=maybe"],
}


@pytest.mark.parametrize("command", list(SWITCHES_OF_COMMANDS))
def test_a_switch_given_a_word_is_refused_not_taken_as_true(
    command: str, written: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:  # fmt: skip
    """`trust_checkpoint=maybe` is a word, which Python reads as true: it must not unpickle. The
    schema lets a switch hold any value (OmegaConf would read 2 or "on" as true), so the
    validation phase (run/settings.py SWITCHES) refuses it before the checkpoint is opened."""
    monkeypatch.chdir(tmp_path)
    overrides = [f"ckpt_path={written}/pickled.ckpt", *SWITCHES_OF_COMMANDS[command]]
    cfg = compose_config(command, overrides, tmp_path / command)
    task = {"train": train, "eval": evaluate, "predict": run_prediction, "export": run_export}
    line = fails_with(task[command], cfg, capsys)
    assert line == "error: trust_checkpoint='maybe': use true or false."
    assert not (tmp_path / command).exists(), "a refused run wrote its folder"


@pytest.mark.parametrize("command", ["predict", "export"])
@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_bad_checkpoints_for_predict_and_export_get_one_clear_error(
    command: str, case: str, written: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:  # fmt: skip
    """The same catalogue: both rebuild the model from the checkpoint as eval does."""
    monkeypatch.chdir(tmp_path)
    path, fragments = EVAL_CASES[case]
    before = snapshot(written)
    overrides = [f"ckpt_path={path.format(dir=written)}", "extras.print_config=false"]
    if command == "predict":
        overrides += ["trainer=cpu", "prompt=x", "inputs=null"]
    cfg = compose_config(command, overrides, tmp_path / command)
    task = run_prediction if command == "predict" else run_export
    fails_with(task, cfg, capsys, *fragments)
    assert snapshot(written) == before
    assert not (tmp_path / "pwned").exists(), "the checkpoint's code ran"


CLI_CASES = {
    "unknown option of a group": (["model=nope"], ["model", "nope"]),
    "unknown key": (["trainer.max_epoch=3"], ["trainer.max_epoch", "+trainer.max_epoch"]),
    "unknown group": (["optimiser=adam"], ["optimiser"]),
    "unparsable override": (["trainer.max_epochs=[1"], ["[1", "override_grammar"]),
    "a log folder behind a loop of links": (["paths.log_dir=loop_a/logs"], ["loop_a/logs", "leads back to itself"]),
    "an empty log folder": (["paths.log_dir="], ["paths.log_dir is empty"]),
    "an unknown flag": (["--bogus"], ["unrecognized arguments: --bogus", "--help"]),
    "a flag given a value it does not take": (["--cfg", "banana"], ["--cfg", "banana"]),
    "a package the config lacks": (["--cfg", "job", "-p", "nope.key"], ["nope.key", "--cfg job"]),
    "an empty run folder": (["hydra.run.dir=''"], ["hydra.run.dir is empty"]),
    "an empty output folder": (["paths.output_dir= "], ["paths.output_dir is empty"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_command_line_gets_a_clear_error_without_a_traceback(case: str, tmp_path: Path) -> None:
    args, fragments = CLI_CASES[case]
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    result = subprocess.run(
        [sys.executable, "-m", PACKAGE, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ")
    for fragment in fragments:
        assert fragment in line
    left = sorted(path.name for path in tmp_path.iterdir())
    assert left == ["loop_a", "loop_b"], "nothing was written"


OTHER_COMMAND_CASES = {
    "bench, a class that cannot be built": (
        ["-c", f"from {PACKAGE}.recipes.bench import main; main()", "trainer=cpu", "+model.net.bogus=1"],
        ["model.net", "bogus"],
    ),
    "bench, an unknown option": (
        ["-c", f"from {PACKAGE}.recipes.bench import main; main()", "model=nope"], ["model", "nope"],
    ),
    "doctor, a config that does not compose": (
        ["-c", f"import sys; from {PACKAGE}.recipes.doctor import main; sys.exit(main())", "model=nope"],
        ["the config does not compose", "nope"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(OTHER_COMMAND_CASES))
def test_bench_and_doctor_refuse_bad_input_in_one_line_and_write_nothing(
    case: str, tmp_path: Path
) -> None:
    args, fragments = OTHER_COMMAND_CASES[case]
    result = subprocess.run(
        [sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and all(fragment in line for fragment in fragments), line
    assert "warning:" not in result.stdout
    assert list(tmp_path.iterdir()) == [], "nothing was written"


def test_an_early_error_leaves_no_run_directory_behind(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", PACKAGE, "trainer=cpu", "seed=-1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: seed=-1: use a whole number from 0 to 4294967295, or null."
    ]
    assert list(tmp_path.iterdir()) == [], "the run directory Hydra made is gone"


def test_eval_without_a_checkpoint_says_which_key_is_missing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", f"from {PACKAGE}.cli import evaluate; evaluate()"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: ckpt_path must be set: add e.g. ckpt_path=... to the command."
    ]


NAN_AT_STEP_5 = [
    "allowed_targets=[tests.faults.NanGradientAt]",
    "+callbacks.nan._target_=tests.faults.NanGradientAt",
    "+callbacks.nan.steps=[5]",
]


def assert_all_checkpoints_finite(cfg: DictConfig) -> None:
    for path in checkpoints(cfg):
        state = torch.load(path, weights_only=True)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(
    train_config: ComposeFn, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second checkpoint write fails as a full disk fails it (ENOSPC, half-way through)."""
    cfg = train_config(*SHORT_RUN, "callbacks.step_checkpoint.every_n_train_steps=2")
    real_save, writes = torch.save, []

    def save(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
        writes.append(file)
        if len(writes) == 2:
            file.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(checkpoints_module.torch, "save", save)
    line = fails_with(train, cfg, capsys, "No space left on device", "free space")
    assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setattr(checkpoints_module.torch, "save", real_save)
    (kept,) = checkpoints(cfg)
    torch.load(kept, weights_only=True)  # the previous checkpoint, whole
    assert not list(kept.parent.glob(".*tmp*")), f"no partial file left ({line})"


@pytest.mark.parametrize("allocator", ["cuda", "cpu"])
def test_out_of_memory_is_one_line_of_advice_and_keeps_the_checkpoints(
    allocator: str, train_config: ComposeFn, capsys: pytest.CaptureFixture[str]
) -> None:
    """The error PyTorch raises for a full device, at step 3, after the step-2 checkpoint."""
    cfg = train_config(
        *SHORT_RUN, "callbacks.step_checkpoint.every_n_train_steps=2",
        "+callbacks.oom._target_=tests.faults.OutOfMemoryAt", "+callbacks.oom.at=3",
        f"+callbacks.oom.allocator={allocator}", "allowed_targets=[tests.faults.OutOfMemoryAt]",
    )  # fmt: skip
    batch = cfg.data.batch_size
    line = fails_with(
        train, cfg, capsys, f"out of memory on cpu with data.batch_size={batch} per device",
        f"data.batch_size={batch // 2} trainer.accumulate_grad_batches=2", "GiB of",
        SHARDING_ADVICE, "bench.find_batch_size=true", str(cfg.paths.output_dir),
    )  # fmt: skip
    assert "Traceback" not in capsys.readouterr().err
    (kept,) = checkpoints(cfg)
    assert torch.load(kept, weights_only=True)["global_step"] == 2, line
{%- if cookiecutter.examples == "language" %}


def test_an_unreadable_data_folder_is_named(
    train_config: ComposeFn, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:  # fmt: skip
    """A subfolder of the corpus that cannot be listed (as `chmod 000` makes it for a user other
    than root) is an error naming it, not a corpus with fewer files or "no bytes"."""
    corpus = tmp_path / "corpus"
    (corpus / "closed").mkdir(parents=True)
    (corpus / "open.txt").write_text("some text " * 1000)
    real_scandir = os.scandir

    def scandir(path: Any = ".") -> Any:
        if isinstance(path, (str, os.PathLike)) and Path(path) == corpus / "closed":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    cfg = train_config(*SHORT_RUN, f"data.source={corpus}")
    fails_with(train, cfg, capsys, "cannot read", "closed", "Permission denied")
{%- endif %}


def test_nan_gradient_stops_the_run_naming_the_step(train_config: ComposeFn) -> None:
    cfg = train_config(
        *SHORT_RUN, *NAN_AT_STEP_5, "callbacks.step_checkpoint.every_n_train_steps=2"
    )
    with pytest.raises(TrainingError, match="at step 5"):
        train(cfg)
    assert_all_checkpoints_finite(cfg)
    assert newest_valid_checkpoint(Path(cfg.paths.output_dir) / "checkpoints") is not None


def test_nan_gradient_is_skipped_when_asked(train_config: ComposeFn) -> None:
    cfg = train_config(*SHORT_RUN, *NAN_AT_STEP_5, "callbacks.non_finite.action=skip")
    metrics = train(cfg)
    assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values())
    assert_all_checkpoints_finite(cfg)


def test_too_many_skipped_steps_stop_the_run(train_config: ComposeFn) -> None:
    cfg = train_config(
        *SHORT_RUN, *NAN_AT_STEP_5[:2], "+callbacks.nan.steps=[1,2,3,4,5]",
        "callbacks.non_finite.action=skip", "callbacks.non_finite.max_skipped=3",
    )  # fmt: skip
    with pytest.raises(TrainingError, match="max_skipped=3"):
        train(cfg)
    assert_all_checkpoints_finite(cfg)
