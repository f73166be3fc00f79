"""Tokenizers for token shards: a byte-level BPE (Hugging Face `tokenizers`), trained on the
corpus or a pretrained model's (the `tokenizer.json` of a Hugging Face GPT-2 folder), or plain
UTF-8 bytes. Both end every document with the `<|endoftext|>` token."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from .errors import ConfigError
from .folder_files import read_bounded

END_OF_TEXT = "<|endoftext|>"
BYTES = "bytes"


class TokenizerFailed(ConfigError):
    """The tokenizers library failed on a text: its tokenizer.json cannot encode or decode it."""


@contextmanager
def library_boundary(doing: str) -> Iterator[None]:
    """Every failure of the tokenizers library as one TokenizerFailed. It raises plain
    Exceptions, and a Rust panic inside it (a regular expression that backtracks past its limit,
    say) as pyo3's PanicException, a BaseException that `except Exception` lets through."""
    try:
        yield
    except BaseException as error:
        if not (isinstance(error, Exception) or type(error).__name__ == "PanicException"):
            raise  # KeyboardInterrupt, SystemExit, a stop signal's exception
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise TokenizerFailed(
            f"the tokenizer cannot {doing} ({reason}): check its tokenizer.json (a regular "
            "expression in it may backtrack too far)"
        ) from None


class TextTokenizer(Protocol):
    vocab_size: int
    end_of_text: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, path: Path) -> None: ...


class ByteTokenizer:
    """Token i < 256 is byte i; 256 ends a document."""

    vocab_size = 257
    end_of_text = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"type": BYTES}) + "\n")


class BPETokenizer:
    """A byte-level BPE: any text encodes, and decoding gives it back exactly. The vocabulary
    counts the added tokens (GPT-2's 50257 is 50256 merges and bytes, then `<|endoftext|>`)."""

    def __init__(self, tokenizer: Any, end_token: str = END_OF_TEXT) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        end_of_text = tokenizer.token_to_id(end_token)
        if end_of_text is None:
            raise ValueError(f"it has no {end_token} token, which ends every document here")
        self.end_of_text = int(end_of_text)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer)

    def encode(self, text: str) -> list[int]:
        with library_boundary("encode this text"):
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        library = self.tokenizer
        batch = getattr(library, "encode_batch_fast", library.encode_batch)  # fast: no offsets
        with library_boundary("encode these texts"):
            return [encoding.ids for encoding in batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        with library_boundary("decode these tokens"):
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def save(self, path: Path) -> None:
        self.tokenizer.save(str(path))


def load_tokenizer(path: Path, end_token: str = END_OF_TEXT) -> TextTokenizer:
    """A tokenizer that `save` wrote, or a pretrained model's `tokenizer.json` (JSON either way:
    nothing in it runs), whose `end_token` ends a document (or a chat's turn). Raises ValueError
    (or OSError) naming what is wrong."""
    return tokenizer_from_json(read_tokenizer_text(path), end_token)


TOKENIZER_LIMIT = 64 << 20  # bytes: Llama 3's tokenizer.json is 9 MB, Gemma 3's 33 MB


def read_tokenizer_text(path: Path) -> str:
    """A tokenizer.json's text; ValueError, before a byte is read, where it is not a regular file
    or is larger than TOKENIZER_LIMIT."""
    try:
        data = read_bounded(path, TOKENIZER_LIMIT, "the file", "no tokenizer is that large")
    except ConfigError as error:
        raise ValueError(str(error).rstrip(".")) from None
    return data.decode("utf-8")


def tokenizer_file(
    setting: str, choice: str, instead: str, end_token: str = END_OF_TEXT
) -> TextTokenizer:
    """The tokenizer.json that a setting (`data.tokenizer=<choice>`) names; one error line, ending
    with what to give `instead`, where it is not a file or not a tokenizer."""
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ConfigError(f"{setting}={choice} is not a file: {instead}")
    try:
        return load_tokenizer(path, end_token)
    except Exception as error:  # the tokenizers library raises plain Exceptions
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{setting}={choice} is not a tokenizer ({reason}): {instead}") from None


def tokenizer_from_json(text: str, end_token: str = END_OF_TEXT) -> TextTokenizer:
    settings = json.loads(text)
    if not isinstance(settings, dict):
        raise ValueError(f"it holds a JSON {type(settings).__name__}, not a tokenizer's settings")
    if settings.get("type") == BYTES:
        return ByteTokenizer()
    from tokenizers import Tokenizer

    with library_boundary("be read"):
        library = Tokenizer.from_str(text)
    return BPETokenizer(library, end_token)
