"""Time an experiment's training step, in Lightning and in plain PyTorch.

    {{ cookiecutter.package_name }}-bench{% if cookiecutter.examples != "vision" %} experiment=gpt2_small trainer=gpu{% endif %} bench.steps=50

Both loops train the same network with the same optimizer, schedule, precision (autocast),
compile setting, gradient clipping and accumulation on the same batches. Each runs `bench.warmup`
steps (compilation and autotuning happen there; the device is synchronized after each), then
`bench.steps` measured steps during which the host clock is read at every step's start and end
and the device is synchronized only at the window's two ends. The plain loop trains `model.net`
with cross-entropy of its output against the batch's targets, which is what both example modules
do; the Lightning loop runs the LightningModule's own `training_step`.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from ...callbacks.throughput import peak_tflops
from ...errors import ConfigError
from ...files import write_text_atomically
from ...models.fp8 import convert_to_fp8
from ...models.lora import add_adapters
from ...models.optim import configure_optimizers
from ...run.machine import (
    check_fp8,
    configure_matmul_precision,
    resolve_accelerator,
    resolve_precision,
    use_hydra_logging_only,
)
from ...targets import build

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


class StepClock:
    """Host clock at each step's start (batch on the device) and end (optimizer stepped).

    The device is synchronized around every warm-up step and at the start of step `warmup` and
    of step `warmup + steps`, never in between: the measured window holds `steps` whole steps.
    """

    def __init__(self, device: torch.device, warmup: int, steps: int) -> None:
        self.device = device
        self.warmup = warmup
        self.steps = steps
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.fingerprints: list[int] = []

    @property
    def total(self) -> int:
        """Steps started: warm-up, measured, and the one whose start closes the window."""
        return self.warmup + self.steps + 1

    @property
    def done(self) -> bool:
        return len(self.starts) >= self.total

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self, batch: Any) -> None:
        index = len(self.starts)
        if index >= self.total:
            return
        if index < self.warmup:
            # Tells whether both loops saw the same batches; the warm-up syncs anyway.
            self.fingerprints.append(int(batch[-1].long().sum()))
        if index <= self.warmup or index == self.total - 1:
            self.synchronize()
        self.starts.append(time.perf_counter())

    def end(self) -> None:
        if len(self.ends) < self.warmup:
            self.synchronize()
        self.ends.append(time.perf_counter())

    def summary(self) -> dict[str, Any]:
        """Step times in seconds. `data_share` is the host time between one step's end and the
        next step's start (fetching the next batch, moving it to the device) over the window."""
        if not self.done:
            raise RuntimeError(f"only {len(self.starts)} of {self.total} steps ran")
        first, last = self.warmup, self.warmup + self.steps
        window = self.starts[last] - self.starts[first]
        steps = [b - a for a, b in itertools.pairwise(self.starts[first : last + 1])]
        waits = [self.starts[i + 1] - self.ends[i] for i in range(first, last)]
        median = statistics.median(steps)
        deciles = (
            statistics.quantiles(steps, n=10, method="inclusive")  # within the times measured
            if len(steps) > 1
            else [median] * 9
        )
        warmup_steps = [b - a for a, b in itertools.pairwise(self.starts[: first + 1])]
        return {
            "step_time_median_s": median,
            "step_time_p10_s": deciles[0],
            "step_time_p90_s": deciles[-1],
            "step_time_mean_s": window / self.steps,
            "data_share": sum(waits) / window,
            "first_step_s": warmup_steps[0] if warmup_steps else None,
            "warmup_excess_s": sum(max(0.0, t - median) for t in warmup_steps),
        }


class LightningStepClock(Callback):
    """Reads a `StepClock` at Lightning's batch hooks; nothing else."""

    def __init__(self, clock: StepClock, seed: int) -> None:
        self.clock = clock
        self.seed = seed

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The same sampler seed as the plain loop: Lightning draws it when it first iterates.
        torch.manual_seed(self.seed)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.clock.start(batch)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.clock.end()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    return f"{cpu} ({torch.get_num_threads()} threads)"


def ceiling_dtype(precision: str, device: torch.device) -> torch.dtype:
    """On a GPU, the dtype the model's matrix products run in under this precision; on a CPU,
    float32 (few CPUs multiply 16-bit floats natively)."""
    if device.type == "cpu":
        return torch.float32
    return AUTOCAST_DTYPES.get(precision) or TRUE_DTYPES.get(precision) or torch.float32


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """The median rate of a size x size x size matrix product over 5 timings, on the threads the
    loops use: the ceiling the model's matmuls can reach on this device in this dtype (float32
    follows `matmul_precision`)."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    out = torch.empty_like(a)
    repeats = 10 if device.type == "cuda" else 2
    for _ in range(2):
        torch.mm(a, b, out=out)
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / repeats)
    return 2 * size**3 / statistics.median(times) / 1e12


def release_memory(device: torch.device) -> None:
    """Free what the last loop left, forget compiled graphs, and restart the memory peak."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def build_trainer(
    cfg: DictConfig, accelerator: str, precision: str, callbacks: list[Any], max_steps: int
) -> L.Trainer:
    """The configured Trainer on one device, with no validation, logger, checkpoint, progress
    bar or configured callback: what remains is the training step as Lightning runs it."""
    return build(
        cfg.trainer,
        where="trainer",
        accelerator=accelerator,
        precision=precision,
        devices=1,
        num_nodes=1,
        strategy="auto",
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=-1,
        max_steps=max_steps,
        val_check_interval=1.0,
        check_val_every_n_epoch=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )


def lightning_loop(
    cfg: DictConfig, accelerator: str, precision: str, clock: StepClock
) -> tuple[dict[str, Any], Any, Any]:
    seed = int(cfg.get("seed") or 0)
    L.seed_everything(seed, workers=True)
    datamodule = build(cfg.data, where="data")
    model = build(cfg.model, where="model")
    accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    trainer = build_trainer(
        cfg,
        accelerator,
        precision,
        [LightningStepClock(clock, seed)],
        max_steps=math.ceil(clock.total / accumulate),
    )
    trainer.fit(model, datamodule=datamodule)
    optimizer = trainer.optimizers[0]
    return {**clock.summary(), **network_figures(model, optimizer)}, model, datamodule


def plain_loop(
    cfg: DictConfig, device: torch.device, precision: str, clock: StepClock
) -> dict[str, Any]:
    """The same training in plain PyTorch: what Lightning's automatic optimization does, written
    out (autocast, GradScaler for 16-mixed, accumulation, clipping, per-step LR schedule)."""
    seed = int(cfg.get("seed") or 0)
    L.seed_everything(seed, workers=True)
    datamodule = build(cfg.data, where="data")
    datamodule.setup("fit")
    net = build(cfg.model.net, where="model.net")
    # As the LightningModule prepares it: adapters when it is built, float8 layers at setup.
    if cfg.model.get("lora"):
        add_adapters(net, **OmegaConf.to_container(cfg.model.lora))  # type: ignore[arg-type]
    if cfg.model.get("fp8"):
        convert_to_fp8(net, cfg.model.fp8)
    if precision in TRUE_DTYPES:
        net.to(TRUE_DTYPES[precision])
    net.to(device).train()
    if cfg.model.get("compile"):
        net.compile()
    accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    scheduler_factory = (
        build(cfg.model.scheduler, where="model.scheduler") if cfg.model.get("scheduler") else None
    )
    configured = configure_optimizers(
        net,
        build(cfg.model.optimizer, where="model.optimizer"),
        scheduler_factory,
        total_steps=math.ceil(clock.total / accumulate),
    )
    optimizer = configured["optimizer"]
    scheduler = configured["lr_scheduler"]["scheduler"] if "lr_scheduler" in configured else None
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
    autocast_dtype = AUTOCAST_DTYPES.get(precision)
    clip_value = cfg.trainer.get("gradient_clip_val")
    clip_by_value = cfg.trainer.get("gradient_clip_algorithm") == "value"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    loader = datamodule.train_dataloader()

    def batches() -> Any:
        """Epoch after epoch, setting the sampler's epoch at each start as Lightning does."""
        for epoch in itertools.count():
            for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
                set_epoch = getattr(sampler, "set_epoch", None)
                if set_epoch is not None:
                    set_epoch(epoch)
            yield from loader

    torch.manual_seed(seed)
    stream = batches()
    for index in range(clock.total):
        batch = next(stream)
        batch = [t.to(device, non_blocking=True) for t in batch]
        batch = datamodule.on_after_batch_transfer(batch, 0)
        inputs, targets = batch
        if precision in TRUE_DTYPES and inputs.is_floating_point():
            inputs = inputs.to(TRUE_DTYPES[precision])
        clock.start(batch)
        if clock.done:
            break
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = net(inputs)
            loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
        scaler.scale(loss / accumulate).backward()
        if (index + 1) % accumulate == 0:
            if clip_value:
                scaler.unscale_(optimizer)
                if clip_by_value:
                    torch.nn.utils.clip_grad_value_(params, clip_value)
                else:
                    torch.nn.utils.clip_grad_norm_(params, clip_value)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        clock.end()
    return {**clock.summary(), **network_figures(net, optimizer)}


def network_figures(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What a loop trained: both loops must agree on these for their times to compare."""
    return {
        "trained_parameters": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
        "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in net.modules()),
    }


def find_batch_size(cfg: DictConfig, accelerator: str, precision: str) -> int:
    """The largest batch size (powers of two) that trains without running out of memory."""
    from lightning.pytorch.tuner import Tuner

    datamodule = build(cfg.data, where="data")
    model = build(cfg.model, where="model")
    trainer = build_trainer(cfg, accelerator, precision, [], max_steps=1)
    found = Tuner(trainer).scale_batch_size(
        model,
        datamodule=datamodule,
        mode="power",
        steps_per_trial=3,
        init_val=int(cfg.data.batch_size),
    )
    if not found:
        raise ConfigError("the batch-size finder found no batch size that fits")
    # The finder stops at the data set's size; training drops the ragged last batch.
    while found > 1 and len(datamodule.train_dataloader()) == 0:
        found //= 2
        datamodule.batch_size = found
    return int(found)


def rates(
    summary: dict[str, Any],
    samples_per_step: int,
    tokens_per_sample: int | None,
    flops_per_sample: float | None,
    peak: float | None,
    ceiling: float,
) -> dict[str, Any]:
    """Throughput over the whole window (its mean step time), and the achieved share of the
    table's peak and of the measured matmul ceiling."""
    samples_per_sec = samples_per_step / summary["step_time_mean_s"]
    tflops = samples_per_sec * flops_per_sample / 1e12 if flops_per_sample else None
    return {
        "samples_per_sec": samples_per_sec,
        "tokens_per_sec": samples_per_sec * tokens_per_sample if tokens_per_sample else None,
        "tflops": tflops,
        "mfu": tflops / peak if tflops and peak else None,
        "mfu_vs_matmul": tflops / ceiling if tflops else None,
    }


def command_line() -> str:
    try:
        overrides = HydraConfig.get().overrides.task
    except ValueError:
        overrides = []
    program = "{{ cookiecutter.package_name }}-bench"
    return " ".join([program, *overrides])


def bench(cfg: DictConfig) -> dict[str, Any]:
    settings = cfg.bench
    accelerator = resolve_accelerator(str(cfg.trainer.accelerator))
    precision = resolve_precision(str(cfg.trainer.precision), accelerator)
    configure_matmul_precision(cfg.get("matmul_precision"))
    use_hydra_logging_only()
    device = torch.device("cuda" if accelerator in ("gpu", "cuda") else accelerator)
    with torch.device("meta"):
        check_fp8(cfg, device.type, build(cfg.model.net, where="model.net"))

    if settings.get("find_batch_size"):
        found = find_batch_size(cfg, accelerator, precision)
        log.info("Batch-size finder: data.batch_size=%d", found)
        with open_dict(cfg):
            cfg.data.batch_size = found
        release_memory(device)

    size = settings.get("matmul_size") or (8192 if device.type == "cuda" else 1024)
    ceiling = matmul_tflops(device, ceiling_dtype(precision, device), size)
    peak = peak_tflops(device_name(device), precision) if device.type == "cuda" else None
    release_memory(device)

    clock = StepClock(device, settings.warmup, settings.steps)
    summary, model, datamodule = lightning_loop(cfg, accelerator, precision, clock)
    summary["peak_memory_gib"] = peak_memory_gib(device)
    batch_size = int(datamodule.batch_size)
    tokens_per_sample = getattr(model, "tokens_per_sample", None)
    flops_per_sample = getattr(model, "flops_per_sample", None)
    fingerprints = clock.fingerprints
    del model, datamodule
    release_memory(device)

    compiled = bool(cfg.model.get("compile"))
    results: dict[str, Any] = {
        "command": command_line(),
        "device": device_name(device),
        "torch_version": torch.__version__,
        "lightning_version": L.__version__,
        "precision": precision,
        "compile": compiled,
        "fp8": cfg.model.get("fp8"),
        "batch_size": batch_size,
        "accumulate_grad_batches": int(cfg.trainer.get("accumulate_grad_batches") or 1),
        "tokens_per_sample": tokens_per_sample,
        "flops_per_sample": flops_per_sample,
        "warmup_steps": settings.warmup,
        "steps": settings.steps,
        "peak_tflops": peak,
        "matmul_tflops": ceiling,
        "matmul_size": size,
        "matmul_dtype": str(ceiling_dtype(precision, device)).removeprefix("torch."),
    }
    loops = {"lightning": summary}
    if settings.get("plain", True):
        clock = StepClock(device, settings.warmup, settings.steps)
        loops["plain"] = plain_loop(cfg, device, precision, clock)
        loops["plain"]["peak_memory_gib"] = peak_memory_gib(device)
        results["same_batches"] = clock.fingerprints == fingerprints
        release_memory(device)
    # The ceiling again after the loops, and the higher of the two: on a machine whose speed
    # changes (other jobs, clocks), one measurement can fall below what the loops then reached.
    after = matmul_tflops(device, ceiling_dtype(precision, device), size)
    results["matmul_tflops_before_after"] = [ceiling, after]
    ceiling = results["matmul_tflops"] = max(ceiling, after)
    for name, loop in loops.items():
        loop["compile_s"] = loop["warmup_excess_s"] if compiled else None
        loop.update(rates(loop, batch_size, tokens_per_sample, flops_per_sample, peak, ceiling))
        if not results["fp8"] and loop["mfu_vs_matmul"] is not None and loop["mfu_vs_matmul"] > 1:
            # Faster than the best matrix product measured: the machine's speed changed under
            # the run, and the figure would mislead. (Float8 matrix products may beat it.)
            loop["mfu_vs_matmul"] = None
            results["matmul_note"] = "MFU vs matmul left out: a loop beat the measured ceiling"
        results[name] = loop
    if "plain" in loops:
        plain = loops["plain"]
        results["ratio"] = summary["step_time_median_s"] / plain["step_time_median_s"]
        results["ratio_mean"] = summary["step_time_mean_s"] / plain["step_time_mean_s"]

    publish(results, Path(settings.output), report(results))
    return results


def publish(results: dict[str, Any], output: Path, text: str) -> None:
    """Print the report and write the results as JSON."""
    write_text_atomically(json.dumps(results, indent=2) + "\n", output)
    print(text)
    print(f"Wrote {output}")


# The width of the report's row labels, the longest of them
# ("MFU vs matmul (% of 1234.5 TFLOP/s)") included.
LABEL = 36


def report(results: dict[str, Any]) -> str:
    loops = [name for name in ("lightning", "plain") if name in results]

    def row(label: str, key: str, scale: float = 1.0, places: int = 2) -> str:
        cells = []
        for name in loops:
            value = results[name].get(key)
            cells.append("-" if value is None else f"{value * scale:,.{places}f}")
        return "  " + label.ljust(LABEL) + "".join(f"{cell:>14}" for cell in cells)

    peak = results["peak_tflops"]
    # Both MFU rows are percentages: the loop's TFLOP/s over the GPU's table peak, and over the
    # matmul ceiling measured on this device.
    mfu_vs_table = f"MFU vs table (% of {peak:g} TFLOP/s)" if peak else "MFU vs table peak (%)"
    mfu_vs_matmul = f"MFU vs matmul (% of {results['matmul_tflops']:.1f} TFLOP/s)"
    lines = [
        f"{results['command']}",
        f"  {results['device']}, {results['precision']}, "
        f"{'compiled' if results['compile'] else 'eager'}, "
        f"{'FP8 ' + results['fp8'] + ', ' if results['fp8'] else ''}batch {results['batch_size']}, "
        f"{results['steps']} steps after {results['warmup_steps']} warm-up",
        "  " + " " * LABEL + "".join(f"{name:>14}" for name in loops),
        row("step time median (ms)", "step_time_median_s", 1e3),
        row("step time p10 (ms)", "step_time_p10_s", 1e3),
        row("step time p90 (ms)", "step_time_p90_s", 1e3),
        row("step time mean (ms)", "step_time_mean_s", 1e3),
        row("samples/s", "samples_per_sec", places=1),
        row("tokens/s", "tokens_per_sec", places=0),
        row("TFLOP/s", "tflops", places=3),
        row(mfu_vs_table, "mfu", 100, 1),
        row(mfu_vs_matmul, "mfu_vs_matmul", 100, 1),
        row("peak memory (GiB)", "peak_memory_gib"),
        row("data wait share (%)", "data_share", 100, 1),
        row("first step (s)", "first_step_s"),
        row("compile (s)", "compile_s"),
        row("trained parameters", "trained_parameters", places=0),
        row("float8 layers", "float8_layers", places=0),
    ]
    if results.get("matmul_note"):
        lines.append(f"  {results['matmul_note']}")
    if "ratio" in results:
        lines.append(
            f"  Lightning/plain step time: {results['ratio']:.3f} (median), "
            f"{results['ratio_mean']:.3f} (mean); same batches: {results['same_batches']}"
        )
    return "\n".join(lines)
