"""The packed CPU model, cached on disk.

On the CPU a quantized checkpoint is dequantized, loaded in float32, packed
for the CPU library (:func:`~asyncstep.models.model_loader.pack_weights`) and
cast to the model's dtype: about a second for the embedded model, at every
start. :class:`PackedCache` keeps the result, once, as one safetensors file
under ``${ASYNCSTEP_CACHE_DIR:-~/.cache/asyncstep}/weights/``; a later load of
the same checkpoint with the same options maps that file instead, reading
a byte of each page as it loads.

An entry's name is keyed by everything its content depends on: the
checkpoint's files (absolute path, size, mtime), the code that builds it (a
hash of the loader, model and packing sources), torch's version, the dtype,
the packing options and the CPU features they were decided from, and the
rank's place in the TP x PP layout. One entry is kept per checkpoint and
options: writing one removes those that an older file or older code wrote.
An entry is written to a temporary file and renamed, so a reader sees a
whole entry or none; one that does not fit the model (names, shapes, dtypes,
packed layouts) is ignored with a warning, and a filesystem error only costs
the cache. May import torch, safetensors and ``asyncstep.models`` (not the
loader, which imports this).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from asyncstep.logging import get_logger
from asyncstep.models.dense_weights import drop_dense_weights, served_by_packed
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.models.loader.tokenizer import cache_root
from asyncstep.ops.packed import PackedWeight
from asyncstep.ops.weights import packed_from_layout, packed_layout, packed_shape_ok

log = get_logger("models")

#: The sources an entry's content depends on (their bytes are in the key).
_SOURCES = (
    "models/model_loader.py",
    "models/weight_cache.py",
    "models/dense_weights.py",
    "models/llama.py",
    "models/loader/gguf.py",
    "models/loader/gguf_blocks.py",
    "models/loader/gguf_config.py",
    "models/loader/gguf_layouts.py",
    "models/loader/gguf_names.py",
    "models/loader/gguf_reader.py",
    "models/loader/hf.py",
    "ops/cpu/quant.py",
    "ops/weights.py",
    "ops/packed.py",
    "models/layers/linear.py",
    "models/layers/embedding.py",
    "models/layers/norm.py",
)
_PACKED_PREFIX = "packed."
#: Leave at least this much of the disk free when writing an entry.
_DISK_MARGIN = 4


@dataclass(frozen=True)
class PackedCache:
    """The cache entry of one checkpoint and rank (see the module doc)."""

    path: Path

    @classmethod
    def for_checkpoint(cls, checkpoint: Path, options: dict[str, object]) -> PackedCache | None:
        """The entry of ``checkpoint`` (a file or an HF directory) loaded
        with ``options`` (JSON-able: everything else the content depends
        on), or None when its files cannot be read."""
        try:
            files = _checkpoint_files(checkpoint.resolve())
            stamp = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        except OSError:
            return None
        here = Path(__file__).resolve().parents[1]
        code = hashlib.sha256()
        for source in _SOURCES:
            with contextlib.suppress(OSError):
                code.update((here / source).read_bytes())
        which = _digest({"checkpoint": str(checkpoint.resolve()), "options": options})
        content = _digest(
            {
                "files": stamp,
                "code": code.hexdigest(),
                "torch": str(torch.__version__),
            }
        )
        return cls(cache_root() / "weights" / f"{which}-{content}.safetensors")

    def load(self, model: LlamaForCausalLM, dtype: torch.dtype) -> bool:
        """Fill ``model`` (built, its dtypes settled to ``dtype``) from the
        entry: its tensors and its layers' packed copies, the dense weights
        those serve alone dropped. False, ``model`` untouched, where there is
        no usable entry (or it lacks a dense weight this machine needs)."""
        if not self.path.is_file():
            return False
        try:
            tensors = load_file(self.path)
            with open(self.path, "rb") as file:
                header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
            layouts = json.loads(header["__metadata__"]["packed"])
            packed = _packed_weights(model, tensors, layouts)
            dense = {k: v for k, v in tensors.items() if not k.startswith(_PACKED_PREFIX)}
            dropped = set(json.loads(header["__metadata__"].get("dropped", "[]")))
            _check_dense(model, dense, dropped)
        except Exception as exc:  # a foreign, truncated or stale file: rebuild it
            log.warning(
                "ignoring a packed-weights cache entry", path=str(self.path), error=str(exc)
            )
            return False
        for name, weight in packed.items():
            setattr(model.get_submodule(name), "packed", weight)  # noqa: B010 (a plain attribute)
        if not all(served_by_packed(model.get_submodule(n), dtype) for n in _layers_of(dropped)):
            for name in packed:
                setattr(model.get_submodule(name), "packed", None)  # noqa: B010
            log.info("the packed-weights cache entry lacks dense weights this CPU needs")
            return False
        model.load_state_dict(dense, strict=False, assign=True)
        model.tie_weights()
        drop_dense_weights(model, dtype)
        _touch_pages(tensors.values())
        return True

    def store(self, model: LlamaForCausalLM) -> None:
        """Write ``model``'s entry (and remove this checkpoint's older ones);
        on a filesystem error, log and carry on uncached."""
        state = model.state_dict()
        dropped = sorted(n for n, t in state.items() if t.numel() == 0)
        tensors = _unshared({n: t for n, t in state.items() if t.numel() > 0})
        layouts: dict[str, dict[str, Any]] = {}
        for name, module in model.named_modules():
            weight = getattr(module, "packed", None)
            if isinstance(weight, PackedWeight):
                layouts[name] = packed_layout(weight)
                tensors[f"{_PACKED_PREFIX}{name}.data"] = weight.data
                tensors[f"{_PACKED_PREFIX}{name}.scales"] = weight.scales
        size = sum(t.nbytes for t in tensors.values())
        tmp: Path | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.path.parent).free < _DISK_MARGIN * size:
                log.warning("no room for the packed-weights cache", needed=size)
                return
            fd, name = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            os.close(fd)
            tmp = Path(name)
            metadata = {"packed": json.dumps(layouts), "dropped": json.dumps(dropped)}
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, self.path)
            tmp = None
            self._remove_older()
        except OSError as exc:
            log.warning(
                "cannot write a packed-weights cache entry", path=str(self.path), error=str(exc)
            )
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def _remove_older(self) -> None:
        which = self.path.name.partition("-")[0]
        for other in self.path.parent.glob(f"{which}-*.safetensors"):
            if other != self.path:
                other.unlink(missing_ok=True)


def _touch_pages(tensors: Iterable[torch.Tensor]) -> None:
    """Read a byte of every page of the mapping now, while loading, rather
    than in the first step, which would fault them in one by one."""
    for tensor in tensors:
        raw = tensor.reshape(-1).view(torch.uint8)
        raw[:: mmap.PAGESIZE].sum()


def _checkpoint_files(checkpoint: Path) -> list[Path]:
    if checkpoint.is_dir():
        return sorted(f for f in checkpoint.iterdir() if f.is_file())
    return [checkpoint]


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:24]


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor once (tied weights are one tensor: the
    first name keeps it; loading ties them again through the module)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        if key not in seen:
            seen.add(key)
            out[name] = tensor.contiguous()
    return out


def _packed_weights(
    model: LlamaForCausalLM, tensors: dict[str, torch.Tensor], layouts: dict[str, Any]
) -> dict[str, PackedWeight]:
    """The entry's packed copies, each checked against its layer (its
    sizes) and its kind's layout (the data's shape and dtype)."""
    out: dict[str, PackedWeight] = {}
    for name, layout in layouts.items():
        rows, cols = (int(n) for n in model.get_parameter(f"{name}.weight").shape)
        data = tensors[f"{_PACKED_PREFIX}{name}.data"]
        scales = tensors[f"{_PACKED_PREFIX}{name}.scales"]
        if (layout["out_features"], layout["in_features"]) != (rows, cols):
            raise ValueError(f"{name}: packed for {layout['out_features']}x{layout['in_features']}")
        try:
            weight = packed_from_layout(layout, data, scales)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if not packed_shape_ok(weight):
            raise ValueError(f"{name}: packed {weight.kind} data of the wrong shape")
        out[name] = weight
    return out


def _layers_of(weights: set[str]) -> list[str]:
    """The layers of dropped weight names (``<layer>.weight``)."""
    return [name.removesuffix(".weight") for name in sorted(weights)]


def _check_dense(
    model: LlamaForCausalLM, tensors: dict[str, torch.Tensor], dropped: set[str]
) -> None:
    """``tensors`` are ``model``'s state, name for name (but the tied
    aliases and the ``dropped`` projections' weights), each with its shape
    and dtype."""
    expected = model.state_dict()
    if any(not name.endswith(".weight") or name not in expected for name in dropped):
        raise ValueError("dropped weights that are not the model's")
    for name, tensor in tensors.items():
        want = expected.get(name)
        if want is None or want.shape != tensor.shape or want.dtype != tensor.dtype:
            raise ValueError(f"{name}: not one of the model's tensors")
    missing = expected.keys() - tensors.keys() - model.tied_weight_names() - dropped
    if missing:
        raise ValueError(f"{len(missing)} tensors missing, e.g. {min(missing)}")
