"""The export recipe: a trained model as a file that runs without this project.

- `format=checkpoint`: a plain checkpoint (weights, run config; no optimizer state) with any LoRA
  adapters merged into their base weights, which `eval`, `predict` and `export` use like any other;
- `format=pt2`: a `torch.export` program (`torch.export.load(path).module()`);
- `format=onnx`: ONNX through torch's dynamo exporter (needs the `export` extra).

The program takes what the data module stores (token ids; uint8 images, normalized inside) and
returns logits. The batch dimension (and a language model's sequence length, up to its context)
is dynamic. Before the file is written, its outputs on a real test batch of another size are
compared with the eager model's; above `tolerance` the export fails and nothing is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from ..checkpointing.door import load_own_export
from ..checkpointing.saving import atomic_torch_save
from ..checkpointing.trained import Trained, rebuild
from ..errors import PACKAGE, ConfigError
from ..files import absolute, remove_stale_temporaries
from ..models.lora import merge
from ..run import lock as run_lock
from ..run.settings import check_switches
from ..targets import allow

log = logging.getLogger(__name__)

FORMATS = {"checkpoint": "ckpt", "pt2": "pt2", "onnx": "onnx"}


class Inference(nn.Module):
    """The network as a program sees it: stored inputs in, logits out, preprocessing inside."""

    def __init__(self, net: nn.Module, datamodule: Any) -> None:
        super().__init__()
        self.net = net
        self.datamodule = datamodule

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.is_floating_point() or inputs.dtype == torch.uint8:
            inputs = self.datamodule.on_after_batch_transfer((inputs, None), 0)[0]
        return self.net(inputs)


def export(cfg: DictConfig) -> dict[str, float]:
    allow(cfg)
    check_switches(cfg)
    with run_lock.hold(Path(cfg.paths.output_dir)):
        return export_checkpoint(cfg)


def output_path(cfg: DictConfig, fmt: str) -> Path:
    if cfg.get("output"):
        return absolute(str(cfg.output))
    return Path(cfg.paths.output_dir) / f"model.{FORMATS[fmt]}"


def check_output(path: Path, fmt: str, checkpoint: Path) -> None:
    """A file the export may replace: not a folder, a device or the checkpoint it reads, and
    named for its format where the name says one."""
    if path.is_dir():
        raise ConfigError(f"output={path} is a folder: give a file path, e.g. {path / 'model'}.")
    if path.exists() and not path.is_file():
        raise ConfigError(f"output={path} is not a regular file (a device or a pipe): give a file.")
    if path == checkpoint or checkpoint in path.parents:
        raise ConfigError(f"output={path} is the checkpoint being exported: give another file.")
    named = {suffix: name for name, suffix in FORMATS.items()}.get(path.suffix.lstrip("."))
    if named is not None and named != fmt:
        raise ConfigError(
            f"output={path} names a {named} file, but format={fmt}: add format={named}, or name "
            f"it {path.with_suffix('.' + FORMATS[fmt]).name}."
        )


def check_tolerance(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"tolerance={value!r}: use a number, 0 or more (e.g. 1e-4).")
    return float(value)


def make_parents(path: Path) -> list[Path]:
    """Make the folders `path` goes in; returns those that were made, deepest first."""
    made = [parent for parent in path.parents if not parent.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    return made


def remove_folders(folders: list[Path]) -> None:
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def check_writable(path: Path) -> list[Path]:
    """Before any work: the folder exists (or is made) and takes a file. Returns the folders
    made, which a failed export removes again."""
    probe = path.with_name(f".{path.name}.probe-{os.getpid()}")
    made: list[Path] = []
    try:
        made = make_parents(path)
        probe.touch()
        probe.unlink()
    except OSError as error:
        remove_folders(made)
        reason = error.strerror or str(error)
        raise ConfigError(
            f"cannot write {path} ({reason}): give output=<a file in a writable folder>."
        ) from error
    return made


def export_checkpoint(cfg: DictConfig) -> dict[str, float]:
    fmt = str(cfg.format)
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt}: use one of {', '.join(FORMATS)}.")
    tolerance = check_tolerance(cfg.tolerance)
    path = output_path(cfg, fmt)
    check_output(path, fmt, absolute(str(cfg.ckpt_path)))
    trained = rebuild(cfg.ckpt_path, cfg.trust_checkpoint, cfg.data, cfg.model)
    net: nn.Module = trained.model.net  # type: ignore[assignment]
    merged = merge(net)
    if merged:
        log.info("Merged the LoRA adapters of %d layers into their weights", merged)
    made = check_writable(path)
    remove_stale_temporaries(path)
    try:
        difference = write_export(trained, net, fmt, path, tolerance)
    except BaseException:
        remove_folders(made)
        raise
    log.info("Exported %s", path)
    return {} if difference is None else {"export/max_abs_difference": difference}


def write_export(
    trained: Trained, net: nn.Module, fmt: str, path: Path, tolerance: float
) -> float | None:
    """Write `path` in `fmt`; a program only where its outputs match the model's on a test batch
    (returns the largest difference)."""
    if fmt == "checkpoint":
        write_plain_checkpoint(trained, path)
        return None
    net.eval()
    program = Inference(net, trained.datamodule).eval()
    example, check = test_batches(trained)
    with torch.no_grad():
        expected = program(check)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if fmt == "pt2":
            got = export_pt2(program, example, check, temporary, dynamic_shapes(trained, example))
        else:
            got = export_onnx(program, example, check, temporary, dynamic_shapes(trained, example))
        difference = float((got.float() - expected.float()).abs().max())
        scale = float(expected.float().abs().max())
        log.info(
            "Parity on a test batch of %d: max |exported - eager| = %.3g (outputs up to %.3g)",
            check.size(0), difference, scale,
        )  # fmt: skip
        if not difference <= tolerance * max(1.0, scale):
            raise ConfigError(
                f"the exported program's outputs differ from the model's by up to {difference:.3g} "
                f"on a test batch, more than tolerance={tolerance} (relative to outputs up to "
                f"{scale:.3g}): nothing was written. Export in float32, or raise tolerance."
            )
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)
    return difference


def test_batches(trained: Trained) -> tuple[torch.Tensor, torch.Tensor]:
    """Two batches of stored inputs from the test split: one to trace with, and one of another
    batch size (and, for token ids, another length) to check the exported program on."""
    datamodule: Any = trained.datamodule
    datamodule.setup("test")
    dataset = datamodule.splits["test"]
    count = min(len(dataset), 6)
    if count < 3:
        raise ConfigError("the test split holds fewer than 3 samples: nothing to check export on.")
    inputs = torch.stack([dataset[index][0] for index in range(count)])
    example, check = inputs[:2], inputs[2:]
    if not example.is_floating_point() and example.dtype != torch.uint8:
        check = check[:, : max(1, check.size(1) // 2)]
    return example, check


def dynamic_shapes(trained: Trained, example: torch.Tensor) -> dict[str, Any]:
    batch = torch.export.Dim("batch", min=1, max=4096)
    if example.is_floating_point() or example.dtype == torch.uint8:
        images = {0: batch}
        return {"inputs": images}
    block_size = int(getattr(trained.model.net, "block_size", example.size(1)))
    sequence = torch.export.Dim("seq", min=1, max=block_size)
    tokens = {0: batch, 1: sequence}
    return {"inputs": tokens}


def export_pt2(
    program: nn.Module, example: torch.Tensor, check: torch.Tensor, path: Path, shapes: Any
) -> torch.Tensor:
    exported = torch.export.export(program, (example,), dynamic_shapes=shapes)
    with open(path, "wb") as file:
        torch.export.save(exported, file)
    loaded = load_own_export(path)
    with torch.no_grad():
        result: torch.Tensor = loaded.module()(check)
    return result


def export_onnx(
    program: nn.Module, example: torch.Tensor, check: torch.Tensor, path: Path, shapes: Any
) -> torch.Tensor:
    try:
        import onnxruntime
        import onnxscript  # noqa: F401  (torch's dynamo exporter imports it)
    except ImportError as error:
        raise ConfigError(
            f"format=onnx needs onnx, onnxscript and onnxruntime ({error.name} is missing): "
            f"pip install '{PACKAGE}[export]'"
        ) from error
    for name in ("onnxscript", "onnx_ir", "torch.onnx"):  # a line per optimization pass
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
    exported = torch.onnx.export(
        program, (example,), dynamo=True, dynamic_shapes=shapes, input_names=["inputs"],
        output_names=["logits"], verbose=False,
    )  # fmt: skip
    if exported is None:
        raise ConfigError("torch.onnx.export returned no program: update torch and onnxscript.")
    exported.save(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (result,) = session.run(None, {"inputs": check.numpy()})
    return torch.from_numpy(result)


def write_plain_checkpoint(trained: Trained, path: Path) -> None:
    """The weights (adapters merged) and what `eval` and `predict` rebuild the model from; no
    optimizer or loop state, so it starts new runs (`init_from`) but does not resume one."""
    checkpoint = {
        key: value
        for key, value in trained.checkpoint.items()
        if key not in ("optimizer_states", "lr_schedulers", "base_weights")
    }
    checkpoint["state_dict"] = trained.model.state_dict()
    model_config = dict(checkpoint["run_config"]["model"])
    if model_config.get("lora"):
        model_config["lora"] = None
    checkpoint["run_config"] = {**checkpoint["run_config"], "model": model_config}
    atomic_torch_save(checkpoint, path)


if __name__ == "__main__":  # `python -m <package>.recipes.export` runs `<package>-export`
    from .. import cli

    cli.export()
