"""A pretrained model's own chat template: the Jinja template in its Hugging Face folder
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`) that puts a conversation
into the text the model was trained on, with its end-of-turn token (`eos_token`).

The template is an untrusted file, rendered as transformers' `apply_chat_template` renders it: in
Jinja's immutable sandbox (no attribute of Python's internals, no changing a list or dict it is
given), with transformers' globals (`raise_exception`, `strftime_now`) and its `tojson` filter.
What it renders is bounded in size; a template that does not compile, or fails on a
conversation, is one error line naming it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .folder_files import file_in_folder, read_bounded

CONFIG = "tokenizer_config.json"
TEMPLATE = "chat_template.jinja"
FILE_LIMIT = 1 << 20  # a tokenizer_config.json with its template is tens of kilobytes
RENDER_LIMIT = 1 << 22  # characters of one rendered conversation
SETTING = "data.chat_template"

# A record as text parts: (text, whether it is a response); see data/instructions.py.
Parts = list[tuple[str, bool]]


def read_limited(path: Path, where: str) -> str:
    data = read_bounded(path, FILE_LIMIT, f"{where}: {path}", "not a template's settings")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {path} is not UTF-8 text.") from None


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an object with its
    `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def template_text(value: Any) -> str | None:
    """`chat_template` as a string, or the `default` one of a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


class ChatTemplate:
    """A compiled chat template with the special tokens it names."""

    def __init__(self, source: str, text: str, bos_token: str, eos_token: str) -> None:
        try:
            from jinja2 import TemplateError, ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError(
                f"{SETTING}={source} needs the jinja2 package: pip install jinja2 (or the "
                "project's `pretrained` extra)."
            ) from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
        )
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = strftime_now
        try:
            self.template = environment.from_string(text)
        except (TemplateError, RecursionError, ValueError) as error:  # too deep; a NUL byte
            raise ConfigError(
                f"{SETTING}={source}: the chat template does not compile ({first_line(error)})."
            ) from None

    @classmethod
    def load(cls, choice: str) -> ChatTemplate:
        """The template of a Hugging Face folder, or of its tokenizer_config.json or
        chat_template.jinja, with the tokens of the tokenizer_config.json beside it."""
        path = Path(choice).expanduser()
        where = f"{SETTING}={choice}"
        folder = path if path.is_dir() else path.parent
        config_path = file_in_folder(folder, CONFIG, where)
        if config_path is None:
            raise ConfigError(
                f"{where}: {folder / CONFIG} is not a file; the template's end-of-turn token is "
                f"its eos_token: give a model folder that holds {CONFIG}."
            )
        try:
            config = json.loads(read_limited(config_path, where))
        except (ValueError, RecursionError) as error:
            raise ConfigError(f"{where}: {CONFIG} is not JSON ({first_line(error)}).") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: {CONFIG} holds no object of settings.")
        jinja_path = file_in_folder(
            folder, path.name if path.suffix == ".jinja" else TEMPLATE, where
        )
        if jinja_path is not None:
            text = read_limited(jinja_path, where)
        else:
            found = template_text(config.get("chat_template"))
            if found is None:
                raise ConfigError(
                    f"{where}: neither {TEMPLATE} nor a chat_template in {CONFIG}: this model "
                    "has no chat template (a base model); use null for this project's own."
                )
            text = found
        eos = token_text(config.get("eos_token"))
        if not eos:
            raise ConfigError(f"{where}: {CONFIG} names no eos_token, which ends each turn.")
        return cls(choice, text, token_text(config.get("bos_token")) or "", eos)

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation as the template writes it; ValueError where the template fails."""
        pieces, size = [], 0
        try:
            for piece in self.template.generate(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token,
            ):  # fmt: skip
                size += len(piece)
                if size > RENDER_LIMIT:
                    raise ValueError(
                        f"the chat template writes more than {RENDER_LIMIT} characters"
                    )
                pieces.append(piece)
        except ValueError:
            raise
        except Exception as error:  # a template can raise anything its expressions raise
            raise ValueError(f"the chat template fails on it ({first_line(error)})") from None
        return "".join(pieces)

    def parts(self, messages: Sequence[dict[str, str]]) -> Parts:
        """The conversation as prompt text and responses: each assistant turn's text as the
        template writes it (its content and end-of-turn), after the prompt that leads to it (the
        template's rendering of the turns before, with the generation prompt)."""
        parts: Parts = []
        written = ""
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:index], add_generation_prompt=True)
            whole = self.render(messages[: index + 1], add_generation_prompt=False)
            if not (prompt.startswith(written) and whole.startswith(prompt)):
                raise ValueError(
                    "the chat template does not write a conversation as the beginning of its "
                    "continuation, so its responses cannot be told apart"
                )
            parts += [(prompt[len(written) :], False), (whole[len(prompt) :], True)]
            written = whole
        return parts


def tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: Any = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200].rstrip(".") if text else type(error).__name__
