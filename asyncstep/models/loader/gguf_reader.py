"""The GGUF file reader, checked: :func:`open_reader` opens a ``.gguf`` file
with :class:`CheckedReader`, a ``gguf.GGUFReader`` (memory-mapped) that
checks every count, offset and size the untrusted file declares, in Python
integers, before the stock reader acts on it, and turns every way the file
can be broken into a one-line :class:`~asyncstep.errors.ModelLoadError`.
:class:`~asyncstep.models.loader.gguf.GGUFCheckpoint` reads a file through it.

Imports numpy, gguf, :mod:`asyncstep.errors` and :mod:`asyncstep.models.limits` only.
"""

from __future__ import annotations

import itertools
import math
import struct
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from asyncstep.errors import ModelLoadError
from asyncstep.models.limits import (
    MAX_GGUF_ARRAY_ELEMENTS,
    MAX_GGUF_ARRAY_LENGTH,
    MAX_GGUF_KEYS,
    MAX_GGUF_TENSORS,
    MAX_TENSOR_DIMS,
)

__all__ = ["GGUF_MAGIC", "CheckedReader", "open_reader"]

GGUF_MAGIC = b"GGUF"


class _FileTooShortError(Exception):
    """The reader wanted bytes past the end of the file."""


class _HostileFileError(Exception):
    """The file declares a table, array or tensor it cannot hold."""


class CheckedReader(gguf.GGUFReader):
    """A ``GGUFReader`` that checks, in Python integers, every count and offset the
    file declares before the stock reader acts on it (numpy's uint64 arithmetic
    wraps: a tensor offset of 2**64 - 32 would point back into the header).

    - a read past the end of the file is reported as such (the stock reader
      slices its memory map without a bounds check);
    - the key and tensor counts are bounded before their tables are parsed;
    - a metadata array is kept whole, as one part holding its elements (numbers)
      or their raw bytes (strings), after its length is bounded: the stock
      reader makes numpy views per element (~650 bytes each), which a hostile
      file turns into gigabytes;
    - each tensor's type must be known, its shape whole blocks of that type,
      its data aligned, inside the file and clear of every other tensor's.
    """

    def __init__(self, path: Path) -> None:
        self._array_elements = 0
        super().__init__(path, "r")

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray[Any, Any]:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _FileTooShortError(
                f"data runs past the end of the file (needs byte {end:,}, "
                f"the file has {len(self.data):,})"
            )
        return super()._get(offset, dtype, count, override_order)

    def _build_fields(self, offs: int, count: int) -> int:
        if int(count) > MAX_GGUF_KEYS:
            raise _HostileFileError(f"{int(count):,} metadata keys (at most {MAX_GGUF_KEYS:,})")
        result: int = super()._build_fields(offs, count)
        return result

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
        if int(count) > MAX_GGUF_TENSORS:
            raise _HostileFileError(f"{int(count):,} tensors (at most {MAX_GGUF_TENSORS:,})")
        result: tuple[int, list[Any]] = super()._build_tensor_info(offs, count)
        return result

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray[Any, Any]], list[int], list[gguf.GGUFValueType]]:
        if raw_type != gguf.GGUFValueType.ARRAY:
            parts: tuple[int, list[Any], list[int], list[Any]] = super()._get_field_parts(
                orig_offs, raw_type
            )
            return parts
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        count, start = int(length[0]), orig_offs + 12
        if count > MAX_GGUF_ARRAY_LENGTH:
            raise _HostileFileError(
                f"a metadata array of {count:,} elements (at most {MAX_GGUF_ARRAY_LENGTH:,})"
            )
        self._array_elements += count
        if self._array_elements > MAX_GGUF_ARRAY_ELEMENTS:
            raise _HostileFileError(
                f"metadata arrays of over {MAX_GGUF_ARRAY_ELEMENTS:,} elements in all"
            )
        itype = gguf.GGUFValueType(int(raw_itype[0]))  # ValueError: an unknown type
        if itype == gguf.GGUFValueType.STRING:
            items = self._get(start, np.uint8, self._strings_end(start, count) - start)
        elif itype in self.gguf_scalar_to_np:
            items = self._get(start, self.gguf_scalar_to_np[itype], count)
        else:
            raise _HostileFileError(f"a metadata array of {itype.name} (nested arrays)")
        types = [gguf.GGUFValueType.ARRAY, itype]
        return 12 + int(items.nbytes), [raw_itype, length, items], [2], types

    def _strings_end(self, offs: int, count: int) -> int:
        """Where ``count`` length-prefixed strings from ``offs`` end (read, not kept)."""
        size, fmt = len(self.data), "<Q" if self._little_endian() else ">Q"
        buffer = self.data.data
        for _ in range(count):
            if offs + 8 > size:
                break
            offs += 8 + struct.unpack_from(fmt, buffer, offs)[0]
        else:
            if offs <= size:
                return offs
        raise _FileTooShortError(
            f"a metadata array of {count:,} strings runs past the end of the file"
        )

    def _little_endian(self) -> bool:
        return (self.byte_order == "I") == (sys.byteorder == "little")

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        extents = sorted(self._tensor_extent(start_offs, field) for field in fields)
        for (_, end, name), (begin, _, other) in itertools.pairwise(extents):
            if begin < end:
                raise _HostileFileError(f"tensors {name!r} and {other!r} overlap")
        super()._build_tensors(start_offs, fields)

    def _tensor_extent(self, start_offs: int, field: Any) -> tuple[int, int, str]:
        """(begin, end, name) of a tensor's data, checked in Python integers."""
        _, name_data, n_dims, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        shape = [int(d) for d in dims.tolist()]
        if not 1 <= int(n_dims[0]) <= MAX_TENSOR_DIMS or not all(shape):
            raise _HostileFileError(f"tensor {name!r} has shape {shape}")
        try:
            qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise _HostileFileError(
                f"tensor {name!r} has unknown type {int(raw_type[0])}"
            ) from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if shape[0] % block:
            raise _HostileFileError(
                f"tensor {name!r}: rows of {shape[0]} are not whole {qtype.name} blocks"
            )
        relative = int(offset[0])
        if relative % int(self.alignment):
            raise _HostileFileError(f"tensor {name!r} is not aligned to {int(self.alignment)}")
        begin = start_offs + relative
        end = begin + math.prod(shape) // block * type_size
        if end > len(self.data):
            raise _FileTooShortError(
                f"tensor {name!r} needs bytes up to {end:,} but the file has {len(self.data):,}"
            )
        return begin, end, name


def open_reader(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file, turning every way it can be broken into a one-line ModelLoadError."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
        )
    try:
        return CheckedReader(path)
    except _FileTooShortError as exc:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file: {exc}") from None
    except _HostileFileError as exc:
        raise ModelLoadError(f"{path}: corrupt GGUF file: {exc}") from None
    except Exception as exc:  # the reader raises ValueError, KeyError, IndexError, ...
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{path}: corrupt GGUF file: {detail}") from None
