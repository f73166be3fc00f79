"""The one door for checkpoint bytes that the user did not write by hand: single-file checkpoints,
folders of shards (torch.distributed.checkpoint), a fine-tuning run's base weights, and the
programs `export` writes and reads back. Nothing else in the package calls `torch.load`,
`pickle`, `torch.export.load` or a `torch.distributed.checkpoint` loader (a test reads the source
to make sure): every byte goes through the readers here, and none of them hands a file to an
unpickler that can import or call anything.

- `single_file`: a single file is read by torch's restricted unpickler (`weights_only=True`);
  full unpickling happens only for `trust_checkpoint=true`, which the user types.
- `shard_metadata`, `shards`: a folder's `.metadata` is read by `MetadataUnpickler` (the classes
  a real one holds, nothing else), then every attribute is type-checked against torch's own
  dataclasses, every shard it names is a whole file of the folder, and every value that is not a
  tensor loads as plain values. `ShardReader` is the only storage reader handed to
  torch.distributed.checkpoint: it returns that checked metadata, never reads a rank-local
  `__<rank>.metadata` (torch's loader falls back to one, with a bare `pickle.load`, when the
  global one fails to read), and refuses transforms it did not write.
- `hugging_face_folder`: a Hugging Face model folder is read as JSON (`config.json`, checked
  against the fields its reader expects) and safetensors (`model.safetensors`: a JSON header,
  then raw tensor bytes; a large model's shards, each a plain file of the folder named by
  `model.safetensors.index.json`); neither format can name code, and its pickled weights
  (`pytorch_model.bin`) are never read.
- `checkpoint`: a checkpoint a command is given, whichever of these forms it has.
"""

from .checkpoint import check_weights, load_checkpoint, read_checkpoint, read_fit_state
from .hugging_face_folder import (
    HF_CONFIG,
    HF_INDEX,
    HF_PICKLED,
    HF_TOKENIZER,
    HF_WEIGHTS,
    JSON_KINDS,
    JSON_LIMIT,
    hugging_face_files,
    is_hugging_face,
    read_json_fields,
    read_safetensors,
    read_safetensors_folder,
    shard_names,
)
from .shard_metadata import (
    META,
    METADATA,
    METADATA_CLASSES,
    MetadataUnpickler,
    MissingShards,
    Schema,
    UnsafeCheckpoint,
    check_plain_values,
    is_sharded,
    read_shard_metadata,
)
from .shards import (
    first_failure,
    load_shards,
    plain_values_planner,
    read_meta,
    read_shards_whole,
    shard_reader,
)
from .single_file import (
    UNREADABLE,
    first_line,
    load_own_export,
    load_plain,
    load_trusted,
    non_finite_tensors,
    refused_as_python_objects,
)

__all__ = [
    "HF_CONFIG",
    "HF_INDEX",
    "HF_PICKLED",
    "HF_TOKENIZER",
    "HF_WEIGHTS",
    "JSON_KINDS",
    "JSON_LIMIT",
    "META",
    "METADATA",
    "METADATA_CLASSES",
    "UNREADABLE",
    "MetadataUnpickler",
    "MissingShards",
    "Schema",
    "UnsafeCheckpoint",
    "check_plain_values",
    "check_weights",
    "first_failure",
    "first_line",
    "hugging_face_files",
    "is_hugging_face",
    "is_sharded",
    "load_checkpoint",
    "load_own_export",
    "load_plain",
    "load_shards",
    "load_trusted",
    "non_finite_tensors",
    "plain_values_planner",
    "read_checkpoint",
    "read_fit_state",
    "read_json_fields",
    "read_meta",
    "read_safetensors",
    "read_safetensors_folder",
    "read_shard_metadata",
    "read_shards_whole",
    "refused_as_python_objects",
    "shard_names",
    "shard_reader",
]
