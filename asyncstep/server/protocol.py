"""The bodies of the OpenAI API (and vLLM's extensions) as msgspec structs:
requests decoded from JSON with their types checked (a wrong type names
its field: :func:`decode_body`), responses and stream chunks encoded to
JSON. Values are checked where they become
:class:`~asyncstep.datatypes.SamplingParams` (:mod:`asyncstep.server.requests`),
so that one rule holds for the Python API and the HTTP API alike.

Unknown request fields are ignored, as OpenAI and vLLM do. A body nested
deeper than :data:`~asyncstep.checks.MAX_JSON_DEPTH` is refused before it is
parsed. Imports msgspec, :mod:`asyncstep.checks` and the engine's call types
(:class:`~asyncstep.engine.messages.outputs.ToolCall`,
:class:`~asyncstep.engine.messages.outputs.DeltaToolCall`).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from asyncstep.checks import check_json_depth
from asyncstep.engine.messages.outputs import DeltaToolCall, ToolCall
from asyncstep.errors import InvalidRequestError

T = TypeVar("T")


class BodyError(ValueError):
    """A body that is not JSON, or not of the request's shape; ``param``
    names the field when one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def decode_body(body: bytes, kind: type[T]) -> T:
    """Decode a JSON request body as ``kind`` (raises :class:`BodyError`)."""
    try:
        check_json_depth("request body", body)
    except InvalidRequestError as exc:
        raise BodyError(str(exc)) from None
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError:  # (a limit above the interpreter's)
        raise BodyError("request body nests too deeply") from None
    except msgspec.ValidationError as exc:
        message = str(exc)
        _, at, path = message.rpartition(" - at `$.")
        param = path.rstrip("`").split("[")[0].split(".")[0] if at else None
        raise BodyError(f"invalid request body: {message}", param) from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None


# -- requests -------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    #: vLLM: usage in every chunk.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    #: ``text``, ``json_object`` or ``json_schema``.
    type: str
    json_schema: JsonSchemaFormat | None = None


class GenerationRequest(msgspec.Struct, kw_only=True):
    """The fields both generation endpoints take (OpenAI's, then vLLM's)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Token id (as a string) -> bias.
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    #: StructuredOutputsParams' fields (json, json_object, regex, choice, grammar).
    structured_outputs: dict[str, Any] | None = None
    #: Each prompt position's log-prob and top-k (vLLM's; the first position: null).
    prompt_logprobs: int | None = None


class CompletionRequest(GenerationRequest, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings,
    a list of token ids, or a list of lists of token ids (checked in
    :func:`asyncstep.server.requests.completion_prompts`). ``echo`` puts the
    prompt before the output (with ``logprobs``, its tokens' log-probs too;
    with ``max_tokens`` 0, the prompt alone)."""

    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    #: A string, or a list of content parts (only ``{"type": "text", "text": ...}``).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    #: An assistant message's calls.
    tool_calls: list[ToolCall] | None = None
    #: A ``tool`` message: the call it answers.
    tool_call_id: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    #: The JSON schema of the arguments (an object).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming one function: its call is forced."""

    type: str
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    #: Deprecated by OpenAI for ``max_completion_tokens``; still taken.
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    #: Functions the model may call (:mod:`asyncstep.engine.chat.tools`).
    tools: list[ChatTool] | None = None
    #: ``none``, ``auto``, ``required`` or a named function (default: ``auto``
    #: with tools, else ``none``).
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: vLLM's: a Jinja chat template for this request (taken only by a server
    #: started with ``--trust-request-chat-template``).
    chat_template: str | None = None
    #: vLLM's: the chat template's variables (e.g. ``{"enable_thinking": false}``).
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# -- responses ------------------------------------------------------------


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's log-prob of one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One prompt position's log-probs by token id (as a string); null for the first.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    #: vLLM: the stop string or token id that ended the choice.
    stop_reason: int | str | None = None
    #: vLLM: the prompt's log-probs (in a stream, in the chunk that has them).
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A completion, or (``usage`` None, or ``choices`` empty) one stream chunk of one."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChatChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatLogprob] | None = None


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    #: The thinking before the answer (``--reasoning-parser``).
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "asyncstep"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo
