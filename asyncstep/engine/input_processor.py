"""The front end's door (vLLM v1's ``InputProcessor``): each request's
checks and tokenization before anything of it is kept or sent.

:class:`InputProcessor` checks a request's sampling parameters against the
model (log-prob counts, ``logit_bias`` and bad-word token ids inside the
vocabulary; ``bad_words`` tokenized as vLLM does: each word with and without a
leading space; the EOS ids that ``min_tokens`` bans), its structured-output
grammar (within its budget, then whether it builds), and its prompt: text is
tokenized, chat messages go through the tokenizer's chat template, token ids
are taken as they are, and the ids must fit the model;
:func:`check_request_id` checks a caller's request id. A
refused request raises :class:`InvalidRequestError`.

It may import the request types (:mod:`asyncstep.datatypes`), the grammar
check, the errors and the model's config; it knows nothing of the engine core,
the requests in flight or the transport (the :class:`Engine` holds those).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio
import msgspec

from asyncstep.checks import is_utf8, shown
from asyncstep.config import StructuredOutputsConfig
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.grammar import check_grammar
from asyncstep.errors import InvalidRequestError, describe
from asyncstep.models.config import ModelArchConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: A prompt: text, token ids, or chat messages ({"role": ..., "content": ...}).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
#: Sequences of ints that are not token ids.
_BINARY = (bytes, bytearray, memoryview)


class InputProcessor:
    """Checks and tokenizes a model's requests (the :class:`Engine` holds one)."""

    def __init__(
        self,
        arch_config: ModelArchConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        max_model_len: int,
        grammar_budget: StructuredOutputsConfig | None = None,
    ) -> None:
        """``grammar_budget``: the limits a structured-output grammar is
        checked against (None: the defaults)."""
        self.arch_config = arch_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.grammar_budget = grammar_budget or StructuredOutputsConfig()
        #: What ends a request unless it ignores EOS (``min_tokens`` bans them early).
        self.eos_token_ids = tuple(
            sorted(frozenset(arch_config.eos_token_ids) | tokenizer_eos(tokenizer))
        )

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text as ``tokenizer(text).input_ids``, chat
        messages through the tokenizer's chat template, token ids as they are.
        Anything else, or ids the model cannot take, raise
        :class:`InvalidRequestError`."""
        if isinstance(prompt, str):
            ids = self._encode_text(prompt)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, _BINARY):
            items = list(prompt)
            if items and all(isinstance(m, Mapping) for m in items):
                ids = self._apply_chat_template(cast(list[Mapping[str, Any]], items))
            elif all(type(t) is int for t in items):
                ids = cast(list[int], items)
            else:
                raise InvalidRequestError(
                    "prompt must be a string, a list of token ids (ints) or a list of chat "
                    f"messages, got a list holding {_kinds(items)}"
                )
        else:
            raise InvalidRequestError(
                "prompt must be a string, a list of token ids or a list of chat messages, "
                f"got {type(prompt).__name__}"
            )
        self._check_prompt(ids)
        return ids

    def check_params(self, params: object) -> SamplingParams:
        """The request's sampling parameters (the defaults for None), checked
        against the model; with ``bad_words`` tokenized and the EOS ids that
        ``min_tokens`` bans filled in."""
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        params.validate()  # again: its fields may have been set behind its back
        vocab = self.arch_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > vocab:
                raise InvalidRequestError(
                    f"{name} must be <= the vocabulary size ({vocab}), got {count}"
                )
        outside = [t for t in params.logit_bias or () if t >= vocab]
        if outside:
            raise InvalidRequestError(
                f"logit_bias token ids must be < the vocabulary size ({vocab}), got {outside[0]}"
            )
        derived: dict[str, Any] = {}
        if params.bad_words:
            derived["_bad_words_token_ids"] = self._tokenize_bad_words(params.bad_words)
        bad = derived.get("_bad_words_token_ids", params.bad_words_token_ids)
        outside = [t for seq in bad for t in seq if t >= vocab]
        if outside:
            raise InvalidRequestError(
                f"bad_words token ids must be < the vocabulary size ({vocab}), got {outside[0]}"
            )
        if params.min_tokens > 0 and params._eos_token_ids != self.eos_token_ids:
            derived["_eos_token_ids"] = self.eos_token_ids
        return msgspec.structs.replace(params, **derived) if derived else params

    async def check_grammar(self, params: object) -> None:
        """The door's check of ``structured_outputs``: the grammar is within
        its budget (sizes, checked first), then builds (in a worker thread:
        xgrammar's first import takes seconds)."""
        if not isinstance(params, SamplingParams) or params.structured_outputs is None:
            return
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs need a tokenizer, and this model has none"
            )
        structured = params.structured_outputs
        structured.validate()  # again: its fields may have been set behind its back
        await anyio.to_thread.run_sync(check_grammar, structured, self.grammar_budget)

    def _tokenize_bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad words: each word (its leading spaces
        stripped) alone, and after a space when that gives other tokens of
        the same count (the word in the middle of a text)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("bad_words need a tokenizer, and this model has none")
        sequences: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not bare:
                raise InvalidRequestError(f"bad word {shown(word)} tokenizes to nothing")
            sequences.append(bare)
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return tuple(sequences)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the model's context (max_model_len) is "
                f"{self.max_model_len}, and at least one token must be generated"
            )
        vocab = self.arch_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")

    def _need_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass the prompt as token ids")
        return self.tokenizer

    def _encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise InvalidRequestError("prompt is empty")
        if not is_utf8(text):
            raise InvalidRequestError("prompt is not valid UTF-8 (it holds a lone surrogate)")
        tokenizer = self._need_tokenizer()
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def _apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        tokenizer = self._need_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template")
        for i, message in enumerate(messages):
            _check_chat_message(i, message)
        try:
            conversation: list[dict[str, Any]] = [dict(m) for m in messages]
            text = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:  # jinja errors: a malformed conversation
            raise InvalidRequestError(f"chat template failed: {describe(exc)}") from None
        return self._encode_text(cast(str, text), add_special_tokens=False)


def check_request_id(request_id: object) -> str:
    """A caller's request id: a string, in UTF-8 (whether it is in flight is
    the engine's to check)."""
    if not isinstance(request_id, str):
        raise InvalidRequestError(
            f"request_id must be a string, got {type(request_id).__name__} {shown(request_id)}"
        )
    if not is_utf8(request_id):
        raise InvalidRequestError(f"request_id {shown(request_id)} is not valid UTF-8")
    return request_id


def _check_chat_message(index: int, message: Mapping[str, Any]) -> None:
    """A chat message: a string ``role`` and a string ``content``, in UTF-8."""
    for key in ("role", "content"):
        value = message.get(key)
        if not isinstance(value, str):
            raise InvalidRequestError(
                f"chat message {index}: {key!r} must be a string, got {shown(value)}"
            )
        if not is_utf8(value):
            raise InvalidRequestError(f"chat message {index}: {key!r} is not valid UTF-8")
    if not message["role"]:
        raise InvalidRequestError(f"chat message {index}: 'role' is empty")


def _kinds(items: list[Any]) -> str:
    """The kinds of a prompt list's items, for an error message."""
    names = sorted({type(item).__name__ for item in items})
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def tokenizer_eos(tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The tokenizer's EOS token id, if it has one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset([eos]) if isinstance(eos, int) else frozenset()
