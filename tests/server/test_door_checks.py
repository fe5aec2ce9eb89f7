"""The door's checks in-process (issue 22; ``test_door.py`` attacks a real
server): JSON nesting depth measured without parsing (brackets in strings
and escapes do not count) and bounded for bodies and schemas; the prompt's
byte bound (strict for SmolLM2's byte-level BPE: a token stands for at most
81 bytes; four times looser for a tokenizer that normalizes); prompts past
it, and token-id lists past the context, refused before any tokenization;
long text tokenized in a worker thread, short text inline."""

from __future__ import annotations

import json
import threading
from typing import Any
from unittest import mock

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncstep import checks
from asyncstep.checks import MAX_JSON_DEPTH, check_json_depth, json_depth
from asyncstep.engine.front_end.input_processor import (
    INLINE_TOKENIZE_BYTES,
    NORMALIZER_SHRINK,
    InputProcessor,
    prompt_byte_limit,
    token_byte_bound,
)
from asyncstep.errors import InvalidRequestError
from asyncstep.models.model_loader import LoadedModel
from asyncstep.server.protocol import BodyError, CompletionRequest, decode_body
from asyncstep.structured_params import StructuredOutputsParams

MAX_MODEL_LEN = 1024


def depth_of(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    return 0


#: Strings full of what a depth scanner could trip on.
TRICKY = st.text(alphabet='[]{}"\\ab\n', max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.integers() | TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(JSON_VALUES, st.booleans())
def test_json_depth_counts_the_brackets_outside_strings(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_depth(text) == depth_of(value)
    with mock.patch.object(checks, "_DEPTH_SLICE", 3):  # strings and depth across slices
        assert json_depth(text) == depth_of(value)
        for k in range(4):
            assert (json_depth(text, stop_above=k) > k) == (depth_of(value) > k)


def test_json_past_the_depth_limit_is_refused_before_it_is_parsed() -> None:
    at_limit = ("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH).encode()
    check_json_depth("x", at_limit)
    with pytest.raises(InvalidRequestError, match=f"x nests more than {MAX_JSON_DEPTH} levels"):
        check_json_depth("x", b"[" + at_limit + b"]")
    # Brackets in strings are not nesting.
    check_json_depth("x", json.dumps(["[" * 10_000]).encode())
    with pytest.raises(BodyError, match="request body nests more than 128 levels deep"):
        decode_body(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", CompletionRequest)
    schema = '{"properties":' * 10_000 + "{}" + "}" * 10_000
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.json nests more than"):
        StructuredOutputsParams(json=schema)


def test_the_byte_bound_is_strict_for_smollm2(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    assert token_byte_bound(tokenizer) == 81
    assert prompt_byte_limit(tokenizer, MAX_MODEL_LEN) == 81 * MAX_MODEL_LEN
    # The densest text: a newline and 80 spaces, one token each time.
    densest = ("\n" + " " * 80) * 50
    assert len(tokenizer(densest, add_special_tokens=False).input_ids) == 50


def test_the_byte_bound_is_looser_for_a_tokenizer_that_normalizes() -> None:
    from tokenizers import Tokenizer, normalizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({"[UNK]": 0, "héllo": 1}, unk_token="[UNK]"))
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert token_byte_bound(tokenizer) == len("héllo".encode())
    assert prompt_byte_limit(tokenizer, 10) == 10 * 6 * NORMALIZER_SHRINK


@pytest.fixture
def processor(smollm2: LoadedModel) -> InputProcessor:
    return InputProcessor(smollm2.arch_config, smollm2.tokenizer, MAX_MODEL_LEN)


def untokenizable(processor: InputProcessor, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> list[int]:
        raise AssertionError("tokenized")

    monkeypatch.setattr(processor, "_tokenize", refuse)


@pytest.mark.parametrize("kind", ["text", "chat", "token ids"])
def test_a_prompt_past_the_bound_is_refused_untokenized(
    processor: InputProcessor, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    limit = processor.max_prompt_bytes
    assert limit == 81 * MAX_MODEL_LEN
    untokenizable(processor, monkeypatch)
    half = "é" * (limit // 4 + 1)  # two bytes each: two halves are just past the bound
    size = 2 * len(half.encode())
    prompts: dict[str, Any] = {
        "text": half + half,
        "chat": [{"role": "user", "content": half}, {"role": "user", "content": half}],
        # A token-id list is refused by its count before its items are looked at.
        "token ids": [1] * MAX_MODEL_LEN + ["not an id"],
    }
    words = "tokens" if kind == "token ids" else f"{size} bytes of text"
    with pytest.raises(InvalidRequestError, match=words):
        trio.run(processor.encode_prompt, prompts[kind])
    with pytest.raises(InvalidRequestError, match=words):
        processor.encode_prompt_nowait(prompts[kind])


def test_long_text_is_tokenized_in_a_worker_thread(
    processor: InputProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    tokenize = processor._tokenize

    def recorded(text: str, **kwargs: Any) -> list[int]:
        threads.append(threading.get_ident())
        return tokenize(text, **kwargs)

    monkeypatch.setattr(processor, "_tokenize", recorded)
    short, long = "Hello there", "Hello there." + " " * INLINE_TOKENIZE_BYTES

    async def main() -> list[list[int]]:
        return [
            await processor.encode_prompt(short),
            await processor.encode_prompt(long),
            await processor.encode_prompt([{"role": "user", "content": long}]),
            await processor.tokenize(long, add_special_tokens=False),
        ]

    ids = trio.run(main)
    loop = threading.get_ident()
    assert threads[0] == loop and all(t != loop for t in threads[1:]), threads
    assert ids[1] == processor.encode_prompt_nowait(long) == ids[3]
    assert threads[-1] == loop  # (nowait: on the caller's thread, whatever the size)
