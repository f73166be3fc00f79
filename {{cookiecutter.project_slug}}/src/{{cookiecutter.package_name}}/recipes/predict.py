"""The predict recipe: a trained model on new inputs, through Lightning's predict loop.

Image classifiers read image files, folders of them, or `inputs=test` (the data set's own test
split) and write `predictions.csv`: the path, the predicted class's id and name (an image
folder's class names, which the checkpoint stores), its probability, and the top-k ids, names (a
JSON list) and probabilities.
Language models continue prompts (`prompt=...`, or `prompt_file=...`, one per line) and write
`predictions.jsonl`; a single prompt's continuation is also streamed to the terminal."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from ..checkpointing.trained import Trained, rebuild, text_interface, utf8_bytes
from ..errors import ConfigError
from ..files import write_text_atomically
from ..loggers import finished_at_the_end, instantiate_loggers, log_predictions, log_run_config
from ..run import lock as run_lock
from ..run.checks import check_config
from ..run.plan import RunPlan
from ..run.settings import check_whole
from ..run.steps import build_trainer, exit_143_on_stop_signals

log = logging.getLogger(__name__)

PROMPT_FILE_LIMIT = 64 << 20


def predict(cfg: DictConfig) -> dict[str, float]:
    plan = check_config(cfg)
    with run_lock.hold(plan.run_dir):
        return predict_checkpoint(cfg, plan)


def as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, ListConfig)):
        return [str(item) for item in value]
    return [str(value)]


def predict_checkpoint(cfg: DictConfig, plan: RunPlan) -> dict[str, float]:
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    one_device = devices == 1 or (isinstance(devices, (list, ListConfig)) and len(devices) == 1)
    if not one_device or nodes != 1:
        raise ConfigError(
            f"predict runs on one device (trainer.devices={devices}, trainer.num_nodes={nodes}): "
            "drop those overrides, or pick the GPU with trainer.devices=[<index>]."
        )
    trained = rebuild(cfg.ckpt_path, cfg.trust_checkpoint, cfg.data, cfg.model)
    language = callable(getattr(getattr(trained.model, "net", None), "generate", None))
    given_prompts = cfg.get("prompt") is not None or cfg.get("prompt_file") is not None
    if language and cfg.get("inputs") is not None:
        raise ConfigError(
            f"ckpt_path={trained.path} is a language model: give prompt=... or prompt_file=... "
            "(one prompt per line), not inputs=..."
        )
    if not language and given_prompts:
        raise ConfigError(
            f"ckpt_path={trained.path} is an image classifier: give inputs=<image files or "
            "folder> or inputs=test, not prompts."
        )
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True, verbose=False)
    # Every input is read and checked before the trainer exists.
    interactive = language and bool(cfg.get("chat")) and not given_prompts
    if interactive:
        check_sampling(cfg)
        chat = chat_template(trained)
    elif language:
        prompts, encoded = prompt_inputs(cfg, trained)
    else:
        names = image_inputs(cfg, trained)
    # A single-device command: Lightning's hint to start it with srun means nothing here.
    warnings.filterwarnings("ignore", message=".*The `srun` command is available")
    loggers = instantiate_loggers(cfg.get("logger"), plan.tracked, trained_from=str(trained.path))
    trainer = build_trainer(
        cfg.trainer, plan.machine, plan.matmul_precision, callbacks=[], loggers=loggers
    )
    resolved = OmegaConf.to_container(cfg, resolve=True)
    log_run_config(loggers, resolved, trained_from=str(trained.path))
    output_dir = Path(cfg.paths.output_dir)
    with exit_143_on_stop_signals(), finished_at_the_end(loggers):
        if interactive:
            converse(cfg, trained, trainer, chat, output_dir)
        elif language:
            continue_prompts(cfg, trained, trainer, prompts, encoded, output_dir)
        else:
            classify_images(cfg, trained, trainer, names, output_dir)
        log_predictions(loggers, output_dir)
    return {}


def image_inputs(cfg: DictConfig, trained: Trained) -> list[str]:
    """The names of the inputs; their images become the data module's `predict` split."""
    from ..data.image_files import image_paths

    datamodule: Any = trained.datamodule
    inputs = as_list(cfg.get("inputs"))
    if not inputs:
        raise ConfigError("inputs is not set: give image files, a folder of them, or inputs=test.")
    check_whole("top_k_classes", cfg.top_k_classes, 1, allowed=())
    if inputs == ["test"]:
        datamodule.setup("test")
        datamodule.splits = {"predict": datamodule.splits["test"]}
        return [f"test/{index}" for index in range(len(datamodule.splits["predict"]))]
    paths = image_paths(inputs)
    images = datamodule.images_from_files(paths)
    datamodule.splits = {"predict": TensorDataset(images, torch.full((len(paths),), -1))}
    return [str(path) for path in paths]


def class_names(datamodule: Any, count: int) -> list[str]:
    """What each class id means: the data module's class names (an image folder's, which its
    checkpoint stores), else the ids themselves."""
    names = getattr(datamodule, "classes", None)
    if isinstance(names, (list, tuple)) and len(names) == count:
        return [str(name) for name in names]
    return [str(index) for index in range(count)]


def classify_images(
    cfg: DictConfig, trained: Trained, trainer: L.Trainer, names: list[str], output_dir: Path
) -> None:
    batches = trainer.predict(trained.model, datamodule=trained.datamodule)
    probabilities = torch.cat([batch for batch in batches or []])  # type: ignore[misc]
    top = probabilities.topk(min(int(cfg.top_k_classes), probabilities.size(1)), dim=1)
    labels = class_names(trained.datamodule, probabilities.size(1))
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(
        ["path", "class", "name", "probability", "top_classes", "top_names", "top_probabilities"]
    )
    for name, classes, probs in zip(names, top.indices.tolist(), top.values.tolist(), strict=True):
        writer.writerow([
            name, classes[0], labels[classes[0]], f"{probs[0]:.6f}", " ".join(map(str, classes)),
            json.dumps([labels[c] for c in classes]), " ".join(f"{p:.6f}" for p in probs),
        ])  # fmt: skip
    path = output_dir / "predictions.csv"
    write_text_atomically(table.getvalue(), path)
    log.info("Predicted %d images: %s", len(names), path)


def read_prompts(cfg: DictConfig) -> list[str]:
    if cfg.get("prompt") is not None and cfg.get("prompt_file") is not None:
        raise ConfigError("prompt and prompt_file are both set: give one.")
    if cfg.get("prompt") is not None:
        return [str(cfg.prompt)]
    if cfg.get("prompt_file") is None:
        raise ConfigError(
            "no prompt: give prompt='...' or prompt_file=<a text file, one prompt per line>."
        )
    path = Path(str(cfg.prompt_file)).expanduser()
    try:
        with path.open("rb") as file:  # at most a byte past the limit: /dev/zero never ends
            data = file.read(PROMPT_FILE_LIMIT + 1)
        lines = data.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(f"prompt_file={path} cannot be read as UTF-8 text ({reason}).") from error
    if len(data) > PROMPT_FILE_LIMIT:
        raise ConfigError(
            f"prompt_file={path} holds more than {PROMPT_FILE_LIMIT >> 20} MiB: give prompts, one "
            "per line, in a smaller file."
        )
    prompts = [line for line in lines if line]
    if not prompts:
        raise ConfigError(f"prompt_file={path} holds no prompts (one per line).")
    return prompts


def encode(
    prompts: list[str], block_size: int, tokenize: Callable[[str], list[int]] = utf8_bytes
) -> list[torch.Tensor]:
    """Each prompt as the model's tokens."""
    unit = "bytes" if tokenize is utf8_bytes else "tokens"
    encoded = []
    for number, prompt in enumerate(prompts, start=1):
        tokens = tokenize(prompt)
        where = f"prompt {number}" if len(prompts) > 1 else "the prompt"
        if not tokens:
            raise ConfigError(f"{where} is empty: give at least one character.")
        if len(tokens) > block_size:
            raise ConfigError(
                f"{where} is {len(tokens)} {unit} long, more than the model's context of "
                f"{block_size}: shorten it to its last {block_size} {unit} or fewer."
            )
        encoded.append(torch.tensor(list(tokens), dtype=torch.long))
    return encoded


class Stream:
    """Print tokens as they come, decoded; a character split over tokens waits for the rest.
    The end-of-text token ends it."""

    def __init__(self, decode: Callable[[list[int]], str], stop_token: int | None) -> None:
        self.decode = decode
        self.stop_token = stop_token
        self.tokens: list[int] = []
        self.printed = 0
        self.ended = False

    def __call__(self, token: torch.Tensor) -> None:
        self.ended = self.ended or int(token.item()) == self.stop_token
        if self.ended:
            return
        self.tokens.append(int(token.item()))
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):
            return
        self.write(text)

    def write(self, text: str) -> None:
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()
        self.printed = len(text)

    def finish(self) -> None:
        """What is still held back: bytes that never completed a character."""
        self.write(self.decode(self.tokens))


def prompt_inputs(cfg: DictConfig, trained: Trained) -> tuple[list[str], list[torch.Tensor]]:
    model: Any = trained.model
    prompts = read_prompts(cfg)
    tokenize = text_interface(trained.datamodule).encode
    if bool(cfg.get("chat")):
        tokenize = user_turn(chat_template(trained))
    encoded = encode(prompts, int(model.net.block_size), tokenize)
    check_sampling(cfg)
    return prompts, encoded


def check_sampling(cfg: DictConfig) -> None:
    check_whole("max_new_tokens", cfg.max_new_tokens, 1, allowed=())
    check_whole("top_k", cfg.top_k, 1)
    temperature = cfg.temperature
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ConfigError(f"temperature={temperature!r}: use a finite number, 0 (greedy) or more.")


def chat_template(trained: Trained) -> Callable[[Any], list[int]]:
    """`chat=true`: a conversation's prompt tokens, in the template the model was trained on."""
    chat = text_interface(trained.datamodule).chat
    if chat is None:
        raise ConfigError(
            f"chat=true, but ckpt_path={trained.path} was not trained on instructions "
            "(data=instructions), so it has no chat template: drop chat=true."
        )

    def tokens(messages: Any) -> list[int]:
        try:
            return chat(messages)
        except ValueError as error:  # the model's own chat template failed on the conversation
            raise ConfigError(f"chat=true: {error}.") from None

    return tokens


def continue_prompts(
    cfg: DictConfig, trained: Trained, trainer: L.Trainer, prompts: list[str],
    encoded: list[torch.Tensor], output_dir: Path,
) -> None:  # fmt: skip
    model: Any = trained.model
    text = text_interface(trained.datamodule)
    decode, stop_token = text.decode, text.end_of_text
    stream = Stream(decode, stop_token) if len(prompts) == 1 and bool(cfg.stream) else None
    model.generation = {
        "max_new_tokens": int(cfg.max_new_tokens), "temperature": float(cfg.temperature),
        "top_k": cfg.top_k, "kv_cache": bool(cfg.kv_cache), "on_token": stream,
        "stop_token": stop_token, "compiled": cfg.compile_decode,
    }  # fmt: skip
    if stream:
        sys.stdout.write(prompts[0] + ("\n" if cfg.get("chat") else ""))
        sys.stdout.flush()
    loader: DataLoader[torch.Tensor] = DataLoader(encoded, batch_size=1)  # type: ignore[arg-type]
    outputs = trainer.predict(model, dataloaders=loader)
    if stream:
        stream.finish()
        sys.stdout.write("\n")
    lines = []
    for prompt, tokens, output in zip(prompts, encoded, outputs or [], strict=True):
        generated = output[0, len(tokens) :].tolist()
        if stop_token in generated:
            generated = generated[: generated.index(stop_token)]
        completion = decode(generated)
        lines.append(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    path = output_dir / "predictions.jsonl"
    write_text_atomically("".join(lines), path)
    log.info("Continued %d prompt%s: %s", len(prompts), "s"[: len(prompts) > 1], path)


def user_turn(chat: Callable[[Any], list[int]]) -> Callable[[str], list[int]]:
    """A prompt as the user's only turn of a conversation (an empty one stays empty)."""

    def tokens(prompt: str) -> list[int]:
        return chat([{"role": "user", "content": prompt}]) if prompt else []

    return tokens


def converse(
    cfg: DictConfig, trained: Trained, trainer: L.Trainer, chat: Callable[[Any], list[int]],
    output_dir: Path,
) -> None:  # fmt: skip
    """`chat=true` without a prompt: a conversation on the terminal. Each line read is the
    user's turn and the reply is printed as it is made; the conversation so far is the next
    turn's prompt, its oldest turns left out where it outgrows the context. It ends at the end of
    the input (Ctrl-D), and predictions.jsonl holds each turn and its reply."""
    model: Any = trained.model
    text = text_interface(trained.datamodule)
    block_size = int(model.net.block_size)
    messages: list[dict[str, str]] = []
    turns = []
    while True:
        if sys.stdin.isatty():
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        said = line.rstrip("\r\n")
        if not said.strip():
            continue
        messages.append({"role": "user", "content": said})
        while len(tokens := chat(messages)) > block_size and len(messages) > 1:
            del messages[: 2 if messages[1]["role"] == "assistant" else 1]
        if len(tokens) > block_size:
            sys.stderr.write(
                f"That turn is {len(tokens)} tokens with the template, more than the model's "
                f"context of {block_size}: say it in fewer words.\n"
            )
            messages.clear()
            continue
        stream = Stream(text.decode, text.end_of_text)
        model.generation = {
            "max_new_tokens": int(cfg.max_new_tokens), "temperature": float(cfg.temperature),
            "top_k": cfg.top_k, "kv_cache": bool(cfg.kv_cache), "on_token": stream,
            "stop_token": text.end_of_text, "compiled": cfg.compile_decode,
        }  # fmt: skip
        prompt = [torch.tensor(tokens, dtype=torch.long)]
        trainer.predict(model, dataloaders=DataLoader(prompt, batch_size=1))  # type: ignore[arg-type]
        stream.finish()
        sys.stdout.write("\n")
        sys.stdout.flush()
        reply = text.decode(stream.tokens)
        messages.append({"role": "assistant", "content": reply})
        turns.append(json.dumps({"prompt": said, "completion": reply}) + "\n")
    path = output_dir / "predictions.jsonl"
    write_text_atomically("".join(turns), path)
    log.info("A conversation of %d turn%s: %s", len(turns), "s"[: len(turns) != 1], path)


if __name__ == "__main__":  # `python -m <package>.recipes.predict` runs `<package>-predict`
    from .. import cli

    cli.predict()
