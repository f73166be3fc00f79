"""Strategies with several processes, multirun launchers, the sweep summary, and Optuna searches.
Each runs the real command line in a subprocess, on CPU with gloo."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from {{ cookiecutter.package_name }}.sweeps.report import (
    best_job,
    draw_summary,
    short_labels,
    significant,
)
from {{ cookiecutter.package_name }}.sweeps.summary import (
    collect_jobs,
)

from .helpers import PACKAGE, PROJECT_ROOT, ComposeFn, run_cli
from .killing import (
    FAULT_TARGETS,
    SMALL_RUN,
    assert_equal,
    assert_same_outcome,
    fault,
    killed_then_finished,
    read_last,
)
from .killing import run as run_killable

QUICK = ["trainer=cpu", "logger=csv", "extras.print_config=false", "trainer.max_epochs=2"]
EVAL_METRICS = ("val/loss", "test/loss")


def read(path: Path) -> dict[str, float]:
    return dict(json.loads(path.read_text()))


def assert_picture(path: Path) -> None:
    """A PNG that opens, of a size a person can read."""
    from PIL import Image

    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        width, height = image.size
        assert image.format == "PNG" and 500 <= width <= 3000 and 150 <= height <= 5000


def summary_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "summary.csv").open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_ddp_and_ddp_spawn_train_two_processes_into_one_run_dir(tmp_path: Path) -> None:
    results = {}
    for strategy in ("ddp", "ddp_spawn"):
        run_dir = tmp_path / strategy
        result = run_cli(
            "-m", PACKAGE, f"strategy={strategy}", "trainer.devices=2", *QUICK,
            f"hydra.run.dir={run_dir}", cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert list((run_dir / "checkpoints").glob("best-*.ckpt"))
        results[strategy] = read(run_dir / "metrics.json")
        for rank_file in run_dir.glob("metrics-rank*.json"):
            per_rank = read(rank_file)
            for name in EVAL_METRICS:
                assert per_rank[name] == pytest.approx(results[strategy][name], rel=1e-6)
    assert len(list((tmp_path / "ddp").glob("metrics-rank*.json"))) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp", "ddp_spawn"], "no stray run dirs"
    for name in EVAL_METRICS:
        assert results["ddp"][name] == pytest.approx(results["ddp_spawn"][name], rel=1e-5)


def test_fsdp_config_builds_its_strategy(train_config: ComposeFn) -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = instantiate(train_config("strategy=fsdp").trainer.strategy)
    assert isinstance(strategy, FSDPStrategy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP needs CUDA")
def test_fsdp_trains_on_gpu(tmp_path: Path) -> None:
    result = run_cli(
        "-m", PACKAGE, "strategy=fsdp", "trainer=gpu", "trainer.devices=1", "logger=csv",
        "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP needs CUDA")
def test_fsdp_continues_and_evaluates_a_checkpoint_through_the_door_on_gpu(
    tmp_path: Path,
) -> None:
    """FSDP's own reader of a whole-file checkpoint unpickles without restriction; under this
    project it is the door's (`checkpointing.door`), on the GPU as on the CPU."""
    first = tmp_path / "first"
    common = ["strategy=fsdp", "trainer=gpu", "trainer.devices=1", "logger=csv"]
    result = run_cli(
        "-m", PACKAGE, *common, "trainer.max_epochs=1", f"hydra.run.dir={first}", cwd=tmp_path
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    last = first / "checkpoints" / "last.ckpt"
    result = run_cli(
        "-m", PACKAGE, *common, "trainer.max_epochs=2", f"ckpt_path={last}",
        f"hydra.run.dir={tmp_path / 'second'}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    steps = read_last(last)["global_step"]
    assert read_last(tmp_path / "second" / "checkpoints" / "last.ckpt")["global_step"] > steps
    evaluate = ["-c", f"from {PACKAGE}.cli import evaluate; evaluate()", f"ckpt_path={last}"]
    result = run_cli(*evaluate, "trainer=gpu", f"hydra.run.dir={tmp_path / 'eval'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
{%- if cookiecutter.examples != "vision" %}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_folder_of_shards_continues_and_evaluates_through_the_door_on_gpu(
    tmp_path: Path,
) -> None:
    """FSDP2 on one GPU (NCCL): a folder of shards read back by the door's storage reader."""
    first = tmp_path / "first"
    common = [
        "experiment=language", "strategy=model_parallel", "trainer.strategy.data_parallel_size=1",
        "trainer=gpu", "trainer.devices=1", "logger=csv", "model.net.n_layer=2",
        "trainer.val_check_interval=5", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
    ]  # fmt: skip
    result = run_cli(
        "-m", PACKAGE, *common, "trainer.max_steps=10", f"hydra.run.dir={first}", cwd=tmp_path
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    last = first / "checkpoints" / "last.ckpt"
    assert (last / ".metadata").is_file()
    result = run_cli(
        "-m", PACKAGE, *common, "trainer.max_steps=20", f"ckpt_path={last}",
        f"hydra.run.dir={tmp_path / 'second'}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_last(tmp_path / "second" / "checkpoints" / "last.ckpt")["global_step"] == 20
    evaluate = ["-c", f"from {PACKAGE}.cli import evaluate; evaluate()", f"ckpt_path={last}"]
    result = run_cli(*evaluate, "trainer=gpu", f"hydra.run.dir={tmp_path / 'eval'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_fsdp2_model_parallel_on_two_cpu_processes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(
        "-m", PACKAGE, "experiment=language", "strategy=model_parallel",
        "trainer.strategy.data_parallel_size=2", "trainer.devices=2", *QUICK,
        "trainer.max_steps=10", "trainer.val_check_interval=5", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2", "model.net.n_layer=2", f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]
    state = read_last(last)["state_dict"]
    assert state and all(isinstance(value, torch.Tensor) for value in state.values())
{%- endif %}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])  # basic: the test below
def test_sweep_runs_on_each_launcher_and_is_summarized(tmp_path: Path, launcher: str) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "-m", PACKAGE, "--multirun", f"hydra/launcher={launcher}", *QUICK, "model.optimizer.lr=0.001,0.003",
        f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = summary_rows(sweep_dir)
    assert [row["overrides"] for row in rows] == [
        "model.optimizer.lr=0.001",
        "model.optimizer.lr=0.003",
    ]
    for row in rows:
        assert row["status"] == "COMPLETED"
        metric = next(key for key in row if key.startswith("val/"))
        from_job = read(Path(row["run_dir"]) / "metrics.json")[metric]
        assert float(row[metric]) == pytest.approx(from_job)
    assert (sweep_dir / "summary.md").read_text().count("COMPLETED") == 2
    assert_picture(sweep_dir / "summary.png")


@pytest.mark.slow
def test_failed_job_is_named_the_others_run_and_the_same_command_resumes_the_sweep(
    tmp_path: Path,
) -> None:
    command = ["-m", PACKAGE, "--multirun", *QUICK, "data.batch_size=0,32"]
    first = run_cli(*command, cwd=tmp_path)
    assert first.returncode == 1
    output = first.stdout + first.stderr
    assert "Job #0 (" in output and "data.batch_size=0" in output
    (sweep_dir,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    failed, completed = summary_rows(sweep_dir)
    assert (failed["status"], completed["status"]) == ("FAILED", "COMPLETED")
    metric = next(key for key in completed if key.startswith("val/"))
    from_job = read(tmp_path / completed["run_dir"] / "metrics.json")[metric]
    assert float(completed[metric]) == pytest.approx(from_job)
    summary = (sweep_dir / "summary.md").read_text()
    assert summary.count("FAILED") == 1 and summary.count("COMPLETED") == 1

    again = run_cli(*command, cwd=tmp_path)
    assert again.returncode == 1
    assert [p.name for p in (tmp_path / "logs" / "train" / "multiruns").iterdir()] == [
        sweep_dir.name
    ], "the same sweep command uses the same sweep directory"
    assert "This run already finished" in again.stdout + again.stderr


def test_ddp_inside_a_multirun_is_refused_before_any_job(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "-m", PACKAGE, "--multirun", "strategy=ddp", "trainer.devices=2", *QUICK,
        "model.optimizer.lr=0.001,0.003", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    assert "strategy=ddp_spawn" in result.stderr
    assert not sweep_dir.exists()
{%- if cookiecutter.examples == "language" %}


SEARCH = "hparams_search=language_optuna"
PINNED = ["model.optimizer.weight_decay=0.1", "model.scheduler.warmup_steps=10"]
SHORT_RUN = [
    "trainer.max_steps=20", "trainer.val_check_interval=10", "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2", "model.net.n_layer=1", "data.max_bytes=200000",
]  # fmt: skip
{%- else %}


SEARCH = "hparams_search=digits_optuna"
PINNED = ["data.batch_size=64", "model.net.dropout=0.1"]
SHORT_RUN = ["trainer.max_epochs=3"]
{%- endif %}


@pytest.mark.slow
def test_optuna_study_is_continued_only_by_the_same_command(tmp_path: Path) -> None:
    """The same command extends its study with new parameters, each trial in a directory of its
    own (a trial left running without the search's parameters is marked failed); another
    command makes another study, whose
    pruned trials are reported as pruned, not failed."""
    import optuna

    storage = f"sqlite:///{tmp_path / 'optuna' / 'search.db'}"

    def search(n_trials: int, lr_range: str, prune_after: int, sweep: str) -> optuna.Study:
        result = run_cli(
            "-m", PACKAGE, "--multirun", SEARCH, *PINNED, f"model.optimizer.lr={lr_range}",
            f"hydra.sweeper.n_trials={n_trials}", f"hydra.sweeper.storage={storage}",
            "hydra.sweeper.study_name=search", f"hydra.sweeper.pruner.n_startup_trials={prune_after}",
            *QUICK, *SHORT_RUN, f"hydra.sweep.dir={tmp_path / sweep}",
            cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        results = OmegaConf.load(tmp_path / sweep / "optimization_results.yaml")
        return optuna.load_study(study_name=str(results.study_name), storage=storage)

    def states(study: optuna.Study) -> list[str]:
        return [trial.state.name for trial in study.get_trials(deepcopy=False)]

    first = search(2, "interval(0.002,0.004)", prune_after=10, sweep="a")
    assert states(first) == ["COMPLETE", "COMPLETE"]
    first.ask()  # left running, with none of the search's parameters
    again = search(3, "interval(0.002,0.004)", prune_after=10, sweep="a")
    assert again.study_name == first.study_name, "the same command continues its study"
    assert states(again) == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE"]
    done = again.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    assert len({trial.params["model.optimizer.lr"] for trial in done}) == 3, "new parameters"
    rows = summary_rows(tmp_path / "a")
    assert [row["job"] for row in rows] == ["0", "1", "3"], "one directory per trial number"
    for row in rows:
        assert row["status"] == "COMPLETED"
        assert (Path(row["run_dir"]) / "metrics.json").is_file()

    hopeless = "interval(0.0000001,0.0000002)"
    other = search(1, hopeless, prune_after=1, sweep="b")
    assert other.study_name != first.study_name, "another search never joins the first"
    assert len(again.get_trials(deepcopy=False)) == 4
    # A finished trial far ahead at every step: the next hopeless one falls below the median.
    best = 1.0 if other.direction == optuna.study.StudyDirection.MAXIMIZE else 0.0
    ahead = {step: best for step in range(5000)}
    other.add_trial(optuna.trial.create_trial(value=best, intermediate_values=ahead))
    other = search(3, hopeless, prune_after=1, sweep="b")
    assert states(other) == ["COMPLETE", "COMPLETE", "PRUNED"], "a hopeless trial is pruned"
    assert [row["status"] for row in summary_rows(tmp_path / "b")] == ["COMPLETED", "PRUNED"]
    assert not (tmp_path / "a" / "param_importances.png").exists(), "3 trials rank nothing"
    for picture in ("summary.png", "optimization_history.png"):
        assert_picture(tmp_path / "a" / picture)


@pytest.mark.slow
def test_a_search_killed_in_every_trial_ends_as_one_never_stopped(tmp_path: Path) -> None:
    """Each trial is killed (SIGKILL to the whole group) once mid-training; after each kill the
    same command resumes the killed trial in its folder. The study holds the same trials,
    parameters and values, and each trial the same weights and metrics, as a search that was
    never stopped."""
    import optuna

    # Quoted: the comma is oc.select's, not a sweep's. The search checks its settings first,
    # where no trial has a number yet.
    marker = Path("'killed-" + "${oc.select:optuna_trial.number,none}'")
    command = [
        "--multirun", SEARCH, *QUICK, *SHORT_RUN, "callbacks.step_checkpoint.every_n_train_steps=4",
        "model.optimizer.lr=interval(0.001,0.01)", "hydra.sweeper.n_trials=2",
        "hydra.sweeper.storage=sqlite:///search.db",
        "hydra.sweeper.study_name=search", "hydra.sweeper.pruner.n_startup_trials=10",
        "hydra.sweep.dir=sweep", FAULT_TARGETS, *fault("train_step", 6, marker),
    ]  # fmt: skip
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    for number in range(2):  # its faults have fired already: it runs through
        (reference / f"killed-{number}").touch()
    code, output = run_killable(command, reference)
    assert code == 0, output[-3000:]
    killed_then_finished(command, killed, kills=2)

    def trials(cwd: Path) -> list[tuple[str, dict[str, object], float | None]]:
        study = optuna.load_study(study_name=None, storage=f"sqlite:///{cwd / 'search.db'}")
        return [(t.state.name, t.params, t.value) for t in study.get_trials(deepcopy=False)]

    assert [state for state, _, _ in trials(reference)] == ["COMPLETE"] * 2
    assert trials(killed) == trials(reference)
    for number in range(2):
        expected, got = (cwd / "sweep" / str(number) for cwd in (reference, killed))
        for key in ("state_dict", "optimizer_states", "global_step"):
            assert_equal(
                read_last(expected / "checkpoints" / "last.ckpt")[key],
                read_last(got / "checkpoints" / "last.ckpt")[key],
                f"trial {number}: {key}",
            )
        metrics = [
            {
                k: v
                for k, v in json.loads((run / "metrics.json").read_text()).items()
                if "perf/" not in k
            }
            for run in (expected, got)
        ]
        assert metrics[0] == metrics[1], f"trial {number}"
    rows = [
        [(row["job"], row["overrides"], row["status"]) for row in summary_rows(cwd / "sweep")]
        for cwd in (reference, killed)
    ]
    assert rows[0] == rows[1]


@pytest.mark.slow
def test_a_basic_sweep_killed_in_every_job_ends_as_one_never_stopped(tmp_path: Path) -> None:
    """Each job of a two-job grid is killed (SIGKILL to the whole group, the sweep with it) once
    mid-training; the same command then resumes the killed job and skips the finished one. Each
    job ends with the weights, optimizer state, steps and metrics of a sweep never stopped."""
    marker = Path("'killed-" + "${seed}'")
    command = [
        "--multirun", *QUICK, *SHORT_RUN, "callbacks.step_checkpoint.every_n_train_steps=4",
        "seed=1,2", "hydra.sweep.dir=sweep", FAULT_TARGETS, *fault("train_step", 6, marker),
    ]  # fmt: skip
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    for seed in (1, 2):  # its faults have fired already: it runs through
        (reference / f"killed-{seed}").touch()
    code, output = run_killable(command, reference)
    assert code == 0, output[-3000:]
    killed_then_finished(command, killed, kills=2)
    assert {path.name for path in killed.glob("killed-*")} == {"killed-1", "killed-2"}

    def jobs(cwd: Path) -> list[dict[str, str]]:
        return summary_rows(cwd / "sweep")

    assert [row["status"] for row in jobs(reference)] == ["COMPLETED"] * 2
    pairs = zip(jobs(reference), jobs(killed), strict=True)
    for expected, got in pairs:
        assert (expected["job"], expected["overrides"], expected["status"]) == (
            got["job"], got["overrides"], got["status"],
        )  # fmt: skip
        runs = [cwd / row["run_dir"] for cwd, row in ((reference, expected), (killed, got))]
        for key in ("state_dict", "optimizer_states", "global_step"):
            assert_equal(
                *(read_last(run / "checkpoints" / "last.ckpt")[key] for run in runs),
                f"job {expected['overrides']}: {key}",
            )
        metrics = [
            {k: v for k, v in read(run / "metrics.json").items() if "perf/" not in k}
            for run in runs
        ]
        assert metrics[0] == metrics[1], expected["overrides"]


@pytest.mark.slow
def test_a_grid_extended_by_one_value_trains_each_point_once_in_its_own_directory(
    tmp_path: Path,
) -> None:
    for seeds in ("1,2", "1,2,3"):
        result = run_cli(
            "-m", PACKAGE, "--multirun", *QUICK, "trainer.max_epochs=1", f"seed={seeds}",
            cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    sweeps = sorted((tmp_path / "logs" / "train" / "multiruns").iterdir())
    assert len(sweeps) == 2
    assert not [s.name for s in sweeps if "print_config" in s.name], "named as run directories are"
    rows = [row for sweep in sweeps for row in summary_rows(sweep)]
    assert sorted(row["overrides"] for row in rows) == ["seed=1"] * 2 + ["seed=2"] * 2 + ["seed=3"]
    assert all(row["status"] == "COMPLETED" for row in rows)
    assert len({row["run_dir"] for row in rows}) == 5


def test_a_run_directory_is_not_taken_by_other_settings(tmp_path: Path) -> None:
    """An explicit run_name with other overrides: one error line, the finished run untouched."""
    first = run_cli(
        "-m", PACKAGE, *QUICK, "debug=limit", "resume=true", "run_name=mine", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-3000:]
    other = run_cli(
        "-m", PACKAGE, *QUICK, "debug=limit", "resume=true", "run_name=mine", "seed=7", cwd=tmp_path
    )
    assert other.returncode == 1
    (line,) = other.stderr.strip().splitlines()
    assert line.startswith("error: ") and "seed=7" in line and "run_name" in line


@pytest.mark.slow
def test_torchrun_script_runs_two_processes(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "scripts" / "torchrun.sh"
    result = subprocess.run(
        ["bash", str(script), *QUICK[1:], "trainer.max_epochs=1"],
        cwd=tmp_path,
        env={**os.environ, "NPROC_PER_NODE": "2", "TRAINER": "cpu", "RUN_NAME": "two ranks,a"},
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()  # one folder, a safe name
    assert run_dir.name.startswith("two_ranks,a-")
    assert len(list(run_dir.glob("metrics-rank*.json"))) == 2
    assert list((run_dir / "checkpoints").glob("*.ckpt"))


def free_port() -> int:
    """A free port below the range the kernel hands out to outgoing connections. A port from that
    range (what binding port 0 gives) can, rarely, become the source port of the other node's own
    attempt to reach the store before it listens: the node then connects to itself and waits for
    ever, silently (a suspect for one 240 s wait in CI with both nodes' logs empty)."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    lowest = int(ranges.read_text().split()[0]) if ranges.is_file() else 32768
    for port in random.sample(range(10000, max(10001, lowest)), 100):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the outgoing range")


def node_environment(style: str, node_rank: int, port: int) -> dict[str, str]:
    """What each launcher sets on node `node_rank` of two, one process per node."""
    if style == "pytorchjob":  # Kubeflow's training operator, for torchrun
        return {"PET_NNODES": "2", "PET_NODE_RANK": str(node_rank), "PET_NPROC_PER_NODE": "1",
                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
                "MASTER_PORT": str(port)}  # fmt: skip
    if style == "skypilot":
        return {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": str(node_rank),
                "SKYPILOT_NUM_GPUS_PER_NODE": "1", "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.2",
                "MASTER_PORT": str(port)}  # fmt: skip
    return {"NNODES": "2", "NODE_RANK": str(node_rank), "NPROC_PER_NODE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


def start_node(
    node_rank: int, port: int, cwd: Path, args: list[str], style: str = "torchrun"
) -> subprocess.Popen[str]:
    """One of two torchrun agents (`scripts/torchrun.sh`) on this machine, as on two nodes
    sharing a filesystem: one CPU process each, in a process group of its own."""
    script = Path(__file__).parents[1] / "scripts" / "torchrun.sh"
    python_path = os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SKYPILOT_"))},
        **node_environment(style, node_rank, port), "TRAINER": "cpu", "RUN_NAME": "two-nodes",
        "PYTHONPATH": python_path,
    }  # fmt: skip
    with (cwd / f"node{node_rank}.log").open("a") as log:  # a pipe left unread would block it
        return subprocess.Popen(
            ["bash", str(script), *args], cwd=cwd, env=env, stdout=log,
            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, as a node that dies (torchrun starts its workers
    in sessions of their own, out of reach of its process group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    family, pending = [], [pid]
    while pending:
        family.append(pending.pop())
        pending += children.get(family[-1], [])
    for member in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def two_nodes(
    cwd: Path, args: list[str], kill_node_1_at_step: int | None = None, style: str = "torchrun"
) -> list[int]:
    """Both agents' exit codes; node 1 killed (with every process it started) at a step."""
    cwd.mkdir(parents=True, exist_ok=True)
    port = free_port()
    nodes = [start_node(rank, port, cwd, args, style) for rank in (0, 1)]
    if kill_node_1_at_step is not None:
        batches = cwd / "batches.txt.rank1"
        for _ in range(1200):
            if batches.is_file() and len(batches.read_text().splitlines()) > kill_node_1_at_step:
                break
            time.sleep(0.1)
        kill_tree(nodes[1].pid)
    try:
        codes = [node.wait(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    if kill_node_1_at_step is None and codes != [0, 0]:
        raise AssertionError((cwd / "node0.log").read_text()[-3000:])
    return codes


@pytest.mark.slow
def test_two_torchrun_nodes_train_one_run_and_resume_it_after_one_dies(tmp_path: Path) -> None:
    """Killing one node makes both exit non-zero; the same two commands resume the run, which
    ends as an uninterrupted run of the same two commands does."""
    args = [*SMALL_RUN, "+callbacks.slow._target_=tests.faults.SlowSteps",
            "+callbacks.slow.seconds=1"]  # fmt: skip
    assert two_nodes(tmp_path / "reference", args) == [0, 0]
    codes = two_nodes(tmp_path / "killed", args, kill_node_1_at_step=2)
    assert codes[0] != 0 and codes[1] != 0, codes
    assert two_nodes(tmp_path / "killed", args) == [0, 0]
    assert_same_outcome(tmp_path / "reference", tmp_path / "killed")


@pytest.mark.slow
@pytest.mark.parametrize("style", ["pytorchjob", "skypilot"])
def test_the_torchrun_script_reads_the_environment_of_pytorchjob_and_skypilot(
    tmp_path: Path, style: str
) -> None:
    assert two_nodes(tmp_path, [*QUICK, "trainer.max_epochs=1"], style=style) == [0, 0]
    run_dir = tmp_path / "logs" / "train" / "runs" / "two-nodes"
    assert sorted(p.name for p in run_dir.glob("metrics-rank*.json")) == [
        "metrics-rank0.json",
        "metrics-rank1.json",
    ]


def test_a_range_search_dimension_keeps_hydras_values_without_an_optuna_warning() -> None:
    import warnings

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.{{ cookiecutter.package_name }}_optuna_sweeper._impl import (
        distribution,
    )

    override = OverridesParser.create().parse_override("x=range(10,100,10)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dimension = distribution(override)
    assert (dimension.low, dimension.high, dimension.step) == (10, 90, 10)  # type: ignore[attr-defined]


def test_a_job_whose_override_holds_an_interpolation_is_summarized_as_written(
    tmp_path: Path,
) -> None:
    """Only the job's own config resolves it (the summary was lost, and with it a failed
    sweep's exit code)."""
    written = "callbacks.step_checkpoint.filename='s${trainer.max_epochs}-{step}'"
    for job, seed in enumerate((1, 2)):
        (tmp_path / str(job) / ".hydra").mkdir(parents=True)
        overrides = OmegaConf.create([f"seed={seed}", written])
        OmegaConf.save(overrides, tmp_path / str(job) / ".hydra" / "overrides.yaml")
    rows = collect_jobs(tmp_path)
    assert [row["overrides"] for row in rows] == ["seed=1", "seed=2"]
    (tmp_path / "1" / ".hydra" / "overrides.yaml").unlink()
    (single,) = collect_jobs(tmp_path)
    assert single["overrides"] == f"seed=1 {written}"


def test_sweep_labels_are_short_names_and_values_rounded_to_three_places() -> None:
    labels = short_labels(
        [
            "model.optimizer.lr=0.0012345 seed=2",
            "model.optimizer.lr=0.034 model.scheduler.lr=1e-05 seed=13",
            "",
        ]
    )
    assert labels == [
        "optimizer.lr=0.00123 seed=2",
        "optimizer.lr=0.034 scheduler.lr=1e-05 seed=13",
        "(no overrides)",
    ]
    assert significant(0.98765) == "0.988" and significant("12") == "12"
    assert significant("fast") == "fast" and significant(3) == "3"


def test_the_sweep_picture_marks_the_best_completed_job(tmp_path: Path) -> None:
    jobs = [("lr=0.1", "COMPLETED", 0.5), ("lr=0.2", "FAILED", None),
            ("lr=0.3", "PRUNED", 0.9), ("lr=0.4", "COMPLETED", 0.7)]  # fmt: skip
    rows = [
        dict(overrides=text, status=status, metrics=dict([("val/acc", value)] if value else []))
        for text, status, value in jobs
    ]
    values = [row["metrics"].get("val/acc") for row in rows]
    statuses = [row["status"] for row in rows]
    assert best_job(values, statuses, "max") == 3, "a pruned job is never the best"
    assert best_job(values, statuses, "min") == 0
    draw_summary(tmp_path / "summary.png", rows, "val/acc", "max")
    assert_picture(tmp_path / "summary.png")
