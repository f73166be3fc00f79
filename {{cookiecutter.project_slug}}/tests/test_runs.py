"""What every run shares: machine settings, throughput, the command line, and its errors."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from {{ cookiecutter.package_name }}.callbacks import ModelSummary
from {{ cookiecutter.package_name }}.callbacks.throughput import (
    peak_tflops,
)
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.recipes.train import train
from {{ cookiecutter.package_name }}.run import machine as runtime
from {{ cookiecutter.package_name }}.run.machine import (
    cpu_has_fast_bf16,
    resolve_accelerator,
    resolve_precision,
)

from .helpers import PACKAGE, ComposeFn, compose_config, run_cli


def test_precision_auto_is_32_on_cpu() -> None:
    assert resolve_precision("auto", "cpu") == "32-true"
    assert resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"


@pytest.mark.parametrize(("bf16", "expected"), [(True, "bf16-mixed"), (False, "16-mixed")])
def test_precision_auto_on_gpu(monkeypatch: pytest.MonkeyPatch, bf16: bool, expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_precision("auto", "cuda") == expected


@pytest.mark.parametrize("bad", ["16-mixed", "16-true"])
def test_fp16_on_cpu_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="bf16-mixed or 32-true"):
        resolve_precision(bad, "cpu")


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ConfigError, match="not one of"):
        resolve_precision("fp8", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine with no GPU")
def test_gpu_without_cuda_is_refused() -> None:
    with pytest.raises(ConfigError, match="trainer=cpu"):
        resolve_accelerator("gpu")


@pytest.mark.parametrize(("cuda_build", "says"), [("12.8", "sees no GPU"), (None, "CPU build")])
def test_gpu_asked_for_says_whether_torch_or_the_machine_lacks_it(
    monkeypatch: pytest.MonkeyPatch, cuda_build: str | None, says: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    with pytest.raises(ConfigError, match=says) as refused:
        resolve_accelerator("gpu")
    assert ("install a CUDA build" in str(refused.value)) == (cuda_build is None)


@pytest.mark.parametrize("requested", ["gpu", "cuda", "auto"])
def test_a_gpu_is_called_cuda_whichever_name_asked_for_it(
    monkeypatch: pytest.MonkeyPatch, requested: str
) -> None:
    # The checks that follow (FP8, pinned memory, bf16, the memory plan) compare with "cuda".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_accelerator(requested) == "cuda"


CPUINFO = {
    "x86 without bf16": ("flags\t\t: fpu sse avx2 avx512f\n", False),
    "x86 with AVX512-BF16": ("flags\t\t: fpu avx512f avx512_bf16\n", True),
    "x86 with AMX": ("flags\t\t: fpu amx_bf16 amx_tile\n", True),
    "ARM with BF16": ("Features\t: fp asimd bf16 i8mm\n", True),
    "ARM without": ("Features\t: fp asimd\n", False),
    "no feature lines": ("processor\t: 0\n", True),
}


@pytest.mark.parametrize("cpu", list(CPUINFO))
def test_cpu_bf16_support_is_read_from_its_features(cpu: str) -> None:
    text, fast = CPUINFO[cpu]
    assert cpu_has_fast_bf16(text) is fast


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_on_a_cpu_without_bf16_instructions_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fast: bool
) -> None:
    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: fast)
    with caplog.at_level(logging.WARNING, logger=runtime.__name__):
        assert resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"
        resolve_precision("32-true", "cpu")
    slow = [r for r in caplog.records if "slower than 32-true" in r.getMessage()]
    assert len(slow) == (0 if fast else 1)


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.0),
        ("NVIDIA H100 PCIe", "bf16-mixed", 756.0),
        ("NVIDIA H100 NVL", "bf16-mixed", 835.0),
        ("NVIDIA H200", "bf16-mixed", 989.0),
        ("NVIDIA B200", "bf16-true", 2250.0),
        ("NVIDIA A100-SXM4-80GB", "16-mixed", 312.0),
        ("NVIDIA A100-SXM4-80GB", "32-true", 156.0),
        ("NVIDIA L4", "bf16-mixed", 121.0),
        ("NVIDIA L40S", "bf16-mixed", 362.0),
        ("Some Future GPU", "bf16-mixed", None),
    ],
)
def test_peak_flops_table(name: str, precision: str, peak: float | None) -> None:
    assert peak_tflops(name, precision) == peak


@pytest.mark.parametrize("preset", ["fdr", "limit", "overfit", "profiler"])
def test_debug_preset_trains(train_config: ComposeFn, preset: str) -> None:
    cfg = train_config(f"debug={preset}", "trainer.max_epochs=2")
    metrics = train(cfg)
    assert metrics["train/loss"] == pytest.approx(metrics["train/loss"]), "loss must be finite"
    if preset == "profiler":
        traces = list((Path(cfg.paths.output_dir) / "profiler").glob("*.json"))
        assert traces, "the profiler must write a trace"


def test_debug_default_is_one_epoch_on_the_cpu_without_a_logger(tmp_path: Path) -> None:
    """As lightning-hydra-template's debug=default: composed as the command line would, then
    run (a few batches of that one epoch)."""
    cfg = compose_config("train", ["debug=default"], tmp_path)
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 1
    assert cfg.trainer.max_epochs == 1 and cfg.trainer.detect_anomaly is True
    assert not cfg.get("logger") and cfg.data.num_workers == 0 and cfg.task_name == "debug"
    limits = [
        "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "trainer.val_check_interval=null",
        "trainer.check_val_every_n_epoch=1",
    ]  # fmt: skip
    cfg = compose_config("train", ["debug=default", "extras.print_config=false", *limits], tmp_path)
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["test/loss"])
    last = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3, "one epoch of its 3 batches"
    assert not (Path(cfg.paths.output_dir) / "csv").exists(), "no logger"


def test_training_loss_reaches_the_logger_every_log_every_n_steps(train_config: ComposeFn) -> None:
    """The training step calls `self.log` only on the steps Lightning writes out; none is lost."""
    cfg = train_config(
        "trainer.max_epochs=2",
        "trainer.max_steps=-1",
        "trainer.limit_train_batches=10",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=7",
        "test=false",
    )
    metrics = train(cfg)
    with (Path(cfg.paths.output_dir) / "csv" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    logged_at = [int(row["step"]) for row in rows if row.get("train/loss")]
    assert logged_at == [6, 13], "steps 7 and 14 of 20, counted from 0"
    assert math.isfinite(metrics["train/loss"])


def test_help_does_not_import_torch(tmp_path: Path) -> None:
    probe = (
        "import sys\n"
        f"sys.argv = ['{PACKAGE}-train', '--help']\n"
        f"from {PACKAGE}.cli import train\n"
        "try:\n    train()\nexcept SystemExit:\n    pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_NOT_IMPORTED')\n"
    )
    result = run_cli("-c", probe, cwd=tmp_path, fresh=True)
    assert "Config groups" in result.stdout
    assert "TORCH_NOT_IMPORTED" in result.stdout


def test_fast_dev_run_from_the_command_line(tmp_path: Path) -> None:
    result = run_cli("-m", PACKAGE, "debug=fdr", "trainer=cpu", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "logs" / "debug" / "runs").glob("*/metrics.json"))


def test_a_run_prints_neither_its_config_nor_a_flops_column_of_zeros(tmp_path: Path) -> None:
    """The composed config is printed only when asked (`extras.print_config=true`; it is always
    in the run's .hydra/), and the model summary leaves out the FLOPs that Lightning counts only
    for a model with an example_input_array: without one, every layer's would read 0."""
    result = run_cli(
        "-m", PACKAGE, "trainer=cpu", "logger=csv", "trainer.fast_dev_run=true",
        "callbacks.progress_bar=null", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "task_name: train" not in output, "the config is not printed by default"
    summary = output[output.index("| Name") : output.index("Modules in eval mode")]
    assert "Total params" in summary and "Params" in summary
    assert "FLOPs" not in summary and "Total Flops" not in output
    (run,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    assert (run / ".hydra" / "config.yaml").is_file()


class Linear(L.LightningModule):
    """One layer of 4 -> 2, with an example input of 3 rows or none."""

    def __init__(self, example: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.example_input_array = torch.zeros(3, 4) if example else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.mark.parametrize("example", [True, False], ids=["example input", "none"])
def test_the_model_summary_keeps_only_flops_it_counted(
    example: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning.pytorch.utilities.model_summary import ModelSummary as Summary

    summary = Summary(Linear(example), max_depth=2)
    with caplog.at_level(logging.INFO):
        ModelSummary.summarize(
            summary._get_summary_data(), summary.total_parameters, summary.trainable_parameters,
            summary.model_size, summary.total_training_modes, total_flops=summary.total_flops,
        )  # fmt: skip
    (table,) = [r.getMessage() for r in caplog.records if "Total params" in r.getMessage()]
    header, divider = table.strip("\n").splitlines()[:2]
    assert ("FLOPs" in header) == example and ("Total Flops" in table) == example, table
    assert len(divider) == len(header) + 6, "Lightning's divider, over the columns shown"
    if example:  # 3 rows x 4 inputs x 2 outputs, a multiply and an add each
        assert "48        Total Flops" in table


def test_unknown_config_option_fails_with_the_choices(tmp_path: Path) -> None:
    result = run_cli("-m", PACKAGE, "data=nope", cwd=tmp_path)
    assert result.returncode == 1
    assert "Could not find 'data/nope'" in result.stderr
    assert "Choose one of: " in result.stderr


def test_eval_of_a_missing_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    result = run_cli(
        "-c",
        f"from {PACKAGE}.cli import evaluate; evaluate()",
        "ckpt_path=missing.ckpt",
        "trainer=cpu",
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
{%- if cookiecutter.logger == "wandb" %}


def test_wandb_without_login_logs_offline_and_finishes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "NETRC": str(home / ".netrc"),
        "WANDB_API_KEY": "",
        "WANDB_MODE": "",
        "WANDB_CONFIG_DIR": str(home / ".config" / "wandb"),
    }
    result = run_cli(
        "-m",
        PACKAGE,
        "debug=limit",
        "logger=wandb",
        "trainer=cpu",
        "extras.print_config=false",
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no login found, logging offline" in result.stderr + result.stdout
    assert list(tmp_path.glob("logs/debug/runs/*/wandb/offline-run-*"))


def test_the_wandb_start_up_timeout_is_the_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from {{ cookiecutter.package_name }} import (
        loggers,
    )

    from .helpers import compose_config

    waited: list[float] = []

    def unanswered(timeout: float) -> str:
        waited.append(timeout)
        return "no answer"

    monkeypatch.setattr(loggers, "wandb_server_answers", unanswered)
    monkeypatch.setenv("WANDB_MODE", "")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_API_KEY", "local-" + "0" * 40)  # a login, so it tries the server
    overrides = ["logger=wandb", "logger.wandb.settings.init_timeout=6"]
    cfg = compose_config("train", overrides, tmp_path)
    assert list(cfg.logger) == ["wandb"], "nothing but the logger in the logger group"
    (logger,) = loggers.instantiate_loggers(cfg.logger)
    assert waited == [2.0] and logger._offline


@pytest.mark.slow
def test_unreachable_wandb_server_means_offline_same_run_id_and_no_secret(tmp_path: Path) -> None:
    import time

    secret = "local-" + "0123456789abcdef" * 2 + "01234567"
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "NETRC": str(home / ".netrc"),
        "WANDB_API_KEY": secret,
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # nothing listens there
        "WANDB_MODE": "",
        "WANDB_CONFIG_DIR": str(home / ".config" / "wandb"),
    }
    command = ["-m", PACKAGE, "debug=limit", "logger=wandb", "trainer=cpu"]
    outputs = []
    for _ in range(2):  # debug=limit trains again in the same run directory
        started = time.monotonic()
        result = run_cli(*command, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert time.monotonic() - started < 90
        outputs.append(result.stdout + result.stderr)
        assert "cannot start the online run" in outputs[-1]
    (run_dir,) = (tmp_path / "logs" / "debug" / "runs").iterdir()
    run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    offline_runs = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(offline_runs) == 2 and all(p.name.endswith(run_id) for p in offline_runs)
    assert all(secret not in output for output in outputs)
    for path in tmp_path.rglob("*"):
        if path.is_file() and home not in path.parents:
            assert secret.encode() not in path.read_bytes(), f"the API key is in {path}"
{%- endif %}
