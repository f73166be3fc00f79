"""Instruction fine-tuning data: prompt/response records in a JSONL file (one JSON object a line),
with the loss on the responses only.

Two kinds of record, mixed freely in one file:
- Alpaca's: `{"instruction": ..., "input": ... (optional), "output": ...}`. The prompt is
  Alpaca's template (`format_prompt`); the response is `output`.
- A chat: `{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}` with at
  least one assistant turn. Each turn is `### System:`, `### User:` or `### Assistant:` on a line
  of its own, then its content; turns are separated by a blank line (`chat_prompt`). Every
  assistant turn's content is a response.

Every response is followed by the tokenizer's end-of-text token, so the model learns to stop.
A record is tokenized as it will be prompted: each prompt part (all the text between two
responses) and each response on its own. Targets are the next tokens, with -100 (`IGNORED`,
which the loss skips) wherever the next token is a prompt's; so the loss counts every response
token and every end-of-text token, and nothing else. Batches are padded on the right to the
longest record (rounded up to a multiple of 8 tokens, at most `block_size`), inputs with the
end-of-text token and targets with -100.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .base import SplitDataModule, check_fractions, check_whole_numbers, split_indices
from .chat_template import ChatTemplate
from .errors import ConfigError
from .folder_files import read_bounded
from .tokenizer import BYTES, ByteTokenizer, TextTokenizer, tokenizer_file

IGNORED = -100  # a target the loss skips (torch's cross_entropy ignore_index)
TOY = "toy"  # data.source for the shipped toy set
TOY_FILE = "toy_instructions.jsonl"
PAD_MULTIPLE = 8
FILE_LIMIT = 1 << 30

ALPACA = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
TURN_GAP = "\n\n"

# A record as text parts: (text, whether it is a response). Each response is followed by the
# end-of-text token.
Parts = list[tuple[str, bool]]


def format_prompt(instruction: str, input: str = "") -> str:  # `input`: Alpaca's field name
    """Alpaca's prompt for an instruction (and its input, if any): the text a model continues
    with its response, which it ends with the end-of-text token."""
    if input:
        return ALPACA_WITH_INPUT.format(instruction=instruction, input=input)
    return ALPACA.format(instruction=instruction)


def turn(role: str, content: str) -> str:
    """A system or user turn as prompt text."""
    return f"### {ROLES[role]}:\n{content}{TURN_GAP}"


def assistant_header() -> str:
    return f"### {ROLES['assistant']}:\n"


def chat_parts(messages: Sequence[dict[str, str]]) -> Parts:
    """The turns as prompt text and responses (every assistant turn's content)."""
    parts: Parts = []
    prompt = ""
    for message in messages:
        if parts and not prompt:  # a turn after an assistant's (and its end-of-text token)
            prompt = TURN_GAP
        if message["role"] == "assistant":
            parts.append((prompt + assistant_header(), False))
            parts.append((message["content"], True))
            prompt = ""
        else:
            prompt += turn(message["role"], message["content"])
    if prompt:
        parts.append((prompt, False))
    return parts


def chat_prompt(messages: Sequence[dict[str, str]], tokenizer: TextTokenizer) -> list[int]:
    """The tokens of a conversation so far (ending with a user turn) and the header of the
    assistant's reply, as the model was trained on them: the reply is what it generates next,
    up to its end-of-text token. Earlier assistant turns end with that token, so a conversation
    is tokens, not text."""
    ids, _ = encode_parts([*chat_parts(messages), (assistant_header(), False)], tokenizer)
    return ids


def encode_parts(
    parts: Parts, tokenizer: TextTokenizer, end_responses: bool = True
) -> tuple[list[int], list[bool]]:
    """The tokens of a record, and for each whether the loss counts it (a response's tokens and
    the end-of-text token after it; a chat template writes its own end of turn into the
    response instead: `end_responses=False`). Prompt parts that follow each other are tokenized
    as one text, as a prompt is at inference."""
    ids: list[int] = []
    counted: list[bool] = []
    prompt = ""
    for text, response in parts:
        if not response:
            prompt += text
            continue
        if prompt:
            tokens = tokenizer.encode(prompt)
            ids += tokens
            counted += [False] * len(tokens)
            prompt = ""
        tokens = tokenizer.encode(text) + ([tokenizer.end_of_text] if end_responses else [])
        ids += tokens
        counted += [True] * len(tokens)
    if prompt:
        tokens = tokenizer.encode(prompt)
        ids += tokens
        counted += [False] * len(tokens)
    return ids, counted


def example(ids: list[int], counted: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of a record; a target the loss skips is -100."""
    tokens = torch.tensor(ids, dtype=torch.long)
    targets = tokens[1:].clone()
    targets[~torch.tensor(counted[1:], dtype=torch.bool)] = IGNORED
    return tokens[:-1], targets


def json_type(value: Any) -> str:
    return (
        "null" if value is None
        else "true/false" if isinstance(value, bool)
        else "a number" if isinstance(value, (int, float))
        else "a string" if isinstance(value, str)
        else "a list" if isinstance(value, list)
        else "an object"
    )  # fmt: skip


def record_parts(record: Any, template: ChatTemplate | None = None) -> Parts:
    """A record's text parts, in this project's templates or in a model's chat template (an
    Alpaca record is then the user's turn and the assistant's); ValueError says what is wrong
    with it."""
    if not isinstance(record, dict):
        raise ValueError(
            f"the record is {json_type(record)}, not an object: give "
            '{"instruction": ..., "output": ...} or {"messages": [...]}'
        )
    alpaca = [key for key in ("instruction", "input", "output") if key in record]
    if "messages" in record and alpaca:
        raise ValueError(
            f"the record holds both messages and {alpaca[0]}: give one kind of record a line"
        )
    if "messages" in record:
        messages = training_messages(record["messages"])
        return template.parts(messages) if template else chat_parts(messages)
    for key in ("instruction", "output"):
        if key not in record:
            raise ValueError(
                f"the record has no {key}: give "
                '{"instruction": ..., "input": ... (optional), "output": ...} or '
                '{"messages": [{"role": ..., "content": ...}, ...]}'
            )
    for key in ("instruction", "input", "output"):
        if key in record and not isinstance(record[key], str):
            raise ValueError(f"{key} is {json_type(record[key])}, not a string")
    if template is not None:
        request = "\n\n".join(text for text in (record["instruction"], record.get("input")) if text)
        answer = record["output"]
        return template.parts(
            [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
        )
    prompt = format_prompt(record["instruction"], record.get("input", ""))
    return [(prompt, False), (record["output"], True)]


def checked_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else json_type(messages)
        raise ValueError(
            f"messages is {what}: give a list of turns, "
            '[{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]'
        )
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise ValueError(
                f"message {number} is not an object with a role and a content: give "
                '{"role": "user", "content": ...}'
            )
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(
                f"message {number} has the role {json.dumps(role)}: use system, user or assistant"
            )
        if not isinstance(content, str):
            raise ValueError(f"message {number}'s content is {json_type(content)}, not a string")
    return messages


def training_messages(messages: Any) -> list[dict[str, str]]:
    messages = checked_messages(messages)
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("the messages hold no assistant turn, so nothing to learn: add one")
    return messages


def prompting_messages(messages: Any) -> list[dict[str, str]]:
    """A conversation for the model to reply to: it ends with a user (or system) turn."""
    messages = checked_messages(messages)
    if messages[-1]["role"] == "assistant":
        raise ValueError(
            "the last message is the assistant's: end with the user's turn the model replies to"
        )
    return messages


def shipped_toy_set() -> bytes:
    return (resources.files(__package__) / "assets" / TOY_FILE).read_bytes()


def read_records(source: str) -> list[tuple[int, Any]]:
    """The JSON value of every line that is not blank, with its line number."""
    where = f"data.source={source}"
    if source == TOY:
        data = shipped_toy_set()
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"{where} is not a file: point it at a JSONL file of instruction records "
                f"(one JSON object a line), or use data.source={TOY}."
            )
        data = read_bounded(path, FILE_LIMIT, where, "split it, or use token shards")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        number = data[: error.start].count(b"\n") + 1
        raise ConfigError(f"{where}, line {number}: not UTF-8 text ({error.reason}).") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            json.dumps(record, ensure_ascii=False).encode("utf-8")  # no lone surrogate (\ud800)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{where}, line {number}: not JSON ({error.msg} at column {error.colno}): "
                "each line holds one JSON record."
            ) from None
        except RecursionError:
            raise ConfigError(
                f"{where}, line {number}: JSON nested too deeply to be a record."
            ) from None
        except (ValueError, UnicodeEncodeError) as error:  # a 5000-digit number; a lone surrogate
            reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
            raise ConfigError(
                f"{where}, line {number}: not a record this project reads ({reason})."
            ) from None
        records.append((number, record))
    if not records:
        raise ConfigError(
            f"{where} holds no records: give one JSON object a line, "
            '{"instruction": ..., "output": ...} or {"messages": [...]}.'
        )
    return records


class Examples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Records' inputs and targets, of their own lengths (`PadBatch` pads a batch)."""

    def __init__(self, examples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.examples[index]


class PadBatch:
    """Records of several lengths as one batch: padded on the right to the longest, rounded up
    to a multiple of 8 tokens but at most `block_size`; inputs with `pad`, targets with -100."""

    def __init__(self, pad: int, block_size: int) -> None:
        self.pad, self.block_size = pad, block_size

    def __call__(
        self, samples: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(inputs) for inputs, _ in samples)
        length = min(self.block_size, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
        inputs = torch.full((len(samples), length), self.pad, dtype=torch.long)
        targets = torch.full((len(samples), length), IGNORED, dtype=torch.long)
        for row, (tokens, next_tokens) in enumerate(samples):
            inputs[row, : len(tokens)] = tokens
            targets[row, : len(next_tokens)] = next_tokens
        return inputs, targets


class InstructionDataModule(SplitDataModule):
    """Prompt/response records from a JSONL file (`source`; `toy` is the shipped toy set),
    tokenized by `tokenizer` (null or `bytes`: UTF-8 bytes; or the path of a `tokenizer.json`, one
    that the prepare command wrote or a pretrained model's), split at random (`split_seed`) into train, validation and test records.

    `vocab_size` is the model's: at least the tokenizer's (257 for bytes: 256 and end-of-text).
    A record must fit the context: at most `block_size` + 1 tokens."""

    def __init__(
        self,
        source: str = TOY,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        vocab_size: int = ByteTokenizer.vocab_size,
        block_size: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        split_seed: int = 0,
        num_workers: int | str = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        check_fractions(val_fraction, test_fraction)
        check_whole_numbers(block_size=block_size, vocab_size=vocab_size)
        self.save_hyperparameters()
        self.template = ChatTemplate.load(chat_template) if chat_template else None
        self.tokenizer = self.load_tokenizer()
        if vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"data.vocab_size={vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size} (data.tokenizer={tokenizer}): set "
                f"data.vocab_size={self.tokenizer.vocab_size} or more."
            )
        self.vocab_size = vocab_size
        self.response_bytes: dict[str, tuple[int, int]] = {}

    def load_tokenizer(self) -> TextTokenizer:
        """The tokenizer of `data.tokenizer` (predict and serve encode prompts with it)."""
        if getattr(self, "tokenizer", None) is not None:
            return self.tokenizer
        choice = self.hparams["tokenizer"]
        template = getattr(self, "template", None)
        if choice is None or choice == BYTES:
            if template is not None:
                raise ConfigError(
                    f"data.chat_template={self.hparams['chat_template']} needs the model's own "
                    "tokens: set data.tokenizer to its folder's tokenizer.json."
                )
            return ByteTokenizer()
        return tokenizer_file(
            "data.tokenizer", str(choice),
            "use null (bytes), or the path of a tokenizer.json (the prepare command writes one "
            "beside its token shards), holding the chat template's end-of-turn token.",
            *([template.eos_token] if template else []),
        )  # fmt: skip

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def format_prompt(self, instruction: str, input: str = "") -> str:
        return format_prompt(instruction, input)

    def chat_tokens(self, messages: Any) -> list[int]:
        """The prompt tokens of a conversation that ends with the user's turn, as training
        tokenized them, up to the assistant's header: the model's reply comes next."""
        messages = prompting_messages(messages)
        if self.template is not None:
            return self.tokenizer.encode(self.template.render(messages, add_generation_prompt=True))
        return chat_prompt(messages, self.tokenizer)

    def tokens_per_byte(self, split: str) -> float:
        """Of the split's responses (their end-of-text tokens counted as tokens of no bytes):
        bits per byte of response text = loss in nats x this / ln 2."""
        tokens, size = self.response_bytes.get(split, (1, 1))
        return tokens / max(1, size)

    def load_splits(self) -> dict[str, Dataset[Any]]:
        source = str(self.hparams["source"])
        block = self.hparams["block_size"]
        examples, response_counts = [], []
        for number, record in read_records(source):
            try:
                parts = record_parts(record, self.template)
            except ValueError as error:
                raise ConfigError(f"data.source={source}, line {number}: {error}.") from None
            ids, counted = encode_parts(parts, self.tokenizer, self.template is None)
            if len(ids) - 1 > block:
                raise ConfigError(
                    f"data.source={source}, line {number}: the record is {len(ids)} tokens, "
                    f"more than the context of data.block_size={block} (+1) holds: shorten it, "
                    "or raise data.block_size."
                )
            examples.append(example(ids, counted))
            size = sum(len(text.encode("utf-8")) for text, response in parts if response)
            response_counts.append((sum(counted), size))
        fractions = (self.hparams["val_fraction"], self.hparams["test_fraction"])
        train, val, test = split_indices(len(examples), fractions, self.hparams["split_seed"])
        splits: dict[str, Dataset[Any]] = {}
        for name, indices in (("train", train), ("val", val), ("test", test)):
            chosen = indices.tolist()
            splits[name] = Examples([examples[i] for i in chosen])
            self.response_bytes[name] = (
                sum(response_counts[i][0] for i in chosen),
                sum(response_counts[i][1] for i in chosen),
            )
        return splits

    def collate(self, split: str) -> Callable[[list[Any]], Any]:
        return PadBatch(self.tokenizer.end_of_text, self.hparams["block_size"])
