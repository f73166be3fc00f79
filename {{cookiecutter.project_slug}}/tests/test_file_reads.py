"""Every place the package opens or reads a file, found in its source, is one this test lists
with what it reads and why that read is bounded. A file a user did not write is read through
`data/folder_files.read_bounded` (a regular file, refused before reading where it is a device or
a pipe, of at most a size fixed by what it holds), `sweeps/returns.read_small_file`, or a door
that bounds it another way (streamed in chunks, memory-mapped after its size is checked). A new
read fails here until it takes one of those ways or is listed with its reason: the list is the
review, so that no reader is added unbounded without anyone deciding it."""

from __future__ import annotations

import ast

from .helpers import PACKAGE, PROJECT_ROOT

SOURCE = PROJECT_ROOT / "src" / PACKAGE
# Calls that open or read a file or a stream, by the name called.
READS = {
    "open", "read_text", "read_bytes", "load", "memmap", "load_file", "safe_open", "fdopen",
    "cat_file", "urlopen", "decompress",
}  # fmt: skip

BOUNDED = "the bounded reader itself"
DOOR = "a door for files a user did not write, bounded there"
OWN = "a file this project wrote itself, in its run or sweep folder"
WRITE = "opened to write (or to fsync what it wrote)"
SYSTEM = "the kernel's own file"
SHIPPED = "a file the package ships"
# "module:function" -> why its reads are bounded or trusted.
LISTED = {
    "data.folder_files:read_bounded": BOUNDED,
    "checkpointing.door.hugging_face_folder:read_json_fields": DOOR + " (1 MiB, inside its folder)",
    "checkpointing.door.hugging_face_folder:read_safetensors": DOOR + " (sizes checked first)",
    "checkpointing.door.shard_metadata:check_plain_values": DOOR + " (each shard's own span)",
    "checkpointing.door.shards:load_shards": DOOR + " (weights only, after the index's check)",
    "checkpointing.door.single_file:load_plain": DOOR + " (weights only, plain values)",
    "checkpointing.door.single_file:load_trusted": "trust_checkpoint=true: the user vouched",
    "checkpointing.door.single_file:load_own_export": DOOR + " (the export command's file)",
    "checkpointing.hugging_face_images:hugging_face_backbone": DOOR + " (meta device first)",
    "checkpointing.trained:text_interface": DOOR + " (the checkpoint's own text settings)",
    "checkpointing.trained:file_digest": DOOR + " (hashed in chunks)",
    "data.image_files:open_image": DOOR + " (Pillow: allowed formats, its pixel limit)",
    "data.text:read_corpus": "data.source, the user's own text, at most data.max_bytes",
    "data.token_shards:file_sha256": DOOR + " (hashed in chunks)",
    "data.token_shards:TokenWindows.read": DOOR + " (memory-mapped after size and checksum)",
    "data.token_shards:TokenShardDataModule.__init__": DOOR + " (a URL's manifest)",
    "data.token_shards:TokenShardDataModule.load_tokenizer": DOOR + " (a URL's tokenizer)",
    "data.streaming:ShardFolder.read_text": DOOR + " (a URL's small files)",
    "data.streaming:StreamedWindows.fetch": DOOR + " (ranges of a sized shard)",
    "data.instructions:InstructionDataModule.__init__": "ChatTemplate.load, through read_bounded",
{%- if cookiecutter.examples != "language" %}
    "data.mnist:download": "MNIST from its mirrors, checked against its MD5 before it is kept",
    "data.digits:load_digits": SHIPPED,
{%- endif %}
    "data.instructions:shipped_toy_set": SHIPPED,
    "targets:shipped_targets": SHIPPED,
    "data.tokenizing:seconds_since_start": SYSTEM,
    "data.tokenizing_worker:serve": "the pipe from the prepare command that started the worker",
    "memory.plan:machine_memory_gib": SYSTEM,
    "run.machine:cpu_has_fast_bf16": SYSTEM,
    "run.other_ranks:is_rank": SYSTEM,
    "run.other_ranks:child_ranks": SYSTEM,
    "recipes.bench.device:device_name": SYSTEM,
    "recipes.bench.preparation:cpu_name": SYSTEM,
    "recipes.bench.plain_prepare:split_pieces": "the bench's own corpus, at most its limit",
    "recipes.predict:read_prompts": "prompt_file, at most its limit",
    "recipes.prepare.corpus_pieces:read_text": "the user's corpus, at most its limit",
    "recipes.prepare.corpus_pieces:split_pieces": "the user's corpus, through read_text",
    "recipes.prepare.corpus_pieces:is_prepared": OWN + " (prepare's manifest, 64 MiB)",
    "recipes.prepare.shards:write_shards": "the answers of prepare's own worker processes",
    "recipes.prepare.shards:ShardWriter.open_next": WRITE,
    "recipes.export:export_pt2": WRITE,
    "checkpointing.saving:atomic_torch_save": WRITE,
    "checkpointing.sharded:fsync_directory": WRITE,
    "checkpointing.sharded:publish": WRITE,
    "files:write_text_atomically": WRITE,
    "entry:EarlyRecorder.take_noted": OWN + " (the sbatch task shell's note of a signal)",
    "loggers:ColumnKeepingWriter._record_new_keys": OWN,
    "loggers:read_tracking": OWN,
    "loggers:prepare_wandb": OWN,
    "loggers:log_predictions": OWN,
    "loggers:store_lock": WRITE,
    "loggers:wandb_server_answers": "a HEAD request to the W&B server the user set",
    "run.identity:check_run_identity": OWN,
    "run.identity:finished_metrics": OWN,
    "run.lock:holder": OWN + " (a lock file)",
    "run.lock:held": OWN + " (a lock file)",
    "run.record:keep_what_hydra_replaces.saving": OWN,
}


def reads_in(node: ast.AST, place: str, found: dict[str, str]) -> None:
    """Into `found`: each function under `node` (named from `place`, module:function) that
    calls a read, with its first such call."""
    module, function = place.split(":")
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = f"{function}.{child.name}" if function else child.name
            reads_in(child, f"{module}:{inner}", found)
            continue
        if isinstance(child, ast.Call):
            called = child.func
            name = getattr(called, "attr", None) or getattr(called, "id", None)
            if name in READS and "pickle" not in ast.unparse(called):
                found.setdefault(place, ast.unparse(child)[:80])
        reads_in(child, place, found)


def reading_functions() -> dict[str, str]:
    """module:function -> the first read call found in it, for every function that reads."""
    found: dict[str, str] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        module = ".".join(path.relative_to(SOURCE).with_suffix("").parts)
        reads_in(ast.parse(path.read_text(encoding="utf-8")), f"{module}:", found)
    return found


def test_every_read_of_a_file_is_listed_with_its_bound() -> None:
    found = reading_functions()
    unlisted = {place: call for place, call in found.items() if place not in LISTED}
    assert not unlisted, (
        "reads that no one has looked at: route a file a user did not write through "
        "data.folder_files.read_bounded (or a door), or list the function here with why its "
        f"read is bounded: {unlisted}"
    )


def test_the_list_names_only_functions_that_read() -> None:
    """A listed place that no longer reads would let a new read there pass unreviewed."""
    found = reading_functions()
    stale = sorted(place for place in LISTED if place not in found)
    # A bake without an example lacks that example's modules: their entries are not stale.
    stale = [p for p in stale if (SOURCE / (p.split(":")[0].replace(".", "/") + ".py")).exists()]
    assert not stale, f"listed but reading nothing: {stale}"
