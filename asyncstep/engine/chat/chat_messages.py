"""Chat messages at the engine's door, and the chat template.

:func:`check_chat_message` checks one message as a chat template will read
it (a role; a content, which an assistant's message with ``tool_calls`` may
leave out; each call's function name and arguments; a tool message's
``tool_call_id``; all in UTF-8) and counts the bytes it renders;
:func:`template_message` gives it the shape templates take (arguments as
objects); :func:`use_chat_template` replaces a tokenizer's template with a
file's, once it renders a chat.

A request may bring its own template (``chat_template``: code from a
client, which the HTTP server takes only with ``--trust-request-chat-template``;
rendered, as every template, in the sandboxed Jinja environment of
transformers' ``apply_chat_template``; :func:`check_chat_template`: at most
:data:`MAX_REQUEST_CHAT_TEMPLATE_BYTES`) and its template's variables
(``chat_template_kwargs``, e.g. ``{"enable_thinking": false}``;
:func:`check_chat_template_kwargs`: a JSON object of at most
:data:`MAX_CHAT_TEMPLATE_KWARGS_BYTES`, none of the names the template's
caller sets itself). May import msgspec, ``asyncstep.checks`` and
``asyncstep.errors``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from asyncstep.checks import check_json_depth, is_utf8, shown, utf8_size
from asyncstep.errors import ConfigError, InvalidRequestError, describe

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


#: Largest chat template file taken (``ModelConfig.chat_template``).
MAX_CHAT_TEMPLATE_BYTES = 1 << 20
#: Largest chat template a request may bring (``chat_template``).
MAX_REQUEST_CHAT_TEMPLATE_BYTES = 64 << 10
#: Largest ``chat_template_kwargs`` (as JSON).
MAX_CHAT_TEMPLATE_KWARGS_BYTES = 16 << 10
#: Template variables a request may not set: what the renderer sets itself
#: (``apply_chat_template``'s own parameters and the messages), beside the
#: tokenizer's special tokens (``bos_token``, ...).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
#: What a chat template must render at start-up.
_PROBE_CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def use_chat_template(tokenizer: PreTrainedTokenizerBase | None, path: str | None) -> None:
    """Give ``tokenizer`` the chat template in file ``path`` (None: keep its
    own), once it renders a two-message chat; else a one-line ConfigError."""
    if path is None:
        return
    if tokenizer is None:
        raise ConfigError(f"chat_template {path}: this model has no tokenizer")
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CHAT_TEMPLATE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"chat_template {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CHAT_TEMPLATE_BYTES:
        raise ConfigError(f"chat_template {path}: larger than {MAX_CHAT_TEMPLATE_BYTES} bytes")
    try:
        template = data.decode()
        text = tokenizer.apply_chat_template(
            _PROBE_CHAT, chat_template=template, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # not UTF-8, or jinja's errors
        why = describe(exc)
        raise ConfigError(f"chat_template {path}: does not render a chat: {why}") from None
    if not isinstance(text, str) or "Hi" not in text:
        raise ConfigError(f"chat_template {path}: its rendering of a chat leaves the messages out")
    tokenizer.chat_template = template


def check_chat_template(template: object) -> str | None:
    """A request's ``chat_template``: None, or the text of a Jinja template
    (UTF-8, not empty, at most :data:`MAX_REQUEST_CHAT_TEMPLATE_BYTES`)."""
    if template is None:
        return None
    if not isinstance(template, str):
        raise InvalidRequestError(f"chat_template must be a string, got {shown(template)}")
    if not template.strip():
        raise InvalidRequestError("chat_template must not be empty")
    if not is_utf8(template):
        raise InvalidRequestError("chat_template is not valid UTF-8")
    size = utf8_size(template)
    if size > MAX_REQUEST_CHAT_TEMPLATE_BYTES:
        raise InvalidRequestError(
            f"chat_template has {size} bytes, more than {MAX_REQUEST_CHAT_TEMPLATE_BYTES}"
        )
    return template


def check_chat_template_kwargs(
    kwargs: object, reserved: frozenset[str] = RESERVED_TEMPLATE_KWARGS
) -> tuple[dict[str, Any], int]:
    """A request's ``chat_template_kwargs`` (None: none): a JSON object of
    at most :data:`MAX_CHAT_TEMPLATE_KWARGS_BYTES`, nested at most
    :data:`~asyncstep.checks.MAX_JSON_DEPTH` deep, whose names are
    identifiers outside ``reserved``. Returns it (as plain JSON values) and
    its size in bytes."""
    if kwargs is None:
        return {}, 0
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(
            f"chat_template_kwargs must be a JSON object, got {shown(kwargs)}"
        )
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidRequestError(
                f"chat_template_kwargs: each name must be an identifier, got {shown(key)}"
            )
        if key in reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {key!r} (the template's caller sets it)"
            )
    try:
        text = msgspec.json.encode(kwargs)
    except (TypeError, msgspec.EncodeError, UnicodeEncodeError, RecursionError) as exc:
        raise InvalidRequestError(f"chat_template_kwargs must be JSON: {exc}") from None
    if len(text) > MAX_CHAT_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequestError(
            f"chat_template_kwargs has {len(text)} bytes of JSON, more than "
            f"{MAX_CHAT_TEMPLATE_KWARGS_BYTES}"
        )
    check_json_depth("chat_template_kwargs", text)
    decoded: dict[str, Any] = msgspec.json.decode(text)
    return decoded, len(text)


def check_chat_message(index: int, message: Mapping[str, Any]) -> int:
    """A chat message: a string ``role``; a string ``content``, which an
    assistant's message with ``tool_calls`` may leave out (or null); each
    tool call a ``function`` with a string ``name`` and ``arguments`` (a
    JSON string or object); a string ``tool_call_id`` where given; all in
    UTF-8. Returns the UTF-8 bytes the template renders of it."""
    role = message.get("role")
    _check_string(index, "role", role)
    if not role:
        raise InvalidRequestError(f"chat message {index}: 'role' is empty")
    calls = message.get("tool_calls")
    content = message.get("content")
    if content is not None or not calls:
        _check_string(index, "content", content)
    size = utf8_size(content or "")
    if calls is not None:
        size += _check_tool_calls(index, calls)
    if (call_id := message.get("tool_call_id")) is not None:
        _check_string(index, "tool_call_id", call_id)
        size += utf8_size(call_id)
    return size


def _check_string(index: int, key: str, value: object) -> None:
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"chat message {index}: {key!r} must be a string, got {shown(value)}"
        )
    if not is_utf8(value):
        raise InvalidRequestError(f"chat message {index}: {key!r} is not valid UTF-8")


def _check_tool_calls(index: int, calls: object) -> int:
    if not isinstance(calls, Sequence) or isinstance(calls, str | bytes) or not calls:
        raise InvalidRequestError(f"chat message {index}: 'tool_calls' must be a non-empty list")
    size = 0
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise InvalidRequestError(
                f"chat message {index}: each tool call must hold a 'function' object"
            )
        _check_string(index, "tool_calls[].function.name", function.get("name"))
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            _check_string(index, "tool_calls[].function.arguments", arguments)
            size += utf8_size(arguments)
        else:
            size += json_size(arguments, f"chat message {index}: tool call arguments")
        size += utf8_size(function["name"])
    return size


def json_size(value: object, what: str) -> int:
    """The UTF-8 bytes of ``value`` as JSON (InvalidRequestError if it is not JSON)."""
    try:
        return len(msgspec.json.encode(value))
    except (TypeError, msgspec.EncodeError, UnicodeEncodeError) as exc:
        raise InvalidRequestError(f"{what} must be JSON: {exc}") from None


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A checked message as chat templates take it: tool calls' arguments
    as objects (they render them with ``tojson``), a missing content empty."""
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [_template_call(call) for call in out["tool_calls"]]
    return out


def _template_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        with contextlib.suppress(msgspec.DecodeError):  # not JSON: the template gets the string
            function["arguments"] = msgspec.json.decode(function["arguments"])
    return {**call, "type": call.get("type", "function"), "function": function}


def is_chat(prompt: object) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str | bytes)
        and bool(prompt)
        and all(isinstance(m, Mapping) for m in prompt)
    )
