"""From an OpenAI request to what the engine takes: each prompt's token ids
and :class:`~asyncstep.datatypes.SamplingParams` (a
:class:`GenerationJob`).

The rules are OpenAI's, with vLLM's extensions: ``temperature`` and
``top_p`` default to 1; a completion's ``max_tokens`` to 16 (at most what
the context leaves), a chat's ``max_completion_tokens`` (or ``max_tokens``)
to what the context leaves after the prompt (None); one larger than that
is refused by the engine, as every door's is; chat ``logprobs=true`` with
``top_logprobs=k`` asks for the top-k; ``response_format`` (``json_object``:
the schema of any object, as OpenAI means it; ``json_schema``) and
``structured_outputs`` (as they are) become
:class:`~asyncstep.structured_params.StructuredOutputsParams`. Every
value is then checked by ``SamplingParams`` itself, and each prompt by the
engine (:meth:`~asyncstep.engine.front_end.engine.Engine.encode_prompt`: one that
cannot fit the context is refused by its size, before it is tokenized; long
text is tokenized off the event loop): what they refuse raises
:class:`~asyncstep.errors.InvalidRequestError` (a 400).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncstep.checks import shown
from asyncstep.datatypes import MAX_LOGPROBS, SamplingParams
from asyncstep.engine.chat.tool_parsers import ToolParser
from asyncstep.engine.chat.tools import ForcedCalls, ToolMode, check_tools
from asyncstep.engine.front_end.data_parallel import ServedEngine
from asyncstep.errors import InvalidRequestError
from asyncstep.server.errors import bad_request
from asyncstep.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    CompletionRequest,
    GenerationRequest,
    ResponseFormat,
)
from asyncstep.structured_params import StructuredOutputsParams, check_structured_outputs

#: A completion's ``max_tokens`` when none is given (OpenAI's).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Most prompts one completion request may hold.
MAX_PROMPTS = 1024
#: Most choices one request may ask for: ``n`` x prompts, each an engine
#: request (a list of MAX_PROMPTS prompts, or MAX_N choices of a few).
MAX_CHOICES = MAX_PROMPTS
#: ``response_format`` ``json_object``: any JSON object (OpenAI's meaning).
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class GenerationJob:
    """One request's prompts (token ids, and their text where known) and
    each prompt's sampling parameters; with ``n`` choices each."""

    prompts: list[list[int]]
    texts: list[str | None]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    #: Top log-probs asked per position (None: no log-probs).
    logprobs: int | None
    #: Top log-probs asked per prompt position (None: none).
    prompt_logprobs: int | None = None
    echo: bool = False
    #: ``echo`` with ``max_tokens`` 0: the prompt alone (one token is made, not shown).
    hide_output: bool = False
    #: A chat's tool calls: forced ones, or the parser of ``auto``'s.
    tool_calls: ToolMode = None

    @property
    def n(self) -> int:
        return self.params[0].n

    @property
    def num_choices(self) -> int:
        """Choices over every prompt (each a request of the engine's core)."""
        return self.n * len(self.prompts)


async def completion_job(engine: ServedEngine, request: CompletionRequest) -> GenerationJob:
    if request.suffix is not None:
        raise bad_request("suffix is not supported", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of must equal n (or be left out)", "best_of")
    hide_output = request.echo and request.max_tokens == 0
    prompt_logprobs = request.prompt_logprobs
    if request.echo and request.logprobs is not None and (prompt_logprobs or 0) >= 0:
        # The echoed prompt's tokens come with their log-probs (a bad value is
        # left for SamplingParams to refuse).
        prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
    prompts = completion_prompts(request.prompt, engine.max_model_len)
    check_choices(request.n, len(prompts))
    ids = [await _encoded(engine, p) for p in prompts]
    check_prompt_logprobs(engine, ids, prompt_logprobs)
    texts = [p if isinstance(p, str) else None for p in prompts]
    max_tokens = 1 if hide_output else request.max_tokens
    params = [
        _sampling_params(
            request,
            _max_tokens(engine, len(p), max_tokens, "max_tokens", completion=True),
            request.logprobs,
            prompt_logprobs,
        )
        for p in ids
    ]
    return _job(request, ids, texts, params, request.logprobs, echo=request.echo, hide=hide_output)


async def chat_job(
    engine: ServedEngine,
    request: ChatCompletionRequest,
    parser: ToolParser | None = None,
    *,
    trust_chat_template: bool = False,
) -> GenerationJob:
    """``parser``: the server's tool-call parser (``tool_choice`` ``auto``);
    ``trust_chat_template``: a request's own ``chat_template`` is taken
    (else refused)."""
    if not request.messages:
        raise bad_request("messages must not be empty", "messages")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if request.chat_template is not None and not trust_chat_template:
        raise bad_request(
            "chat_template: this server does not take a request's chat template (start it "
            "with --trust-request-chat-template)",
            "chat_template",
        )
    messages = chat_messages(request.messages)
    tools = template_tools(request.tools)
    mode = check_tools(
        tools,
        msgspec.to_builtins(request.tool_choice),
        request.parallel_tool_calls,
        messages,
        parser,
        auto_needs="--enable-auto-tool-choice and --tool-call-parser to be set",
    )
    forced = mode if isinstance(mode, ForcedCalls) else None
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    ids = await _encoded(
        engine,
        messages,
        "messages",
        tools=tools,
        chat_template=request.chat_template,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    given, name = request.max_completion_tokens, "max_completion_tokens"
    if given is None and request.max_tokens is not None:
        given, name = request.max_tokens, "max_tokens"
    max_tokens = _max_tokens(engine, len(ids), given, name, completion=False)
    params = [_sampling_params(request, max_tokens, logprobs, request.prompt_logprobs, forced)]
    job = _job(request, [ids], [None], params, logprobs)
    return dataclasses.replace(job, tool_calls=mode)


def template_tools(tools: Sequence[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as JSON values (OpenAI's shape), as the engine takes them."""
    if not tools:
        return None
    return [msgspec.to_builtins(tool) for tool in tools]


def completion_prompts(prompt: str | list[Any], max_model_len: int) -> list[str | list[int]]:
    """A completion's ``prompt``: a string, a list of strings, a list of
    token ids, or a list of lists of token ids; as a list of prompts. A list
    of ``max_model_len`` token ids or more is refused by its length."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    if type(prompt[0]) is int and len(prompt) >= max_model_len:
        raise bad_request(
            f"prompt has {len(prompt)} tokens; the model's context (max_model_len) is "
            f"{max_model_len}, and at least one token must be generated",
            "prompt",
        )
    if len(prompt) > MAX_PROMPTS and not all(type(t) is int for t in prompt):
        raise bad_request(f"prompt may list at most {MAX_PROMPTS} prompts", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_token_ids(p) for p in prompt):
        return [list(p) for p in prompt]
    if all(type(t) is int for t in prompt):
        return [list(prompt)]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids",
        "prompt",
    )


def check_choices(n: object, num_prompts: int) -> None:
    """At most :data:`MAX_CHOICES` choices over every prompt (a bad ``n`` is
    left for ``SamplingParams`` to refuse)."""
    if type(n) is int and n * num_prompts > MAX_CHOICES:
        raise bad_request(
            f"n x prompts must be at most {MAX_CHOICES} (choices over every prompt), got "
            f"{n} x {num_prompts}",
            "n",
        )


def check_prompt_logprobs(engine: ServedEngine, prompts: list[list[int]], k: object) -> None:
    """A request's prompt log-probs (``k + 1`` per prompt position after the
    first, over every prompt) are at most one whole-context prompt's at the
    largest ``k``: they are held and sent whole (a bad ``k`` is left for
    ``SamplingParams`` to refuse)."""
    if type(k) is not int or not 0 <= k <= MAX_LOGPROBS:
        return
    asked = (k + 1) * sum(max(len(p) - 1, 0) for p in prompts)
    most = engine.max_model_len * (MAX_LOGPROBS + 1)
    if asked > most:
        raise bad_request(
            f"prompt_logprobs: this request asks for {asked} log-probs ({k + 1} per prompt "
            f"token after the first, over {len(prompts)} prompts); at most {most} (the "
            f"model's context, {engine.max_model_len} tokens, x {MAX_LOGPROBS + 1})",
            "prompt_logprobs",
        )


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the engine's chat template takes them: string
    contents (text parts joined by newlines; none: empty), an assistant's
    ``tool_calls`` and a tool message's ``tool_call_id`` as given."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": _content(i, m.content)}
        if m.tool_calls:
            message["tool_calls"] = [msgspec.to_builtins(call) for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _content(index: int, content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"type {shown(kind)}" if kind != "text" else "a text part without a string text"
            raise bad_request(
                f"messages[{index}].content: {what} is not supported (only text parts)",
                "messages",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


async def _encoded(
    engine: ServedEngine,
    prompt: Any,
    param: str = "prompt",
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    try:
        return await engine.encode_prompt(
            prompt,
            tools=tools,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
    except InvalidRequestError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0].rstrip(":")
        given = field if field in ("chat_template", "chat_template_kwargs") else param
        raise bad_request(message, given) from None


def _max_tokens(
    engine: ServedEngine, prompt_len: int, given: int | None, name: str, *, completion: bool
) -> int | None:
    """The output budget: ``given``, else the default: a completion's 16
    at most what the context leaves, a chat's None (what the context
    leaves). One past what the context leaves after the prompt is the
    engine's 400 (its one rule, asked here before any prompt of the
    request runs; ``name`` is the field given)."""
    if given is None:
        room = engine.max_model_len - prompt_len
        return min(room, DEFAULT_COMPLETION_MAX_TOKENS) if completion else None
    if isinstance(given, int):  # (another type is SamplingParams' to refuse)
        try:
            engine.input_processor.check_fits(given, prompt_len)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), name) from None
    return given


def _sampling_params(
    request: GenerationRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    forced: ForcedCalls | None = None,
) -> SamplingParams:
    return SamplingParams(
        n=request.n,
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if request.top_k is None else request.top_k,
        min_p=0.0 if request.min_p is None else request.min_p,
        seed=request.seed,
        stop=request.stop,  # type: ignore[arg-type]  # a string or a list: checked there
        stop_token_ids=request.stop_token_ids or (),  # type: ignore[arg-type]
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=request.include_stop_str_in_output,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else request.repetition_penalty,
        logit_bias=_logit_bias(request.logit_bias),
        min_tokens=request.min_tokens,
        bad_words=request.bad_words or (),  # type: ignore[arg-type]
        structured_outputs=structured_outputs(request, forced),
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit bias: token ids as strings."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids (integers, as strings), got {shown(key)}",
                "logit_bias",
            ) from None
    return out


def structured_outputs(
    request: GenerationRequest, forced: ForcedCalls | None = None
) -> StructuredOutputsParams | None:
    """``response_format`` (OpenAI's), ``structured_outputs`` (vLLM's) or
    the schema of ``forced`` tool calls: one of them."""
    given = request.structured_outputs
    from_format = _response_format(request.response_format)
    if from_format is not None and given is not None:
        raise bad_request(
            "give response_format or structured_outputs, not both", "structured_outputs"
        )
    if forced is not None:
        if from_format is not None or given is not None:
            raise bad_request(
                "a forced tool call (tool_choice required or a named function) cannot be "
                "combined with response_format or structured_outputs",
                "tool_choice",
            )
        return forced.structured_outputs()
    if given is not None:
        return check_structured_outputs("structured_outputs", given)
    return from_format


def _response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        # OpenAI's json_object is an object; the engine's json_object any JSON value.
        return StructuredOutputsParams(json=JSON_OBJECT_SCHEMA)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise bad_request(
                "response_format json_schema needs json_schema.schema", "response_format"
            )
        try:
            return StructuredOutputsParams(json=fmt.json_schema.schema)
        except InvalidRequestError as exc:
            raise bad_request(f"response_format: {exc}", "response_format") from None
    raise bad_request(
        f"response_format type must be text, json_object or json_schema, got {shown(fmt.type)}",
        "response_format",
    )


def _job(
    request: GenerationRequest,
    ids: list[list[int]],
    texts: list[str | None],
    params: list[SamplingParams],
    logprobs: int | None,
    *,
    echo: bool = False,
    hide: bool = False,
) -> GenerationJob:
    options = request.stream_options
    if options is not None and not request.stream:
        raise bad_request("stream_options needs stream set to true", "stream_options")
    return GenerationJob(
        prompts=ids,
        texts=texts,
        params=params,
        stream=request.stream,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None and options.continuous_usage_stats,
        logprobs=logprobs,
        prompt_logprobs=request.prompt_logprobs,
        echo=echo,
        hide_output=hide,
    )
