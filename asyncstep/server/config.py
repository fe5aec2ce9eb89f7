"""``ServerConfig``: the HTTP server's own options (the engine's are an
:class:`~asyncstep.config.EngineConfig`). Each field carries its one-line
description, so ``asyncstep serve`` derives a flag from each, as it does for
the engine options. Checked when built (one-line
:class:`~asyncstep.errors.ConfigError`). Imports nothing heavy.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated

import msgspec

from asyncstep.config import EngineOption, config_error, field_doc, struct_options
from asyncstep.errors import ConfigError

#: Where the API key may come from instead of a command line (which every
#: user of the machine can read).
API_KEY_ENV = "ASYNCSTEP_API_KEY"
#: Bodies larger than this are refused with 413 unless configured otherwise.
DEFAULT_MAX_BODY_BYTES = 8 << 20
#: Seconds a request's body may take to arrive unless configured otherwise.
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
#: ``tool_call_parser`` names (:data:`asyncstep.engine.chat.tool_parsers.TOOL_PARSERS`).
TOOL_PARSER_NAMES = ("hermes", "llama3_json")
#: Most API server processes (``api_server_count``).
MAX_API_SERVERS = 64
#: ``max_waiting_requests`` by default: this many times the server's share of
#: the batch. A burst of a few batches' worth queues (the last of it waits
#: about that many request lifetimes for a slot); past it a client is told to
#: retry (429) rather than queue without bound, holding memory and its
#: connection.
WAITING_BATCHES = 4
#: ``max_waiting_requests`` that switches the limit off.
NO_WAITING_LIMIT = -1


class ServerConfig(msgspec.Struct, kw_only=True):
    """How ``asyncstep serve`` listens and what it accepts."""

    host: Annotated[
        str, field_doc("address to listen on (loopback by default; 0.0.0.0: every interface)")
    ] = "127.0.0.1"
    port: Annotated[int, field_doc("port to listen on (0: any free port, printed when ready)")] = (
        8000
    )
    api_key: Annotated[
        str | None,
        field_doc(
            "require 'Authorization: Bearer KEY' (not on /health, /metrics, /version); "
            f"better: set {API_KEY_ENV}, a command line is visible to every user"
        ),
    ] = None
    served_model_name: Annotated[
        list[str] | None,
        field_doc("model names the API answers to (the first is reported); none: from --model"),
    ] = None
    max_waiting_requests: Annotated[
        int | None,
        field_doc(
            "refuse requests with 429 once this many choices would wait for a batch slot "
            f"(each API server counts its own); none: {WAITING_BATCHES} x this server's "
            f"share of the batch (max_num_seqs); {NO_WAITING_LIMIT}: no limit"
        ),
    ] = None
    shutdown_timeout: Annotated[
        float,
        field_doc(
            "seconds requests in flight may take to finish after SIGTERM before they are aborted"
        ),
    ] = 30.0
    max_request_body_bytes: Annotated[
        int, field_doc("largest request body accepted (larger: 413)")
    ] = DEFAULT_MAX_BODY_BYTES
    body_read_timeout: Annotated[
        float,
        field_doc(
            "seconds a client may take to send a request's whole body (longer: 408, "
            "and the connection is closed)"
        ),
    ] = DEFAULT_BODY_READ_TIMEOUT_S
    keep_alive_timeout: Annotated[
        float, field_doc("seconds an idle keep-alive connection stays open")
    ] = 5.0
    access_log: Annotated[
        bool, field_doc("log every request to stderr (Hypercorn's access log)")
    ] = False
    enable_auto_tool_choice: Annotated[
        bool,
        field_doc(
            "serve tool_choice 'auto' (the default with tools): the model chooses to call, "
            "and --tool-call-parser reads its calls from its text"
        ),
    ] = False
    tool_call_parser: Annotated[
        str | None,
        field_doc("how calls are written in the model's text: hermes or llama3_json"),
    ] = None
    trust_request_chat_template: Annotated[
        bool,
        field_doc(
            "take a chat request's own chat_template (code from a client: rendered in "
            "transformers' sandboxed Jinja, bounded in size, but its rendering time is not "
            "bounded); off: such a request is refused (400)"
        ),
    ] = False
    api_server_count: Annotated[
        int,
        field_doc(
            "HTTP server processes (each its own front end: HTTP, detokenizer, streams) "
            "sharing the port and one engine core"
        ),
    ] = 1

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (none: no key)")
        if self.served_model_name is not None and (
            not self.served_model_name or not all(self.served_model_name)
        ):
            raise ConfigError("served_model_name needs at least one non-empty name")
        if self.max_waiting_requests is not None and self.max_waiting_requests < NO_WAITING_LIMIT:
            raise ConfigError(
                f"max_waiting_requests must be >= 0, {NO_WAITING_LIMIT} (no limit) or none, "
                f"got {self.max_waiting_requests}"
            )
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_request_body_bytes <= 0:
            raise ConfigError(
                f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}"
            )
        if not 1 <= self.api_server_count <= MAX_API_SERVERS:
            raise ConfigError(
                f"api_server_count must be in [1, {MAX_API_SERVERS}], got {self.api_server_count}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSER_NAMES:
            raise ConfigError(
                f"tool_call_parser must be one of {', '.join(TOOL_PARSER_NAMES)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice needs a tool_call_parser")
        if not self.body_read_timeout > 0:
            raise ConfigError(f"body_read_timeout must be positive, got {self.body_read_timeout}")
        if not self.keep_alive_timeout > 0:
            raise ConfigError(f"keep_alive_timeout must be positive, got {self.keep_alive_timeout}")

    @classmethod
    def from_options(cls, **options: object) -> ServerConfig:
        """The config of flat options (:func:`server_options`' names); the
        API key from ``ASYNCSTEP_API_KEY`` when none is given. A bad value
        raises one :class:`ConfigError`."""
        unknown = sorted(set(options) - set(server_options()))
        if unknown:
            raise ConfigError(f"unknown server option {unknown[0]!r}")
        if options.get("api_key") is None and os.environ.get(API_KEY_ENV):
            options = {**options, "api_key": os.environ[API_KEY_ENV]}
        try:
            return msgspec.convert(options, cls)
        except msgspec.ValidationError as exc:
            raise config_error(exc) from None

    def waiting_limit(self, batch_share: int) -> int | None:
        """Choices that may wait for a batch slot at a server whose share of
        the batch is ``batch_share`` (``max_waiting_requests`` resolved);
        None: no limit."""
        limit = self.max_waiting_requests
        if limit is None:
            return WAITING_BATCHES * batch_share
        return None if limit == NO_WAITING_LIMIT else limit

    @property
    def bind(self) -> str:
        """``host:port`` as Hypercorn takes it (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


@functools.cache
def server_options() -> Mapping[str, EngineOption]:
    """Every field of :class:`ServerConfig`, by name (section ``server``)."""
    return MappingProxyType(struct_options(ServerConfig, "server"))
