"""The Llama-family decoder (models/nets/llama.py) and its published weights: a Llama 3, Qwen2,
Qwen3 or Mistral folder that transformers saves (one safetensors file or shards) gives, in this
project's network, transformers' logits and greedy tokens; a folder that does not fit is one error
line before any weight changes; the README's fine-tune -> serve -> ask flow runs on a random
Llama-family folder. Nothing here uses the network: each model is small and random."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.hugging_face import (
    load_hugging_face,
)
from {{ cookiecutter.package_name }}.checkpointing.hugging_face_decoders import (
    read_config,
    settings_of_config,
)
from {{ cookiecutter.package_name }}.data.chat_template import (
    ChatTemplate,
)
from {{ cookiecutter.package_name }}.data.instructions import (
    InstructionDataModule,
    encode_parts,
)
from {{ cookiecutter.package_name }}.errors import ConfigError
from {{ cookiecutter.package_name }}.models.lora import (
    add_adapters,
)
from {{ cookiecutter.package_name }}.models.nets.llama import (
    Llama,
)

from .helpers import PACKAGE, run_cli

QUIET = ["trainer=cpu", "logger=csv", "extras.print_config=false", "callbacks.progress_bar=null"]
COMMON = {
    "vocab_size": 101, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 128,
}  # fmt: skip
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}  # fmt: skip
# Each family with what sets it apart: Llama 3's scaled RoPE and untied head, Qwen2's biases on
# q/k/v (saved in shards), Qwen3's query/key norms and wider heads, Mistral's untied head.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0, "tie_word_embeddings": False,
    }),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {
        "sliding_window": None, "tie_word_embeddings": False,
    }),
}  # fmt: skip


@dataclass
class Saved:
    folder: Path
    model: Any  # transformers' *ForCausalLM


def save_family(family: str, folder: Path, **changes: Any) -> Saved:
    import transformers

    config_class, model_class, extra = FAMILIES[family]
    settings = copy.deepcopy({**COMMON, **extra, **changes})  # transformers edits rope dicts
    config = getattr(transformers, config_class)(**settings)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # every weight away from its initial value (norms from 1), so each counts
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(folder, max_shard_size="100KB" if family == "qwen2" else "5GB")
    return Saved(folder, model)


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return save_family(request.param, tmp_path_factory.mktemp(request.param))


def built(folder: Path, block_size: int = 64) -> Llama:
    settings = settings_of_config(read_config(folder / "config.json", "init_from"), "init_from")
    return Llama(block_size=block_size, **settings).eval()


def test_each_family_gives_the_logits_and_greedy_tokens_of_transformers(saved: Saved) -> None:
    net = built(saved.folder)
    load_hugging_face(net, saved.folder)
    tokens = torch.randint(
        0, COMMON["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ours, theirs = net(tokens), saved.model(tokens).logits
        assert theirs.abs().max() > 0.5, "the logits are far from uniform: every weight counts"
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        cache = net.new_cache()  # the same logits a few positions at a time, through the cache
        pieces = [
            net(tokens[:, :20], cache),
            net(tokens[:, 20:21], cache),
            net(tokens[:, 21:], cache),
        ]
        torch.testing.assert_close(torch.cat(pieces, dim=1), theirs, atol=1e-4, rtol=0)
        mine = net.generate(tokens[:1, :6], 12, temperature=0.0)
        hub = saved.model.generate(tokens[:1, :6], max_new_tokens=12, do_sample=False)
    assert torch.equal(mine, hub)


def test_left_padded_rows_get_the_logits_they_get_alone(saved: Saved) -> None:
    net = built(saved.folder)
    load_hugging_face(net, saved.folder)
    short, long = torch.randint(0, 100, (1, 5)), torch.randint(0, 100, (1, 9))
    batch = torch.cat((torch.cat((torch.zeros(1, 4, dtype=torch.long), short), 1), long))
    real = torch.ones_like(batch, dtype=torch.bool)
    real[0, :4] = False
    with torch.no_grad():
        together = net.generate(batch, 6, temperature=0.0, padding_mask=real)
        alone = [net.generate(row, 6, temperature=0.0) for row in (short, long)]
    assert torch.equal(together[0, 4:], alone[0][0]) and torch.equal(together[1], alone[1][0])


def test_a_config_in_the_older_layout_reads_as_the_newer(tmp_path: Path) -> None:
    """transformers before 5 writes `rope_theta` and `rope_scaling` (kind under `type`), not
    `rope_parameters`: the same model either way."""
    saved = save_family("llama", tmp_path / "llama")
    config = json.loads((saved.folder / "config.json").read_text())
    parameters = config.pop("rope_parameters")
    config["rope_theta"] = parameters.pop("rope_theta")
    config["rope_scaling"] = {"type": parameters.pop("rope_type"), **parameters}
    (saved.folder / "config.json").write_text(json.dumps(config))
    net = built(saved.folder)
    assert net.rope_theta == 500000.0 and net.rope_scaling == LLAMA3_SCALING
    load_hugging_face(net, saved.folder)
    tokens = torch.randint(0, 100, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(net(tokens), saved.model(tokens).logits, atol=1e-4, rtol=0)


def test_lora_and_activation_checkpointing_on_the_llama() -> None:
    """Adapters on every projection train alone (the rest is frozen); recomputing each block in
    the backward pass gives the gradients of keeping its activations."""
    torch.manual_seed(0)
    net = Llama(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = add_adapters(net, rank=4, alpha=8, dropout=0.0, target_modules=targets)
    assert len(adapted) == 2 * len(targets)
    trains = {name for name, p in net.named_parameters() if p.requires_grad}
    assert trains and all(name.endswith(("lora_a", "lora_b")) for name in trains)

    tokens = torch.randint(0, 64, (2, 32))
    gradients = []
    for recompute in (False, True):
        torch.manual_seed(0)
        plain = Llama(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                      activation_checkpointing=recompute).train()  # fmt: skip
        plain(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        gradients.append({n: p.grad.clone() for n, p in plain.named_parameters()})
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, atol=1e-6, rtol=1e-5)


def test_fp8_converts_every_projection_of_the_llama_and_it_trains() -> None:
    """torchao's float8 layers in place of every q/k/v/o and MLP projection (not the head); a step
    on the CPU (torch._scaled_mm has a CPU kernel) gives a finite loss and moves the weights."""
    pytest.importorskip("torchao")
    from {{ cookiecutter.package_name }}.models.fp8 import (
        convert_to_fp8,
        fp8_layers,
    )

    torch.manual_seed(0)
    net = Llama(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                mlp_width=128)  # fmt: skip
    converted, kept = fp8_layers(net)
    assert len(converted) == 14 and kept == ["lm_head"]
    convert_to_fp8(net, "tensorwise")
    assert type(net.blocks[1].mlp.down_proj).__name__ == "Float8Linear"
    before = net.blocks[0].attn.q_proj.weight.detach().clone()
    tokens = torch.randint(0, 64, (2, 32))
    loss = net(tokens[:, :-1], targets=tokens[:, 1:])
    loss.backward()
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    assert torch.isfinite(loss) and not torch.equal(before, net.blocks[0].attn.q_proj.weight)


def one_line(error: pytest.ExceptionInfo[ConfigError]) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


def test_a_folder_of_other_sizes_names_the_overrides_and_changes_no_weight(tmp_path: Path) -> None:
    saved = save_family("qwen3", tmp_path / "qwen3")
    net = Llama(vocab_size=101, block_size=64, n_layer=2, n_head=4, n_kv_head=4, n_embd=64,
                mlp_width=96).eval()  # fmt: skip
    before = {name: value.clone() for name, value in net.state_dict().items()}
    with pytest.raises(ConfigError) as error:
        load_hugging_face(net, saved.folder)
    line = one_line(error)
    for override in ("model.net.n_kv_head=2", "model.net.head_dim=32", "model.net.qk_norm=true",
                     "model.net.norm_eps=1e-06"):  # fmt: skip
        assert override in line, line
    assert "n_layer" not in line and all(
        torch.equal(v, before[n]) for n, v in net.state_dict().items()
    )

    too_long = built(saved.folder, block_size=256)
    with pytest.raises(ConfigError) as error:
        load_hugging_face(too_long, saved.folder)
    assert "model.net.block_size=128" in one_line(error)


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
NO_FACTOR = {**LLAMA3_SCALING, "factor": None}


def edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"hidden_act": "gelu"}, ["hidden_act=gelu"]),
        ({"rope_parameters": YARN}, ["'yarn'", "default, linear, llama3"]),
        ({"rope_parameters": NO_FACTOR}, ["positive factor"]),
        ({"model_type": "gemma"}, ["'gemma'", "llama, qwen2, qwen3, mistral"]),
        ({"num_hidden_layers": "2"}, ["num_hidden_layers=\"2\"", "a whole number"]),
        ({"sliding_window": 32}, ["model.net.block_size=32"]),
    ],
)  # fmt: skip
def test_a_config_this_network_does_not_compute_is_one_error_line(
    tmp_path: Path, change: dict[str, Any], words: list[str]
) -> None:
    saved = save_family("mistral", tmp_path / "mistral")
    net = built(saved.folder)
    edit_config(saved.folder, **change)
    with pytest.raises(ConfigError) as error:
        load_hugging_face(net, saved.folder)
    line = one_line(error)
    assert all(word in line for word in words), line


def test_shards_are_files_of_the_folder_holding_what_the_index_says(tmp_path: Path) -> None:
    saved = save_family("qwen2", tmp_path / "qwen2")
    index_path = saved.folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    net = built(saved.folder)

    def refused(weight_map: dict[str, Any], *words: str) -> None:
        index_path.write_text(json.dumps({**index, "weight_map": weight_map}))
        with pytest.raises(ConfigError) as error:
            load_hugging_face(net, saved.folder)
        line = one_line(error)
        assert all(word in line for word in words), line

    first = next(iter(index["weight_map"]))
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((saved.folder / shards[0]).read_bytes())
    refused({**index["weight_map"], first: "../outside.safetensors"}, "not a .safetensors file")
    refused({**index["weight_map"], first: 7}, "not a .safetensors file")
    refused({**index["weight_map"], first: "missing.safetensors"}, "does not hold")
    moved = {name: shards[0] for name in index["weight_map"]}
    refused(moved, "does not hold the tensors")
    index_path.write_text(json.dumps(index))
    load_hugging_face(net, saved.folder)


def jinja(text: str) -> str:
    """Jinja's delimiters from [[ ]] and [% %] (this file is itself rendered by a template)."""
    brace, close, percent = "{", "}", "%"
    pairs = (("[[", brace * 2), ("]]", close * 2), ("[%", brace + percent), ("%]", percent + close))
    for ours, theirs in pairs:
        text = text.replace(ours, theirs)
    return text


CHATML = jinja(
    "[% for message in messages %][% if loop.first and messages[0]['role'] != 'system' %]"
    "[[ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' ]][% endif %]"
    "[[ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' ]]"
    "[% endfor %][% if add_generation_prompt %][[ '<|im_start|>assistant\\n' ]][% endif %]"
)
LLAMA3 = jinja(
    "[[ bos_token ]][% for message in messages %]"
    "[[ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' ]]"
    "[[ message['content'] | trim ]][[ '<|eot_id|>' ]][% endfor %]"
    "[% if add_generation_prompt %][[ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' ]]"
    "[% endif %]"
)
TEMPLATES = {
    "chatml": (CHATML, "<|endoftext|>", "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>",
               ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
}  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Uppercase: fox"},
    {"role": "assistant", "content": "FOX"},
    {"role": "user", "content": "Reverse: owl"},
    {"role": "assistant", "content": "lwo"},
]


def chat_folder(folder: Path, kind: str, text: str, template: str | None = None) -> Path:
    """A model folder's tokens: a byte-level BPE with the template's special tokens, and a
    tokenizer_config.json holding the template (or `template` in its place) and its tokens."""
    from .test_pretrained import gpt2_tokenizer

    chat, bos, eos, specials = TEMPLATES[kind]
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = gpt2_tokenizer(text)
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
        "eos_token": {"__type": "AddedToken", "content": eos, "special": True, "lstrip": False,
                      "rstrip": False, "normalized": False, "single_word": False},
        "chat_template": template or chat,
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("kind", list(TEMPLATES))
def test_a_models_chat_template_gives_the_token_ids_of_apply_chat_template(
    tmp_path: Path, kind: str
) -> None:
    """Prompts and whole training records: the ids transformers' `apply_chat_template` gives;
    the loss counts the assistant's turns, each with its end-of-turn token, and nothing else."""
    from transformers import AutoTokenizer

    folder = chat_folder(tmp_path / kind, kind, json.dumps(CONVERSATION) * 20)
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    data = InstructionDataModule(
        source=str(records), tokenizer=str(folder / "tokenizer.json"), chat_template=str(folder),
        vocab_size=1000, block_size=256,
    )  # fmt: skip
    theirs = AutoTokenizer.from_pretrained(folder)

    def hub_ids(messages: list[dict[str, str]], prompt: bool) -> list[int]:
        ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    assert data.chat_tokens(CONVERSATION[:2]) == hub_ids(CONVERSATION[:2], True)
    assert data.chat_tokens(CONVERSATION[:4]) == hub_ids(CONVERSATION[:4], True)
    template = ChatTemplate.load(str(folder))
    ids, counted = encode_parts(template.parts(CONVERSATION), data.tokenizer, end_responses=False)
    assert ids == hub_ids(CONVERSATION, False)
    learned = data.tokenizer.decode([i for i, c in zip(ids, counted, strict=True) if c])
    eos = TEMPLATES[kind][2]
    assert data.tokenizer.end_of_text == theirs.convert_tokens_to_ids(eos)
    learned_ids = [i for i, c in zip(ids, counted, strict=True) if c]
    assert learned_ids.count(data.tokenizer.end_of_text) == 2
    assert learned.replace("\n", "") == "FOXlwo", learned


HOSTILE = {
    "reaches Python's internals": jinja("[[ ''.__class__.__mro__[1].__subclasses__() ]]"),
    "calls os through a global": jinja(
        "[[ cycler.__init__.__globals__.os.system('touch MARKER') ]]"
    ),
    "changes the conversation": jinja("[[ messages.append({'role': 'user'}) ]]"),
    "raises": jinja("[[ raise_exception('no system turns, please') ]]"),
    "writes without end": jinja(
        "[% for i in range(99999) %][% for j in range(99999) %]x[% endfor %][% endfor %]"
    ),
    "does not compile": jinja("[% for message in messages %]"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_or_broken_chat_template_is_one_error_line_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.chdir(tmp_path)
    folder = chat_folder(tmp_path / "model", "chatml", "Uppercase: fox " * 50, HOSTILE[name])
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"messages": CONVERSATION[1:3]}) + "\n")
    with pytest.raises(ConfigError) as error:
        data = InstructionDataModule(
            source=str(records), tokenizer=str(folder / "tokenizer.json"),
            chat_template=str(folder), vocab_size=1000, block_size=256,
        )  # fmt: skip
        data.setup("fit")
    line = one_line(error)
    assert line.startswith(("data.source=", "data.chat_template=")), line
    assert not (tmp_path / "MARKER").exists()


def test_the_readme_flow_on_a_llama_family_folder_fine_tune_serve_ask(tmp_path: Path) -> None:
    """experiment=smollm2_instruct fine-tunes a random Llama-family folder (with its own BPE and
    ChatML template) on chat records; the server answers a conversation in that template with the
    fine-tuned model's greedy reply, ended by the template's end-of-turn token."""
    from .test_pretrained import CHATS, httpx_post
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
    folder = chat_folder(tmp_path / "smol", "chatml", records.read_text() * 3)
    data = InstructionDataModule(
        source=str(records), tokenizer=str(folder / "tokenizer.json"), chat_template=str(folder),
        vocab_size=1000,
    )  # fmt: skip
    saved = save_family("llama", folder, vocab_size=data.tokenizer.vocab_size,
                        tie_word_embeddings=True, rope_scaling=None)  # fmt: skip
    sizes = settings_of_config(read_config(saved.folder / "config.json", "x"), "x")
    overrides = [
        f"model.net.{name}={value}" for name, value in sizes.items()
        if name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "mlp_width",
                    "rope_theta", "norm_eps")
    ]  # fmt: skip
    result = run_cli(
        "-m", PACKAGE, *QUIET, "experiment=smollm2_instruct", f"init_from={saved.folder}",
        *overrides, "model.net.block_size=96", f"data.source={records}", "data.batch_size=4",
        "trainer.max_epochs=2", "run_name=chat", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    last = tmp_path / "logs" / "train" / "runs" / "chat" / "checkpoints" / "last.ckpt"
    tuned = built(saved.folder, block_size=96)
    state = torch.load(last, weights_only=True)["state_dict"]
    tuned.load_state_dict({name.removeprefix("net."): value for name, value in state.items()})

    question = [{"role": "user", "content": "Uppercase: fox"}]
    prompt = data.chat_tokens(question)
    assert data.tokenizer.decode(prompt) == (
        "system\nYou are a helpful assistant.\nuser\nUppercase: fox\nassistant\n"
    )  # the special tokens are not text
    end = data.tokenizer.end_of_text
    reply = tuned.generate(torch.tensor([prompt]), 16, temperature=0.0, stop_token=end)
    reply_ids = reply[0, len(prompt) :].tolist()
    ended = end in reply_ids
    expected = data.tokenizer.decode(reply_ids[: reply_ids.index(end)] if ended else reply_ids)
    # The compiled decode step (serve's compile_decode) gives the uncompiled greedy reply.
    server = Server([f"ckpt_path={last}", "compile_decode=true"], tmp_path / "serve")
    try:
        response = httpx_post(f"{server.url}/generate", {
            "messages": question, "max_new_tokens": 16, "temperature": 0,
        })  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["completion"] == expected
        assert response.json()["finish_reason"] == ("end" if ended else "length")
        # The same conversation through the OpenAI-compatible route, streamed and not.
        request = {"model": "chat", "messages": question, "max_tokens": 16, "temperature": 0}
        response = httpx_post(f"{server.url}/v1/chat/completions", request)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        assert choice["message"] == {"role": "assistant", "content": expected}
        assert choice["finish_reason"] == ("stop" if ended else "length")
        streamed = httpx_post(f"{server.url}/v1/chat/completions", {**request, "stream": True})
        events = [line.removeprefix("data: ") for line in streamed.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        deltas = [json.loads(event)["choices"][0]["delta"] for event in events[:-1]]
        assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
        assert "".join(delta.get("content", "") for delta in deltas) == expected
    finally:
        assert server.stop() == 0


def test_the_llama_trains_under_fsdp2_and_eval_reads_its_shards(tmp_path: Path) -> None:
    """strategy=model_parallel on two gloo processes: each block of the Llama sharded by FSDP2,
    the last checkpoint a folder of shards, which eval reads back."""
    result = run_cli(
        "-m", PACKAGE, *QUIET, "experiment=language_llama", "model.net.n_layer=2",
        "data.max_bytes=200000", "trainer.max_steps=4", "trainer.val_check_interval=4",
        "trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "run_name=fsdp",
        "strategy=model_parallel", "trainer.strategy.data_parallel_size=2", "trainer.devices=2",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    last = tmp_path / "logs" / "train" / "runs" / "fsdp" / "checkpoints" / "last.ckpt"
    assert last.is_dir() and sorted(path.name for path in last.glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp",
    ], "each rank wrote its shard"  # fmt: skip
    evaluated = run_cli(
        "-c", f"from {PACKAGE}.cli import evaluate; evaluate()", f"ckpt_path={last}",
        "trainer=cpu", "logger=csv", "extras.print_config=false", "trainer.limit_test_batches=2",
        cwd=tmp_path,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "test/loss=" in evaluated.stdout + evaluated.stderr
