"""Experiment trackers, read back with their own code: W&B offline run files (wandb's protobuf
records), MLflow's client on the local store. Each job of a multirun is a tracker run of its own;
eval and predict are runs of their own, linked to the training run. No server anywhere."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from {{ cookiecutter.package_name }}.run.checks import (
    check_config,
)

from .helpers import PACKAGE, PROJECT_ROOT, compose_config, run_cli

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

QUICK = ["trainer=cpu", "extras.print_config=false", "callbacks.progress_bar=null"]
{%- if cookiecutter.examples == "language" %}
TINY = [*QUICK, "model.net.n_layer=1", "data.max_bytes=100000", "trainer.max_steps=4",
        "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]  # fmt: skip
PREDICT = ["prompt=Hello", "max_new_tokens=4", "stream=false"]
{%- else %}
TINY = [*QUICK, "trainer.max_epochs=1", "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]  # fmt: skip
PREDICT = ["inputs=test"]
{%- endif %}
OFFLINE = {"WANDB_MODE": "offline"}


# wandb writes a run as a LevelDB-style log of protobuf records (its `Record` message): 32 KiB
# blocks, a 7-byte file header (":W&B", 0xBEE1, version 0), and a 7-byte header per chunk
# (checksum, length, type: 1 whole, 2 first, 3 middle, 4 last, 0 padding).
BLOCK, HEADER = 32768, 7


def wandb_records(run_file: Path) -> list[Any]:
    """Every record of an offline run file, parsed with wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert struct.unpack("<4sHB", data[:HEADER]) == (b":W&B", 0xBEE1, 0)
    records, pending, offset = [], b"", HEADER
    while offset + HEADER <= len(data):
        space = BLOCK - offset % BLOCK
        if space < HEADER:
            offset += space
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        if kind == 0:
            break
        pending += data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def settled_records(run_file: Path, seconds: float = 60) -> list[Any]:
    """The run file's records once wandb's writer (a process of its own) has written its run
    record and stopped growing the file: on a loaded machine it may still be writing when
    `wandb.finish` returns. Waits at most `seconds`; a file that never settles is read as it is."""
    deadline = time.monotonic() + seconds
    while True:
        size = run_file.stat().st_size
        if time.monotonic() > deadline:
            return wandb_records(run_file)
        try:
            records = wandb_records(run_file)
        except Exception:  # a record half written
            records = []
        has_run = any(record.WhichOneof("record_type") == "run" for record in records)
        time.sleep(0.2)
        if has_run and run_file.stat().st_size == size:
            return records


class WandbRun:
    """One offline run file: its run record, its config and its history, as wandb wrote them."""

    def __init__(self, run_file: Path) -> None:
        self.records = settled_records(run_file)
        kinds = [record.WhichOneof("record_type") for record in self.records]
        assert kinds.count("run") == 1, "one run per run file"
        typed = list(zip(kinds, self.records, strict=True))
        self.run = next(record.run for kind, record in typed if kind == "run")
        self.artifacts = [record.artifact for kind, record in typed if kind == "artifact"]
        self.config: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        for kind, record in typed:
            if kind == "config":
                self.config |= {i.key: json.loads(i.value_json) for i in record.config.update}
            elif kind == "history":
                self.history.append({
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                })  # fmt: skip

    def logged(self, key: str) -> list[Any]:
        return [row[key] for row in self.history if key in row]


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def job_dirs(cwd: Path) -> list[Path]:
    (sweep,) = (cwd / "logs" / "train" / "multiruns").iterdir()
    return sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def assert_one_run_per_job(cwd: Path, rates: list[float]) -> list[str]:
    """Each job: one wandb run of its own id, named by its overrides, grouped by the sweep's
    folder, tagged with the config's tags, holding its own learning rate and its own history."""
    jobs = job_dirs(cwd)
    assert len(jobs) == len(rates)
    ids = []
    for job, rate in zip(jobs, rates, strict=True):
        (run_file,) = offline_runs(job)
        run = WandbRun(run_file)
        run_id = (job / "wandb_run_id.txt").read_text().strip()
        assert run.run.run_id == run_id and run_file.name == f"run-{run_id}.wandb"
        assert run.run.run_group == job.parent.name and run.run.job_type == "train"
        assert f"model.optimizer.lr={rate}" in run.run.display_name
        overrides = json.loads((job / "run_overrides.json").read_text())
        assert overrides and all(str(o) in run.run.display_name for o in overrides)
        assert list(run.run.tags) == run.config["tags"] and run.config["tags"]
        assert run.config["model"]["optimizer"]["lr"] == rate
        assert len(run.logged("val/loss")) == 1 and len(run.logged("test/loss")) == 1
        assert json.loads((job / "tracking.json").read_text())["wandb"] == run_id
        ids.append(run_id)
    assert len(set(ids)) == len(ids), "no job inherits another's run id"
    return ids


@pytest.mark.slow
def test_each_job_of_a_multirun_is_its_own_wandb_run_and_a_resumed_job_continues_it(
    tmp_path: Path,
) -> None:
    """Hydra's basic launcher runs the jobs one after the other in one process: wandb's global
    run of the first job was reused by the second (its history in the first job's file)."""
    sweep = ["-m", PACKAGE, "-m", *TINY, "logger=wandb", "model.optimizer.lr=0.001,0.003"]
    result = run_cli(*sweep, cwd=tmp_path, env=OFFLINE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "already in progress" not in result.stdout + result.stderr
    first, second = assert_one_run_per_job(tmp_path, [0.001, 0.003])

    jobs = job_dirs(tmp_path)
    (jobs[0] / "metrics.json").unlink()  # resumed from its finished checkpoint: tests again
    again = run_cli(*sweep, cwd=tmp_path, env=OFFLINE)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = offline_runs(jobs[0])
    assert len(resumed) == 2 and {WandbRun(p).run.run_id for p in resumed} == {first}
    assert [p.name for p in offline_runs(jobs[1])] == [f"run-{second}.wandb"], "finished: no run"


@pytest.mark.slow
def test_parallel_joblib_jobs_are_wandb_runs_of_their_own(tmp_path: Path) -> None:
    """Three jobs on two joblib workers: a worker process runs two jobs, one after the other."""
    launcher = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    rates = ["model.optimizer.lr=0.001,0.002,0.003"]
    result = run_cli("-m", PACKAGE, "-m", *TINY, "logger=wandb", *launcher, *rates,
                     cwd=tmp_path, env=OFFLINE)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert_one_run_per_job(tmp_path, [0.001, 0.002, 0.003])


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_jobs_are_wandb_runs_of_their_own(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    result = run_cli(
        "-m", PACKAGE, "-m", "hydra/launcher=slurm", *TINY, "logger=wandb",
        "model.optimizer.lr=0.001,0.003", cwd=tmp_path, env={**slurm_cluster, **OFFLINE},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert_one_run_per_job(tmp_path, [0.001, 0.003])


@pytest.mark.slow
def test_eval_and_predict_are_wandb_runs_linked_to_the_training_run(tmp_path: Path) -> None:
    """Their own runs (and ids), in the training run's group, the training run's id in their
    config; with log_model=true the training run uploads its checkpoints as artifacts."""
    trained = run_cli("-m", PACKAGE, *TINY, "logger=wandb", "logger.wandb.log_model=true",
                      cwd=tmp_path, env=OFFLINE)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    (run_file,) = offline_runs(run_dir)
    training = WandbRun(run_file)
    assert training.run.run_group == run_dir.name
    uploaded = [a for a in training.artifacts if a.type == "model"]
    assert uploaded and all(a.manifest.contents for a in uploaded), "checkpoints as artifacts"
    checkpoint = run_dir / "checkpoints" / "last.ckpt"

    for command, extra in (("evaluate", []), ("predict", PREDICT)):
        result = run_cli(
            "-c", f"from {PACKAGE}.cli import {command}; {command}()", "trainer=cpu", "logger=wandb",
            f"ckpt_path={checkpoint}", *extra, cwd=tmp_path, env=OFFLINE,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        task = "eval" if command == "evaluate" else "predict"
        (own_dir,) = (tmp_path / "logs" / task / "runs").iterdir()
        (own_file,) = offline_runs(own_dir)
        own = WandbRun(own_file)
        assert own.run.run_id != training.run.run_id and own.run.job_type == task
        assert own.run.run_group == training.run.run_group
        assert own.config["trained_run"]["wandb"] == training.run.run_id
        assert own.config["trained_run"]["checkpoint"] == str(checkpoint)
        metric = "test/loss" if task == "eval" else "predict/count"
        assert own.logged(metric), f"{task} logged {metric}"


def mlflow_runs(tracking_uri: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = client.search_experiments()
    return list(client.search_runs([e.experiment_id for e in experiments]))


@pytest.mark.slow
def test_mlflow_runs_with_csv_beside_them_then_eval_as_a_child_run(tmp_path: Path) -> None:
    """`logger=[csv,mlflow]`: both write; MLflow's own client reads the local SQLite store: the
    run's name, tags, parameters and metric history; an eval run under the training run; the
    same command again continues the same MLflow run."""
    from mlflow.tracking import MlflowClient

    train = ["-m", PACKAGE, *TINY, "logger=[csv,mlflow]"]
    trained = run_cli(*train, cwd=tmp_path, env=OFFLINE)
    assert trained.returncode == 0, trained.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    assert "val/loss" in (run_dir / "csv" / "metrics.csv").read_text()
    uri = f"sqlite:///{tmp_path / 'logs' / 'mlflow' / 'mlflow.db'}"
    (run,) = mlflow_runs(uri)
    assert run.info.run_id == json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    assert run.info.status == "FINISHED"
    assert "logger=[csv,mlflow]" in run.info.run_name and "trainer=cpu" in run.info.run_name
    assert run.data.tags["group"] == run_dir.name and run.data.tags["job_type"] == "train"
    tags = compose_config("train", [*TINY, "logger=csv"], tmp_path / "composed").tags
    assert set(tags) <= set(run.data.tags)
    assert run.data.params["trainer/max_epochs"] or run.data.params["trainer/max_steps"]
    client = MlflowClient(uri)
    assert len(client.get_metric_history(run.info.run_id, "val/loss")) == 1

    (run_dir / "metrics.json").unlink()  # tests again, in the same MLflow run
    again = run_cli(*train, cwd=tmp_path, env=OFFLINE)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r.info.run_id for r in mlflow_runs(uri)] == [run.info.run_id]
    assert len(client.get_metric_history(run.info.run_id, "test/loss")) == 2

    evaluated = run_cli(
        "-c", f"from {PACKAGE}.cli import evaluate; evaluate()", "trainer=cpu", "logger=mlflow",
        f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", cwd=tmp_path, env=OFFLINE,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (child,) = [r for r in mlflow_runs(uri) if r.info.run_id != run.info.run_id]
    assert child.data.tags["mlflow.parentRunId"] == run.info.run_id
    assert child.data.tags["job_type"] == "eval" and child.data.tags["group"] == run_dir.name
    assert client.get_metric_history(child.info.run_id, "test/loss")


def test_every_logger_composes_in_every_bake_and_combines(tmp_path: Path) -> None:
    """The bake's answer picks only the default: every tracker's config is there."""
    for logger in ("csv", "tensorboard", "wandb", "mlflow", "none", "[csv,mlflow,wandb]"):
        cfg = compose_config("train", [*QUICK, f"logger={logger}"], tmp_path)
        names = set(cfg.logger or {})
        assert names == ({"csv", "mlflow", "wandb"} if "," in logger else
                         set() if logger == "none" else {logger})  # fmt: skip
    cfg = compose_config("train", ["logger=mlflow"], tmp_path)
    assert cfg.logger.mlflow.tracking_uri == f"sqlite:///{tmp_path}/logs/mlflow/mlflow.db"


def test_mlflow_tracking_uri_from_the_environment_or_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    cfg = compose_config("train", ["logger=mlflow"], tmp_path)
    assert cfg.logger.mlflow.tracking_uri == "http://tracking.example:5000"
    given = ["logger=mlflow", "logger.mlflow.tracking_uri=sqlite:////data/mlflow.db"]
    cfg = compose_config("train", given, tmp_path)
    assert cfg.logger.mlflow.tracking_uri == "sqlite:////data/mlflow.db"


def test_a_tracker_whose_package_is_missing_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.loggers import mlflow
    from lightning_utilities.core.imports import RequirementCache

    from {{ cookiecutter.package_name }}.errors import ConfigError
    from {{ cookiecutter.package_name }}.loggers import (
        instantiate_loggers,
    )

    monkeypatch.setattr(mlflow, "_MLFLOW_AVAILABLE", RequirementCache("mlflow>=999"))
    cfg = compose_config("train", [*QUICK, "logger=mlflow"], tmp_path)
    with pytest.raises(ConfigError) as refused:
        instantiate_loggers(cfg.logger, check_config(cfg).tracked)
    assert str(refused.value).startswith("logger.mlflow needs the mlflow-skinny package")
    assert "pip install -e '.[mlflow]'" in str(refused.value)


def test_a_wandb_run_left_open_by_an_earlier_job_is_finished_before_the_next_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process (the basic launcher, a joblib worker), job after job."""
    import wandb

    from {{ cookiecutter.package_name }}.loggers import (
        finish_loggers,
        instantiate_loggers,
    )

    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    ids = []
    for job in ("a", "b"):
        cfg = compose_config("train", [*QUICK, "logger=wandb"], tmp_path / job)
        (logger,) = instantiate_loggers(cfg.logger, check_config(cfg).tracked)
        logger.log_metrics({"x": 1.0}, step=0)  # starts the run
        assert wandb.run is not None and wandb.run.id == logger.experiment.id
        ids.append(wandb.run.id)
        if job == "b":
            finish_loggers([logger], failed=False)
    assert ids[0] != ids[1] and wandb.run is None
    for job, run_id in zip("ab", ids, strict=True):
        assert [WandbRun(p).run.run_id for p in offline_runs(tmp_path / job / "run")] == [run_id]


def test_the_wandb_sweep_file_makes_train_commands_that_compose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command wandb's own agent builds from sweeps/wandb.yaml (its `_command_run`, with the
    process it would start caught), for values the sweep could pick; the train command accepts
    exactly those arguments (`--cfg job`: composed, nothing trained). What needs a W&B server
    (`wandb sweep`, the agent asking for runs) is not run here."""
    from wandb import wandb_agent

    sweep = yaml.safe_load((PROJECT_ROOT / "sweeps" / "wandb.yaml").read_text())
    assert "${args_no_hyphens}" in sweep["command"]
    lr = sweep["parameters"]["model.optimizer.lr"]
    picked = {
        "model.optimizer.lr": {"value": lr["min"]},
        "data.batch_size": {"value": sweep["parameters"]["data.batch_size"]["values"][-1]},
    }
    started: list[list[str]] = []

    class Caught:
        def __init__(self, command: list[str], **kwargs: Any) -> None:
            started.append(command)

    monkeypatch.setattr(wandb_agent, "AgentProcess", Caught)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep1")
    agent = wandb_agent.Agent.__new__(wandb_agent.Agent)
    agent._sweep_command, agent._function, agent._in_jupyter = sweep["command"], None, False
    agent._forward_signals, agent._run_processes = False, {}
    agent._command_run({"run_id": "trial1", "program": sweep["program"], "args": picked})
    (command,) = started
    assert command[:2] == ["/usr/bin/env", f"{PACKAGE}-train"]
    args = command[2:]
    assert args == ["logger=wandb", f"model.optimizer.lr={lr['min']}", "data.batch_size=128"]

    composed = subprocess.run(
        [sys.executable, "-m", PACKAGE, *args, "--cfg", "job"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "WANDB_MODE": "offline"},
    )  # fmt: skip
    assert composed.returncode == 0, composed.stderr[-2000:]
    cfg = yaml.safe_load(composed.stdout)
    assert cfg["model"]["optimizer"]["lr"] == lr["min"] and cfg["data"]["batch_size"] == 128
    assert list(cfg["logger"]) == ["wandb"]


def test_under_a_wandb_sweep_agent_the_run_takes_the_agents_run_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent starts the command with WANDB_SWEEP_ID and WANDB_RUN_ID: the trial reports to
    that run, and its run directory records it."""
    from {{ cookiecutter.package_name }}.loggers import (
        describe_run,
        prepare_wandb,
    )

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep1")
    monkeypatch.setenv("WANDB_RUN_ID", "agentsrun1")
    cfg = compose_config("train", [*QUICK, "logger=wandb"], tmp_path)
    node = cfg.logger.wandb
    prepare_wandb(node, describe_run(check_config(cfg).tracked))
    assert node.id == "agentsrun1"
    assert (Path(cfg.paths.output_dir) / "wandb_run_id.txt").read_text().strip() == "agentsrun1"
