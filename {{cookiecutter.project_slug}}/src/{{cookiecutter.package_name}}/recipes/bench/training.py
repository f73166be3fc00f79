"""Time an experiment's training step: in Lightning and in plain PyTorch{% if cookiecutter.examples != "vision" %},
and for a GPT in the nanoGPT-style peer{% endif %}.

    {{ cookiecutter.package_name }}-bench{% if cookiecutter.examples != "vision" %} experiment=gpt2_small trainer=gpu{% endif %} bench.steps=50

The Lightning and plain loops train the same network with the same optimizer, schedule, precision
(autocast), compile setting, gradient clipping and accumulation on the same batches. Each runs
`bench.warmup` steps (compilation and autotuning happen there; the device is synchronized after
each), then `bench.steps` measured steps during which the host clock is read at every step's start
and end and the device is synchronized only at the window's two ends (clock.py). The plain loop
computes the loss as the example modules do (the net's own `forward(inputs, targets=...)` where it
takes targets, the cross-entropy of the net's output otherwise); the Lightning loop runs the LightningModule's own
`training_step`.{% if cookiecutter.examples != "vision" %} With `bench.peer=nanogpt`, a GPT is also trained by a plain nanoGPT-style loop
with its own model of the same shape (peer.py), on the same batches, in the same process.{% endif %}
"""

from __future__ import annotations

import inspect
import logging
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf, open_dict

from ...callbacks.throughput import peak_tflops
from ...errors import ConfigError
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
from ...run.plan import strategy_of
from ...targets import build
from .clock import LightningStepClock, StepClock, epochs_of
from .device import (
    AUTOCAST_DTYPES,
    TRUE_DTYPES,
    ceiling_dtype,
    device_name,
    matmul_tflops,
    peak_memory_gib,
    release_memory,
)
from .report import command_line, compare, publish, rates, report

log = logging.getLogger(__name__)

NET_SHAPE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "loss_chunk_size")


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
    schedule = configured.get("lr_scheduler") or {}
    # One that steps on a validation metric (ReduceLROnPlateau) has none to step on here.
    scheduler = None if schedule.get("monitor") else schedule.get("scheduler")
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
    autocast_dtype = AUTOCAST_DTYPES.get(precision)
    clip_value = cfg.trainer.get("gradient_clip_val")
    clip_by_value = cfg.trainer.get("gradient_clip_algorithm") == "value"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    takes_targets = "targets" in inspect.signature(net.forward).parameters
    stream = epochs_of(datamodule.train_dataloader(), seed)
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
            if takes_targets:  # the net computes its loss itself, in its compiled forward
                loss = net(inputs, targets=targets)
            else:
                loss = F.cross_entropy(net(inputs).flatten(0, -2).float(), targets.flatten())
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


def bench(cfg: DictConfig) -> dict[str, Any]:
    settings = cfg.bench
    accelerator = resolve_accelerator(str(cfg.trainer.accelerator))
    precision = resolve_precision(str(cfg.trainer.precision), accelerator)
    configure_matmul_precision(cfg.get("matmul_precision"))
    use_hydra_logging_only()
    device = torch.device("cuda" if accelerator in ("gpu", "cuda") else accelerator)
    with torch.device("meta"):
        net = build(cfg.model.net, where="model.net")
        check_fp8(cfg.model.get("fp8"), strategy_of(cfg.trainer.get("strategy")), device.type, net)

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
    # A language model's shape, where the net has one: what the peer mirrors.
    shape = {key: cfg.model.net.get(key) for key in NET_SHAPE if key in cfg.model.net}
    if shape:
        results["net"] = shape
    loops = {"lightning": summary}
    if settings.get("plain", True):
        clock = StepClock(device, settings.warmup, settings.steps)
        loops["plain"] = plain_loop(cfg, device, precision, clock)
        loops["plain"]["peak_memory_gib"] = peak_memory_gib(device)
        results["same_batches"] = clock.fingerprints == fingerprints
        release_memory(device)
{%- if cookiecutter.examples != "vision" %}
    if settings.get("peer"):
        peer = run_peer(cfg, device, precision, fingerprints, results)
        if peer is not None:
            loops["peer"] = peer
{%- endif %}
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
    compare(results)

    publish(results, Path(settings.output), report(results))
    return results
{%- if cookiecutter.examples != "vision" %}


def run_peer(
    cfg: DictConfig,
    device: torch.device,
    precision: str,
    fingerprints: list[int],
    results: dict[str, Any],
) -> dict[str, Any] | None:
    """The peer's loop on the same batches, or None (with a note) for a net it cannot mirror."""
    from .peer import NAME, peer_loop, peer_shape

    shape = peer_shape(cfg.model.net)
    if shape is None:
        results["peer_note"] = (
            f"bench.peer={NAME} mirrors a GPT (model.net with vocab_size, block_size, n_layer, "
            "n_head, n_embd): not run for this model"
        )
        return None
    clock = StepClock(device, cfg.bench.warmup, cfg.bench.steps)
    loop = peer_loop(cfg, device, precision, clock, shape)
    loop["peak_memory_gib"] = peak_memory_gib(device)
    results["peer_name"] = NAME
    results["peer_same_batches"] = clock.fingerprints == fingerprints
    release_memory(device)
    return loop
{%- endif %}
