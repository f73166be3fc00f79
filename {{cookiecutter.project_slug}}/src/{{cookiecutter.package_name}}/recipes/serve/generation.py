"""A language model behind the server: prompts (or conversations) in, continuations out. The
requests run in one batch that they join and leave between decode steps (continuous.py), each
row getting what it gets alone and ending at its own `max_new_tokens` or end-of-text token."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from ...checkpointing.trained import Trained, text_interface
from ...errors import ConfigError
from .batching import Checked, Pending, Scheduler
{%- if cookiecutter.examples != "vision" %}
from .continuous import ContinuousBatcher
{%- endif %}
from .errors import BadRequest, fields, shown, whole_field
from .settings import Settings, check_temperature


class Generation:
    """A language model: prompts in, continuations out."""

    kind = "language"
    path = "/generate"

    def __init__(
        self, trained: Trained, settings: Settings, device: torch.device, seed: int | None
    ) -> None:
        model: Any = trained.model
        self.net = model.net.to(device).eval()
        self.device = device
        self.settings = settings
        text = text_interface(trained.datamodule)
        self.encode, self.decode, self.chat = text.encode, text.decode, text.chat
        self.encode("a")  # loads the tokenizer now: one that cannot be read fails the command
        self.stop_token = text.end_of_text
        self.generator = torch.Generator(device)
        if seed is not None:
            self.generator.manual_seed(seed)

    def parse(self, body: Any) -> Checked:
        keys = ("max_new_tokens", "temperature", "top_k", "stream")
        if isinstance(body, dict) and "messages" in body:
            body = fields(body, ("messages",), keys)
            tokens = self.chat_tokens(body["messages"])
        else:
            body = fields(body, ("prompt",), ("messages", *keys))
            tokens = self.prompt_tokens(body["prompt"])
        settings = self.settings
        options = {
            "max_new_tokens": whole_field(
                body, "max_new_tokens", settings.max_new_tokens, 1, settings.most_new_tokens
            ),
            "top_k": whole_field(body, "top_k", settings.top_k, 1, None, nullable=True),
            "temperature": body.get("temperature", settings.temperature),
            "stream": body.get("stream", False),
        }
        problem = check_temperature(options["temperature"])
        if problem:
            raise BadRequest(f"temperature={shown(options['temperature'])}: {problem}")
        if not isinstance(options["stream"], bool):
            raise BadRequest(f"stream={shown(options['stream'])}: use true or false")
        block_size = int(self.net.block_size)
        if len(tokens) > block_size:
            what = "the conversation" if "messages" in body else "prompt"
            raise BadRequest(
                f"{what} is {len(tokens)} tokens long, more than the model's context of "
                f"{block_size}: shorten it"
            )
        options["temperature"] = float(options["temperature"])
        return Checked(torch.tensor(tokens, dtype=torch.long), options)

    def prompt_tokens(self, prompt: Any) -> list[int]:
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string")
        if not prompt:
            raise BadRequest("prompt is empty: give at least one character")
        try:
            prompt.encode("utf-8")
            return self.encode(prompt)
        except UnicodeEncodeError as error:
            raise BadRequest(f"prompt is not valid Unicode ({error.reason})") from error
        except ConfigError as error:  # the tokenizer failed on it
            raise BadRequest(str(error)) from None

    def chat_tokens(self, messages: Any) -> list[int]:
        """A conversation in the template the model was trained on (instruction data only)."""
        if self.chat is None:
            raise BadRequest(
                "this model was not trained on instructions (data=instructions), so it has no "
                "chat template: send a prompt instead of messages"
            )
        try:
            json.dumps(messages, ensure_ascii=False).encode("utf-8")
            return self.chat(messages)
        except UnicodeEncodeError as error:
            raise BadRequest(f"messages are not valid Unicode ({error.reason})") from error
        except (ValueError, ConfigError) as error:
            raise BadRequest(str(error)) from None

    def scheduler(self, settings: Settings) -> Scheduler:
{%- if cookiecutter.examples != "vision" %}
        return ContinuousBatcher(self, settings)
{%- else %}
        raise ConfigError("this project has no language model to serve")
{%- endif %}

    def continuation(self, pending: Pending) -> Continuation:
        return Continuation(pending, self.decode, 1)

    def info(self) -> dict[str, Any]:
        settings = self.settings
        return {
            "batching": "continuous", "compile_decode": settings.compile_decode,
            "context": int(self.net.block_size),
            "defaults": {"max_new_tokens": settings.max_new_tokens,
                         "temperature": settings.temperature, "top_k": settings.top_k},
        }  # fmt: skip


class Continuation:
    """One row of a batch: its tokens as they come, its text streamed where asked, its answer
    once it ends. A character split over tokens waits for the rest."""

    def __init__(self, pending: Pending, decode: Callable[[list[int]], str], batch: int) -> None:
        self.pending = pending
        self.decode = decode
        self.batch = batch
        self.limit = int(pending.options["max_new_tokens"])
        self.stream = bool(pending.options["stream"])
        self.tokens: list[int] = []
        self.sent = 0
        self.ended = False

    def take(self, token: int, stop_token: int | None) -> None:
        if self.ended:
            return
        if token == stop_token:
            self.finish("end")
            return
        self.tokens.append(token)
        if self.stream:
            text = self.decode(self.tokens)
            if not text.endswith("\ufffd"):
                self.send_text(text)
        if len(self.tokens) >= self.limit:
            self.finish("length")

    def send_text(self, text: str) -> None:
        if len(text) > self.sent:
            self.pending.send({"text": text[self.sent :]})
            self.sent = len(text)

    def finish(self, reason: str) -> None:
        self.ended = True
        text = self.decode(self.tokens)
        answer: dict[str, Any] = {"tokens": len(self.tokens), "finish_reason": reason,
                                  "batch_size": self.batch}  # fmt: skip
        if self.stream:
            self.send_text(text)
            self.pending.send({"done": True, **answer})
        else:
            self.pending.send({"completion": text, **answer})
