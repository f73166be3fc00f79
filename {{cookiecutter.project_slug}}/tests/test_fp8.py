"""FP8 training (torchao float8) on the CPU, where `torch._scaled_mm` has a kernel: which layers it
converts, numerics close to bf16, checkpoints that load and evaluate without torchao, exact resume,
and one line where it cannot work. Speed needs a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.models.fp8 import (
    convert_to_fp8,
    fp8_layers,
)
from {{ cookiecutter.package_name }}.models.lora import (
    add_adapters,
)
from {{ cookiecutter.package_name }}.models.nets.gpt import (
    GPT,
)
from {{ cookiecutter.package_name }}.run.machine import (
    FP8_ON_CPU,
    check_fp8,
    resolve_accelerator,
)
from {{ cookiecutter.package_name }}.run.plan import strategy_of

from .helpers import PACKAGE, run_cli
from .killing import (
    COMMON,
    References,
    assert_same_outcome,
    fault,
    killed_then_finished,
    run_dir,
)
from .killing import entry_point as entry

pytest.importorskip("torchao", reason="FP8 needs torchao (pip install -e '.[fp8]')")


def test_the_output_projection_odd_sizes_and_adapters_stay_in_high_precision() -> None:
    net = GPT(256, 32, n_layer=2, n_head=2, n_embd=64)
    converted, kept = fp8_layers(net)
    assert kept == ["lm_head"] and len(converted) == 2 * 4
    odd = GPT(256, 32, n_layer=1, n_head=2, n_embd=40)  # 40 and 120 are not multiples of 16
    assert fp8_layers(odd)[0] == []
    add_adapters(net, rank=4, alpha=8, dropout=0.0, target_modules=["attn.qkv"])
    converted, kept = fp8_layers(net)
    assert "blocks.0.attn.qkv" in kept and len(converted) == 2 * 3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_close_to_bf16(recipe: str) -> None:
    """Ten AdamW steps on the same batches: the losses stay within 2 % of bf16's."""
    torch.manual_seed(0)
    bf16 = GPT(256, 64, n_layer=2, n_head=4, n_embd=128)
    fp8 = copy.deepcopy(bf16)
    convert_to_fp8(fp8, recipe)
    assert type(fp8.blocks[0].attn.qkv).__name__ == "Float8Linear"
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog; " * 40))
    batches = [torch.stack([text[i * 8 + row : i * 8 + row + 65] for row in range(8)])
               for i in range(10)]  # fmt: skip
    losses = {}
    for name, net in (("bf16", bf16), ("fp8", fp8)):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = net(batch[:, :-1])
                loss = F.cross_entropy(logits.float().view(-1, 256), batch[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.setdefault(name, []).append(loss.item())
    assert losses["fp8"][-1] < losses["fp8"][0] - 0.3, losses
    for ours, theirs in zip(losses["fp8"], losses["bf16"], strict=True):
        assert abs(ours - theirs) <= 0.02 * theirs, losses


QUIET = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]
RUN = [
    "experiment=language", "model.net.n_layer=1", "model.net.n_embd=64", "model.net.n_head=2",
    "data.block_size=64", "data.max_bytes=200000", "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
]  # fmt: skip


@pytest.mark.slow
def test_an_fp8_checkpoint_loads_safely_and_evaluates_without_torchao(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FP8_ON_CPU, "1")
    result = run_cli(
        "-m", PACKAGE, *QUIET, *RUN, "model.fp8=tensorwise", "trainer.precision=bf16-mixed",
        "trainer.max_steps=6", "trainer.val_check_interval=3", "run_name=fp8", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in high precision: lm_head" in result.stdout + result.stderr
    last = tmp_path / "logs" / "train" / "runs" / "fp8" / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)["state_dict"]
    assert all(type(value) is torch.Tensor for value in state.values())
    # torchao cannot be imported here, as where it is not installed.
    script = f"import sys; sys.modules['torchao'] = None; {entry('evaluate')[1]}"
    result = subprocess.run(
        [sys.executable, "-c", script, f"ckpt_path={last}", *QUIET[:3], "hydra.run.dir=eval"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["test/loss"] > 0


@pytest.mark.slow
def test_a_killed_fp8_run_finishes_as_if_never_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference_run: References
) -> None:
    monkeypatch.setenv(FP8_ON_CPU, "1")
    run = [
        *COMMON, *RUN, "model.fp8=rowwise", "trainer.precision=bf16-mixed", "trainer.max_steps=8",
        "trainer.val_check_interval=4", "callbacks.step_checkpoint.every_n_train_steps=4",
    ]  # fmt: skip
    killed_then_finished([*run, *fault("train_step", 6, tmp_path / "fired")], tmp_path / "run")
    assert_same_outcome(reference_run(run), tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setting", "allowed_on_cpu", "words"),
    [
        (["model.fp8=fp4"], True, ["model.fp8='fp4'", "tensorwise"]),
        (["model.fp8=tensorwise"], False, ["compute capability 8.9", "on cpu"]),
        (["model.fp8=tensorwise", "model.net.n_embd=40"], True, ["multiples of 16"]),
        (["model.fp8=tensorwise", "strategy=fsdp"], True, ["strategy=model_parallel (FSDP2"]),
    ],
    ids=["unknown", "cpu", "odd-sizes", "fsdp1"],
)
def test_fp8_where_it_cannot_work_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: list[str], allowed_on_cpu: bool,
    words: list[str],
) -> None:  # fmt: skip
    if allowed_on_cpu:
        monkeypatch.setenv(FP8_ON_CPU, "1")
    else:
        monkeypatch.delenv(FP8_ON_CPU, raising=False)
    result = run_cli("-m", PACKAGE, *QUIET, *RUN, *setting, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(word in lines[0] for word in words), lines
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(("capability", "refused"), [((9, 0), False), ((8, 0), True)])
def test_fp8_under_trainer_gpu_is_judged_by_the_gpus_compute_capability(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], refused: bool
) -> None:
    # trainer=gpu asks for accelerator "gpu": it was once refused as "not a GPU" on an H200.
    monkeypatch.delenv(FP8_ON_CPU, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "a test GPU")
    net = GPT(256, 32, n_layer=1, n_head=2, n_embd=64)
    if refused:
        with pytest.raises(ConfigError, match=r"a test GPU has 8\.0"):
            check_fp8("tensorwise", strategy_of("auto"), resolve_accelerator("gpu"), net)
    else:
        check_fp8("tensorwise", strategy_of("auto"), resolve_accelerator("gpu"), net)


@pytest.mark.slow
def test_fp8_under_fsdp2_all_gathering_in_float8_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference_run: References
) -> None:
    """Two gloo processes, weights all-gathered in float8 (tensorwise), a checkpoint folder of
    shards every 4 steps (written in the background), a kill at step 6."""
    monkeypatch.setenv(FP8_ON_CPU, "1")
    run = [
        *COMMON, *RUN, "model.fp8=tensorwise", "trainer.precision=bf16-mixed",
        "trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_test_batches=2",
        "callbacks.step_checkpoint.every_n_train_steps=4", "strategy=model_parallel",
        "trainer.strategy.data_parallel_size=2", "trainer.devices=2",
    ]  # fmt: skip
    killed_then_finished([*run, *fault("train_step", 6, tmp_path / "fired")], tmp_path / "run")
    reference = reference_run(run)
    assert_same_outcome(reference, tmp_path / "run")
    metrics = json.loads((run_dir(reference) / "metrics.json").read_text())
    # The test, in float8 too, on the trained weights: below a uniform guess, near validation.
    assert metrics["test/loss"] < math.log(257), metrics
    assert abs(metrics["test/loss"] - metrics["val/loss"]) < 0.25, metrics


def fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a GPU of compute capability 8.9 or newer")
def test_fp8_compiled_on_a_gpu_learns_and_saves_plain_weights(tmp_path: Path) -> None:
    result = run_cli(
        "-m", PACKAGE, "trainer=gpu", "logger=csv", "extras.print_config=false",
        "callbacks.progress_bar=null", "experiment=language", "model.fp8=tensorwise",
        "model.compile=true", "trainer.max_steps=100", "trainer.val_check_interval=50",
        "trainer.limit_val_batches=10", "trainer.limit_test_batches=10", "run_name=fp8",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "logs" / "train" / "runs" / "fp8"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["val/loss"] < math.log(256) - 1.0, metrics
    assert abs(metrics["test/loss"] - metrics["val/loss"]) < 0.25, metrics
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert all(type(value) is torch.Tensor for value in state.values())
