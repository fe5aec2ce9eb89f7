"""Speculative decoding with a draft model (``"method": "draft_model"``):
its options at the door, the scheduler's side (drafts kept for the token
count they follow, lookahead slots), and the whole engine: greedy output
with a draft model equals greedy output without speculation, token for
token, with overlap on and off, stops and ``max_tokens`` inside accepted
runs, prefix caching, preemption, an abort, seeded sampling and a grammar.

Two drafts of ``looping_hf_dir`` (the n-gram tests' small random Llama):
the model itself (every draft must be accepted: this checks the draft's
KV cache mirrors the target's, position for position) and its first layer
alone (some drafts accepted, some rejected). A layer-truncated GGUF cut
from the embedded model is checked too: its tensors and tokenizer are the
source's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import EngineConfig, SpeculativeConfig
from asyncstep.engine.spec_decode.draft_model_drafts import DraftModelDrafts
from asyncstep.errors import ConfigError
from tests.engine.test_spec_decode_engine import (
    ENGINE,
    MAX_TOKENS,
    PROMPTS,
    Result,
    greedy,
    looping_hf_dir,  # noqa: F401  (the fixture)
    serve,
)

K = 3


def draft_config(path: Path) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def one_layer_dir(looping_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """``looping_hf_dir``'s first layer, its embedding, norm and head: a
    draft that agrees with the target sometimes."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(looping_hf_dir)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    path = tmp_path_factory.mktemp("draft-one-layer")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(looping_hf_dir).save_pretrained(path)
    return path


# -- the door ---------------------------------------------------------------


def test_draft_model_options_with_vllms_names() -> None:
    config = EngineConfig.from_options(
        speculative_config={"method": "draft_model", "model": "draft.gguf"}
    )
    spec = config.speculative_config
    assert spec is not None and spec.method == "draft_model" and spec.model == "draft.gguf"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "draft_model"}, 'needs "model"'),
        ({"method": "ngram", "model": "x.gguf"}, 'needs "model"'),
    ],
)
def test_a_draft_model_without_its_checkpoint_is_refused(
    value: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_options(speculative_config=value)


def test_a_draft_model_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match="one rank only"):
        EngineConfig.from_options(
            speculative_config={"method": "draft_model", "model": "d.gguf"},
            tensor_parallel_size=2,
        )


def test_a_draft_model_of_another_vocabulary_is_refused(looping_hf_dir: Path) -> None:  # noqa: F811
    async def main() -> None:
        spec = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 2}
        async with asyncstep.open_engine(
            "tiny-llama", load_format="dummy", speculative_config=spec, **ENGINE
        ):
            pass

    # (tiny-llama's vocabulary is its own; the target's is SmolLM2's)
    async def mismatched() -> None:
        async with asyncstep.open_engine(
            looping_hf_dir,
            speculative_config={"method": "draft_model", "model": "tiny-llama"},
            load_format="dummy",
            **ENGINE,
        ):
            pass

    trio.run(main)  # a dummy pair of one shape serves
    with pytest.raises(Exception, match="vocabulary"):
        trio.run(mismatched)


# -- the scheduler's side ---------------------------------------------------


def test_kept_drafts_follow_only_the_token_count_they_were_made_for() -> None:
    drafts = DraftModelDrafts(SpeculativeConfig(method="draft_model", model="d"))
    drafts.update("a", 3, [7, 8, 9])
    assert drafts.propose("a", [1, 2, 3, 4], 4) == []  # a token came since
    assert drafts.propose("a", [1, 2, 3], 4) == []  # used up
    drafts.update("a", 3, [7, 8, 9])
    assert drafts.propose("a", [1, 2, 3], 2) == [7, 8]
    drafts.update("b", 1, [5])
    drafts.forget("b")
    assert drafts.propose("b", [1], 4) == []
    assert drafts.num_lookahead_tokens == 4 and drafts.may_propose("c", [1])


# -- the engine -------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_greedy_output_with_a_draft_model_is_the_targets(
    looping_hf_dir: Path,  # noqa: F811
    one_layer_dir: Path,
    overlap: bool,
) -> None:
    params = [greedy()] * len(PROMPTS)
    options: dict[str, Any] = {"async_scheduling": overlap}
    plain = trio.run(lambda: serve(looping_hf_dir, params, spec=False, **options))
    spec = trio.run(
        lambda: serve(looping_hf_dir, params, spec=draft_config(one_layer_dir), **options)
    )
    assert spec == plain


def test_the_target_as_its_own_draft_has_every_draft_accepted(
    looping_hf_dir: Path,  # noqa: F811
) -> None:
    """The draft's cache mirrors the target's: the same model proposes
    exactly the target's greedy tokens, so none is rejected."""

    async def run() -> tuple[list[Result], int, int]:
        async with asyncstep.open_engine(
            looping_hf_dir, speculative_config=draft_config(looping_hf_dir), **ENGINE
        ) as engine:
            outs = [await engine.generate(p, greedy()) for p in PROMPTS]
            stats = engine.statistics()
        results = [Result(tuple(o.token_ids), o.text, o.finish_reason) for o in outs]
        return results, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens

    plain = trio.run(lambda: serve(looping_hf_dir, [greedy()] * len(PROMPTS), spec=False))
    results, drafted, accepted = trio.run(run)
    assert results == plain
    assert drafted > len(PROMPTS) * MAX_TOKENS // (K + 1) and accepted == drafted


def test_some_drafts_of_a_smaller_draft_model_are_rejected(
    looping_hf_dir: Path,  # noqa: F811
    one_layer_dir: Path,
) -> None:
    async def run() -> tuple[int, int]:
        async with asyncstep.open_engine(
            looping_hf_dir, speculative_config=draft_config(one_layer_dir), **ENGINE
        ) as engine:
            for p in PROMPTS:
                await engine.generate(p, greedy())
            stats = engine.statistics()
        return stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens

    drafted, accepted = trio.run(run)
    assert 0 < accepted < drafted


def test_stops_prefix_caching_preemption_and_an_abort_with_a_draft_model(
    looping_hf_dir: Path,  # noqa: F811
    one_layer_dir: Path,
) -> None:
    """Stop strings, stop tokens and max_tokens inside a verify step; then
    a tight cache (preemption; the lookahead slots come from free blocks
    only) with an abort; then the same prompts twice (prefix-cache hits:
    the draft's cache of a cached block is valid too)."""
    spec = draft_config(one_layer_dir)
    plain = trio.run(lambda: serve(looping_hf_dir, [greedy()] * len(PROMPTS), spec=False))
    text = plain[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = [
        greedy(stop=(stop,)),
        greedy(stop_token_ids=[plain[1].token_ids[9]]),
        greedy(max_tokens=7),
        greedy(stop=(stop,), include_stop_str_in_output=True),
        greedy(max_tokens=3),
    ]
    off = trio.run(lambda: serve(looping_hf_dir, params, spec=False))
    assert trio.run(lambda: serve(looping_hf_dir, params, spec=spec)) == off

    prompts = PROMPTS + PROMPTS[:2]
    long = [greedy(max_tokens=32)] * len(prompts)
    plain_long = trio.run(lambda: serve(looping_hf_dir, long, spec=False, prompts=prompts))
    tight = trio.run(
        lambda: serve(
            looping_hf_dir,
            long,
            spec=spec,
            prompts=prompts,
            abort_after={2: 5},
            block_size=4,
            num_blocks=20,
            preempts=True,
        )
    )
    assert tight[2] == Result(plain_long[2].token_ids[:5], "", "abort")
    assert [r for i, r in enumerate(tight) if i != 2] == [
        r for i, r in enumerate(plain_long) if i != 2
    ]

    async def twice() -> tuple[list[list[int]], float]:
        """The prompts at once, then again at once (each of the second batch's
        prompts is in the prefix cache)."""
        async with asyncstep.open_engine(
            looping_hf_dir, speculative_config=spec, **(ENGINE | {"block_size": 4})
        ) as engine:
            outs: list[list[int]] = []
            for _ in range(2):
                batch: dict[int, list[int]] = {}

                async def one(i: int, prompt: str, batch: dict[int, list[int]] = batch) -> None:
                    batch[i] = list((await engine.generate(prompt, long[0])).token_ids)

                async with trio.open_nursery() as nursery:
                    for i, prompt in enumerate(prompts):
                        nursery.start_soon(one, i, prompt)
                outs += [batch[i] for i in range(len(prompts))]
            return outs, engine.statistics().prefix_cache_hit_rate

    outs, hit_rate = trio.run(twice)
    assert outs == [list(r.token_ids) for r in plain_long] * 2 and hit_rate > 0.3


def test_seeded_sampling_and_a_grammar_with_a_draft_model(
    looping_hf_dir: Path,  # noqa: F811
    one_layer_dir: Path,
) -> None:
    """Sampled requests verify greedy drafts with the random rule (the same
    tokens twice for a seed); a grammar's request gets the drafts its
    matcher accepts and the tokens it gets without speculation."""
    from asyncstep import StructuredOutputsParams

    spec = draft_config(one_layer_dir)
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS) for i in range(5)]
    first = trio.run(lambda: serve(looping_hf_dir, sampled, spec=spec, check_accepted=False))
    second = trio.run(lambda: serve(looping_hf_dir, sampled, spec=spec, check_accepted=False))
    assert first == second and all(len(r.token_ids) <= MAX_TOKENS for r in first)

    params = [greedy()] * len(PROMPTS)
    params[2] = greedy(structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"]))
    plain = trio.run(lambda: serve(looping_hf_dir, params, spec=False))
    assert trio.run(lambda: serve(looping_hf_dir, params, spec=spec)) == plain


def test_a_layer_truncated_gguf_keeps_its_sources_tensors_and_tokenizer(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    from asyncstep.models.loader import default_model_path
    from asyncstep.models.loader.gguf_truncate import write_truncated_gguf

    source = gguf.GGUFReader(default_model_path())
    path = write_truncated_gguf(default_model_path(), tmp_path / "draft.gguf", 2)
    cut = gguf.GGUFReader(path)
    assert cut.fields["llama.block_count"].contents() == 2
    for key in ("tokenizer.ggml.tokens", "tokenizer.chat_template", "llama.embedding_length"):
        assert cut.fields[key].contents() == source.fields[key].contents()
    kept = {
        t.name: t
        for t in source.tensors
        if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < 2
    }
    assert {t.name for t in cut.tensors} == set(kept)
    for tensor in cut.tensors:
        assert tensor.tensor_type == kept[tensor.name].tensor_type
        assert np.array_equal(tensor.data, kept[tensor.name].data)
    with pytest.raises(ValueError, match="num_layers"):
        write_truncated_gguf(default_model_path(), tmp_path / "bad.gguf", 30)


@pytest.mark.skipif(ENGINE["device"] != "cpu", reason="the stand-in graphs are the CPU's")
def test_a_draft_model_through_the_graph_wiring(
    looping_hf_dir: Path,  # noqa: F811
    one_layer_dir: Path,
) -> None:
    """Stand-in CUDA graphs asked for FULL_AND_PIECEWISE with the Triton
    attention (interpreted): with a draft model the steps run PIECEWISE
    (the draft reads the step's attention metadata, which a FULL graph's
    step lacks), and the tokens are the target's."""
    params = [greedy(max_tokens=12)] * 2
    graphs = {
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "cudagraph_stand_in": True,
        "attention_backend": "triton",
        "max_num_seqs": 8,
    }
    prompts = PROMPTS[:2]
    plain = trio.run(lambda: serve(looping_hf_dir, params, spec=False, prompts=prompts))
    spec = trio.run(
        lambda: serve(
            looping_hf_dir,
            params,
            spec=draft_config(one_layer_dir),
            prompts=prompts,
            check_accepted=False,  # (12 tokens: the one-layer draft may hit none)
            **graphs,
        )
    )
    assert spec == plain
