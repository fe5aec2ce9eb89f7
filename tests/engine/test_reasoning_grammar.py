"""A grammar after the thinking (:mod:`asyncstep.engine.structured_output.reasoning_gate`):
with a reasoning parser on, the thinking is free and the answer after
``</think>`` follows the grammar; the gate on a made-up vocabulary (markers
of one token and of several, a prompt that opened or closed the thinking,
qwen3's opening, drafts that would cross the end); and on the embedded
model, whose ``</think>`` is three tokens: free thinking then a valid
answer, the same with speculative drafts, a forced tool call through
``Engine.chat`` read apart from its thinking, whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import anyio
import jsonschema
import pytest

import asyncstep
from asyncstep import SamplingParams, StructuredOutputsParams
from asyncstep.engine.core.engine_core import EngineCore
from asyncstep.engine.messages.outputs import ChatChunk, ChatCompletion
from asyncstep.engine.structured_output.reasoning_gate import (
    THINKING,
    ReasoningGate,
    ReasoningMarkers,
)
from asyncstep.models.model_loader import LoadedModel

#: A made-up vocabulary: ``<think>`` and ``</think>`` whole (0, 1), and in pieces.
VOCAB = [b"<think>", b"</think>", b"a", b"</", b"think", b">{", b"{", b"<", b">", b" b"]
THINK, END, A, CLOSE, WORD, END_BRACE, BRACE, LT, GT, B = range(len(VOCAB))


def test_the_thinking_ends_at_the_marker_in_one_token_or_several() -> None:
    markers = ReasoningMarkers("deepseek_r1", VOCAB)
    gate = markers.gate([A])
    assert gate is not None
    assert [gate.feed(t) for t in (A, B, CLOSE, WORD)] == [THINKING] * 4
    assert gate.feed(END_BRACE) == b"{" and gate.ended  # the rest goes to the matcher
    whole = markers.gate([A])
    assert whole is not None and whole.feed(A) is THINKING and whole.feed(END) == b""


def test_the_prompt_s_last_marker_decides_where_a_request_starts() -> None:
    qwen3 = ReasoningMarkers("qwen3", VOCAB)
    assert qwen3.gate([THINK, A, END, B]) is None  # the template closed the thinking
    opened = qwen3.gate([A, THINK])  # the template opened it
    assert opened is not None and opened.opening is None
    assert ReasoningMarkers("deepseek_r1", VOCAB).gate([LT, WORD, GT, A, CLOSE, WORD, GT]) is None


def test_qwen3_thinks_only_where_the_reply_opens_with_its_think_token() -> None:
    qwen3 = ReasoningMarkers("qwen3", VOCAB)
    thinks = qwen3.gate([A])
    assert thinks is not None and thinks.opening == THINK
    assert thinks.valid_drafts([THINK, A]) == []  # one position: no drafts
    assert thinks.feed(THINK) is THINKING and thinks.feed(A) is THINKING and not thinks.ended
    answers = qwen3.gate([A])
    assert answers is not None and answers.feed(BRACE) == BRACE and answers.ended
    no_token = ReasoningMarkers("qwen3", [b"<", b"think", b">"])  # <think> is not one token
    assert no_token.gate([0, 1]) is None


def test_drafts_never_cross_the_end_of_the_thinking() -> None:
    gate = ReasoningMarkers("deepseek_r1", VOCAB).gate([A])
    assert gate is not None
    assert gate.valid_drafts([A, B, A]) == [A, B, A]
    assert gate.valid_drafts([A, CLOSE, WORD, END_BRACE, BRACE]) == [A, CLOSE, WORD]
    gate.feed(CLOSE)
    assert gate.valid_drafts([WORD, GT]) == [WORD]  # the tail is kept
    assert not gate.ended  # drafts leave the gate as it was


# -- on the embedded model ------------------------------------------------------

#: Few-shot text after which SmolLM2 (greedy) thinks a sentence, ends it with
#: ``</think>`` (three of its tokens) and answers.
FEW_SHOT = (
    'Q: What is 2+2?\n<think>Two plus two is four.</think>{"answer": 4}\n'
    'Q: What is 3+3?\n<think>Three plus three is six.</think>{"answer": 6}\n'
    "Q: What is 5+1?\n<think>"
)
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
#: A chat template that renders the messages' text alone (the few-shot text).
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
ANSWER_TOOL = {"type": "function", "function": {"name": "answer", "parameters": ANSWER}}


def answer_params() -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=ANSWER)
    )


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_thinking_is_free_and_the_answer_follows_the_schema(
    smollm2: LoadedModel, anyio_backend: str
) -> None:
    async with asyncstep.open_engine(smollm2) as engine:  # no reasoning parser
        from_the_start = await engine.generate(FEW_SHOT, answer_params())
    assert from_the_start.text.startswith("{")  # the grammar held from the first token
    jsonschema.validate(json.loads(from_the_start.text), ANSWER)

    texts = []
    for speculative in (None, SPECULATIVE):
        async with asyncstep.open_engine(
            smollm2, reasoning_parser="deepseek_r1", speculative_config=speculative
        ) as engine:
            out = await engine.generate(FEW_SHOT, answer_params())
            assert isinstance(engine.core, EngineCore)
            manager = engine.core.structured_output
            assert manager.statistics().num_rejected_tokens == 0
            assert manager.gates == {} and manager.matchers == {}
            if speculative is not None:
                assert engine.statistics().spec_decode_num_accepted_tokens > 0
        thinking, ended, answer = out.text.partition("</think>")
        assert ended and out.finish_reason == "stop", out.text
        assert thinking.strip() and not thinking.lstrip().startswith("{")  # free text
        jsonschema.validate(json.loads(answer), ANSWER)
        texts.append(out.text)
    assert texts[0] == texts[1]  # drafts change nothing


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio", "asyncio"])
async def test_a_forced_call_after_the_thinking_through_engine_chat(
    smollm2: LoadedModel, anyio_backend: str
) -> None:
    chat: list[dict[str, Any]] = [{"role": "user", "content": FEW_SHOT}]
    options: dict[str, Any] = {
        "tools": [ANSWER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "answer"}},
        "chat_template": PLAIN_TEMPLATE,
    }
    params = SamplingParams(temperature=0, max_tokens=40)
    async with asyncstep.open_engine(smollm2, reasoning_parser="deepseek_r1") as engine:
        wholes: list[ChatCompletion] = []
        chunks: list[ChatChunk] = []

        async def chat_whole() -> None:
            wholes.append(await engine.chat(chat, params, **options))

        async def chat_streamed() -> None:
            async for c in engine.chat_stream(chat, params, **options):
                chunks.append(c)

        # Whole and streamed in one batch (dense fp32: the same greedy tokens).
        async with anyio.create_task_group() as tg:
            tg.start_soon(chat_whole)
            tg.start_soon(chat_streamed)
    [whole] = wholes
    assert whole.finish_reason == "tool_calls" and whole.content is None
    assert whole.reasoning_content and "</think>" not in whole.reasoning_content
    [call] = whole.tool_calls
    assert call.function.name == "answer" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), ANSWER)

    thinking = "".join(c.reasoning_content or "" for c in chunks).strip()
    deltas = [d for c in chunks for d in c.tool_calls or []]
    assert thinking == whole.reasoning_content
    assert deltas[0].id and deltas[0].function is not None
    assert deltas[0].function.name == "answer"
    assert all(d.id is None for d in deltas[1:])  # then pieces of the arguments
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert arguments == call.function.arguments
    assert not any(c.content for c in chunks)
    assert chunks[-1].finish_reason == "tool_calls"


def test_a_thinking_row_allows_everything_and_an_opening_row_its_think_token(
    smollm2: LoadedModel,
) -> None:
    """The bitmask rows: all-allowed while thinking; before the reply opens
    (qwen3), the grammar's tokens and the ``<think>`` token (here a made-up
    id: SmolLM2's ``<think>`` is three tokens); the thinking's tokens never
    reach the matcher, the bytes after its end do."""
    import numpy as np
    import xgrammar as xgr

    from asyncstep.engine.structured_output.manager import _advance_and_fill

    tokenizer = smollm2.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=smollm2.arch_config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(ANSWER))
    markers = ReasoningMarkers("qwen3", info.decoded_vocab)
    think = 63  # bit 31 of its word
    width = (smollm2.arch_config.vocab_size + 31) // 32

    def row_of(gate: Any, tokens: list[int], matcher: Any) -> np.ndarray:
        bitmask = np.full((1, width), -1, dtype=np.int32)  # as the manager starts a step's
        assert _advance_and_fill([("r", matcher, tokens, 0, [], gate)], bitmask) == []
        return bitmask[0]

    def allowed(row: np.ndarray) -> set[int]:
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    grammar_first = allowed(row_of(None, [], xgr.GrammarMatcher(compiled)))
    assert think not in grammar_first
    opening = allowed(
        row_of(ReasoningGate(markers, opening=think), [], xgr.GrammarMatcher(compiled))
    )
    assert opening == grammar_first | {think}

    matcher = xgr.GrammarMatcher(compiled)
    gate = ReasoningGate(markers)
    thinking = tokenizer.encode("hm, 5+1 is six", add_special_tokens=False)
    assert (row_of(gate, thinking, matcher) == -1).all()  # every token allowed
    ended = tokenizer.encode("</think>{", add_special_tokens=False)  # "</", "think", ">", "{"
    after = allowed(row_of(gate, ended, matcher))
    assert gate.ended and after != grammar_first  # the matcher took "{"
    assert tokenizer.encode('"', add_special_tokens=False)[0] in after
