"""``LLM``: the blocking API (vLLM's offline ``LLM``), for code that never
writes ``async``: scripts, notebooks, batch jobs, WSGI views.

An :class:`LLM` runs an engine (:func:`open_engine`) on an event loop of its
own (Trio, in a thread of its own: AnyIO's blocking portal); each call of
its methods is a task there, and the calling thread waits for it. Calls
from many threads at once run side by side, their requests batched as any
engine's; a thread whose own event loop runs (a notebook's) calls it as any
other. An interrupt (Ctrl-C, a notebook's interrupt) while a call waits
cancels its task, which aborts its requests, and is raised once they are:
the engine keeps serving.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from asyncstep.config import EngineConfig
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.chat.chat_messages import is_chat
from asyncstep.engine.front_end.api import _preloaded, make_config, open_engine
from asyncstep.engine.front_end.engine import Engine
from asyncstep.engine.front_end.input_processor import Prompt
from asyncstep.engine.front_end.statistics import EngineStatistics
from asyncstep.engine.messages.outputs import ChatCompletion, Completion
from asyncstep.errors import EngineDeadError, InvalidRequestError
from asyncstep.progress import ProgressBar

if TYPE_CHECKING:
    from asyncstep.models.model_loader import LoadedModel

T = TypeVar("T")

#: The LLMs not closed yet: closed at the interpreter's exit, before the
#: thread pools shut down (an engine needs its own to stop); the lock is
#: held once that is arranged.
_open: weakref.WeakSet[LLM] = weakref.WeakSet()
_close_at_exit = threading.Lock()

#: Held by the call whose progress bar shows (one at a time: bars of calls
#: from several threads would fight over the terminal).
_one_bar = threading.Lock()


class LLM:
    """A model to generate with from blocking code (vLLM's ``LLM``)::

        with asyncstep.LLM() as llm:  # embedded SmolLM2-135M-Instruct
            params = asyncstep.SamplingParams(temperature=0, max_tokens=64)
            for out in llm.generate(["The capital of France is", "Hi"], params):
                print(out.text)

    ``model``, ``config`` and ``options`` are :func:`open_engine`'s (the
    options: :func:`make_config`'s keywords, checked here before anything
    starts). The engine serves until :meth:`close` (or the ``with`` block
    ends). Its methods may be called from any thread, from many at once.
    """

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        *,
        config: EngineConfig | None = None,
        **options: object,
    ) -> None:
        if config is None and _preloaded(model) is None:
            config = make_config(model, **options)  # type: ignore[arg-type]
            model, options = None, {}
        self._closed = False
        stack = contextlib.ExitStack()
        with stack, ProgressBar("loading weights") as loading:
            self._portal: BlockingPortal = stack.enter_context(
                start_blocking_portal("trio", name="asyncstep-llm")
            )
            opened = open_engine(model, config=config, progress=loading.update, **options)
            self._engine: Engine = stack.enter_context(
                self._portal.wrap_async_context_manager(opened)
            )
            #: Stops the engine, then its loop: at close(), or once the LLM is
            #: garbage, or at the interpreter's exit (while its thread runs).
            self._stop = weakref.finalize(self, stack.pop_all().close)
        _close_at_exit_once()
        _open.add(self)

    # -- public API -------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = True,
    ) -> list[Completion]:
        """Generate a completion of each prompt, all at once (batched as the
        scheduler fits them); returned in the prompts' order.

        ``prompts``: one prompt (text, token ids, or chat messages) or a list
        of them; ``sampling_params``: one for all, or a list of one per
        prompt. ``progress``: a progress bar on stderr (on a terminal). A
        request that fails raises its error, and aborts the others.
        """
        batch = _prompt_list(prompts)
        params = _params_list(sampling_params, len(batch))
        calls = [
            functools.partial(self._engine.generate, prompt, each)
            for prompt, each in zip(batch, params, strict=True)
        ]
        return self._run_all(calls, progress, "generating")

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_call_parser: str | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        progress: bool = True,
    ) -> list[ChatCompletion]:
        """Answer each chat, all at once; returned in their order (a list,
        one chat's too, as vLLM's ``LLM.chat``).

        ``messages``: one chat (a list of messages) or a list of chats; the
        other arguments are :meth:`Engine.chat`'s, for every chat
        (``sampling_params``: one, or one per chat), and ``progress`` as
        for :meth:`generate`.
        """
        chats = _chat_list(messages)
        params = _params_list(sampling_params, len(chats))
        chat = functools.partial(
            self._engine.chat,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            tool_call_parser=tool_call_parser,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        calls = [
            functools.partial(chat, each_chat, each)
            for each_chat, each in zip(chats, params, strict=True)
        ]
        return self._run_all(calls, progress, "chatting")

    def statistics(self) -> EngineStatistics:
        """The engine's counters (:meth:`Engine.statistics`)."""
        self._check_open()
        return self._engine.statistics()

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration, its device defaults resolved."""
        return self._engine.config

    def close(self) -> None:
        """Stop the engine (requests still running fail with
        :class:`EngineDeadError`) and its loop's thread; once stopped, a
        no-op. If the engine had stopped on an error, raises it as
        :class:`EngineDeadError`."""
        self._closed = True
        self._stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- calls on the engine's loop -----------------------------------------

    def _run_all(
        self, calls: Sequence[Callable[[], Awaitable[T]]], progress: bool, label: str
    ) -> list[T]:
        with _progress_bar(progress, label) as bar:
            bar.update(0, len(calls))
            return self._call(functools.partial(_gather, calls, bar.update))

    def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()`` on the engine's loop, waited for here. An interrupt
        while it waits cancels it there (its requests abort) and is raised
        once it has ended."""
        self._check_open()
        ended = threading.Event()

        async def run() -> T:
            try:
                return await fn()
            finally:
                ended.set()

        future: Future[T] | None = None
        try:
            # A Ctrl-C while the task is spawned comes once its future is
            # here to cancel (the task may already run: it would run on).
            with _interrupt_after():
                future = self._portal.start_task_soon(run)
            return future.result()
        except BaseException:
            if future is not None and future.cancel():  # interrupted while it runs
                ended.wait()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("this LLM is closed")


@contextlib.contextmanager
def _interrupt_after() -> Iterator[None]:
    """On the main thread, a SIGINT during the block is handed to the
    handler that was there once the block ends (Python's raises
    KeyboardInterrupt); elsewhere, or where the handler cannot be set,
    nothing changes."""
    caught: list[int] = []
    if signal.getsignal(signal.SIGINT) is None:  # set outside Python: not ours to swap
        yield
        return
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except ValueError:  # not the main thread of the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(signal.SIGINT, None)
        elif caught and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


def _close_at_exit_once() -> None:
    """Have the LLMs still open closed at the interpreter's exit: while
    their threads run, and before ``concurrent.futures`` shuts the thread
    pools (``threading._register_atexit``, its hook; plain ``atexit`` runs
    after that)."""
    if _close_at_exit.acquire(blocking=False):
        threading._register_atexit(_close_all)  # type: ignore[attr-defined]


def _close_all() -> None:
    for llm in list(_open):
        with contextlib.suppress(Exception):  # a dead engine failed its callers already
            llm.close()


async def _gather(
    calls: Sequence[Callable[[], Awaitable[T]]], done: Callable[[int, int], None]
) -> list[T]:
    """Every call at once; their results in order (``done(count, total)``
    after each). The first to fail cancels the others and is raised."""
    results: dict[int, T] = {}

    async def one(i: int) -> None:
        results[i] = await calls[i]()
        done(len(results), len(calls))

    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(calls)):
                tg.start_soon(one, i)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:  # the first failure (the others were cancelled)
            error = group.exceptions[0]
            raise error from error.__cause__
        raise
    return [results[i] for i in range(len(calls))]


@contextlib.contextmanager
def _progress_bar(shown: bool, label: str) -> Iterator[ProgressBar]:
    """A progress bar (on a terminal only), or a silent one: one call's at a time."""
    if not (shown and _one_bar.acquire(blocking=False)):
        yield ProgressBar(label)  # never entered: silent
        return
    try:
        with ProgressBar(label) as bar:
            yield bar
    finally:
        _one_bar.release()


def _prompt_list(prompts: object) -> list[Prompt]:
    """``generate``'s prompts as a list: text, token ids and chat messages
    are one prompt; any other sequence holds prompts."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or is_chat(prompts):
        return [prompts]  # type: ignore[list-item]
    if prompts and all(isinstance(token, int) for token in prompts):
        return [prompts]
    return list(prompts)


def _chat_list(messages: object) -> list[Sequence[Mapping[str, Any]]]:
    """``chat``'s chats as a list: a list of messages is one chat (anything
    but a list of chats is taken as one, for the engine to refuse)."""
    if isinstance(messages, str) or not isinstance(messages, Sequence) or is_chat(messages):
        return [messages]  # type: ignore[list-item]
    return list(messages)


def _params_list(params: object, count: int) -> list[SamplingParams | None]:
    """One sampling parameters for each of ``count`` requests."""
    if params is None or isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise InvalidRequestError(
            f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}"
        )
    if len(params) != count:
        raise InvalidRequestError(
            f"sampling_params lists {len(params)} and there are {count} prompts: give one for "
            "all, or one per prompt"
        )
    return list(params)
