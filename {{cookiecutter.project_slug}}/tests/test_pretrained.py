"""Starting from a Hugging Face GPT-2 checkpoint (`init_from=<folder>`: config.json,
model.safetensors, tokenizer.json): the converted GPT gives transformers' logits, a run fine-tunes
it and predict decodes with its tokenizer; pickled weights are never unpickled, and a folder that
does not fit the configured model is one error line that names the overrides. Nothing here uses
the network: the checkpoint is a small random GPT-2 that transformers saves, with a byte-level BPE
trained here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hydra.utils import instantiate
from safetensors.torch import load_file, save_file

from {{ cookiecutter.package_name }}.checkpointing.door import (
    read_checkpoint,
)
from {{ cookiecutter.package_name }}.checkpointing.hugging_face import (
    load_hugging_face,
)
from {{ cookiecutter.package_name }}.checkpointing.trained import (
    file_digest,
)
from {{ cookiecutter.package_name }}.cli import _run
from {{ cookiecutter.package_name }}.data.instructions import (
    chat_prompt,
)
from {{ cookiecutter.package_name }}.data.tokenized_text import (
    TokenizedTextDataModule,
)
from {{ cookiecutter.package_name }}.data.tokenizer import (
    tokenizer_file,
)
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.models.nets.gpt import (
    GPT,
)
from {{ cookiecutter.package_name }}.recipes.train import (
    train,
)

from .helpers import PACKAGE, ComposeFn, run_cli

QUIET = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]
SIZES = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}
END_OF_TEXT = "<|endoftext|>"


@dataclass
class Pretrained:
    folder: Path
    model: Any  # transformers' GPT2LMHeadModel
    tokenizer: Any  # tokenizers' Tokenizer
    corpus: Path

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def overrides(self) -> list[str]:
        sizes = {**SIZES, "vocab_size": self.vocab_size}
        return [f"model.net.{name}={value}" for name, value in sizes.items()]


def gpt2_tokenizer(text: str) -> Any:
    """A byte-level BPE laid out as GPT-2's tokenizer.json: bytes and merges, then
    `<|endoftext|>` as the last token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([text], trainer=trainer)
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Pretrained:
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("pretrained")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "glob.py"))
    corpus = root / "corpus.py"
    corpus.write_text(text)
    tokenizer = gpt2_tokenizer(text)
    end = tokenizer.token_to_id(END_OF_TEXT)
    config = GPT2Config(
        vocab_size=tokenizer.get_vocab_size(), n_positions=SIZES["block_size"],
        n_embd=SIZES["n_embd"], n_layer=SIZES["n_layer"], n_head=SIZES["n_head"],
        bos_token_id=end, eos_token_id=end,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # every weight and bias away from its initial value, so each counts
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    folder = root / "gpt2"
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    assert (folder / "model.safetensors").is_file()
    return Pretrained(folder, model, tokenizer, corpus)


def hub_layout(pretrained: Pretrained, folder: Path) -> Path:
    """The layout of the Hub's own gpt2 files: no `transformer.` prefix, each block's causal mask
    stored as `h.<i>.attn.bias`, and a head tied to the embedding."""
    folder.mkdir()
    stored = load_file(pretrained.folder / "model.safetensors")
    tensors = {name.removeprefix("transformer."): value for name, value in stored.items()}
    block = SIZES["block_size"]
    mask = torch.ones(block, block).tril().view(1, 1, block, block)
    tensors.update({f"h.{i}.attn.bias": mask.clone() for i in range(SIZES["n_layer"])})
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_bytes((pretrained.folder / "config.json").read_bytes())
    return folder


def gpt(vocab_size: int) -> GPT:
    sizes = {**SIZES, "vocab_size": vocab_size}
    return GPT(**sizes, bias=True).eval()  # type: ignore[arg-type]


def fine_tuned(
    result: subprocess.CompletedProcess[str], run_dir: Path, pretrained: Pretrained
) -> tuple[Path, GPT]:
    """A finished fine-tuning run's last checkpoint, and its weights in the project's GPT; the
    run logged its starting weights' validation loss, then its own."""
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert {"init/val/loss", "val/loss", "test/loss"} <= set(metrics), metrics
    last = run_dir / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)["state_dict"]
    tuned = gpt(pretrained.vocab_size)
    tuned.load_state_dict({name.removeprefix("net."): value for name, value in state.items()})
    return last, tuned


@pytest.mark.parametrize("layout", ["save_pretrained", "hub"])
def test_the_converted_gpt_gives_the_logits_of_transformers(
    pretrained: Pretrained, tmp_path: Path, layout: str
) -> None:
    folder = (
        pretrained.folder
        if layout == "save_pretrained"
        else hub_layout(pretrained, tmp_path / "hub")
    )
    net = gpt(pretrained.vocab_size)
    load_hugging_face(net, folder)
    ids = pretrained.tokenizer.encode(pretrained.corpus.read_text()[:2000]).ids
    tokens = torch.tensor([ids[: SIZES["block_size"]], ids[100 : 100 + SIZES["block_size"]]])
    with torch.no_grad():
        ours, theirs = net(tokens), pretrained.model(tokens).logits
    assert theirs.abs().max() > 1.0, "the logits are far from uniform: every weight counts"
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_the_text_module_reads_the_corpus_as_the_folders_tokenizer_tokenizes_it(
    pretrained: Pretrained,
) -> None:
    """data=tokenized_text with the folder's tokenizer.json: its splits decode back to the whole
    corpus, each window's target is its input shifted by one, and bits per byte count BPE's
    several bytes a token."""
    datamodule = TokenizedTextDataModule(
        tokenizer=str(pretrained.folder / "tokenizer.json"), source=str(pretrained.corpus),
        block_size=32, max_bytes=None,
    )  # fmt: skip
    datamodule.setup("fit")
    assert datamodule.vocab_size == pretrained.vocab_size
    texts = [
        pretrained.tokenizer.decode(split.data.tolist(), skip_special_tokens=False)
        for split in datamodule.splits.values()
    ]
    assert Counter("".join(texts)) == Counter(pretrained.corpus.read_text())
    inputs, targets = datamodule.splits["train"][3]
    assert inputs.shape == targets.shape == (32,) and torch.equal(inputs[1:], targets[:-1])
    assert 0.2 < datamodule.tokens_per_byte("train") < 0.8
    assert datamodule.decode(datamodule.encode("def f(x):\n")) == "def f(x):\n"


def one_error_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def test_a_run_fine_tunes_gpt2_and_predict_decodes_with_its_tokenizer(
    pretrained: Pretrained, tmp_path: Path
) -> None:
    """The run starts from the checkpoint's weights (three small steps later they are within
    1e-3 of them) on text tokenized by the folder's tokenizer.json; predict continues a prompt
    as the fine-tuned GPT does greedily, decoded by that tokenizer."""
    result = run_cli(
        "-m", PACKAGE, *QUIET, "experiment=gpt2_pretrained", f"init_from={pretrained.folder}",
        *pretrained.overrides(), "model.compile=false", f"data.source={pretrained.corpus}",
        "data.block_size=32", "data.batch_size=4", "trainer.max_steps=3",
        "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2", "run_name=tuned", cwd=tmp_path,
    )  # fmt: skip
    last, tuned = fine_tuned(result, tmp_path / "logs" / "train" / "runs" / "tuned", pretrained)
    start = gpt(pretrained.vocab_size)
    load_hugging_face(start, pretrained.folder)
    moved = [
        float((value - start.state_dict()[name]).abs().max())
        for name, value in tuned.state_dict().items()
    ]
    assert 0 < max(moved) < 1e-3, "trained a little, from the checkpoint's weights"

    prompt = "def wrap(text, width"
    result = run_cli(
        "-c", f"from {PACKAGE}.cli import predict; predict()", f"ckpt_path={last}",
        f"prompt={prompt}", "max_new_tokens=12", "temperature=0", "stream=false",
        "trainer=cpu", "run_name=greedy", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    written = tmp_path / "logs" / "predict" / "runs" / "greedy" / "predictions.jsonl"
    (line,) = written.read_text().splitlines()
    ids = pretrained.tokenizer.encode(prompt).ids
    expected = tuned.generate(torch.tensor([ids]), 12, temperature=0.0)[0, len(ids) :]
    assert json.loads(line) == {
        "prompt": prompt,
        "completion": pretrained.tokenizer.decode(expected.tolist(), skip_special_tokens=True),
    }


class WritesMarker:
    """Unpickled (torch.load without weights_only), it creates the marker file, as a malicious
    pickle would run anything."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_pickled_weights_are_refused_in_one_line_and_never_unpickled(
    pretrained: Pretrained, train_config: ComposeFn, capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:  # fmt: skip
    """Even with trust_checkpoint=true: a folder whose weights are pytorch_model.bin only."""
    folder = tmp_path / "pickled"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((pretrained.folder / name).read_bytes())
    marker = tmp_path / "unpickled"
    torch.save({"wte.weight": WritesMarker(marker)}, folder / "pytorch_model.bin")  # as a .bin is
    assert not marker.exists()
    cfg = train_config(
        "experiment=gpt2_pretrained", f"init_from={folder}", *pretrained.overrides(),
        "model.compile=false", f"data.source={pretrained.corpus}", "data.block_size=32",
        "trainer.max_steps=1", "trust_checkpoint=true",
    )  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _run(train, cfg)
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: init_from={folder} "), lines
    assert all(word in lines[0] for word in ("pytorch_model.bin", "never", "hf download")), lines
    assert not marker.exists(), "the pickle was never unpickled"
    assert not list(tmp_path.rglob("*.ckpt")), "nothing was trained"


def test_a_checkpoint_of_other_sizes_names_the_overrides_and_writes_nothing(
    pretrained: Pretrained, tmp_path: Path
) -> None:
    """experiment=gpt2_pretrained builds GPT-2 small's 12 layers, 50257 tokens and context of
    1024 (its width narrowed here, to build it quickly); the folder holds a 2-layer GPT-2."""
    result = run_cli(
        "-m", PACKAGE, *QUIET, "experiment=gpt2_pretrained", f"init_from={pretrained.folder}",
        "model.net.n_embd=64", "model.net.n_head=2", "model.compile=false",
        f"data.source={pretrained.corpus}", "data.block_size=32", cwd=tmp_path,
    )  # fmt: skip
    line = one_error_line(result, f"init_from={pretrained.folder}", "a GPT-2 of 2 layers")
    overrides = (
        f"model.net.n_layer=2 model.net.vocab_size={pretrained.vocab_size} model.net.block_size=64"
    )
    assert line.endswith(f"add {overrides}"), line
    assert not (tmp_path / "logs").exists() or not any(
        path.is_file() for path in (tmp_path / "logs").rglob("*")
    ), "nothing was written"


# The Hub's larger GPT-2s: layers, heads, width (each with 50257 tokens and a context of 1024).
LARGER = {"gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}


@pytest.mark.parametrize("name", list(LARGER))
def test_the_larger_gpt2s_name_the_overrides_that_build_them(
    train_config: ComposeFn, tmp_path: Path, name: str
) -> None:
    """What the docs show for gpt2-medium: experiment=gpt2_pretrained needs only the three sizes
    (its vocabulary, context and biases are GPT-2's); the sizes are checked before the weights
    are read."""
    layers, heads, width = LARGER[name]
    folder = tmp_path / name
    folder.mkdir()
    config = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_layer": layers,
              "n_head": heads, "n_embd": width, "activation_function": "gelu_new"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    with torch.device("meta"):  # GPT-2 small's shapes, without its memory
        net = instantiate(train_config("experiment=gpt2_pretrained").model.net)
    with pytest.raises(ConfigError) as refused:
        load_hugging_face(net, folder)
    overrides = f"model.net.n_layer={layers} model.net.n_head={heads} model.net.n_embd={width}"
    assert str(refused.value).endswith(f"the configured model is not: add {overrides}")


def damaged(pretrained: Pretrained, folder: Path, change: str) -> Path:
    """A copy of the checkpoint folder with one thing wrong."""
    folder.mkdir()
    config = json.loads((pretrained.folder / "config.json").read_text())
    tensors = load_file(pretrained.folder / "model.safetensors")
    if change == "activation":
        config["activation_function"] = "relu"
    elif change == "model type":
        config["model_type"] = "gemma"
    elif change == "a size given as text":
        config["n_layer"] = "2"
    elif change == "a missing tensor":
        del tensors["transformer.h.1.mlp.c_fc.weight"]
    elif change == "NaN weights":
        tensors["transformer.wpe.weight"][0, 0] = float("nan")
    elif change == "a head of its own":
        tensors["lm_head.weight"] = torch.randn_like(tensors["transformer.wte.weight"])
    (folder / "config.json").write_text(json.dumps(config))
    if change == "no config":
        (folder / "config.json").unlink()
    if change == "not JSON":
        (folder / "config.json").write_text("{model_type: gpt2")
    save_file(tensors, folder / "model.safetensors")
    if change == "truncated weights":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    if change == "no weights":
        (folder / "model.safetensors").unlink()
    if change == "weights linked out of the folder":
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").symlink_to("/etc/passwd")
    if change == "a config that is a pipe":
        (folder / "config.json").unlink()
        os.mkfifo(folder / "config.json")
    return folder


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("activation", ["activation_function=relu", "does not compute"]),
        ("model type", ["'gemma'", "llama, qwen2, qwen3, mistral (and gpt2)"]),
        ("a size given as text", ['n_layer="2"', "a whole number"]),
        ("not JSON", ["config.json is not JSON"]),
        ("no config", ["no config.json"]),
        ("no weights", ["no model.safetensors", "hf download"]),
        ("truncated weights", ["not a readable safetensors file"]),
        ("a missing tensor", ["missing: blocks.1.mlp.fc.weight"]),
        ("NaN weights", ["NaN or infinite", "transformer.wpe.weight"]),
        ("a head of its own", ["lm_head.weight", "ties"]),
        ("weights linked out of the folder", ["model.safetensors is a link to a file outside"]),
        ("a config that is a pipe", ["config.json is not a regular file"]),
    ],
)
def test_a_folder_that_is_not_a_whole_gpt2_is_refused_in_one_line_before_any_weight_changes(
    pretrained: Pretrained, tmp_path: Path, change: str, words: list[str]
) -> None:
    folder = damaged(pretrained, tmp_path / "gpt2", change)
    net = gpt(pretrained.vocab_size)
    before = {name: value.clone() for name, value in net.state_dict().items()}
    with pytest.raises(ConfigError) as refused:
        load_hugging_face(net, folder)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and f"init_from={folder}" in message, message
    assert all(word in message for word in words), message
    assert all(torch.equal(value, before[name]) for name, value in net.state_dict().items())


def test_a_snapshot_of_the_hugging_face_cache_reads_through_its_links(
    pretrained: Pretrained, tmp_path: Path
) -> None:
    """`hf download` without --local-dir leaves snapshots/<revision>/<file> linked into the
    repository's blobs/: links that stay inside the repository's folder are read."""
    repository = tmp_path / "hub" / "models--gpt2"
    snapshot = repository / "snapshots" / "0123abc"
    (repository / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in pretrained.folder.iterdir():
        blob = repository / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    net = gpt(pretrained.vocab_size)
    load_hugging_face(net, snapshot)
    reference = gpt(pretrained.vocab_size)
    load_hugging_face(reference, pretrained.folder)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(),
                                                  reference.state_dict().values(), strict=True))  # fmt: skip


def test_the_fingerprint_of_a_folder_covers_its_model_files_not_the_download_bookkeeping(
    pretrained: Pretrained, tmp_path: Path
) -> None:
    """What LoRA checkpoints record (a resumed run, eval, predict and export compare it): any
    change to config.json, model.safetensors or tokenizer.json; not the `.cache` that `hf
    download` keeps beside them, whose timestamps change with every download."""
    folder = tmp_path / "gpt2"
    shutil.copytree(pretrained.folder, folder)
    digest = file_digest(folder)
    cache = folder / ".cache" / "huggingface" / "download"
    cache.mkdir(parents=True)
    (cache / "model.safetensors.metadata").write_text("a commit\na timestamp\n")
    assert file_digest(folder) == digest
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        original = (folder / name).read_bytes()
        (folder / name).write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        assert file_digest(folder) != digest, name
        (folder / name).write_bytes(original)
    assert file_digest(folder) == digest


def test_a_hugging_face_folder_given_as_a_checkpoint_to_continue_says_to_start_from_it(
    pretrained: Pretrained,
) -> None:
    with pytest.raises(ConfigError, match=f"init_from={pretrained.folder}$"):
        read_checkpoint(pretrained.folder, key="ckpt_path")


CHATS = [  # one turn each: the test's tokenizer learnt Python, so English takes many tokens
    [("Uppercase: cat", "CAT")],
    [("Uppercase: owl", "OWL")],
    [("Reverse: emu", "ume")],
    [("Uppercase: bee", "BEE")],
]


def test_the_readme_flow_gpt2_on_instructions_then_served_and_asked(
    pretrained: Pretrained, tmp_path: Path
) -> None:
    """The quick start's path: experiment=gpt2_instruct fine-tunes the GPT-2 folder on chat
    records with its own tokenizer, the server answers a conversation (`messages`) in the
    training's template and ends at the end-of-text token, as `predict chat=true` does; both are
    the fine-tuned model's own greedy reply."""
    from .test_serve import Server

    records = tmp_path / "records.jsonl"
    lines = []
    for chat in CHATS * 4:
        messages = [
            {"role": role, "content": text}
            for question, answer in chat
            for role, text in (("user", question), ("assistant", answer))
        ]
        lines.append(json.dumps({"messages": messages}))
    records.write_text("\n".join(lines) + "\n")
    result = run_cli(
        "-m", PACKAGE, *QUIET, "experiment=gpt2_instruct", f"init_from={pretrained.folder}",
        *pretrained.overrides(), "model.compile=false", f"data.source={records}",
        "data.batch_size=4", "trainer.max_epochs=2", "run_name=chat", cwd=tmp_path,
    )  # fmt: skip
    last, tuned = fine_tuned(result, tmp_path / "logs" / "train" / "runs" / "chat", pretrained)
    end = pretrained.tokenizer.token_to_id(END_OF_TEXT)
    question = [{"role": "user", "content": "Uppercase: fox"}]
    prompt = pretrained.tokenizer.encode("### User:\nUppercase: fox\n\n### Assistant:\n").ids
    reply = tuned.generate(torch.tensor([prompt]), 20, temperature=0.0, stop_token=end)
    reply_ids = reply[0, len(prompt) :].tolist()
    ended = end in reply_ids
    expected = pretrained.tokenizer.decode(
        reply_ids[: reply_ids.index(end)] if ended else reply_ids
    )

    server = Server([f"ckpt_path={last}"], tmp_path / "serve")
    try:
        response = httpx_post(f"{server.url}/generate", {
            "messages": question, "max_new_tokens": 20, "temperature": 0,
        })  # fmt: skip
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["completion"] == expected
        assert answer["finish_reason"] == ("end" if ended else "length")
        said = [*question, {"role": "assistant", "content": "FOX"}]
        bad = httpx_post(f"{server.url}/generate", {"messages": said})
        assert bad.status_code == 400 and "the assistant's" in bad.json()["error"], bad.text
    finally:
        assert server.stop() == 0

    result = run_cli(
        "-c", f"from {PACKAGE}.cli import predict; predict()", f"ckpt_path={last}",
        "prompt=Uppercase: fox", "chat=true", "max_new_tokens=20", "temperature=0",
        "stream=false", "trainer=cpu", "run_name=chat", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    written = tmp_path / "logs" / "predict" / "runs" / "chat" / "predictions.jsonl"
    (line,) = written.read_text().splitlines()
    assert json.loads(line) == {"prompt": "Uppercase: fox", "completion": expected}

    # chat=true alone: a conversation, one turn a line. The two turns outgrow this GPT's context
    # of 64 tokens, so the second turn's prompt leaves the first out (test_instructions keeps it).
    result = run_cli(
        "-c", f"from {PACKAGE}.cli import predict; predict()", f"ckpt_path={last}", "chat=true",
        "max_new_tokens=20", "temperature=0", "trainer=cpu", "run_name=conversation",
        cwd=tmp_path, input="Uppercase: fox\n\nReverse: owl\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    written = tmp_path / "logs" / "predict" / "runs" / "conversation" / "predictions.jsonl"
    first, second = (json.loads(line) for line in written.read_text().splitlines())
    assert first == {"prompt": "Uppercase: fox", "completion": expected}
    conversation = [
        *question, {"role": "assistant", "content": expected},
        {"role": "user", "content": "Reverse: owl"},
    ]  # fmt: skip
    tokenizer = tokenizer_file("data.tokenizer", str(pretrained.folder / "tokenizer.json"), "")
    assert len(chat_prompt(conversation, tokenizer)) > SIZES["block_size"]
    prompt = chat_prompt(conversation[2:], tokenizer)
    reply = tuned.generate(torch.tensor([prompt]), 20, temperature=0.0, stop_token=end)
    reply_ids = reply[0, len(prompt) :].tolist()
    reply_ids = reply_ids[: reply_ids.index(end)] if end in reply_ids else reply_ids
    assert second == {"prompt": "Reverse: owl", "completion": tokenizer.decode(reply_ids)}
    printed = [line for line in result.stdout.splitlines() if not line.startswith("[")]  # logs
    assert printed == [expected, second["completion"]], result.stdout


def httpx_post(url: str, body: Any) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120)
