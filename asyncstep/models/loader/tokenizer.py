"""Tokenizers of GGUF files, converted once by transformers and cached on disk.

transformers builds a tokenizer from GGUF metadata in seconds (it re-reads the
whole vocabulary); :func:`load_gguf_tokenizer` saves the result under
``${ASYNCSTEP_CACHE_DIR:-~/.cache/asyncstep}/tokenizers/<key>``, keyed by the file's
absolute path, size and mtime (and the transformers version), and later loads
read that copy. A cache entry is written to a temporary directory and renamed
into place, so a concurrent reader sees a whole entry or none.
A file of an architecture in :data:`TOKENIZER_ONLY_ARCHITECTURES` is
converted from a copy of its tokenizer keys alone
(:func:`~asyncstep.models.loader.gguf_truncate.write_tokenizer_gguf`, in a
temporary directory).
May import transformers, ``asyncstep.errors`` and ``gguf_truncate``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from asyncstep.errors import ModelLoadError
from asyncstep.models.loader.gguf_truncate import write_tokenizer_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "ASYNCSTEP_CACHE_DIR"
#: GGUF architectures whose other metadata transformers cannot read (5.25:
#: ``gpt-oss``'s ``rope.scaling.*``): their tokenizer converts from its keys alone.
TOKENIZER_ONLY_ARCHITECTURES = frozenset({"gpt-oss"})
DEFAULT_CACHE_DIR = "~/.cache/asyncstep"


def cache_root() -> Path:
    """asyncstep's cache directory: ``$ASYNCSTEP_CACHE_DIR`` or ``~/.cache/asyncstep``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def tokenizer_cache_key(path: Path) -> str:
    """A key that changes when the file (path, size, mtime) or transformers changes."""
    import transformers

    resolved = path.resolve()
    stat = resolved.stat()
    ident = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def tokenizer_cache_path(path: Path) -> Path:
    """Where the converted tokenizer of the GGUF file ``path`` is cached."""
    return cache_root() / "tokenizers" / tokenizer_cache_key(path)


def _convert(
    path: Path, chat_template: str | None, architecture: str | None
) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        if architecture in TOKENIZER_ONLY_ARCHITECTURES:
            with tempfile.TemporaryDirectory() as tmp:
                copy = write_tokenizer_gguf(path, Path(tmp) / path.name)
                tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=copy.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(
            f"{path}: cannot build a tokenizer from the GGUF metadata: {exc}"
        ) from None
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    return tokenizer


#: The classes a cache entry's ``tokenizer_config.json`` names that
#: ``PreTrainedTokenizerFast`` loads as they are (transformers' own class
#: for a plain ``tokenizer.json``).
PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _load_cached(cache_dir: Path) -> PreTrainedTokenizerBase:
    """The cached tokenizer: a plain one through ``PreTrainedTokenizerFast``
    (``AutoTokenizer``'s model registry imports torch, which a front end
    that needs no torch would pay at start-up), else as saved."""
    if _saved_class(cache_dir) in PLAIN_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(cache_dir), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cache_dir), local_files_only=True)


def _saved_class(cache_dir: Path) -> str | None:
    try:
        config = json.loads((cache_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def _store(tokenizer: PreTrainedTokenizerBase, cache_dir: Path, *, replace: bool) -> None:
    """Write the cache entry atomically; on any filesystem error, log and carry on uncached."""
    tmp: Path | None = None
    try:
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.", dir=cache_dir.parent))
        tokenizer.save_pretrained(str(tmp))
        if replace and cache_dir.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.stale.", dir=cache_dir.parent))
            os.replace(cache_dir, stale / "entry")
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, cache_dir)  # fails if another process got there first: keep theirs
        tmp = None
    except OSError as exc:
        if not cache_dir.is_dir():
            logger.warning("cannot cache the tokenizer in %s: %s", cache_dir, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_tokenizer(
    path: Path,
    chat_template: str | None = None,
    *,
    before_convert: Callable[[], None] | None = None,
    architecture: str | None = None,
) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file, from the on-disk cache when it holds one.

    ``chat_template`` (the file's ``tokenizer.chat_template``) is set on the
    tokenizer when transformers' conversion left it out. ``before_convert``
    runs before a conversion (to refuse one the machine cannot afford).
    ``architecture`` is the file's ``general.architecture``.
    """
    path = path.resolve()
    cache_dir = tokenizer_cache_path(path)
    broken = False
    if cache_dir.is_dir():
        try:
            return _load_cached(cache_dir)
        except Exception as exc:
            logger.warning("ignoring the unreadable tokenizer cache %s: %s", cache_dir, exc)
            broken = True
    if before_convert is not None:
        before_convert()
    tokenizer = _convert(path, chat_template, architecture)
    _store(tokenizer, cache_dir, replace=broken)
    return tokenizer
