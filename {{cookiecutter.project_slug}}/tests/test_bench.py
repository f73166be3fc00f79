"""The benchmark runs on CPU and reports every figure; these tests check the report, not speed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
{%- if cookiecutter.examples != "vision" %}
from hydra.utils import instantiate
{%- endif %}

from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.recipes.bench import (
    check_bench_settings,
    report,
    training,
)
from {{ cookiecutter.package_name }}.recipes.bench.clock import (
    StepClock,
)
from {{ cookiecutter.package_name }}.recipes.bench.training import (
    bench,
)
{%- if cookiecutter.examples != "vision" %}
from {{ cookiecutter.package_name }}.run.machine import FP8_ON_CPU

from .helpers import PACKAGE, compose_config, run_cli
{%- else %}

from .helpers import compose_config
{%- endif %}

LOOP_FIELDS = [
    "step_time_median_s",
    "step_time_p10_s",
    "step_time_p90_s",
    "step_time_mean_s",
    "samples_per_sec",
    "tflops",
    "data_share",
    "first_step_s",
    "warmup_excess_s",
]


def run_bench(tmp_path: Path, *overrides: str) -> dict[str, Any]:
    cfg = compose_config(
        "bench",
        ["trainer=cpu", "bench.warmup=2", "bench.steps=6", "bench.matmul_size=256", *overrides],
        tmp_path,
    )
    results = bench(cfg)
    written = json.loads(Path(cfg.bench.output).read_text())
    assert written == json.loads(json.dumps(results))
    return results


def assert_sane(results: dict[str, Any]) -> None:
    assert results["precision"] == "32-true"
    assert results["device"]
    assert results["matmul_tflops"] > 0
    assert results["same_batches"] is True
    loops = [loop for loop in ("lightning", "plain", "peer") if loop in results]
    for loop in loops:
        figures = results[loop]
        for field in LOOP_FIELDS:
            assert math.isfinite(figures[field]) and figures[field] >= 0, (loop, field)
        assert figures["step_time_median_s"] > 0
        assert figures["step_time_p10_s"] <= figures["step_time_p90_s"]
        assert 0 <= figures["data_share"] < 1
        # GPU-only figures are absent on CPU; compile time only when compiling.
        assert figures["peak_memory_gib"] is None
        assert figures["mfu"] is None
        assert figures["compile_s"] is None
    assert results["peak_tflops"] is None
    for loop in loops:
        share = results[loop]["mfu_vs_matmul"]
        assert (share is None and results["matmul_note"]) or 0 < share <= 1, (loop, share)
    assert results["matmul_tflops"] == max(results["matmul_tflops_before_after"])
    for ratio in ("ratio", "ratio_mean"):
        assert math.isfinite(results[ratio]) and results[ratio] > 0
    assert_same_network(results)


def assert_same_network(results: dict[str, Any]) -> None:
    """The two loops' times compare only if they trained the same thing."""
    for figure in ("trained_parameters", "float8_layers"):
        assert results["lightning"][figure] == results["plain"][figure], figure
    assert results["lightning"]["trained_parameters"] > 0
{%- if cookiecutter.examples != "language" %}


def test_bench_digits_on_cpu(tmp_path: Path) -> None:
    results = run_bench(tmp_path, "experiment=digits")
    assert_sane(results)
    assert results["batch_size"] == 64
    assert results["flops_per_sample"] > 0
    assert results["tokens_per_sample"] is None
    assert results["lightning"]["tokens_per_sec"] is None
{%- if cookiecutter.examples == "both" %}
    # The nanoGPT-style peer mirrors a GPT only; a convnet runs without it, and says so.
    assert "peer" not in results and "peer_ratio" not in results
    assert "mirrors a GPT" in results["peer_note"]
    assert results["peer_note"] in report.report(results)
{%- endif %}
{%- endif %}
{%- if cookiecutter.examples != "vision" %}


def test_bench_language_on_cpu(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 2000)
    results = run_bench(
        tmp_path,
        "experiment=language",
        f"data.source={text}",
        "model.net.n_layer=2",
        "model.net.n_embd=64",
        "model.net.n_head=2",
        "data.block_size=64",
    )
    assert_sane(results)
    assert results["tokens_per_sample"] == 64
    for loop in ("lightning", "plain", "peer"):
        figures = results[loop]
        assert figures["tokens_per_sec"] == pytest.approx(figures["samples_per_sec"] * 64)
    # The peer trained a network of the same size on the same batches, in the same process.
    assert results["peer_name"] == "nanogpt" and results["peer_same_batches"] is True
    assert results["peer"]["trained_parameters"] == results["lightning"]["trained_parameters"]
    assert results["peer_ratio"] == pytest.approx(
        results["lightning"]["step_time_median_s"] / results["peer"]["step_time_median_s"]
    )
    assert math.isfinite(results["peer_ratio_mean"]) and results["peer_ratio_mean"] > 0
    assert results["peer_memory_ratio"] is None  # no peak memory on a CPU
    printed = report.report(results)
    assert printed.splitlines()[2].split() == ["lightning", "plain", "nanogpt"]
    assert f"Lightning/nanogpt step time: {results['peer_ratio']:.3f} (median)" in printed


def test_the_peer_is_a_gpt_of_the_measured_shape(tmp_path: Path) -> None:
    """nanoGPT's model with the measured net's sizes: as many parameters in the same places
    (tied embeddings, no biases), and its first loss that of a uniform guess."""
    from {{ cookiecutter.package_name }}.recipes.bench.peer import (
        NanoGPT,
        peer_shape,
    )

    cfg = compose_config("bench", ["experiment=gpt2_small", "model.net.vocab_size=50304"], tmp_path)
    with torch.device("meta"):
        ours = instantiate(cfg.model.net)
        peer = NanoGPT(**peer_shape(cfg.model.net))  # type: ignore[arg-type]
    assert peer_shape(cfg.model.net) == {
        "vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768,
        "bias": False,
    }  # fmt: skip
    shapes = sorted(tuple(p.shape) for p in peer.parameters())
    assert shapes == sorted(tuple(p.shape) for p in ours.parameters())
    assert peer.lm_head.weight is peer.wte.weight
    small = NanoGPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
    tokens, targets = torch.randint(0, 64, (2, 4, 16))
    assert small(tokens, targets).item() == pytest.approx(math.log(64), abs=0.1)


def test_bench_without_the_peer(tmp_path: Path) -> None:
    results = run_bench(tmp_path, *SMALL_GPT, "bench.peer=null", "bench.plain=false")
    assert {"plain", "peer", "peer_ratio", "ratio"}.isdisjoint(results)
    assert results["lightning"]["step_time_median_s"] > 0


SMALL_GPT = [
    "experiment=language", "model.net.n_layer=2", "model.net.n_embd=64", "model.net.n_head=2",
    "data.block_size=64", "data.max_bytes=100000",
]  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "float8_layers"),
    [
        (["model.fp8=tensorwise", "trainer.precision=bf16-mixed"], 2 * 4),
        (["model.lora={rank:4,alpha:8,dropout:0.0,target_modules:[attn.qkv,mlp.fc]}"], 0),
    ],
    ids=["fp8", "lora"],
)
def test_both_loops_train_the_same_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: list[str], float8_layers: int
) -> None:
    """FP8 layers and LoRA adapters in the plain loop too, or its times compare nothing."""
    pytest.importorskip("torchao")
    monkeypatch.setenv(FP8_ON_CPU, "1")
    results = run_bench(tmp_path, *SMALL_GPT, *setting, "bench.peer=null")
    assert_same_network(results)
    assert results["lightning"]["float8_layers"] == float8_layers
    net = instantiate(compose_config("bench", SMALL_GPT, tmp_path).model.net)
    every = sum(p.numel() for p in net.parameters())
    trained = results["plain"]["trained_parameters"]
    assert trained < every / 5 if "lora" in str(setting) else trained == every


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        (["model.fp8=tensorwise"], "model.fp8 needs a GPU of compute capability 8.9"),
        (
            ["+hydra.callbacks.x._target_=pathlib.Path.mkdir", "+hydra.callbacks.x.self=made"],
            "hydra.callbacks.x._target_=pathlib.Path.mkdir in the config is not allowed",
        ),
    ],
    ids=["fp8-on-cpu", "hydra-callback"],
)
def test_bench_refuses_what_training_refuses_in_one_line_leaving_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: list[str], words: str
) -> None:
    monkeypatch.delenv(FP8_ON_CPU, raising=False)
    result = run_cli(
        "-c", f"from {PACKAGE}.recipes.bench import main; main()", "trainer=cpu", *SMALL_GPT, *setting,
        cwd=tmp_path,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and words in lines[0], result.stderr[-2000:]
    assert not (tmp_path / "logs").exists() and not (tmp_path / "made").exists()


def test_generation_bench_times_both_ways_from_the_command_line(tmp_path: Path) -> None:
    """Through the console script's own config lookup, as a user runs it."""
    output = tmp_path / "generation.json"
    result = run_cli(
        "-c", f"from {PACKAGE}.recipes.bench import main; main()", "experiment=language", "trainer=cpu",
        "bench.generation=true", "bench.batch=2", "bench.new_tokens=20", "bench.repeats=1",
        "model.net.n_layer=1", f"bench.output={output}", f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())
    for way in ("kv_cache", "recompute"):
        assert results[way]["tokens_per_sec"] == pytest.approx(2 * 20 / results[way]["seconds"])
    assert "cache speedup" in result.stdout
    too_long = run_cli(
        "-c", f"from {PACKAGE}.recipes.bench import main; main()", "experiment=language", "trainer=cpu",
        "bench.generation=true", "bench.new_tokens=500", cwd=tmp_path,
    )  # fmt: skip
    assert too_long.returncode == 1 and "exceeds the model's context" in too_long.stderr


def test_generation_bench_times_transformers_generate_on_the_same_weights(tmp_path: Path) -> None:
    """Transformers' GPT2LMHeadModel gets our GPT's weights (the same logits, biases included)
    and its cached `generate` is timed in pairs with ours."""
    pytest.importorskip("transformers")
    from {{ cookiecutter.package_name }}.models.nets.gpt import (
        GPT,
    )
    from {{ cookiecutter.package_name }}.recipes.bench.generation import (
        bench_generation,
        hugging_face_twin,
    )

    cfg = compose_config(
        "bench",
        [
            "experiment=language", "trainer=cpu", "bench.generation=true", "bench.batch=2",
            "bench.new_tokens=12", "bench.repeats=2", "model.net.n_layer=2",
            "bench.compile_decode=true", f"bench.output={tmp_path / 'generation.json'}",
        ],
        tmp_path,
    )  # fmt: skip
    results = bench_generation(cfg)
    assert results["compiled"]["tokens_per_sec"] == pytest.approx(
        2 * 12 / results["compiled"]["seconds"]
    )
    theirs = results["transformers"]
    assert theirs["max_logit_difference"] < 1e-4
    # Ours (compiled, as asked) against transformers' dynamic cache; its static compiled one is
    # timed on a GPU only.
    assert theirs["ours"] == "compiled" and "static" not in theirs
    assert len(theirs["rounds_s"]) == 2
    dynamic = theirs["dynamic"]
    assert dynamic["tokens_per_sec"] == pytest.approx(
        2 * 12 / min(row[1] for row in theirs["rounds_s"])
    )
    ratios = sorted(row[1] / row[0] for row in theirs["rounds_s"])
    assert dynamic["ours_over_transformers"] == pytest.approx(sum(ratios) / 2)
    torch.manual_seed(0)
    net = GPT(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16, bias=True).eval()
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)  # biases that are not zeros
    idx = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(hugging_face_twin(net)(idx).logits, net(idx))
{%- endif %}


def test_a_share_of_the_matmul_ceiling_above_one_is_not_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine that got faster under the run (the ceiling measured while other jobs ran)."""
    monkeypatch.setattr(training, "matmul_tflops", lambda *args: 1e-9)
    results = run_bench(tmp_path)
    assert results["lightning"]["mfu_vs_matmul"] is None
    assert "beat the measured ceiling" in results["matmul_note"]


def test_bench_without_plain_loop_has_no_ratio(tmp_path: Path) -> None:
    results = run_bench(tmp_path, "bench.plain=false")
    assert "plain" not in results and "ratio" not in results
    assert results["lightning"]["step_time_median_s"] > 0


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("bench.steps=1", "bench.steps=1: use a whole number of 2 or more"),
        ("bench.warmup=0", "bench.warmup=0"),
        ("bench.matmul_size=0", "bench.matmul_size=0"),
{%- if cookiecutter.examples != "vision" %}
        ("bench.peer=llmc", "bench.peer=llmc: use nanogpt"),
{%- endif %}
        ("bench.repeats=0", "bench.repeats=0"),
        ("bench.save_every=-1", "bench.save_every=-1"),
        ("bench.checkpointing=true bench.save_every=100", "more than bench.steps"),
        ("bench.output=.", "is a folder"),
        ("bench.output=pyproject.toml/bench.json", "pyproject.toml, a file"),
        ("bench.output=/dev/null", "a device, a pipe or a socket"),
        ("bench.output=/proc/bench.json", "cannot be written"),
        ("paths.log_dir=", "paths.log_dir is empty"),
        ("trainer.devices=0", "trainer.devices=0"),
    ],
)
def test_bench_refuses_settings_it_cannot_use_before_measuring(
    tmp_path: Path, setting: str, words: str
) -> None:
    cfg = compose_config("bench", ["trainer=cpu", *setting.split()], tmp_path)
    with pytest.raises(ConfigError) as error:
        check_bench_settings(cfg)
    assert words in str(error.value)


def test_step_time_deciles_lie_within_the_times_measured() -> None:
    """Few steps, one quick and the rest slow (a busy machine): the 10th percentile lies among
    the step times measured, never extrapolated below the quickest (it was once negative)."""
    clock = StepClock(torch.device("cpu"), warmup=1, steps=4)
    durations = [0.01, 0.5, 0.5, 0.5]
    now = 0.0
    clock.starts, clock.ends = [now], [now + 0.01]
    for duration in [0.01, *durations]:
        now += duration
        clock.starts.append(now)
        clock.ends.append(now + 0.001)
    figures = clock.summary()
    assert min(durations) <= figures["step_time_p10_s"] <= figures["step_time_p90_s"] <= 0.5


@pytest.mark.parametrize("peak", [989.4, None], ids=["GPU in the table", "CPU"])
def test_both_mfu_rows_are_percentages_of_a_ceiling_in_tflops(peak: float | None) -> None:
    """MFU is the loops' TFLOP/s as a share of the table's peak and of the matmul ceiling
    measured on this device, printed as percentages: each row says so, and which ceiling."""
    mfu = 0.425 if peak else None  # no peak known, no MFU
    loop = {"tflops": 4.0, "mfu": mfu, "mfu_vs_matmul": 0.53, "step_time_median_s": 0.01}
    results = {
        "command": "bench", "device": "GPU", "precision": "bf16-mixed", "compile": False,
        "fp8": None, "batch_size": 64, "steps": 6, "warmup_steps": 2, "peak_tflops": peak,
        "matmul_tflops": 1234.56, "lightning": loop, "plain": loop,
    }  # fmt: skip
    lines = report.report(results).splitlines()
    rows = {line[:38].strip(): line[38:].split() for line in lines[2:]}
    assert rows["MFU vs matmul (% of 1234.6 TFLOP/s)"] == ["53.0", "53.0"]
    table = "MFU vs table (% of 989.4 TFLOP/s)" if peak else "MFU vs table peak (%)"
    assert rows[table] == (["42.5", "42.5"] if peak else ["-", "-"])
    assert len({len(line) for line in lines[2:]}) == 1, "every label fits its column"
