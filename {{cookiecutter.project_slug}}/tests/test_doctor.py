"""The doctor: every field on this machine, and the warnings on machines faked to be broken."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from {{ cookiecutter.package_name }}.memory import (
    plan as memory_plan,
)
from {{ cookiecutter.package_name }}.recipes import doctor

from .helpers import PACKAGE, run_cli

FIELDS = [
    "python",
    "torch",
    "cuda_runtime",
    "driver",
    "lightning",
    "hydra",
    "logger",
    "gpus",
    "bf16",
    "fp8",
    "nccl",
    "slurm",
{%- if cookiecutter.logger == "wandb" %}
    "wandb_login",
{%- endif %}
    "disk_free",
    "accelerator",
    "precision",
    "strategy",
    "memory",
    "data_loader",
]
V100 = SimpleNamespace(name="Tesla V100-SXM2-16GB", total_memory=16 * 1024**3, major=7, minor=0)
H100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 1024**3, major=9, minor=0)


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def fake_cuda(monkeypatch: pytest.MonkeyPatch, *gpus: SimpleNamespace, bf16: bool = True) -> None:
    """torch built for CUDA 12.8 with these GPUs visible (none: a machine without a GPU)."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpus[0].name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(doctor, "driver_version", lambda: "570.86.15" if gpus else None)


def test_every_field_is_printed(tmp_path: Path) -> None:
    result = run_cli("-m", f"{PACKAGE}.recipes.doctor", cwd=tmp_path)
    for field in FIELDS:
        label = field.replace("_", " ")
        assert re.search(rf"^{label}: +\S", result.stdout, re.MULTILINE), f"no {label}: line"
    warned = "\nwarning: " in result.stdout
    assert result.returncode == (1 if warned else 0), result.stderr[-3000:]


def test_json_has_every_key(tmp_path: Path) -> None:
    result = run_cli("-m", f"{PACKAGE}.recipes.doctor", "--json", cwd=tmp_path)
    report = json.loads(result.stdout)
    assert set(FIELDS) <= set(report)
    assert result.returncode == (1 if report["warnings"] else 0), result.stderr[-3000:]


def test_cuda_build_without_a_gpu_warns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_cuda(monkeypatch)
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^accelerator: +cpu", out, re.MULTILINE)
    assert "warning: torch is built for CUDA 12.8 but cannot use a GPU" in out


def test_driver_with_a_cpu_only_torch_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(doctor, "driver_version", lambda: "570.86.15")
    fields, problems = doctor.diagnose()
    assert fields["driver"] == "570.86.15"
    assert any("is a CPU-only build" in problem for problem in problems)


@pytest.mark.parametrize(
    ("emulated", "warning"),
    [(True, "emulated and slow"), (False, "has no bf16 support")],
)
def test_bf16_on_a_gpu_without_it_warns(
    monkeypatch: pytest.MonkeyPatch, emulated: bool, warning: str
) -> None:
    fake_cuda(monkeypatch, V100, bf16=emulated)
    fields, problems = doctor.diagnose(["trainer.precision=bf16-mixed"])
    assert "compute capability 7.0" in fields["gpu_0"]
    assert fields["bf16"].startswith("no")
    assert fields["fp8"].startswith("no")
    assert any(warning in problem for problem in problems), problems


def test_several_gpus_without_nccl_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, H100, H100)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    fields, problems = doctor.diagnose(["trainer.devices=2"])
    assert fields["gpus"] == "2"
    assert (fields["bf16"], fields["fp8"]) == ("yes", "yes")
    assert fields["precision"].startswith("bf16-mixed")
    assert fields["strategy"].startswith("auto (DDP), 2 cuda devices")
    assert any("no NCCL" in problem for problem in problems), problems


def test_the_loader_processes_a_run_would_use_are_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """data.num_workers=auto: from the cores this process may use and the GPUs sharing them."""
    fake_cuda(monkeypatch, H100, H100)
    monkeypatch.setattr(doctor, "usable_cores", lambda: 16)
    fields, _ = doctor.diagnose(["trainer.devices=2", "data.num_workers=auto"])
    assert fields["data_loader"].startswith(
        "7 workers per process (data.num_workers=auto: 16 cores"
    )
    assert "pinned memory" in fields["data_loader"]
    fields, _ = doctor.diagnose(["trainer=cpu", "data.num_workers=auto"])
    assert fields["data_loader"].startswith("0 workers per process"), fields["data_loader"]
{%- if cookiecutter.examples != "vision" %}


def test_a_config_too_big_for_the_gpu_is_warned_before_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The large experiments' stated batches fit an 80 GB GPU by the estimate; 512 does not."""
    fake_cuda(monkeypatch, H100)
    for experiment in ("gpt2_small", "gpt2_medium", "gpt_1b"):
        fields, problems = doctor.diagnose([f"experiment={experiment}"])
        assert "GiB per device" in fields["memory"], fields["memory"]
        assert not any("exceeds" in problem for problem in problems), (experiment, problems)
    fields, problems = doctor.diagnose(["experiment=gpt2_small", "data.batch_size=512"])
    assert any("exceeds 90 % of this GPU's 80.0 GiB" in problem for problem in problems)
{%- endif %}
{%- if cookiecutter.logger == "wandb" %}


def test_wandb_key_is_never_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "")
    assert doctor.diagnose()[0]["wandb_login"] == "not logged in: runs log offline"

    monkeypatch.setenv("WANDB_API_KEY", "secret-key-0123456789")
    doctor.main(["--json"])
    out = capsys.readouterr().out
    assert json.loads(out)["wandb_login"] == "logged in (key from WANDB_API_KEY)"
    assert "secret-key" not in out
{%- endif %}


SLURM_JOB = {
    "SLURM_JOB_ID": "4242", "SLURM_JOB_PARTITION": "gpu", "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_GPUS_ON_NODE": "4",
}  # fmt: skip


@pytest.mark.parametrize(("devices", "warns"), [(4, False), (8, True)])
def test_the_slurm_job_is_reported_and_a_task_count_off_the_devices_warns(
    monkeypatch: pytest.MonkeyPatch, devices: int, warns: bool
) -> None:
    for name, value in SLURM_JOB.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    fields, problems = doctor.diagnose(["trainer=cpu", f"trainer.devices={devices}"])
    described = "job 4242 on partition gpu: 2 nodes, 4 tasks per node, 4 GPUs per node"
    assert fields["slurm"] == described
    mismatch = [p for p in problems if "tasks per node" in p]
    assert bool(mismatch) == warns
    if warns:
        assert "--ntasks-per-node=8" in mismatch[0]


def test_outside_a_slurm_job_the_doctor_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*SLURM_JOB, "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    fields, problems = doctor.diagnose(["trainer=cpu"])
    assert fields["slurm"].startswith("not in a SLURM job")
    assert not [p for p in problems if "tasks per node" in p]


@pytest.mark.parametrize(("gib", "warned"), [(1e-6, True), (1e6, False)])
def test_a_run_bigger_than_the_machines_memory_on_a_cpu_is_warned(
    monkeypatch: pytest.MonkeyPatch, gib: float, warned: bool
) -> None:
    """On a CPU the system kills a run that runs out of memory without a word: say so first."""
    monkeypatch.setattr(memory_plan, "machine_memory_gib", lambda: gib)
    _, problems = doctor.diagnose(["trainer=cpu", "trainer.devices=2", "strategy=ddp"])
    found = [p for p in problems if "exceeds 90 % of this machine's" in p]
    assert bool(found) == warned, problems
    assert not found or "for each of 2 processes" in found[0]


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("trainer.devices=0", "trainer.devices=0"),
        ("data.batch_size=0", "data.batch_size=0"),
        ("data.batch_size=-4", "data.batch_size=-4"),
        ("data.batch_size=abc", "data.batch_size='abc'"),
        ("data.num_workers=-1", "data.num_workers=-1"),
        ("data.num_workers=true", "data.num_workers=True"),
    ],
)
def test_a_setting_a_run_would_refuse_is_a_warning(setting: str, words: str) -> None:
    _, problems = doctor.diagnose(["trainer=cpu", setting])
    assert any(p.startswith("a run would refuse this config") and words in p for p in problems)


def test_an_unknown_option_gets_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        doctor.main(["--bogus"])
    assert ended.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: unrecognized arguments: --bogus")
