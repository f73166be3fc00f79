"""Using a trained language model: generation with and without the key/value cache, the predict
command, LoRA fine-tuning from a trained checkpoint (kill-safe like any run), merging, export."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser

from {{ cookiecutter.package_name }}.models.lora import (
    LoRALinear,
    add_adapters,
    merge,
)
from {{ cookiecutter.package_name }}.models.nets.gpt import (
    GPT,
)
from {{ cookiecutter.package_name }}.run.names import (
    verbatim,
)

from .helpers import PACKAGE, run_cli, run_commands
from .killing import (
    COMMON,
    References,
    assert_same_outcome,
    fault,
    killed_then_finished,
    read_last,
)
from .killing import entry_point as entry

TARGETS = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]


def tiny_gpt(block_size: int = 16) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=block_size, n_layer=2, n_head=2, n_embd=32).eval()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_cache_gives_the_tokens_of_recomputing_the_whole_context(temperature: float) -> None:
    """Also past the context (16 tokens here), where the cache is refilled from the last window."""
    net = tiny_gpt()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    runs = [
        net.generate(prompt, 40, temperature=temperature, top_k=20, kv_cache=cached,
                     generator=torch.Generator().manual_seed(7))
        for cached in (True, False)
    ]  # fmt: skip
    assert runs[0].shape == (2, 45)
    assert torch.equal(runs[0], runs[1])


def test_a_cached_forward_in_pieces_gives_the_logits_of_one_pass() -> None:
    net = tiny_gpt()
    tokens = torch.randint(0, 256, (1, 12))
    cache = net.new_cache()
    pieces = [net(tokens[:, :5], cache), net(tokens[:, 5:6], cache), net(tokens[:, 6:], cache)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), net(tokens), atol=1e-5, rtol=1e-5)


def test_one_sequence_generates_the_logits_of_the_training_layout_and_sees_new_weights() -> None:
    """Generating for one sequence on the CPU multiplies by a transposed copy of each weight; the
    logits must be those of the layers themselves, also after the weights change in place."""
    net = tiny_gpt()
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        cache = net.new_cache()
        with torch.no_grad():
            net(tokens[:, :-1], cache)
            one_row = net(tokens[:, -1:], cache)[:, -1]
        with torch.enable_grad():
            layers = net(tokens)[:, -1].detach()
        torch.testing.assert_close(one_row, layers, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            for param in net.parameters():
                param.mul_(1.5)


def test_adapters_start_at_the_base_train_alone_and_merge_to_the_same_logits() -> None:
    net, base = tiny_gpt(), tiny_gpt()
    tokens = torch.randint(0, 256, (2, 12))
    adapted = add_adapters(net, rank=4, alpha=8, dropout=0.0, target_modules=TARGETS)
    assert len(adapted) == 4 * 2
    torch.testing.assert_close(net(tokens), base(tokens))
    trainable = [name for name, p in net.named_parameters() if p.requires_grad]
    assert trainable and all(name.endswith(("lora_a", "lora_b")) for name in trainable)
    for module in net.modules():
        if isinstance(module, LoRALinear):
            torch.nn.init.normal_(module.lora_b, std=0.5)
    with torch.no_grad():
        adapted_logits = net(tokens)
    assert not torch.allclose(adapted_logits, base(tokens), atol=1e-3)
    assert merge(net) == 8
    assert not any(isinstance(m, LoRALinear) for m in net.modules())
    with torch.no_grad():
        torch.testing.assert_close(net(tokens), adapted_logits, atol=1e-5, rtol=1e-5)
    assert set(net.state_dict()) == set(base.state_dict())


def test_adapter_targets_that_match_no_layer_are_refused_with_the_names_there_are() -> None:
    with pytest.raises(ValueError, match=r"matches none.*fc.*qkv"):
        add_adapters(tiny_gpt(), rank=4, alpha=8, dropout=0.0, target_modules=["attention"])


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"rank": 0}, "model.lora.rank=0"),
        ({"rank": True}, "model.lora.rank=True"),
        ({"alpha": float("nan")}, "model.lora.alpha=nan"),
        ({"alpha": 0}, "model.lora.alpha=0"),
    ],
)
def test_adapter_settings_a_run_cannot_use_are_refused(
    setting: dict[str, float], words: str
) -> None:
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["mlp.fc"], **setting}
    with pytest.raises(ValueError, match=re.escape(words)):
        add_adapters(tiny_gpt(), **lora)  # type: ignore[arg-type]


def test_one_adapter_target_may_be_given_as_a_name() -> None:
    assert add_adapters(tiny_gpt(), rank=4, alpha=8, dropout=0.0, target_modules="mlp.fc")


@pytest.mark.parametrize(
    "prompt", ["def main(", "it's", "a\\b", "end\\", "x\\'y", "${oc.env:HOME}", "a=b, c", "été"]
)
def test_a_prompt_on_the_command_line_is_taken_as_typed(prompt: str) -> None:
    override = OverridesParser.create().parse_override(verbatim(f"prompt={prompt}", ("prompt",)))
    from omegaconf import OmegaConf

    assert OmegaConf.create({"prompt": override.value()}).prompt == prompt


# The CLI: a base model trained once, then fine-tuned, run, merged and exported.
TINY = ["model.net.n_layer=1", "model.net.n_embd=64", "model.net.n_head=2", "data.block_size=64"]
QUIET = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]


def command(entry_name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*entry(entry_name), *args, cwd=cwd)


def one_error_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The language example, trained briefly on the standard library's source."""
    cwd = tmp_path_factory.mktemp("base")
    result = run_cli(
        "-m", PACKAGE, *QUIET, "experiment=language", *TINY, "data.max_bytes=300000",
        "trainer.max_steps=40", "trainer.val_check_interval=40", "trainer.limit_val_batches=4",
        "trainer.limit_test_batches=2", "run_name=base", cwd=cwd,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "logs" / "train" / "runs" / "base" / "checkpoints" / "last.ckpt"


FINE_TUNE = [*QUIET, "experiment=language_finetune", *TINY, "trainer.limit_test_batches=2"]


@pytest.fixture(scope="module")
def fine_tuned(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("fine_tuned")
    result = run_cli(
        "-m", PACKAGE, *FINE_TUNE, f"init_from={base}", "trainer.max_steps=60",
        "trainer.val_check_interval=30", "run_name=tuned", cwd=cwd,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "logs" / "train" / "runs" / "tuned"


@pytest.mark.slow
def test_lora_fine_tuning_lowers_the_validation_loss_training_a_small_share(
    fine_tuned: Path, base: Path
) -> None:
    """On this project's YAML configs, from a model of Python source: at least 0.1 nats lower
    after 60 steps, with at most 10 % of the parameters training; checkpoints hold only the
    adapters, and name (with its SHA-256) the checkpoint the rest comes from."""
    metrics = json.loads((fine_tuned / "metrics.json").read_text())
    assert metrics["init/val/loss"] - metrics["val/loss"] >= 0.1, metrics
    last = torch.load(fine_tuned / "checkpoints" / "last.ckpt", weights_only=True)
    assert set(last["state_dict"]) and all(
        name.endswith(("lora_a", "lora_b")) for name in last["state_dict"]
    )
    assert last["base_weights"]["path"] == str(base.resolve())
    (optimizer,) = last["optimizer_states"]
    assert len(optimizer["state"]) == len(last["state_dict"]), "the optimizer holds the adapters"
    trained = sum(v.numel() for v in last["state_dict"].values())
    total = sum(v.numel() for v in torch.load(base, weights_only=True)["state_dict"].values())
    assert trained / total <= 0.10, (trained, total)


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    [
        ["strategy=ddp", "trainer.devices=2"],
        ["strategy=model_parallel", "trainer.strategy.data_parallel_size=2", "trainer.devices=2"],
        ["model.compile=true", "trainer.precision=bf16-mixed"],
    ],
    ids=["ddp", "fsdp2", "compiled-bf16"],
)
def test_fine_tuning_runs_under_each_strategy_and_compiled(
    base: Path, tmp_path: Path, setting: list[str]
) -> None:
    result = run_cli(
        "-m", PACKAGE, *FINE_TUNE, f"init_from={base}", *setting, "trainer.max_steps=6",
        "trainer.val_check_interval=3", "trainer.limit_val_batches=2", "run_name=tuned",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "logs" / "train" / "runs" / "tuned"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["val/loss"] < metrics["init/val/loss"], metrics
    state = read_last(run_dir / "checkpoints" / "last.ckpt")["state_dict"]  # a folder under fsdp2
    assert state and all(name.endswith(("lora_a", "lora_b")) for name in state)


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "at"), [("train_step", 6), ("fit_end", 1), ("test", 1)])
def test_a_killed_fine_tuning_run_finishes_as_if_never_stopped(
    base: Path, tmp_path: Path, reference_run: References, phase: str, at: int
) -> None:
    """Killed after fit, the resumed run's metrics.json lacked the starting weights' `init/...`
    validation; killed after the last step, it resumed from the checkpoint of step 12, where
    Lightning skips the end of the epoch and of fit."""
    run = [
        *COMMON, "experiment=language_finetune", *TINY, f"init_from={base}",
        "trainer.max_steps=12", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2", "callbacks.step_checkpoint.every_n_train_steps=4",
    ]  # fmt: skip
    killed_then_finished([*run, *fault(phase, at, tmp_path / "fired")], tmp_path / "run")
    assert_same_outcome(reference_run(run), tmp_path / "run")


@pytest.mark.slow
def test_merged_adapters_evaluate_as_the_adapters_do(fine_tuned: Path, tmp_path: Path) -> None:
    adapters = fine_tuned / "checkpoints" / "last.ckpt"
    merged = tmp_path / "merged.ckpt"
    result = command("export", f"ckpt_path={adapters}", "format=checkpoint", f"output={merged}",
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = torch.load(merged, weights_only=True)
    assert "base_weights" not in checkpoint and checkpoint["run_config"]["model"]["lora"] is None
    losses = []
    for name, path in (("adapters", adapters), ("merged", merged)):
        result = command("evaluate", f"ckpt_path={path}", *QUIET[:3], "trainer.limit_test_batches=2",
                         f"hydra.run.dir={name}", cwd=tmp_path)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append(json.loads((tmp_path / name / "metrics.json").read_text())["test/loss"])
    assert abs(losses[0] - losses[1]) < 1e-5, losses


@pytest.mark.slow
def test_predict_streams_one_prompt_and_writes_many_the_same_with_a_seed(
    fine_tuned: Path, tmp_path: Path
) -> None:
    ckpt = fine_tuned / "checkpoints" / "last.ckpt"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\nclass Config:\n")
    outputs = []
    for cached in ("true", "true", "false"):
        result = command("predict", f"ckpt_path={ckpt}", f"prompt_file={prompts}", "seed=3",
                         "max_new_tokens=30", f"kv_cache={cached}", f"hydra.run.dir=out{len(outputs)}",
                         cwd=tmp_path)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        lines = (tmp_path / f"out{len(outputs)}" / "predictions.jsonl").read_text().splitlines()
        outputs.append([json.loads(line) for line in lines])
    assert [row["prompt"] for row in outputs[0]] == ["def main(", "class Config:"]
    assert all(len(row["completion"].encode()) >= 20 for row in outputs[0])
    assert outputs[0] == outputs[1] == outputs[2]
    result = command("predict", f"ckpt_path={ckpt}", "prompt=def main(", "seed=3",
                     "max_new_tokens=30", "hydra.run.dir=single", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "single" / "predictions.jsonl").open()]
    assert "def main(" + row["completion"] + "\n" in result.stdout


@pytest.mark.slow
def test_a_killed_predict_run_again_writes_its_predictions_in_the_same_folder(
    base: Path, tmp_path: Path
) -> None:
    """Killed while it waits for its prompts (on standard input), the same command run again
    writes into the folder the first one made what a command never killed writes."""
    args = [sys.executable, *entry("predict"), f"ckpt_path={base}", "prompt_file=/dev/stdin",
            "seed=3", "max_new_tokens=20"]  # fmt: skip
    prompts = "def main(\nclass Config:\n"
    never_killed, killed = tmp_path / "never_killed", tmp_path / "killed"

    def predict(cwd: Path) -> list[dict[str, str]]:
        cwd.mkdir(exist_ok=True)
        result = subprocess.run(
            args, cwd=cwd, input=prompts, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
        (folder,) = (cwd / "logs" / "predict" / "runs").iterdir()
        return [json.loads(line) for line in (folder / "predictions.jsonl").open()]

    killed.mkdir()
    waiting = subprocess.Popen(
        args, cwd=killed, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(killed.glob("logs/predict/runs/*/predict.log")):
        assert waiting.poll() is None and time.monotonic() < deadline, "it never started"
        time.sleep(0.2)
    time.sleep(1)
    os.killpg(waiting.pid, signal.SIGKILL)
    waiting.wait()
    assert waiting.stdin is not None
    waiting.stdin.close()
    assert not list(killed.glob("logs/predict/runs/*/predictions.jsonl"))
    assert predict(killed) == predict(never_killed)


@pytest.mark.slow
def test_exported_programs_match_the_model_and_run_without_the_project(
    fine_tuned: Path, tmp_path: Path
) -> None:
    ckpt = fine_tuned / "checkpoints" / "last.ckpt"
    for fmt in ("pt2", "onnx"):
        out = tmp_path / f"model.{fmt}"
        result = command("export", f"ckpt_path={ckpt}", f"format={fmt}", f"output={out}",
                         cwd=tmp_path)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Parity on a test batch" in result.stdout + result.stderr and out.is_file()
    # Above the tolerance the export fails and writes nothing (ONNX differs by about 1e-6).
    strict = tmp_path / "strict.onnx"
    result = command("export", f"ckpt_path={ckpt}", "format=onnx", f"output={strict}",
                     "tolerance=1e-12", cwd=tmp_path)  # fmt: skip
    one_error_line(result, "more than tolerance=1e-12", "nothing was written")
    assert not strict.exists() and not list(tmp_path.glob(".strict.onnx*"))
    # The project cannot be imported here, as on a machine where it is not installed.
    script = f"""
import sys; sys.modules[{PACKAGE!r}] = None
import torch, numpy, onnxruntime
tokens = torch.randint(0, 256, (3, 50))
logits = torch.export.load({str(tmp_path / "model.pt2")!r}).module()(tokens)
session = onnxruntime.InferenceSession({str(tmp_path / "model.onnx")!r})
(other,) = session.run(None, dict(inputs=tokens.numpy()))
assert logits.shape == (3, 50, 256), logits.shape
assert numpy.abs(logits.detach().numpy() - other).max() < 1e-4
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300)  # fmt: skip
    assert result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.slow
def test_bad_inputs_get_one_line_and_leave_nothing(
    base: Path, fine_tuned: Path, tmp_path: Path
) -> None:
    ckpt = fine_tuned / "checkpoints" / "last.ckpt"
    (tmp_path / "empty.txt").write_text("\n\n")
    cases = {
        ("predict", f"ckpt_path={ckpt}", "prompt=" + "x" * 65): ("65 bytes", "context of 64"),
        ("predict", f"ckpt_path={ckpt}", "prompt="): ("empty",),
        ("predict", f"ckpt_path={ckpt}", "prompt_file=empty.txt"): ("no prompts",),
        ("predict", f"ckpt_path={ckpt}", "prompt_file=missing.txt"): ("cannot be read",),
        ("predict", f"ckpt_path={ckpt}", "prompt_file=/dev/zero"): ("more than 64 MiB",),
        ("predict", f"ckpt_path={ckpt}"): ("prompt=",),
        ("predict", f"ckpt_path={ckpt}", "inputs=a.png"): ("language model", "prompt="),
        ("predict", f"ckpt_path={ckpt}", "prompt=x", "temperature=-1"): ("temperature",),
        ("predict", f"ckpt_path={ckpt}", "prompt=x", "temperature=nan"): ("temperature", "finite"),
        ("predict", f"ckpt_path={ckpt}", "prompt=x", "temperature=inf"): ("temperature", "finite"),
        ("predict", f"ckpt_path={ckpt}", "prompt=x", "chat=true"): ("not trained on instructions",),
        ("predict", f"ckpt_path={ckpt}", "chat=true"): ("not trained on instructions",),
        ("export", f"ckpt_path={ckpt}", "format=tflite"): ("format=tflite", "pt2"),
    }
    ran = run_commands(list(cases), tmp_path, tmp_path.parent / f"{tmp_path.name}-results.json")
    for result, words in zip(ran, cases.values(), strict=True):
        one_error_line(result, *words)
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("*.json*"))
    # init_from a checkpoint of another shape: the mismatched weights are named.
    result = run_cli("-m", PACKAGE, *FINE_TUNE, "model.net.n_layer=2", f"init_from={base}",
                     cwd=tmp_path)  # fmt: skip
    one_error_line(result, "another model", "missing: net.blocks.1")
    # Fine-tuned adapters whose base checkpoint changed since: refused, named.
    copy = tmp_path / "copy"
    copy.mkdir()
    moved_base = copy / "base.ckpt"
    moved_base.write_bytes(base.read_bytes())
    result = run_cli("-m", PACKAGE, *FINE_TUNE, f"init_from={moved_base}", "trainer.max_steps=2",
                     "trainer.val_check_interval=2", "run_name=short", cwd=copy)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    short = copy / "logs" / "train" / "runs" / "short" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(moved_base, weights_only=True)
    checkpoint["state_dict"]["net.wte.weight"] += 1
    torch.save(checkpoint, moved_base)
    one_error_line(command("predict", f"ckpt_path={short}", "prompt=x", cwd=tmp_path),
                   "has changed", str(moved_base))  # fmt: skip
    result = run_cli("-m", PACKAGE, *FINE_TUNE, f"init_from={moved_base}", "trainer.max_steps=4",
                     "trainer.val_check_interval=2", "run_name=short", "extend=true", cwd=copy)  # fmt: skip
    one_error_line(result, "has changed since this run started")
    moved_base.unlink()
    one_error_line(command("evaluate", f"ckpt_path={short}", cwd=tmp_path), "missing")
