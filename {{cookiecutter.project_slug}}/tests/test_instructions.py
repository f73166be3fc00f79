"""Instruction fine-tuning (data/instructions.py): the loss falls on the responses and their
end-of-text tokens only, bad records are one line each, a tiny model learns the toy set through
the train command, LoRA and full fine-tuning run, and a killed run finishes exactly."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from {{ cookiecutter.package_name }}.checkpointing.trained import (
    stored_data,
)
from {{ cookiecutter.package_name }}.cli import _run
from {{ cookiecutter.package_name }}.console import (
    HYDRA_START_FILES,
)
from {{ cookiecutter.package_name }}.data.base import (
    split_indices,
)
from {{ cookiecutter.package_name }}.data.instructions import (
    IGNORED,
    InstructionDataModule,
    PadBatch,
    chat_prompt,
    format_prompt,
    read_records,
)
from {{ cookiecutter.package_name }}.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    TextTokenizer,
)
from {{ cookiecutter.package_name }}.errors import (
    ConfigError,
)
from {{ cookiecutter.package_name }}.models.language_model import (
    LanguageModel,
)
from {{ cookiecutter.package_name }}.models.nets.gpt import (
    GPT,
)
from {{ cookiecutter.package_name }}.recipes.train import train
from {{ cookiecutter.package_name }}.run.steps import (
    build_model_and_data,
)

from .helpers import PACKAGE, ComposeFn, compose_config, run_cli
from .killing import COMMON, References, assert_same_outcome, fault, killed_then_finished

END = ByteTokenizer.end_of_text
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\nAdd the numbers.\n\n### Input:\n2 3\n\n### Response:\n"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Uppercase: cat"},
    {"role": "assistant", "content": "CAT"},
    {"role": "user", "content": "Reverse: dog"},
    {"role": "assistant", "content": "god"},
]


def write_jsonl(path: Path, *records: Any) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def pieces(tokenizer: TextTokenizer, *parts: tuple[str, bool]) -> tuple[list[int], list[bool]]:
    """Tokens of prompt texts and responses, each response followed by the end token, and for
    each token whether it is a response's (or its end token)."""
    ids: list[int] = []
    response: list[bool] = []
    for text, is_response in parts:
        tokens = tokenizer.encode(text) + ([tokenizer.end_of_text] if is_response else [])
        ids += tokens
        response += [is_response] * len(tokens)
    return ids, response


def expected_targets(ids: list[int], response: list[bool]) -> list[int]:
    return [ids[i + 1] if response[i + 1] else IGNORED for i in range(len(ids) - 1)]


def read(tmp_path: Path, *records: Any, tokenizer: str = "bytes") -> list[Any]:
    """Every (inputs, targets) example of the records, whatever split each went to."""
    source = write_jsonl(tmp_path / "records.jsonl", *records)
    datamodule = InstructionDataModule(
        source=str(source), tokenizer=tokenizer, vocab_size=512, val_fraction=0.5,
        test_fraction=0.0,
    )  # fmt: skip
    datamodule.setup("fit")
    return [example for split in datamodule.splits.values() for example in split]  # type: ignore[attr-defined]


def test_the_alpaca_template_is_alpacas_own() -> None:
    assert format_prompt("Add the numbers.", "2 3") == ALPACA_PROMPT
    assert format_prompt("Say hi.") == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nSay hi.\n\n### Response:\n"
    )


@pytest.mark.parametrize("tokenizer_kind", ["bytes", "bpe"])
def test_every_prompt_token_is_ignored_and_every_response_token_and_end_token_is_a_target(
    tmp_path: Path, tokenizer_kind: str
) -> None:
    """For both kinds of record, with bytes and with a BPE tokenizer (data.tokenizer=<path>):
    each prompt part and each response is tokenized on its own, as a prompt is at inference."""
    tokenizer: TextTokenizer = ByteTokenizer()
    setting = "bytes"
    if tokenizer_kind == "bpe":
        tokenizer = BPETokenizer.train([ALPACA_PROMPT, json.dumps(CHAT)] * 20, vocab_size=300)
        tokenizer.save(tmp_path / "tokenizer.json")
        setting = str(tmp_path / "tokenizer.json")
    alpaca = {"instruction": "Add the numbers.", "input": "2 3", "output": "5", "id": 7}
    examples = read(tmp_path, alpaca, {"messages": CHAT}, tokenizer=setting)
    by_kind = {
        "alpaca": pieces(tokenizer, (ALPACA_PROMPT, False), ("5", True)),
        "chat": pieces(
            tokenizer,
            ("### System:\nBe brief.\n\n### User:\nUppercase: cat\n\n### Assistant:\n", False),
            ("CAT", True),
            ("\n\n### User:\nReverse: dog\n\n### Assistant:\n", False),
            ("god", True),
        ),
    }
    found = {}
    for inputs, targets in examples:
        (kind,) = [k for k, (ids, _) in by_kind.items() if inputs.tolist() == ids[:-1]]
        ids, response = by_kind[kind]
        assert targets.tolist() == expected_targets(ids, response)
        found[kind] = targets
    assert found.keys() == by_kind.keys()
    counted = found["chat"] != IGNORED
    assert counted.sum() == len(tokenizer.encode("CAT")) + len(tokenizer.encode("god")) + 2
    # The conversation up to its last reply, as predict and serve prompt it: the training tokens.
    ids, _ = by_kind["chat"]
    prompt = chat_prompt(CHAT[:-1], tokenizer)
    assert prompt == ids[: len(prompt)] and ids[len(prompt) :] == [
        *tokenizer.encode("god"),
        tokenizer.end_of_text,
    ]


def test_a_batch_is_padded_to_its_longest_record_with_ignored_targets(tmp_path: Path) -> None:
    long = {"instruction": "Add the numbers.", "input": "2 3", "output": "5"}
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}]}
    samples = sorted(read(tmp_path, long, short), key=lambda example: -len(example[0]))
    inputs, targets = PadBatch(END, 256)(samples)
    longest = len(samples[0][0])
    assert longest % 8 and inputs.shape == targets.shape == (2, math.ceil(longest / 8) * 8)
    for row, (sample_inputs, sample_targets) in enumerate(samples):
        length = len(sample_inputs)
        assert inputs[row, :length].tolist() == sample_inputs.tolist()
        assert targets[row, :length].tolist() == sample_targets.tolist()
        assert (inputs[row, length:] == END).all() and (targets[row, length:] == IGNORED).all()
    assert PadBatch(END, longest)(samples)[0].size(1) == longest, "never past the context"


def tiny_model() -> LanguageModel:
    torch.manual_seed(0)
    net = GPT(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_embd=16)
    return LanguageModel(net, optimizer=torch.optim.AdamW)  # type: ignore[arg-type]


def test_losses_skip_ignored_targets_and_weigh_batches_by_the_targets_they_count() -> None:
    """Two validation batches, one with 3 counted targets and one with 12: their mean loss is
    over the 15 targets (before, each batch weighed as its 16 tokens, ignored ones included)."""
    model = tiny_model()
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 256, (2, 1, 16), generator=generator)
    targets = torch.randint(0, 257, (2, 1, 16), generator=generator)
    targets[0, 0, :13] = IGNORED
    targets[1, 0, :4] = IGNORED
    batches = list(zip(inputs, targets, strict=True))
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    (measured,) = trainer.validate(model, DataLoader(batches, batch_size=None), verbose=False)
    with torch.no_grad():
        logits = torch.cat([model(x) for x in inputs]).view(-1, 257)
        expected = F.cross_entropy(logits, targets.view(-1), reduction="sum") / 15
    assert measured["val/loss"] == pytest.approx(float(expected), rel=1e-5)
    # Text windows (no ignored target) give the plain mean, exactly as before.
    window = (inputs[0], torch.randint(0, 257, (1, 16), generator=generator))
    with torch.no_grad():
        plain = F.cross_entropy(model(window[0]).view(-1, 257), window[1].view(-1))
        assert torch.equal(model._loss(window), plain)


# The bad-record catalogue: each record (or file) and the words its one error line holds.
BAD_RECORDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "not JSON": ('{"instruction": "a", "output": ', ("line 2", "not JSON")),
    "a list not an object": ('["instruction", "output"]', ("line 2", "a list, not an object")),
    "no output": ('{"instruction": "a"}', ("line 2", "has no output")),
    "no instruction": ('{"output": "a"}', ("line 2", "has no instruction")),
    "output a number": ('{"instruction": "a", "output": 5}', ("line 2", "output is a number")),
    "input null": (
        '{"instruction": "a", "input": null, "output": "b"}', ("line 2", "input is null"),
    ),
    "both kinds": (
        '{"instruction": "a", "output": "b", "messages": []}', ("line 2", "both messages and"),
    ),
    "messages not a list": ('{"messages": "hi"}', ("line 2", "messages is a string")),
    "no messages": ('{"messages": []}', ("line 2", "messages is an empty list")),
    "a message without content": (
        '{"messages": [{"role": "user"}]}', ("line 2", "message 1 is not an object with"),
    ),
    "unknown role": (
        '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}',
        ("line 2", 'message 2 has the role "bot"', "system, user or assistant"),
    ),
    "role a list": (
        '{"messages": [{"role": ["user"], "content": "a"}]}', ("line 2", 'the role ["user"]'),
    ),
    "content a list": (
        '{"messages": [{"role": "user", "content": ["a"]}]}', ("line 2", "content is a list"),
    ),
    "no assistant turn": (
        '{"messages": [{"role": "user", "content": "a"}]}', ("line 2", "no assistant turn"),
    ),
    "longer than the context": (
        json.dumps({"instruction": "a", "output": "b" * 300}), ("line 2", "more than the context"),
    ),
}  # fmt: skip
GOOD = json.dumps({"instruction": "Say yes.", "output": "yes"})
QUIET = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]


def one_error_line(stderr: str, *words: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    assert all(word in lines[0] for word in words), lines[0]


def bad_files(folder: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    """Each bad record on line 2 of its own file (after a good record and before 30 more), and
    the bad files."""
    folder.mkdir()
    files = {}
    for name, (line, words) in BAD_RECORDS.items():
        path = folder / f"{name.replace(' ', '_')}.jsonl"
        path.write_text("\n".join([GOOD, line, *[GOOD] * 30]) + "\n")
        files[name] = (path, (str(path), *words))
    (folder / "empty.jsonl").write_text("\n\n")
    files["empty"] = (folder / "empty.jsonl", ("holds no records",))
    (folder / "latin1.jsonl").write_bytes(GOOD.encode() + b'\n{"output": "caf\xe9"}\n')
    files["not UTF-8"] = (folder / "latin1.jsonl", ("line 2", "not UTF-8"))
    files["missing"] = (folder / "missing.jsonl", ("missing.jsonl is not a file",))
    return files


def test_each_bad_record_is_one_line_naming_file_and_line_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the train command reports it (`cli._run`): one `error:` line, exit code 1, nothing
    trained or logged. Then the real command, in its own process, on one of them: it leaves no
    folder at all."""
    files = bad_files(tmp_path / "records")
    for name, (path, words) in files.items():
        run = tmp_path / "runs" / name.replace(" ", "_")
        cfg = compose_config("train", [*QUIET, "experiment=instruct", f"data.source={path}"], run)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            _run(train, cfg)
        assert exit_info.value.code == 1, name
        one_error_line(capsys.readouterr().err, *words)
        # Only what a command writes before it trains, which the command line's run removes.
        left = {path.name for path in (run / "run").iterdir()}
        assert left <= set(HYDRA_START_FILES), f"{name}: the run wrote {left}"
    path, words = files["longer than the context"]
    result = run_cli(
        "-m", PACKAGE, *QUIET, "experiment=instruct", f"data.source={path}", cwd=tmp_path
    )
    assert result.returncode == 1, result.stderr[-3000:]
    one_error_line(result.stderr, *words)
    assert not (tmp_path / "logs").exists()


def test_bad_settings_are_one_line(tmp_path: Path, train_config: ComposeFn) -> None:
    cases = {
        "data.tokenizer=missing.json": "data.tokenizer=missing.json is not a file",
        f"data.tokenizer={write_jsonl(tmp_path / 'x.json', {'a': 1})}": "is not a tokenizer",
        "data.vocab_size=256": "data.vocab_size=256 is smaller than the tokenizer's 257",
        "data.block_size=0": "data.block_size=0",
    }
    for override, words in cases.items():
        cfg = train_config("experiment=instruct", override)
        with pytest.raises(ConfigError, match=re.escape(words)):
            build_model_and_data(cfg.model, cfg.data)


def test_the_toy_set_is_shipped_and_every_record_reads() -> None:
    records = read_records("toy")
    assert 50 <= len(records) <= 200
    datamodule = InstructionDataModule()
    datamodule.setup("fit")
    assert sum(len(split) for split in datamodule.splits.values()) == len(records)


def start_loss(cfg: Any) -> float:
    """The validation loss of the weights the train command starts from (the same seed)."""
    L.seed_everything(cfg.seed, verbose=False)
    model, datamodule = build_model_and_data(cfg.model, cfg.data)
    datamodule.setup("fit")
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in datamodule.val_dataloader():
            logits = model(inputs)
            total += float(
                F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            )
            count += int((targets != IGNORED).sum())
    return total / count


def generate_reply(net: GPT, messages: list[dict[str, str]]) -> str:
    tokenizer = ByteTokenizer()
    prompt = torch.tensor([chat_prompt(messages, tokenizer)])
    output = net.generate(prompt, 12, temperature=0.0, stop_token=tokenizer.end_of_text)
    reply = output[0, prompt.size(1) :].tolist()
    assert END in reply, f"no end-of-text token: {reply}"
    return tokenizer.decode(reply[: reply.index(END)])


@pytest.mark.slow
def test_a_tiny_model_learns_the_toy_set_and_answers_held_out_records(tmp_path: Path) -> None:
    """Through the train command: the validation loss of the responses ends far below where it
    starts, and greedy generation answers most validation records (never trained on) right and
    stops at its end-of-text token; the predict command continues a prompt alike."""
    overrides = [*QUIET, "experiment=instruct", "trainer.val_check_interval=100", "test=false"]
    result = run_cli("-m", PACKAGE, *overrides, "run_name=toy", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "logs" / "train" / "runs" / "toy"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    cfg = compose_config("train", overrides, tmp_path / "again")
    start = start_loss(cfg)
    assert metrics["val/loss"] < 0.3 * start, (metrics, start)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    net_config = checkpoint["run_config"]["model"]["net"]
    net = GPT(**{k: v for k, v in net_config.items() if not k.startswith("_")}).eval()
    net.load_state_dict({k[4:]: v for k, v in checkpoint["state_dict"].items()})
    records = [record for _, record in read_records("toy")]
    fractions = (cfg.data.val_fraction, cfg.data.test_fraction)
    _, val, _ = split_indices(len(records), fractions, cfg.data.split_seed)
    val_records = [records[i] for i in val.tolist()]
    answered = []
    for record in val_records:
        messages = record["messages"]
        first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        answer = messages[first_reply]["content"]
        if generate_reply(net, messages[:first_reply]) == answer:
            answered.append((messages[:first_reply], answer))
    assert len(answered) > len(val_records) / 2, f"{len(answered)} of {len(val_records)} right"
    # The predict command rebuilds the model and its data module from the checkpoint, and
    # continues the same prompt (as text: it holds no earlier reply) with the same answer, here
    # with the compiled decode step (on a GPU by default; asked for on this CPU).
    question, answer = answered[0]
    prompt = ByteTokenizer().decode(chat_prompt(question, ByteTokenizer()))
    result = run_cli(
        "-c", f"from {PACKAGE}.cli import predict; predict()", "trainer=cpu",
        "extras.print_config=false", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        f"prompt={prompt}", "compile_decode=true",
        "max_new_tokens=8", "temperature=0", "run_name=predicted", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (written,) = (tmp_path / "logs" / "predict" / "runs").glob("*/predictions.jsonl")
    prediction = json.loads(written.read_text())
    assert prediction["prompt"] == prompt and prediction["completion"].startswith(answer)

    # chat=true alone: a conversation on standard input; the second turn's prompt holds the
    # first turn and the model's reply, whole (256 bytes of context hold both).
    said = [answered[0][0][-1]["content"], answered[1][0][-1]["content"]]
    result = run_cli(
        "-c", f"from {PACKAGE}.cli import predict; predict()", "trainer=cpu", "chat=true",
        "extras.print_config=false", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        "max_new_tokens=12", "temperature=0", "run_name=conversation", cwd=tmp_path,
        input=f"{said[0]}\n{said[1]}\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    written = tmp_path / "logs" / "predict" / "runs" / "conversation" / "predictions.jsonl"
    turns = [json.loads(line) for line in written.read_text().splitlines()]
    conversation: list[dict[str, str]] = []
    for turn in said:
        conversation.append({"role": "user", "content": turn})
        tokens = chat_prompt(conversation, ByteTokenizer())
        output = net.generate(torch.tensor([tokens]), 12, temperature=0.0, stop_token=END)
        reply = output[0, len(tokens) :].tolist()
        reply = reply[: reply.index(END)] if END in reply else reply
        conversation.append({"role": "assistant", "content": ByteTokenizer().decode(reply)})
    assert len(tokens) < 256, "the whole conversation fits"
    assert turns == [
        {"prompt": said[0], "completion": conversation[1]["content"]},
        {"prompt": said[1], "completion": conversation[3]["content"]},
    ]


# A one-layer model for the runs below; the base is the language example's shape with the
# end-of-text token in its vocabulary, trained briefly.
SMALL = ["model.net.n_layer=1", "model.net.n_embd=64", "model.net.n_head=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("base")
    result = run_cli(
        "-m", PACKAGE, *QUIET, "experiment=language", *SMALL, "model.net.vocab_size=257",
        "data.block_size=256", "data.max_bytes=200000", "trainer.max_steps=20",
        "trainer.val_check_interval=20", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2", "run_name=base", cwd=cwd,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "logs" / "train" / "runs" / "base" / "checkpoints" / "last.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["instruct", "instruct_lora"])
def test_full_and_lora_fine_tuning_from_a_trained_model_lower_the_response_loss(
    base: Path, tmp_path: Path, experiment: str
) -> None:
    """Full fine-tuning trains (and saves) every weight; LoRA only the adapters, which its
    checkpoints hold, naming the base they adapt."""
    result = run_cli(
        "-m", PACKAGE, *QUIET, f"experiment={experiment}", *SMALL, f"init_from={base}",
        "trainer.max_steps=40", "trainer.val_check_interval=20", "run_name=tuned", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "logs" / "train" / "runs" / "tuned"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["val/loss"] < metrics["init/val/loss"] - 0.3, metrics
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    adapters = [name for name in last["state_dict"] if name.endswith(("lora_a", "lora_b"))]
    if experiment == "instruct_lora":
        assert adapters and set(adapters) == set(last["state_dict"])
        assert last["base_weights"]["path"] == str(base.resolve())
    else:
        assert not adapters and "base_weights" not in last
        before = torch.load(base, weights_only=True)["state_dict"]
        assert before.keys() == last["state_dict"].keys()
        assert not torch.equal(before["net.wte.weight"], last["state_dict"]["net.wte.weight"])


@pytest.mark.slow
def test_a_killed_instruction_run_finishes_as_if_never_stopped(
    tmp_path: Path, reference_run: References
) -> None:
    """Killed mid-way through its second epoch (5 batches an epoch), with a loader process: the
    resumed run skips the batches done, in the same order, padded alike."""
    run = [
        *COMMON, "experiment=instruct", *SMALL, "data.num_workers=1", "trainer.max_steps=12",
        "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2", "callbacks.step_checkpoint.every_n_train_steps=4",
    ]  # fmt: skip
    killed_then_finished([*run, *fault("train_step", 7, tmp_path / "fired")], tmp_path / "run")
    assert_same_outcome(reference_run(run), tmp_path / "run")


def test_a_checkpoint_naming_a_kind_of_tokenizer_is_followed_and_a_missing_file_is_not(
    tmp_path: Path,
) -> None:
    """data.tokenizer=bytes names a tokenizer, not a file: predict and serve rebuild the data
    module from it; a tokenizer.json that is not here needs the user's data.tokenizer=..."""
    ckpt = tmp_path / "last.ckpt"
    stored = {"source": "toy", "tokenizer": "bytes", "vocab_size": 257}
    assert stored_data(stored, {}, ckpt)["tokenizer"] == "bytes"
    gone = {**stored, "tokenizer": str(tmp_path / "gone" / "tokenizer.json")}
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*a path that does not exist here"):
        stored_data(gone, {}, ckpt)
    assert stored_data(gone, {"tokenizer": "bytes"}, ckpt)["tokenizer"] == "bytes"
