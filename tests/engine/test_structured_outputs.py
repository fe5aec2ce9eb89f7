"""Structured outputs: every constrained output follows its grammar (a JSON
schema, any JSON object, a regex, a choice, EBNF), in a crowd of free
requests, greedy and sampled, overlap on and off, with n > 1, preemption,
aborts and PP = 2; bad grammars are refused at the door; the bitmask is
applied as xgrammar's own kernel applies it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import msgspec
import pytest
import torch

import asyncstep
from asyncstep import SamplingParams, StructuredOutputsParams
from asyncstep.config import ModelConfig
from asyncstep.datatypes import GrammarOutput
from asyncstep.engine.core.engine_core import EngineCore
from asyncstep.engine.structured_output.grammar import GrammarCompiler, grammar_of
from asyncstep.errors import InvalidRequestError
from asyncstep.models.model_loader import LoadedModel, load_model
from asyncstep.runner.grammar_bitmask import GrammarBitmask

pytestmark = pytest.mark.anyio

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "kind", "owner", "toys"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["yes", "no", "maybe"]
QUESTION = [{"role": "user", "content": "Describe a pet, as JSON."}]
OBJECT_QUESTION = [
    {"role": "user", "content": "Give a JSON object with the fields a and b, both numbers."}
]
QUESTIONS = [
    [{"role": "user", "content": q}]
    for q in ("Describe a pet.", "Give me a code.", "Is the sky blue?", "Say hello.")
]


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


@pytest.fixture(scope="module")
def tiny_llama(tiny_hf_dir: Path) -> LoadedModel:
    """The tiny Llama with SmolLM2's tokenizer (conftest), dense fp32: the
    grammars and bitmasks of the real vocabulary at a fraction of SmolLM2's
    steps (its text has no meaning, its JSON object may be any size)."""
    return load_model(ModelConfig(model=str(tiny_hf_dir), device="cpu", dtype="float32"))


def constrained(kind: str, *, seed: int | None = None, max_tokens: int = 100) -> SamplingParams:
    spec: dict[str, Any] = {
        "json": {"json": SCHEMA},
        "json_object": {"json_object": True},
        "regex": {"regex": REGEX},
        "choice": {"choice": CHOICES},
        "grammar": {"grammar": 'root ::= "Answer: " ("A" | "B" | "C")'},
    }[kind]
    temperature = 0.0 if seed is None else 0.8
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**spec),
    )


def check_output(kind: str, text: str) -> None:
    """Fails unless ``text`` is an output of ``kind``'s grammar."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert text in ("Answer: A", "Answer: B", "Answer: C")


#: 16 requests: (kind or "free", seed or None for greedy).
MIX: list[tuple[str, int | None]] = [
    ("json", None),
    ("json", 1),
    ("json", 2),
    ("json_object", 3),
    ("regex", None),
    ("regex", 4),
    ("choice", None),
    ("choice", 5),
    ("choice", 6),
    ("grammar", 7),
    ("free", None),
    ("free", 8),
    ("free", None),
    ("free", 9),
    ("json", None),
    ("regex", 10),
]


def mix_params(kind: str, seed: int | None) -> SamplingParams:
    if kind == "free":
        temperature = 0.0 if seed is None else 0.8
        return SamplingParams(temperature=temperature, seed=seed, max_tokens=24)
    return constrained(kind, seed=seed)


async def run_mix(engine: asyncstep.Engine) -> list[asyncstep.Completion]:
    results: dict[int, asyncstep.Completion] = {}

    async def run(i: int, kind: str, seed: int | None) -> None:
        prompt = prompt_for(kind, i)
        results[i] = await engine.generate(prompt, mix_params(kind, seed))

    async with anyio.create_task_group() as tg:
        for i, (kind, seed) in enumerate(MIX):
            tg.start_soon(run, i, kind, seed)
    return [results[i] for i in range(len(MIX))]


def prompt_for(kind: str, i: int = 0) -> Any:
    if kind == "json_object":
        return OBJECT_QUESTION
    return QUESTION if kind == "json" else QUESTIONS[i % len(QUESTIONS)]


def core_of(engine: asyncstep.Engine) -> EngineCore:
    assert isinstance(engine.core, EngineCore)  # in-process: a preloaded model
    return engine.core


async def test_sixteen_mixed_requests_follow_their_grammars_overlap_on_and_off(
    smollm2: LoadedModel,
) -> None:
    by_overlap = {}
    free = [i for i, (kind, _) in enumerate(MIX) if kind == "free"]
    for overlap in (True, False):
        async with asyncstep.open_engine(smollm2, async_scheduling=overlap) as engine:
            # Overlap off: the matchers advanced by two threads (CI has 2 cores: 1 by default).
            core_of(engine).structured_output.num_pool_threads = 1 if overlap else 2
            outputs = await run_mix(engine)
            await engine.wait_idle()
            manager = core_of(engine).structured_output
            assert manager.matchers == {}  # every finished request let go of its matcher
            stats = manager.statistics()
            if overlap:  # a free request's tokens are those it gets alone
                for i in free:
                    alone = await engine.generate(prompt_for("free", i), mix_params(*MIX[i]))
                    assert alone.token_ids == outputs[i].token_ids
        assert stats.num_rejected_tokens == 0 and stats.num_rows > 0
        for (kind, _), out in zip(MIX, outputs, strict=True):
            if kind != "free":
                assert out.finish_reason == "stop", (kind, out.text)
                check_output(kind, out.text)
        by_overlap[overlap] = [out.token_ids for out in outputs]
    assert by_overlap[True] == by_overlap[False]


async def test_n_choices_follow_the_grammar_and_their_seeds(tiny_llama: LoadedModel) -> None:
    params = msgspec.structs.replace(constrained("json", seed=21), n=4)
    async with asyncstep.open_engine(tiny_llama) as engine:
        alone = await engine.generate(QUESTION, params)
        async with anyio.create_task_group() as tg:  # the same request in a crowd
            results: dict[str, asyncstep.Completion] = {}

            async def run(key: str, prompt: Any, p: SamplingParams) -> None:
                results[key] = await engine.generate(prompt, p)

            tg.start_soon(run, "n", QUESTION, params)
            for i, question in enumerate(QUESTIONS):
                tg.start_soon(run, str(i), question, constrained("choice", seed=i))
    assert len(alone.outputs) == 4
    for output in alone.outputs:
        check_output("json", output.text)
    assert len({o.text for o in alone.outputs}) > 1  # sampled: the choices differ
    assert [o.token_ids for o in results["n"].outputs] == [o.token_ids for o in alone.outputs]


async def constrained_at_once(
    engine: asyncstep.Engine, kinds: list[str]
) -> list[asyncstep.Completion]:
    """A greedy request of each kind, all at once (one batch)."""
    results: dict[int, asyncstep.Completion] = {}

    async def run(i: int, kind: str) -> None:
        results[i] = await engine.generate(prompt_for(kind), constrained(kind))

    async with anyio.create_task_group() as tg:
        for i, kind in enumerate(kinds):
            tg.start_soon(run, i, kind)
    return [results[i] for i in range(len(kinds))]


async def test_preempted_requests_keep_their_grammar(tiny_llama: LoadedModel) -> None:
    kinds = ["json", "regex", "json", "choice", "json", "json_object"]
    # The reference: the same batch in a roomy cache (dense fp32: a request's
    # greedy tokens do not depend on its batch), never preempted.
    async with asyncstep.open_engine(tiny_llama) as engine:
        roomy = await constrained_at_once(engine, kinds)
        assert engine.statistics().num_preemptions == 0
    # 8 blocks of 16 tokens for six requests of ~40-token prompts: some wait,
    # others are preempted and recomputed.
    async with asyncstep.open_engine(tiny_llama, num_blocks=12, block_size=16) as engine:
        results = await constrained_at_once(engine, kinds)
        preemptions = engine.statistics().num_preemptions
    assert preemptions > 0
    for i, kind in enumerate(kinds):
        check_output(kind, results[i].text)
        assert results[i].token_ids == roomy[i].token_ids


async def test_an_aborted_request_lets_go_of_its_matcher(smollm2: LoadedModel) -> None:
    async with asyncstep.open_engine(smollm2) as engine:
        async for chunk in engine.stream(QUESTION, constrained("json")):
            assert chunk.token_ids
            break
        await engine.wait_idle()
        assert core_of(engine).structured_output.matchers == {}
        after = await engine.generate(QUESTION, constrained("regex"))
    check_output("regex", after.text)


#: Bad grammars and what their refusal says.
BAD_GRAMMARS: list[tuple[dict[str, Any], str]] = [
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON object"),
    ({"json": {"type": "frobnicate"}}, "does not compile"),
    ({"regex": "[a-z"}, "does not compile"),
    ({"grammar": "root ::= undefined_rule"}, "does not compile"),
    ({"grammar": 'start ::= "a"'}, "does not compile"),
    ({"json": SCHEMA, "regex": REGEX}, "exactly one of"),
    ({}, "exactly one of"),
    ({"choice": []}, "at least one"),
    ({"choice": ["a", 3]}, "strings only"),
    ({"regex": "   "}, "must not be empty"),
    ({"json_object": "yes"}, "True or False"),
    ({"jsonschema": SCHEMA}, "unknown field"),
]


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}
INDENTED = '{\n  "city": "New York",\n  "country": "USA"\n}'
COMPACT = '{"city":"New York","country":"USA"}'


@pytest.mark.parametrize(
    "compact,text,ok",
    [
        (False, INDENTED, True),
        (False, '{"city": "New York"\n\n,\n"country": "USA"}', False),  # odd whitespace
        (False, '{"city": "New York" , "country": "USA"}', False),
        (False, COMPACT, False),
        (True, COMPACT, True),
        (True, '{"city": "New York", "country": "USA"}', False),
        (True, INDENTED, False),
    ],
)
def test_a_json_schema_s_output_is_standard_json_or_compact(
    compact: bool, text: str, ok: bool
) -> None:
    """A ``json`` grammar takes standard JSON (indented by 2, as
    ``json.dumps(value, indent=2)``), no other whitespace; with
    ``disable_any_whitespace``, compact JSON (none at all); at the door
    (the grammar alone) and compiled alike."""
    import xgrammar as xgr

    params = StructuredOutputsParams(json=CITY, disable_any_whitespace=compact)
    vocabulary = xgr.TokenizerInfo(["<eos>", "x"], stop_token_ids=[0])
    door = xgr.GrammarCompiler(vocabulary, max_threads=1).compile_grammar(grammar_of(params))
    core = GrammarCompiler(vocabulary, max_threads=1).compile(params.grammar_kind, params.spec)
    for compiled in (door, core):
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.accept_token(0)) == ok


async def test_bad_grammars_are_refused_at_the_door(smollm2: LoadedModel) -> None:
    async with asyncstep.open_engine(smollm2) as engine:  # one engine: one compile worker
        for spec, message in BAD_GRAMMARS:
            with pytest.raises(InvalidRequestError, match=message):
                params = SamplingParams(max_tokens=4, structured_outputs=spec)
                await engine.generate("Hi", params)
            assert engine.statistics().num_waiting_reqs == 0
            good = await engine.generate("Hi", constrained("choice"))  # the engine still serves
            check_output("choice", good.text)
        assert core_of(engine).structured_output.pool.statistics().num_refused == 0


async def test_a_model_without_tokenizer_refuses_structured_outputs(
    tiny_model: LoadedModel,
) -> None:
    async with asyncstep.open_engine(tiny_model) as engine:
        with pytest.raises(InvalidRequestError, match="need a tokenizer"):
            await engine.generate([1, 2, 3], constrained("regex"))


@pytest.mark.trio
async def test_pipeline_stages_follow_the_grammar_as_one_rank(
    tiny_hf_dir: Path, tiny_llama: LoadedModel
) -> None:
    """On the tiny Llama: each rank loads it in a second (SmolLM2's GGUF
    takes each rank seconds to dequantize)."""
    kinds = ["json", "regex", "choice", "json_object"]
    async with asyncstep.open_engine(tiny_llama, max_num_batched_tokens=32) as engine:
        expected = await constrained_at_once(engine, kinds)
    async with asyncstep.open_engine(
        tiny_hf_dir,
        device="cpu",
        dtype="float32",  # as the tiny_llama fixture
        pipeline_parallel_size=2,
        max_num_batched_tokens=32,
    ) as engine:
        results = await constrained_at_once(engine, kinds)
    for i, kind in enumerate(kinds):
        check_output(kind, results[i].text)
        assert results[i].token_ids == expected[i].token_ids


@pytest.mark.parametrize("vocab", [64, 70, 100, 5000])
def test_the_triton_kernel_masks_as_the_torch_ops(vocab: int) -> None:
    from asyncstep.ops.triton.grammar_kernel import apply_bitmask_rows

    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator)
    words = (min(vocab, 4096) + 31) // 32  # 5000: a vocabulary wider than the bitmask
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=generator, dtype=torch.int32)
    rows = torch.tensor([5, 0, 3])
    expected = logits.clone()
    grammar_output = GrammarOutput(1, ["a", "b", "c"], bitmask.numpy().tobytes())
    GrammarBitmask(torch.device("cpu")).apply(expected, grammar_output, {"a": 5, "b": 0, "c": 3})
    ours = logits.clone()
    apply_bitmask_rows(ours, bitmask, rows)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("vocab", [64, 70, 100])
def test_the_bitmask_is_applied_as_xgrammar_applies_it(vocab: int) -> None:
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator)
    words = 2  # 64 tokens: a vocabulary of 70 or 100 is wider than the bitmask
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=generator, dtype=torch.int32)
    rows = {"a": 4, "b": 0, "c": 2}
    grammar_output = GrammarOutput(
        7, ["a", "b", "c", "gone"], bitmask.numpy().tobytes() + b"\0" * 8
    )
    ours = logits.clone()
    GrammarBitmask(torch.device("cpu")).apply(ours, grammar_output, rows)

    expected = logits.clone()
    full = torch.zeros(5, (vocab + 31) // 32, dtype=torch.int32)  # beyond the bitmask: banned
    full[:] = -1
    full[[4, 0, 2], :words] = bitmask
    full[[4, 0, 2], words:] = 0
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=vocab, indices=[4, 0, 2])
    assert torch.equal(ours, expected)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # rows without a grammar untouched
