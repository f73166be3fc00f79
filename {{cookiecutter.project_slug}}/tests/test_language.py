"""The language example: byte-level data in its real form (text files) and the GPT train on CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.data.text import (
    ByteTextDataModule,
    ByteWindows,
    split_corpus,
)
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.models.nets.gpt import GPT
from {{ cookiecutter.package_name }}.recipes.train import train

from .helpers import PACKAGE, ComposeFn, assert_checkpoints_load_safely, checkpoints, run_cli

TINY_GPT = ["model.net.n_layer=2", "model.net.n_embd=64", "model.net.n_head=2"]


def test_windows_are_shifted_by_one() -> None:
    data = torch.arange(21, dtype=torch.uint8)
    windows = ByteWindows(data, block_size=4)
    assert len(windows) == 5
    inputs, targets = windows[1]
    assert inputs.tolist() == [4, 5, 6, 7]
    assert targets.tolist() == [5, 6, 7, 8]


def test_splits_cover_the_corpus_without_overlap() -> None:
    data = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
    parts = split_corpus(data, val_fraction=0.1, test_fraction=0.1, min_chunk=65)
    assert sum(len(p) for p in parts.values()) == len(data)
    assert 0.05 < len(parts["val"]) / len(data) < 0.15
    assert 0.05 < len(parts["test"]) / len(data) < 0.15


def test_text_folder_is_read(tmp_path: Path) -> None:
    for index in range(3):
        (tmp_path / f"doc{index}.txt").write_text("the quick brown fox jumps. " * 400)
    datamodule = ByteTextDataModule(source=str(tmp_path), block_size=32, batch_size=4)
    datamodule.setup()
    inputs, targets = next(iter(datamodule.train_dataloader()))
    assert inputs.shape == (4, 32) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert 0 < datamodule.baseline["baseline/unigram_loss"] < math.log(256)


def test_a_text_folder_is_read_without_its_hidden_files(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text("a" * 4000)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_bytes(b"\x00" * 4000)
    (tmp_path / ".notes.swp").write_bytes(b"\xff" * 4000)
    datamodule = ByteTextDataModule(source=str(tmp_path), block_size=32, batch_size=4)
    datamodule.setup()
    counts = torch.bincount(next(iter(datamodule.train_dataloader()))[0].flatten(), minlength=256)
    assert counts[ord("a")] == counts.sum(), "only doc.txt's bytes are read"


def test_missing_text_source_says_what_to_do(tmp_path: Path) -> None:
    datamodule = ByteTextDataModule(source=str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match="neither a file nor a folder"):
        datamodule.setup()


def test_gpt_shapes_and_tied_embeddings() -> None:
    net = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    logits = net(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)
    assert net.lm_head.weight is net.wte.weight
    assert net.flops_per_token(16) > 6 * net.num_params()


def test_language_model_learns(train_config: ComposeFn) -> None:
    cfg = train_config(
        "experiment=language",
        *TINY_GPT,
        "data.max_bytes=300000",
        "data.block_size=64",
        "trainer.max_steps=60",
        "trainer.val_check_interval=30",
        "trainer.limit_val_batches=10",
        "trainer.limit_test_batches=10",
        "trainer.log_every_n_steps=10",
        "model.scheduler.warmup_steps=5",
    )
    metrics = train(cfg)
    assert metrics["val/loss"] < math.log(256) - 1.0, "60 steps must beat uniform guessing by far"
    assert metrics["perf/tokens_per_sec"] > 0
    assert metrics["baseline/unigram_loss"] > 0
    assert_checkpoints_load_safely(cfg)


def test_the_llama_learns_and_a_weights_only_best_checkpoint_serves_predict(
    train_config: ComposeFn, tmp_path: Path
) -> None:
    """experiment=language_llama (RoPE, RMSNorm, SwiGLU, grouped-query attention) beats uniform
    guessing by far in 60 steps; with callbacks.model_checkpoint.save_weights_only=true the best
    checkpoint holds no optimizer state (last.ckpt, which resuming needs, does), is smaller, and
    predict continues a prompt from it."""
    cfg = train_config(
        "experiment=language_llama", "model.net.n_layer=2", "model.net.n_embd=64",
        "model.net.mlp_width=160", "data.max_bytes=300000", "data.block_size=64",
        "trainer.max_steps=60", "trainer.val_check_interval=30", "trainer.limit_val_batches=10",
        "trainer.limit_test_batches=10", "model.scheduler.warmup_steps=5",
        "callbacks.model_checkpoint.save_weights_only=true",
    )  # fmt: skip
    metrics = train(cfg)
    assert metrics["val/loss"] < math.log(256) - 1.0, "60 steps must beat uniform guessing by far"
    assert_checkpoints_load_safely(cfg)
    (best,) = [path for path in checkpoints(cfg) if path.name.startswith("best")]
    last = best.parent / "last.ckpt"
    assert "optimizer_states" not in torch.load(best, weights_only=True, mmap=True)
    assert "optimizer_states" in torch.load(last, weights_only=True, mmap=True)
    assert best.stat().st_size < 0.6 * last.stat().st_size
    result = run_cli(
        "-c", f"from {PACKAGE}.cli import predict; predict()", f"ckpt_path={best}",
        "prompt=def main(", "max_new_tokens=8", "stream=false", "trainer=cpu",
        "logger=csv", "run_name=from_best", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    written = tmp_path / "logs" / "predict" / "runs" / "from_best" / "predictions.jsonl"
    assert len(written.read_text().splitlines()) == 1


@pytest.mark.slow
def test_default_language_experiment_beats_unigram_baseline(train_config: ComposeFn) -> None:
    """The default experiment's model, data and schedule, cut to 120 of its 300 steps and without
    the test stage (its full run ends near val/loss 2.28 against the unigram baseline's 3.24)."""
    cfg = train_config(
        "experiment=language",
        "trainer.max_steps=120",
        "trainer.val_check_interval=120",
        "test=false",
    )
    metrics = train(cfg)
    assert metrics["val/loss"] < metrics["baseline/unigram_loss"] - 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_language_on_gpu_bf16_compiled(train_config: ComposeFn) -> None:
    cfg = train_config(
        "experiment=language",
        "trainer=gpu",
        "trainer.precision=bf16-mixed",
        "model.compile=true",
        "trainer.max_steps=100",
        "trainer.val_check_interval=50",
        "trainer.log_every_n_steps=10",
    )
    metrics = train(cfg)
    assert metrics["val/loss"] < math.log(256) - 1.0
    assert metrics["perf/mfu"] > 0
