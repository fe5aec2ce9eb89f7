"""The front end's door (vLLM v1's ``InputProcessor``): each request's
checks and tokenization before anything of it is kept or sent.

:class:`InputProcessor` checks a request's sampling parameters against the
model (the prompt and ``max_tokens`` within the context, as vLLM checks them;
log-prob counts, ``logit_bias`` and bad-word token ids inside the
vocabulary; ``bad_words`` tokenized as vLLM does: each word with and without a
leading space; the EOS ids that ``min_tokens`` bans), its structured-output
grammar (within its budget, then whether it builds), and its prompt: text is
tokenized, chat messages go through the tokenizer's chat template, token ids
are taken as they are, and the ids must fit the model;
:func:`check_request_id` checks a caller's request id. A
refused request raises :class:`InvalidRequestError`.

Length before work: a prompt that cannot fit the context is refused by its
size before it is tokenized (token ids by their count; text by its UTF-8
bytes, past :func:`prompt_byte_limit`), and long text is tokenized in a worker
thread (the tokenizer releases the GIL), so that the caller's event loop,
and every stream on it, keeps going meanwhile.

It may import the request types (:mod:`asyncstep.datatypes`), the grammar
check, the errors and the model's config; it knows nothing of the engine core,
the requests in flight or the transport (the :class:`Engine` holds those).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio
import msgspec

from asyncstep.checks import is_utf8, shown, utf8_size
from asyncstep.config import StructuredOutputsConfig
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.chat.chat_messages import (
    RESERVED_TEMPLATE_KWARGS,
    check_chat_message,
    check_chat_template,
    check_chat_template_kwargs,
    is_chat,
    json_size,
    template_message,
)
from asyncstep.engine.structured_output.grammar import check_grammar
from asyncstep.errors import InvalidRequestError, describe
from asyncstep.models.config import ModelArchConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: A prompt: text, token ids, or chat messages ({"role": ..., "content": ...}).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
#: Sequences of ints that are not token ids.
_BINARY = (bytes, bytearray, memoryview)
#: Prompt text up to this many UTF-8 bytes is tokenized on the caller's
#: thread; longer text in a worker thread.
INLINE_TOKENIZE_BYTES = 4096
#: Worker threads tokenizing at once (per front end); more wait their turn
#: (each holds memory in proportion to its text).
TOKENIZE_THREADS = 2
#: How much a tokenizer's normalizer is taken to shrink text at most (Unicode
#: composition: three 3-byte jamo make one 3-byte Hangul syllable).
NORMALIZER_SHRINK = 4


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
        #: Most UTF-8 bytes of prompt text (or chat contents) that may fit the
        #: context: more is refused untokenized (None: no tokenizer, no text).
        self.max_prompt_bytes = (
            None if tokenizer is None else prompt_byte_limit(tokenizer, max_model_len)
        )
        self._tokenize_limiter: anyio.CapacityLimiter | None = None

    async def encode_prompt(
        self,
        prompt: Prompt,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a prompt: text as ``tokenizer(text).input_ids``, chat
        messages through the chat template (the tokenizer's, or
        ``chat_template``: see :func:`~asyncstep.engine.chat.chat_messages.check_chat_template`;
        with ``tools``, the function schemas, as its ``tools``, and
        ``chat_template_kwargs`` as its variables), token ids as they are.
        A prompt that cannot fit the context is refused before it is
        tokenized (see the module doc); text of more than
        :data:`INLINE_TOKENIZE_BYTES` is tokenized in a worker thread (a
        cancelled caller waits for it to finish). Anything else, or ids the
        model cannot take, raise :class:`InvalidRequestError`."""
        work, size = self._prepare(prompt, tools, chat_template, chat_template_kwargs)
        ids = await self._in_thread(work) if size > INLINE_TOKENIZE_BYTES else work()
        self._check_prompt(ids)
        return ids

    def encode_prompt_nowait(
        self,
        prompt: Prompt,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """:meth:`encode_prompt` on the caller's thread, whatever the size
        of the text (it never yields: long text blocks the caller's event
        loop while it is tokenized)."""
        work, _ = self._prepare(prompt, tools, chat_template, chat_template_kwargs)
        ids = work()
        self._check_prompt(ids)
        return ids

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``tokenizer(text).input_ids`` of any text that may fit the context
        (the token count is not checked; empty text is taken); refused past
        :attr:`max_prompt_bytes`, and in a worker thread when long."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
        size = self._check_text(text, "prompt") if text else 0
        work = partial(self._tokenize, text, add_special_tokens=add_special_tokens)
        return await self._in_thread(work) if size > INLINE_TOKENIZE_BYTES else work()

    def check_params(self, params: object, num_prompt_tokens: int | None = None) -> SamplingParams:
        """The request's sampling parameters (the defaults for None), checked
        against the model (given its prompt's length, ``max_tokens`` against
        what the context leaves); with ``bad_words`` tokenized and the EOS ids
        that ``min_tokens`` bans filled in."""
        if params is None:
            params = SamplingParams()
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
        if num_prompt_tokens is not None:  # last: the request's own fields come first
            self.check_fits(params.max_tokens, num_prompt_tokens)
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

    def _prepare(
        self,
        prompt: Prompt,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[Callable[[], list[int]], int]:
        """Check a prompt's kind and size: the work that gives its token ids,
        and the UTF-8 bytes of text that work tokenizes (0: none)."""
        chat_options = {
            "tools": tools,
            "chat_template": chat_template,
            "chat_template_kwargs": chat_template_kwargs,
        }
        given = [name for name, value in chat_options.items() if value is not None]
        if given and (isinstance(prompt, str) or not is_chat(prompt)):
            raise InvalidRequestError(f"{given[0]} go with chat messages only")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            size = self._check_text(prompt, "prompt")
            return partial(self._encode_text, prompt), size
        if isinstance(prompt, Sequence) and not isinstance(prompt, _BINARY):
            items = list(prompt)
            if items and type(items[0]) is int and len(items) >= self.max_model_len:
                raise self._too_long(len(items))
            if items and all(isinstance(m, Mapping) for m in items):
                messages = cast(list[Mapping[str, Any]], items)
                template = check_chat_template(chat_template)
                variables, variables_size = check_chat_template_kwargs(
                    chat_template_kwargs, self._reserved_template_kwargs()
                )
                size = self._check_chat(messages, tools, variables_size)
                render = partial(self._apply_chat_template, messages, tools, template, variables)
                return render, size
            if all(type(t) is int for t in items):
                return lambda: cast(list[int], items), 0
            raise InvalidRequestError(
                "prompt must be a string, a list of token ids (ints) or a list of chat "
                f"messages, got a list holding {_kinds(items)}"
            )
        raise InvalidRequestError(
            "prompt must be a string, a list of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )

    def _check_text(self, text: str, what: str) -> int:
        """The UTF-8 bytes of text to tokenize: refused past
        :attr:`max_prompt_bytes`, or when it is not UTF-8."""
        size = self._check_size(utf8_size(text), what)
        if not is_utf8(text):
            raise InvalidRequestError(f"{what} is not valid UTF-8 (it holds a lone surrogate)")
        return size

    def _check_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        extra: int = 0,
    ) -> int:
        """Check chat messages
        (:func:`~asyncstep.engine.chat.chat_messages.check_chat_message`) and
        ``tools`` (JSON objects): the UTF-8 bytes of their contents, tool calls and
        tool schemas (and ``extra`` more: the template's variables), refused
        past :attr:`max_prompt_bytes` (the chat template renders each of
        them: the text is longer still; a template that strips whitespace
        may shorten it)."""
        size = extra + sum(check_chat_message(i, message) for i, message in enumerate(messages))
        if tools is not None:
            size += json_size(tools, "tools")
        return self._check_size(size, "the chat messages' content")

    def _check_size(self, size: int, what: str) -> int:
        limit = self.max_prompt_bytes
        if limit is not None and size > limit:
            raise InvalidRequestError(
                f"{what} has {size} bytes of text, more than can fit the model's context "
                f"(max_model_len {self.max_model_len} tokens: at most {limit} bytes)"
            )
        return size

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise self._too_long(len(ids))
        vocab = self.arch_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")

    def check_fits(self, max_tokens: int | None, num_prompt_tokens: int) -> None:
        """The prompt and ``max_tokens`` must fit the context, else
        :class:`InvalidRequestError` naming the numbers (vLLM's rule: no
        silent cut); None asks for what the context leaves. Every request
        passes here (:meth:`check_params`); the HTTP server also asks it
        first, for each prompt of a request, to refuse the request whole."""
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens {max_tokens} does not fit: the prompt has {num_prompt_tokens} "
                f"tokens and the model's context (max_model_len) is {self.max_model_len}, "
                f"which leaves {room}: ask for at most {room}"
            )

    def _too_long(self, num_tokens: int) -> InvalidRequestError:
        return InvalidRequestError(
            f"prompt has {num_tokens} tokens; the model's context (max_model_len) is "
            f"{self.max_model_len}, and at least one token must be generated"
        )

    async def _in_thread(self, work: Callable[[], list[int]]) -> list[int]:
        """``work()`` in a worker thread (at most :data:`TOKENIZE_THREADS` at once)."""
        if self._tokenize_limiter is None:
            self._tokenize_limiter = anyio.CapacityLimiter(TOKENIZE_THREADS)
        return await anyio.to_thread.run_sync(work, limiter=self._tokenize_limiter)

    def _need_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass the prompt as token ids")
        return self.tokenizer

    def _tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._need_tokenizer()
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def _encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise InvalidRequestError("prompt is empty")
        return self._tokenize(text, add_special_tokens=add_special_tokens)

    def _reserved_template_kwargs(self) -> frozenset[str]:
        """Template variables a request may not set: the renderer's own and
        the tokenizer's special tokens."""
        special = getattr(self.tokenizer, "special_tokens_map", None) or {}
        return RESERVED_TEMPLATE_KWARGS | frozenset(special)

    def _apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Checked messages and tools (:meth:`_check_chat`) through the chat
        template (the tokenizer's, or ``chat_template``), with the template
        ``variables`` (checked)."""
        tokenizer = self._need_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template")
        try:
            conversation: list[dict[str, Any]] = [template_message(m) for m in messages]
            text = tokenizer.apply_chat_template(
                conversation,
                tools=None if tools is None else [dict(t) for t in tools],
                chat_template=chat_template,
                add_generation_prompt=True,
                tokenize=False,
                **(variables or {}),
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


def _kinds(items: list[Any]) -> str:
    """The kinds of a prompt list's items, for an error message."""
    names = sorted({type(item).__name__ for item in items})
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def tokenizer_eos(tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The tokenizer's EOS token id, if it has one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset([eos]) if isinstance(eos, int) else frozenset()


def prompt_byte_limit(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """The most UTF-8 bytes of text whose tokens may fit ``max_model_len``:
    ``max_model_len`` times the most bytes of text one token stands for
    (:func:`token_byte_bound`). Strict for a tokenizer that does not
    normalize and cannot make an unknown token (byte-level BPE, or byte
    fallback): each token then stands for at most its own bytes of the
    text. Otherwise :data:`NORMALIZER_SHRINK` times more (a normalizer that
    composes characters shrinks text; one that deletes them is not bounded)."""
    strict = _is_byte_exact(tokenizer)
    return max_model_len * token_byte_bound(tokenizer) * (1 if strict else NORMALIZER_SHRINK)


def token_byte_bound(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most bytes of text one token of the vocabulary (added tokens
    too) stands for: its characters for a byte-level vocabulary (each one
    stands for a byte), else its UTF-8 bytes (at least what it stands for:
    ``▁`` for a space, ``<0x41>`` for a byte)."""
    byte_level = _byte_level_alphabet(tokenizer)

    def size(token: str) -> int:
        if byte_level and byte_level.issuperset(token):
            return len(token)
        return len(token.encode("utf-8", "surrogatepass"))

    return max((size(token) for token in tokenizer.get_vocab()), default=1)


def _backend(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The ``tokenizers`` tokenizer behind a fast tokenizer (None: a slow one)."""
    return getattr(tokenizer, "backend_tokenizer", None)


def _component(part: Any) -> dict[str, Any]:
    """A ``tokenizers`` component's settings (its type, and those of a
    sequence's parts); none when they cannot be read (the bound is then
    the looser one)."""
    try:
        settings = json.loads(part.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


def _byte_level_alphabet(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The 256 characters of a byte-level pre-tokenizer's vocabulary (none: not byte-level)."""
    backend = _backend(tokenizer)
    if backend is None:
        return frozenset()
    settings = _component(backend.pre_tokenizer)
    kinds = [settings.get("type")] + [p.get("type") for p in settings.get("pretokenizers", [])]
    if "ByteLevel" not in kinds:
        return frozenset()
    from tokenizers.pre_tokenizers import ByteLevel

    return frozenset(ByteLevel.alphabet())


def _is_byte_exact(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether each token stands for exactly its own bytes of the text: no
    normalizer, and no unknown token (byte-level, or BPE with byte fallback)."""
    backend = _backend(tokenizer)
    if backend is None or backend.normalizer is not None:
        return False
    byte_fallback = bool(getattr(backend.model, "byte_fallback", False))
    return byte_fallback or bool(_byte_level_alphabet(tokenizer))
