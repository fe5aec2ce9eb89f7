"""A smaller GGUF checkpoint cut from a bigger one: its first ``num_layers``
decoder layers, the embedding, the final norm and the LM head as they are
(their quantized blocks copied byte for byte), every metadata key but the
layer count unchanged, so the tokenizer is the same. A layer-truncated
copy is a draft model for ``draft_model`` speculation that needs no second
download (self-speculation by early exit). Or (:func:`write_tokenizer_gguf`)
its tokenizer alone: the architecture and the ``tokenizer.*`` keys, no
layers, no tensors, for transformers to convert where it misreads the rest
(transformers 5.25 reads a ``gpt-oss`` file's ``rope.scaling.*`` values
from the wrong part of each key and fails).

May import numpy and gguf.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf

__all__ = ["write_tokenizer_gguf", "write_truncated_gguf"]

_LAYER = re.compile(r"^blk\.(\d+)\.")


def write_truncated_gguf(source: str | Path, target: str | Path, num_layers: int) -> Path:
    """Write ``source``'s first ``num_layers`` layers as a GGUF file at
    ``target`` (returned). ValueError unless ``1 <= num_layers`` and fewer
    than ``source`` has, or if ``source`` is not a llama-style GGUF."""
    reader = gguf.GGUFReader(source)
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"{source}: no general.architecture key")
    arch = str(arch_field.contents())
    count_key = f"{arch}.block_count"
    count_field = reader.fields.get(count_key)
    if count_field is None:
        raise ValueError(f"{source}: no {count_key} key")
    total = int(count_field.contents())
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be in [1, {total - 1}] for {source}, got {num_layers}")
    writer = gguf.GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these
        value = num_layers if key == count_key else field.contents()
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type)
    for tensor in reader.tensors:
        layer = _LAYER.match(tensor.name)
        if layer is not None and int(layer.group(1)) >= num_layers:
            continue
        writer.add_tensor(
            tensor.name,
            tensor.data,
            raw_shape=tensor.data.shape,
            raw_dtype=tensor.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(target)


def write_tokenizer_gguf(source: str | Path, target: str | Path) -> Path:
    """Write ``source``'s architecture and ``tokenizer.*`` keys, no tensors,
    as a GGUF file at ``target`` (returned)."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(target, arch)
    writer.add_block_count(0)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(target)
