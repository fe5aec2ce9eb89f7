"""No request can kill the engine: every request is checked whole at the door.

Bad sampling parameters, prompts, request ids and command-line flags are each
refused with a one-line :class:`InvalidRequestError` (the CLI: one stderr
line, exit 1, before the model loads); a refused request leaves nothing
behind. One engine per core placement (in this process, and in a process of
its own) serves the whole module from a thread of its own, so that every case
meets the same live engine: it stays alive, and a healthy request running
beside the bad ones gets the tokens it gets alone. A hypothesis fuzzer over
SamplingParams' keywords and prompts holds the property "a clear
InvalidRequestError, or a correct answer; the engine alive".
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import pytest
import torch
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from msgspec.structs import force_setattr

import asyncstep
from asyncstep import AsyncstepError, InvalidRequestError, SamplingParams
from asyncstep import cli as cli_module
from asyncstep.checks import shown
from asyncstep.datatypes import MAX_COUNT, MAX_LOGPROBS, MAX_SEED
from asyncstep.datatypes.sampling_params import _FIELD_CHECKS
from asyncstep.engine.messages.outputs import Completion
from asyncstep.runner.sampler import Sampler, SamplingMetadata, gather_logprobs

T = TypeVar("T")

#: The shared engines' context: short, so that a fuzzed max_tokens of None
#: (what the context leaves) stays cheap.
MAX_MODEL_LEN = 64
VOCAB = 49152  # tiny_hf_dir's (SmolLM2's tokenizer)
HEALTHY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
#: Sampling parameters that fit the context (the default max_tokens, 256, does not).
FITS = SamplingParams(max_tokens=4)
HEALTHY_PROMPT = [5, 17, 300, 4000, 42]


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class Text(str):
    pass


# ---------------------------------------------------------------------------
# Bad sampling parameters: (keywords, the field the message names).

BAD_SAMPLING: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": 1.0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"temperature": 1j}, "temperature"),
    ({"temperature": BadRepr()}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": "1"}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    ({"top_k": False}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"min_p": [0.1]}, "min_p"),
    ({"seed": 2**64 + 1, "temperature": 0.7}, "seed"),
    ({"seed": 2**64, "temperature": 0.7}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": "1", "temperature": 0.7}, "seed"),
    ({"seed": 1.5, "temperature": 0.7}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop": [b"the"]}, "stop"),
    ({"stop": b"the"}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": 123}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["ok", None]}, "stop"),
    ({"stop": {"the": 1}}, "stop"),
    ({"stop": ["a\udc80"]}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": b"\x01"}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"logprobs": "3"}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": 2**70}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ({"prompt_logprobs": 0.5}, "prompt_logprobs"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"presence_penalty": None}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": [1.2]}, "repetition_penalty"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {2**63: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": {5: "1"}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": {1.5: 1.0}}, "logit_bias"),
    ({"logit_bias": [5, 1.0]}, "logit_bias"),
    ({"logit_bias": 5}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": "2"}, "min_tokens"),
    ({"min_tokens": None}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens"),
    ({"bad_words": [1]}, "bad_words"),
    ({"bad_words": [b"bad"]}, "bad_words"),
    ({"bad_words": b"bad"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["ok", "  "]}, "bad_words"),
    ({"bad_words": ["a\udc80"]}, "bad_words"),
    ({"bad_words": {"bad": 1}}, "bad_words"),
    ({"_bad_words_token_ids": [[]]}, "_bad_words_token_ids"),
    ({"_bad_words_token_ids": [[-1]]}, "_bad_words_token_ids"),
    ({"_bad_words_token_ids": [["a"]]}, "_bad_words_token_ids"),
    ({"_bad_words_token_ids": [5]}, "_bad_words_token_ids"),
    ({"_eos_token_ids": [-1]}, "_eos_token_ids"),
]


def _case_id(case: tuple[dict[str, Any], str]) -> str:
    return ",".join(f"{k}={shown(v, 30)}" for k, v in case[0].items())


def bypassed(**fields: Any) -> SamplingParams:
    """SamplingParams whose fields were set behind its checks' back."""
    params = SamplingParams(max_tokens=2)
    for name, value in fields.items():
        force_setattr(params, name, value)
    return params


def assert_one_line(error: BaseException, *fragments: str) -> None:
    message = str(error)
    assert message and "\n" not in message and len(message) < 300, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("case", BAD_SAMPLING, ids=_case_id)
def test_bad_sampling_params_are_refused(case: tuple[dict[str, Any], str]) -> None:
    kwargs, field = case
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**kwargs)
    assert_one_line(refused.value, field)
    with pytest.raises(InvalidRequestError):
        msgspec.structs.replace(SamplingParams(), **kwargs)
    # Set behind its back: validate() refuses it.
    with pytest.raises(InvalidRequestError):
        bypassed(**kwargs).validate()
    # Decoding is checked as well (where msgpack can carry the value at all).
    try:
        wire = msgspec.msgpack.encode({k: v for k, v in kwargs.items()})
    except (TypeError, OverflowError, UnicodeEncodeError):
        return
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(wire, type=SamplingParams)


def test_every_field_has_its_check() -> None:
    assert list(_FIELD_CHECKS) == list(SamplingParams.__struct_fields__)


def test_good_sampling_params_are_normalized_and_cross_the_wire() -> None:
    params = SamplingParams(
        max_tokens=np.int32(4),
        temperature=np.float32(0.5),
        top_k=np.int64(-1),
        seed=np.uint64(MAX_SEED),
        stop="the",
        stop_token_ids=[np.int64(3), 7],
        logprobs=np.int8(MAX_LOGPROBS),
    )
    assert params.stop == ("the",) and params.stop_token_ids == (3, 7)
    for value in (params.max_tokens, params.top_k, params.seed, params.logprobs):
        assert type(value) is int
    assert type(params.temperature) is float and params.temperature == 0.5
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    # vLLM's None for "no stop strings / ids"; an int temperature is a float.
    none = SamplingParams(stop=None, stop_token_ids=None, temperature=0)
    assert none.stop == () and none.stop_token_ids == () and type(none.temperature) is float
    assert SamplingParams(top_k=MAX_COUNT, max_tokens=MAX_COUNT, seed=0).top_k == MAX_COUNT
    assert SamplingParams(stop=Text("x")).stop == ("x",)


def test_penalty_fields_are_normalized_and_cross_the_wire() -> None:
    params = SamplingParams(
        presence_penalty=np.float32(-2.0),
        frequency_penalty=2,
        repetition_penalty=np.float64(1e6),
        logit_bias={np.int64(7): 250, 3: -1e9, 9: np.float32(0.5)},
        min_tokens=np.int16(3),
        max_tokens=3,
        bad_words="bad",
        _bad_words_token_ids=[[1, 2], (3,)],
    )
    assert params.logit_bias == {7: 100.0, 3: -100.0, 9: 0.5}  # clamped, as vLLM's server does
    assert all(type(k) is int and type(v) is float for k, v in params.logit_bias.items())
    assert type(params.presence_penalty) is float and params.frequency_penalty == 2.0
    assert type(params.min_tokens) is int and params.bad_words == ("bad",)
    assert params.bad_words_token_ids == ((1, 2), (3,))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params and params.processes_logits
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams(repetition_penalty=1, presence_penalty=0).processes_logits


# ---------------------------------------------------------------------------
# The sampler's guards: values the door refuses still cannot break a step.


def test_sampler_clamps_top_k_and_logprobs() -> None:
    huge = bypassed(temperature=1.0, top_k=2**70)
    low = bypassed(temperature=1.0, top_k=-(2**70))
    logits = torch.randn(3, 11)
    metadata = SamplingMetadata.from_params([huge, low, SamplingParams(top_k=3)], {}, logits.device)
    tokens = Sampler()(logits, metadata).sampled_token_ids
    assert tokens.shape == (3,) and bool(((tokens >= 0) & (tokens < 11)).all())
    whole = gather_logprobs(logits.log_softmax(-1), 50, tokens)
    assert whole.logprobs.shape == (3, 12)  # the sampled token, then the whole vocabulary


# ---------------------------------------------------------------------------
# Shared engines, each serving from a trio loop of its own thread.


class EngineThread:
    """An engine serving on a trio loop in a thread of its own; the tests call
    into it with :meth:`run` (``trio.from_thread``)."""

    def __init__(self, model: Path, **options: Any) -> None:
        self._ready: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=trio.run, args=(self._serve, model, options))
        self._thread.start()
        ready = self._ready.get(timeout=240)
        if isinstance(ready, BaseException):
            self._thread.join()
            raise ready
        self.engine: asyncstep.Engine
        self.engine, self._token, self._stop = ready

    async def _serve(self, model: Path, options: dict[str, Any]) -> None:
        try:
            async with asyncstep.open_engine(model, **options) as engine:
                stop = trio.Event()
                self._ready.put((engine, trio.lowlevel.current_trio_token(), stop))
                await stop.wait()
        except BaseException as exc:  # reported to the test thread (or by close())
            self._ready.put(exc)

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def generate(
        self, prompt: Any, params: Any = None, request_id: Any = None
    ) -> Completion | BaseException:
        """A completion, or the error it raised."""

        async def one() -> Completion | BaseException:
            try:
                return await self.engine.generate(prompt, params, request_id=request_id)
            except Exception as exc:
                return exc

        return self.run(one)

    def check_alive(self) -> None:
        assert self.engine.error is None
        out = self.generate(HEALTHY_PROMPT, SamplingParams(temperature=0, max_tokens=2))
        assert isinstance(out, Completion) and len(out.token_ids) == 2, out

    def close(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()
        assert self._ready.empty(), self._ready.get()  # the engine closed cleanly


def open_shared(tiny_hf_dir: Path, *, engine_process: bool) -> Iterator[EngineThread]:
    engine = EngineThread(
        tiny_hf_dir,
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        engine_process=engine_process,
    )
    try:
        yield engine
        engine.check_alive()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def in_process_engine(tiny_hf_dir: Path) -> Iterator[EngineThread]:
    yield from open_shared(tiny_hf_dir, engine_process=False)


@pytest.fixture(scope="module")
def core_process_engine(tiny_hf_dir: Path) -> Iterator[EngineThread]:
    """The core in a process of its own (the default): what a request holds
    also crosses the process boundary."""
    yield from open_shared(tiny_hf_dir, engine_process=True)


@pytest.fixture(
    scope="module",
    params=["in_process_engine", "core_process_engine"],
    ids=["in-process", "core-process"],
)
def shared(request: pytest.FixtureRequest) -> EngineThread:
    engine: EngineThread = request.getfixturevalue(request.param)
    return engine


# ---------------------------------------------------------------------------
# Bad requests at the engine's door: (prompt, sampling params, request id, fragment).

CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS: dict[str, tuple[Any, Any, Any, str]] = {
    "prompt-none": (None, None, None, "prompt must be"),
    "prompt-int": (123, None, None, "prompt must be"),
    "prompt-float": (1.5, None, None, "prompt must be"),
    "prompt-bytes": (b"hello", None, None, "prompt must be"),
    "prompt-bytearray": (bytearray(b"\x01\x02"), None, None, "prompt must be"),
    "prompt-memoryview": (memoryview(b"\x01\x02"), None, None, "prompt must be"),
    "prompt-dict": ({1: "a"}, None, None, "prompt must be"),
    "prompt-set": ({1, 2}, None, None, "prompt must be"),
    "prompt-iterator": (iter([1, 2]), None, None, "prompt must be"),
    "prompt-empty-text": ("", None, None, "prompt is empty"),
    "prompt-empty-list": ([], None, None, "prompt is empty"),
    "prompt-surrogate": ("hi \udc80 there", None, None, "not valid UTF-8"),
    "ids-bool": ([1, True, 3], None, None, "prompt must be"),
    "ids-float": ([1.0, 2.0], None, None, "prompt must be"),
    "ids-str": (["1", "2"], None, None, "prompt must be"),
    "ids-numpy": ([np.int64(5)], None, None, "prompt must be"),
    "ids-nested": ([[1, 2]], None, None, "prompt must be"),
    "ids-negative": ([1, -1], None, None, "token ids must be in [0, 49152)"),
    "ids-vocab": ([1, VOCAB], None, None, "token ids must be in [0, 49152)"),
    "ids-huge": ([2**64 + 1], None, None, "token ids must be in"),
    "ids-too-long": (list(range(1, MAX_MODEL_LEN + 1)), None, None, "max_model_len"),
    "chat-mixed": ([*CHAT, 5], None, None, "prompt must be"),
    "chat-no-content": ([{"role": "user"}], None, None, "'content' must be a string"),
    "chat-none-content": ([{"role": "user", "content": None}], None, None, "'content'"),
    "chat-list-content": ([{"role": "user", "content": ["hi"]}], None, None, "'content'"),
    "chat-no-role": ([{"content": "hi"}], None, None, "'role' must be a string"),
    "chat-empty-role": ([{"role": "", "content": "hi"}], None, None, "'role' is empty"),
    "chat-int-role": ([{"role": 1, "content": "hi"}], None, None, "'role' must be"),
    "chat-surrogate": ([{"role": "user", "content": "\ud800"}], None, None, "not valid UTF-8"),
    "chat-second-surrogate": (
        [{"role": "system", "content": "ok"}, {"role": "user", "content": "a\udcff"}],
        None,
        None,
        "chat message 1: 'content' is not valid UTF-8",
    ),
    "params-dict": ([1, 2], {"temperature": 0}, None, "must be a SamplingParams"),
    "params-str": ([1, 2], "greedy", None, "must be a SamplingParams"),
    "id-int": ([1, 2], FITS, 5, "request_id must be a string"),
    "id-bytes": ([1, 2], FITS, b"x", "request_id must be a string"),
    "id-tuple": ([1, 2], FITS, ("a",), "request_id must be a string"),
    "id-surrogate": ([1, 2], FITS, "r\udc80", "not valid UTF-8"),
    "max-tokens-past-the-context": (
        [1, 2],
        SamplingParams(max_tokens=MAX_MODEL_LEN - 1),
        None,
        "max_tokens 63 does not fit: the prompt has 2 tokens and the model's context "
        "(max_model_len) is 64, which leaves 62: ask for at most 62",
    ),
    "max-tokens-default-past-the-context": ([1, 2], None, None, "max_tokens 256 does not fit"),
    "logit-bias-vocab": (
        [1, 2],
        SamplingParams(logit_bias={3: 1.0, VOCAB: 1.0}),
        None,
        "logit_bias token ids must be < the vocabulary size (49152), got 49152",
    ),
    "bad-words-ids-vocab": (
        [1, 2],
        SamplingParams(_bad_words_token_ids=[[5, VOCAB + 3]]),
        None,
        "bad_words token ids must be < the vocabulary size (49152)",
    ),
}


def assert_refused_leaving_nothing(shared: EngineThread, error: Any, *fragments: str) -> None:
    assert isinstance(error, InvalidRequestError), error
    assert_one_line(error, *fragments)
    engine = shared.engine
    assert not engine.output_processor.requests  # nothing left in the front end
    shared.run(engine.wait_idle)
    stats = engine.statistics()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0  # nor in the core
    assert engine.error is None


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_requests_are_refused_at_the_door(shared: EngineThread, name: str) -> None:
    prompt, params, request_id, fragment = BAD_REQUESTS[name]
    error = shared.generate(prompt, params, request_id)
    assert_refused_leaving_nothing(shared, error, fragment)


@pytest.mark.parametrize("case", BAD_SAMPLING, ids=_case_id)
def test_bad_sampling_params_set_behind_the_checks_are_refused(
    shared: EngineThread, case: tuple[dict[str, Any], str]
) -> None:
    kwargs, field = case
    error = shared.generate([1, 2, 3], bypassed(**kwargs))
    assert_refused_leaving_nothing(shared, error, field)


#: Unusual but valid requests beside the bad ones: each must be served.
EDGE_PARAMS: list[SamplingParams] = [
    SamplingParams(temperature=0.7, seed=MAX_SEED, max_tokens=4),
    SamplingParams(temperature=0.7, seed=0, top_k=MAX_COUNT, max_tokens=4),
    SamplingParams(temperature=0.7, top_k=VOCAB + 1, top_p=1e-9, min_p=1.0, max_tokens=4),
    SamplingParams(temperature=1e-4, max_tokens=4, logprobs=MAX_LOGPROBS),
    SamplingParams(temperature=1e300, max_tokens=4, logprobs=0),
    SamplingParams(temperature=0, max_tokens=None, stop=["the", "\x00"]),  # the context's
    SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 4, ignore_eos=True),  # it, exactly
    SamplingParams(temperature=0, max_tokens=4, stop=None, stop_token_ids=[MAX_COUNT]),
    SamplingParams(temperature=np.float64(0.9), seed=np.uint64(7), max_tokens=np.int64(4)),
    SamplingParams(
        temperature=0,
        max_tokens=4,
        repetition_penalty=1e-9,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={0: 1e9, VOCAB - 1: -100},
        bad_words=["the", " hello world", "\x00"],
        min_tokens=4,
        stop_token_ids=[MAX_COUNT],
    ),
    SamplingParams(
        temperature=0.8,
        seed=3,
        top_k=5,
        max_tokens=4,
        repetition_penalty=1e9,
        min_tokens=4,
        _bad_words_token_ids=[[VOCAB - 1] * 3, [0]],
    ),
]


def test_a_healthy_request_is_unharmed_by_bad_ones_beside_it(shared: EngineThread) -> None:
    engine = shared.engine
    alone = shared.generate(HEALTHY_PROMPT, HEALTHY)
    assert isinstance(alone, Completion) and len(alone.token_ids) == HEALTHY.max_tokens

    async def beside() -> tuple[list[int], list[Any]]:
        healthy: list[int] = []
        results: list[Any] = []

        async def one(prompt: Any, params: Any, request_id: Any) -> None:
            try:
                results.append(await engine.generate(prompt, params, request_id=request_id))
            except Exception as exc:
                results.append(exc)

        async with trio.open_nursery() as nursery:
            stream = engine.stream(HEALTHY_PROMPT, HEALTHY, request_id="healthy")
            first = await stream.__anext__()  # the healthy request is in flight
            healthy += first.token_ids
            for prompt, params, request_id, _ in BAD_REQUESTS.values():
                nursery.start_soon(one, prompt, params, request_id)
            for kwargs, _ in BAD_SAMPLING:
                nursery.start_soon(one, [1, 2, 3], bypassed(**kwargs), None)
            for params in EDGE_PARAMS:
                nursery.start_soon(one, "Once upon a time", params, None)
            # A string id finishing in the same steps as the refused int one.
            nursery.start_soon(one, [1, 2, 3], SamplingParams(max_tokens=2), "5")
            nursery.start_soon(one, [1, 2, 3], SamplingParams(max_tokens=2), 5)
            async for chunk in stream:
                healthy += chunk.token_ids
        return healthy, results

    healthy, results = shared.run(beside)
    assert healthy == alone.token_ids
    served = [r for r in results if isinstance(r, Completion)]
    refused = [r for r in results if not isinstance(r, Completion)]
    assert len(served) == len(EDGE_PARAMS) + 1
    assert len(refused) == len(BAD_REQUESTS) + len(BAD_SAMPLING) + 1
    for error in refused:
        assert isinstance(error, InvalidRequestError), error
        assert_one_line(error)
    for out in served:
        assert out.finish_reason in ("stop", "length") and out.token_ids
        assert all(0 <= t < VOCAB for t in out.token_ids)
    shared.check_alive()


# ---------------------------------------------------------------------------
# The fuzzer: whatever the keywords and the prompt, a clear error or an answer.

_GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.integers(min_value=-2, max_value=30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0, max_value=2),
    st.text(max_size=4),
    st.sampled_from(["\udc80", b"x", "0.5", 1j]),
    st.lists(
        st.one_of(st.integers(-2, 2**64), st.text(max_size=3), st.binary(max_size=2)), max_size=3
    ),
)
#: Valid values of each field, the edges and numpy scalars among them.
_VALID = {
    "max_tokens": st.sampled_from([1, 2, 3, 4, 5, 6, None, MAX_COUNT]),  # MAX_COUNT: refused
    "temperature": st.one_of(
        st.sampled_from([0, 0.0, 0.8, 1e-6, 1e-4, 1e300]), st.floats(0, 3).map(np.float32)
    ),
    "top_p": st.floats(1e-9, 1.0),
    "top_k": st.one_of(st.integers(-1, 60), st.sampled_from([MAX_COUNT, VOCAB + 1])),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.one_of(st.none(), st.integers(0, MAX_SEED), st.integers(0, 99).map(np.uint64)),
    "stop": st.one_of(st.none(), st.text(min_size=1), st.lists(st.text(min_size=1), max_size=2)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, MAX_COUNT), max_size=2)),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    "include_stop_str_in_output": st.booleans(),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.one_of(st.floats(1e-3, 3.0), st.sampled_from([1.0, 1e-30, 1e30])),
    "logit_bias": st.one_of(
        st.none(),
        st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-1e3, 1e3), max_size=3),
    ),
    "min_tokens": st.integers(0, 6),
    "bad_words": st.lists(st.text(min_size=1, max_size=6), max_size=2),
}


@st.composite
def sampling_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    """SamplingParams' keywords: valid ones (max_tokens always: the default
    does not fit the context), and a third of the time one field of garbage."""
    required = {"max_tokens": _VALID["max_tokens"]}
    optional = {k: v for k, v in _VALID.items() if k not in required}
    kwargs: dict[str, Any] = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.integers(0, 2)) == 0:
        kwargs[draw(st.sampled_from(list(_VALID)))] = draw(_GARBAGE)
    return kwargs


_GOOD_PROMPTS = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    st.text(min_size=1, max_size=12),
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=8)}
        ),
        min_size=1,
        max_size=2,
    ),
)
_BAD_PROMPTS = st.one_of(
    _GARBAGE,
    st.lists(st.integers(-3, 2**64), max_size=4),
    st.sampled_from([{1: "a"}, b"ab", "a\ud800", [{"role": "user", "content": "\udc80"}]]),
)


@st.composite
def prompts(draw: st.DrawFn) -> Any:
    """Prompts: valid ones, and a third of the time anything."""
    return draw(_BAD_PROMPTS if draw(st.integers(0, 2)) == 0 else _GOOD_PROMPTS)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    kwargs=sampling_kwargs(),
    prompt=prompts(),
)
def test_fuzz_a_clear_error_or_an_answer(
    core_process_engine: EngineThread, kwargs: dict[str, Any], prompt: Any
) -> None:
    try:
        params = SamplingParams(**kwargs)
    except AsyncstepError as exc:
        assert isinstance(exc, InvalidRequestError)
        assert_one_line(exc)
        event("refused: sampling params")
        return
    out = core_process_engine.generate(prompt, params)
    if isinstance(out, BaseException):
        assert isinstance(out, InvalidRequestError), repr(out)
        assert_one_line(out)
        event("refused: request")
    else:
        event("served")
        assert out.finish_reason in ("stop", "length")
        assert 1 <= len(out.token_ids) <= (params.max_tokens or MAX_MODEL_LEN)
        assert all(0 <= t < VOCAB for t in out.token_ids)
        if params.logprobs is not None:
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            assert all(len(lp.token_ids) == params.logprobs + 1 for lp in out.logprobs)
        if params.prompt_logprobs is not None:
            assert out.prompt_logprobs is not None
            assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert core_process_engine.engine.error is None
    assert not core_process_engine.engine.output_processor.requests


# ---------------------------------------------------------------------------
# The command line: sampling flags refused before the model loads.

BAD_FLAGS: list[tuple[list[str], str]] = [
    (["--seed", str(2**64 + 1), "--temperature", "0.7"], "seed must be"),
    (["--seed=-1"], "seed must be"),
    (["--top-k", str(2**63)], "top_k must be at most"),
    (["--top-k=-7"], "top_k must be >= 1"),
    (["--max-tokens", str(2**63)], "max_tokens must be at most"),
    (["--max-tokens=-1"], "max_tokens must be at least 1"),
    (["--temperature", "nan"], "temperature must be"),
    (["--temperature", "inf"], "temperature must be"),
    (["--top-p", "nan"], "top_p must be in (0, 1]"),
    (["--top-p=-inf"], "top_p must be in (0, 1]"),
    (["--min-p=-0.1"], "min_p must be in [0, 1]"),
    (["--min-p", "nan"], "min_p must be in [0, 1]"),
    (["--stop", ""], "stop strings must not be empty"),
    (["--stop", "ok", "--stop", "\udc80"], "not valid UTF-8"),
    (["--presence-penalty", "2.5"], "presence_penalty must be in [-2, 2]"),
    (["--frequency-penalty=-3"], "frequency_penalty must be in [-2, 2]"),
    (["--frequency-penalty", "nan"], "frequency_penalty must be in [-2, 2]"),
    (["--repetition-penalty", "0"], "repetition_penalty must be a finite number > 0"),
    (["--repetition-penalty", "inf"], "repetition_penalty must be a finite number > 0"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f)[:40] for f, _ in BAD_FLAGS])
def test_bad_cli_flags_are_refused_before_the_model_loads(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    message: str,
) -> None:
    async def never(*args: Any) -> int:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_module, "generate_all", never)
    code = cli_module.main(["generate", *flags, "hello"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith("asyncstep: error:") and message in err, err
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "no-chat"])
def test_cli_refuses_empty_and_undecodable_prompts_alone(
    capsys: pytest.CaptureFixture[str], tiny_hf_dir: Path, chat: bool
) -> None:
    code = cli_module.main(
        [
            "generate",
            "--model",
            str(tiny_hf_dir),
            "--engine-process" if chat else "--no-engine-process",
            "--chat" if chat else "--no-chat",
            "--json",
            "--max-tokens",
            "2",
            "fine",
            "",
            "bad \udc80",  # an argv byte that is not UTF-8
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records[0]["token_ids"]) == 2
    assert "prompt is empty" in records[1]["error"]
    assert "not valid UTF-8" in records[2]["error"] and records[2]["prompt"] == "bad \udc80"
    assert err.count("asyncstep: error:") == 2 and "Traceback" not in err
