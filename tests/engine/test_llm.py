"""The blocking API (``asyncstep.LLM``) on tiny models: many prompts in one
call, chats, calls from many threads at once (batched), Ctrl-C while a call
waits, closing; and docs/python-api.md's notebook in a real Jupyter kernel,
and its WSGI app served to eight threads at once."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import subprocess
import sys
import threading
import urllib.request
import wsgiref.simple_server
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_docs import ROOT, blocks

import asyncstep
from asyncstep import EngineDeadError, InvalidRequestError, SamplingParams
from asyncstep.logging import configure_logging
from asyncstep.models.model_loader import LoadedModel

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42], [5, 6], [7, 7, 7, 7]]
#: Runs to the end of the context unless aborted.
ENDLESS = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)


@pytest.fixture
def llm(tiny_model: LoadedModel) -> Iterator[asyncstep.LLM]:
    with asyncstep.LLM(tiny_model) as opened:
        yield opened


def gate_forward(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch, opened: threading.Event | None = None
) -> threading.Event:
    """An event set when the model's forward is first called (a step runs);
    that call waits for ``opened`` first, if given."""
    first = threading.Event()
    forward = model.model.forward

    def gated(*args: Any, **kwargs: Any) -> Any:
        if not first.is_set():
            first.set()
            if opened is not None:
                assert opened.wait(timeout=120), "the gate was never opened"
        return forward(*args, **kwargs)

    monkeypatch.setattr(model.model, "forward", gated)
    return first


def test_generate_takes_many_prompts_and_answers_in_their_order(llm: asyncstep.LLM) -> None:
    outs = llm.generate(PROMPTS, GREEDY)
    assert [out.prompt_token_ids for out in outs] == PROMPTS
    assert all(len(out.token_ids) == 8 and out.finish_reason == "length" for out in outs)
    # One prompt (token ids here) is a list of one; params may be one per prompt.
    (one,) = llm.generate(PROMPTS[1], GREEDY)
    assert one.token_ids == outs[1].token_ids
    each = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3)]
    assert [len(out.token_ids) for out in llm.generate(PROMPTS[:3], each)] == [1, 2, 3]
    assert llm.generate([], GREEDY) == []

    # From a thread whose own event loop runs (a notebook's is so): the same.
    async def from_a_running_loop() -> list[asyncstep.Completion]:
        return llm.generate(PROMPTS, GREEDY, progress=False)

    assert [out.token_ids for out in asyncio.run(from_a_running_loop())] == [
        out.token_ids for out in outs
    ]
    assert llm.statistics().num_finished_reqs == 5 + 1 + 3 + 5


def test_a_bad_request_raises_its_error_and_aborts_the_others(llm: asyncstep.LLM) -> None:
    with pytest.raises(InvalidRequestError, match="1 and there are 2 prompts"):
        llm.generate(PROMPTS[:2], [GREEDY])
    with pytest.raises(InvalidRequestError, match=r"prompt token ids must be in \[0, "):
        llm.generate([PROMPTS[0], [1, 2, 10**6]], [ENDLESS, GREEDY])
    with pytest.raises(InvalidRequestError, match="sampling_params must be"):
        llm.generate(PROMPTS[0], "greedy")  # type: ignore[arg-type]
    # Nothing was left running (the endless request was aborted), and it serves.
    (out,) = llm.generate(PROMPTS[2], GREEDY)
    assert len(out.token_ids) == 8
    stats = llm.statistics()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.num_finished_reqs == 1


def test_chat_takes_one_chat_or_many_and_the_engines_chat_options(tiny_hf_dir: Path) -> None:
    with asyncstep.LLM(tiny_hf_dir, device="cpu", dtype="float32", engine_process=False) as llm:
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        other = [{"role": "user", "content": "Hello"}]
        (reply,) = llm.chat(ask, GREEDY)
        assert isinstance(reply, asyncstep.ChatCompletion) and reply.finish_reason == "length"
        assert reply.content == reply.outputs[0].text and len(reply.outputs[0].token_ids) == 8
        replies = llm.chat([ask, other, ask], GREEDY)
        assert [r.outputs[0].token_ids for r in replies][::2] == [reply.outputs[0].token_ids] * 2
        assert replies[1].prompt_token_ids != reply.prompt_token_ids
        # The chat options reach the engine: a template of one's own.
        bare = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        (plain,) = llm.chat(ask, GREEDY, chat_template=bare)
        (text,) = llm.generate("What is the capital of France?", GREEDY)
        assert plain.prompt_token_ids == text.prompt_token_ids
        with pytest.raises(InvalidRequestError, match="messages must be"):
            llm.chat("hello", GREEDY)  # type: ignore[arg-type]


def test_eight_threads_at_once_get_their_own_answers_in_one_batch(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log_file = tmp_path / "log.jsonl"
    configure_logging("warning", log_file)
    try:
        with asyncstep.LLM(tiny_model, max_num_seqs=16) as llm:
            alone = [out.token_ids for out in llm.generate(PROMPTS + PROMPTS[:3], GREEDY)]
            first = llm.statistics().num_steps
            # The first step waits until every thread's request is in: the
            # next takes them all (requests queue while a step runs).
            all_in = threading.Event()
            gate_forward(tiny_model, monkeypatch, opened=all_in)
            count_requests(monkeypatch, 8, all_in)
            answers: dict[int, list[int]] = {}

            def ask(i: int) -> None:
                (out,) = llm.generate((PROMPTS + PROMPTS[:3])[i], GREEDY, progress=False)
                answers[i] = out.token_ids

            run_threads([functools.partial(ask, i) for i in range(8)])
    finally:
        configure_logging("warning", None, console=False)
    assert [answers[i] for i in range(8)] == alone
    events = [json.loads(line) for line in log_file.read_text().splitlines()]
    batches = [e["num_reqs"] for e in events if e["event"] == "step" and e["step"] >= first]
    assert max(batches) == 8


def count_requests(monkeypatch: pytest.MonkeyPatch, count: int, done: threading.Event) -> None:
    """``done`` is set once ``count`` requests have reached the engine."""
    add_request = asyncstep.Engine._add_request
    added = 0

    def counted(self: asyncstep.Engine, *args: Any, **kwargs: Any) -> Any:
        nonlocal added
        group = add_request(self, *args, **kwargs)
        added += 1
        if added == count:
            done.set()
        return group

    monkeypatch.setattr(asyncstep.Engine, "_add_request", counted)


def run_threads(targets: list[Callable[[], None]]) -> None:
    """Run each target in a thread of its own, at once; raise the first error."""
    errors: list[BaseException] = []

    def run(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
        assert not thread.is_alive()
    if errors:
        raise errors[0]


def interrupt_endless_call(llm: asyncstep.LLM) -> None:
    """``llm.generate`` of three endless requests, which a Ctrl-C the caller
    arranged interrupts: KeyboardInterrupt, with Python's own SIGINT handler
    for the call (also where SIGINT came ignored: a background job)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[:3], ENDLESS)  # thousands of steps, were it not aborted
    finally:
        signal.signal(signal.SIGINT, previous)


def assert_serves_on(llm: asyncstep.LLM) -> None:
    """The engine serves a short call, and nothing else is left running."""
    (out,) = llm.generate(PROMPTS[0], GREEDY)
    assert len(out.token_ids) == 8
    stats = llm.statistics()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.num_finished_reqs == 1  # the short one: the endless ones were aborted


def test_ctrl_c_aborts_what_the_call_waits_for_and_the_engine_serves_on(
    llm: asyncstep.LLM, tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert threading.current_thread() is threading.main_thread()
    stepping = gate_forward(tiny_model, monkeypatch)

    def interrupt() -> None:  # Ctrl-C, delivered to the waiting main thread
        assert stepping.wait(timeout=120)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt)
    interrupter.start()
    interrupt_endless_call(llm)
    interrupter.join()
    assert_serves_on(llm)


def test_ctrl_c_while_the_call_starts_still_aborts_it(
    llm: asyncstep.LLM, tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C as the call's task is spawned (the task already stepping, its
    future not yet returned): the call is cancelled all the same."""
    stepping = gate_forward(tiny_model, monkeypatch)
    spawn = llm._portal.start_task_soon

    def spawn_then_interrupt(*args: Any) -> Any:
        future = spawn(*args)
        assert stepping.wait(timeout=120)
        signal.raise_signal(signal.SIGINT)  # handled before the future is returned
        return future

    monkeypatch.setattr(llm._portal, "start_task_soon", spawn_then_interrupt)
    interrupt_endless_call(llm)
    monkeypatch.undo()
    assert_serves_on(llm)


def test_a_closed_llm_says_so(tiny_model: LoadedModel) -> None:
    llm = asyncstep.LLM(tiny_model)
    assert llm.config.model.max_model_len
    llm.close()
    llm.close()  # a no-op
    with pytest.raises(EngineDeadError, match="this LLM is closed"):
        llm.generate(PROMPTS[0], GREEDY)
    assert not [t for t in threading.enumerate() if t.name == "asyncstep-llm"]


def test_a_bad_option_fails_before_anything_starts() -> None:
    with pytest.raises(asyncstep.ConfigError, match="block_sise"):
        asyncstep.LLM("tiny-llama", load_format="dummy", block_sise=16)
    assert not [t for t in threading.enumerate() if t.name == "asyncstep-llm"]


def test_an_llm_left_open_is_closed_at_exit() -> None:
    """A script that never closes its LLMs (in this process, and with the
    engine core in its own) ends, cleanly, when it ends."""
    script = (
        "import asyncstep\n"
        "options = dict(load_format='dummy', max_model_len=64)\n"
        "alone = asyncstep.LLM('tiny-llama', engine_process=False, **options)\n"
        "core = asyncstep.LLM('tiny-llama', **options)\n"
        "params = asyncstep.SamplingParams(max_tokens=2, ignore_eos=True)\n"
        "print([len(llm.generate([1, 2], params)[0].token_ids) for llm in (alone, core)])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and done.stdout == "[2, 2]\n", done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# ---------------------------------------------------------------------------
# docs/python-api.md's notebook and WSGI app, for real


def docs_example(marker: str) -> str:
    """The Python example of docs/python-api.md that holds ``marker``."""
    page = ROOT / "docs" / "python-api.md"
    (code,) = [code for lang, code in blocks(page) if lang == "python" and marker in code]
    return code


def test_the_docs_notebook_runs_in_a_jupyter_kernel(tiny_hf_dir: Path, tmp_path: Path) -> None:
    """Its cells in a kernel whose asyncio loop runs while they do (no
    nest_asyncio), the model the tiny checkpoint (with its engine core in a
    process of its own, the default)."""
    import nbclient
    import nbformat

    cells = [cell.strip() for cell in docs_example("# %%").split("# %%") if cell.strip()]
    assert len(cells) == 3 and "LLM()" in cells[0]
    assert ".generate(" in cells[1] and ".chat(" in cells[2]
    tiny = (  # the docs' model, as tests/test_docs.py's: the tiny checkpoint
        "import asyncstep, functools\n"
        f"asyncstep.LLM = functools.partial(asyncstep.LLM, {str(tiny_hf_dir)!r})"
    )
    check = (
        "import asyncio, sys\n"
        "asyncio.get_running_loop()  # (a cell runs inside the kernel's loop)\n"
        "assert len(outs) == 2 and all(out.token_ids for out in outs)\n"
        "assert reply.outputs[0].token_ids and reply.content == reply.outputs[0].text\n"
        "assert not any(name.startswith('nest_asyncio') for name in sys.modules)\n"
        "llm.close()\n"
        "print('checked')"
    )
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in [tiny, *cells, check]]
    )
    client = nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute()
    printed = [
        "".join(output.get("text", "") for output in cell.outputs) for cell in notebook.cells
    ]
    assert printed[2].startswith("[") and printed[3]  # the texts, and the reply
    assert printed[-1] == "checked\n"


def test_the_docs_wsgi_app_serves_eight_threads_at_once(tiny_hf_dir: Path) -> None:
    namespace: dict[str, Any] = {}
    real = asyncstep.LLM

    def tiny(model: object = None, **options: object) -> asyncstep.LLM:
        return real(tiny_hf_dir, engine_process=False, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(asyncstep, "LLM", tiny)
        exec(docs_example("def app(environ"), namespace)
    llm: asyncstep.LLM = namespace["llm"]
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(8)]
    try:
        alone = [out.text for out in llm.generate(prompts, namespace["params"])]
        server = wsgiref.simple_server.make_server(
            "127.0.0.1", 0, namespace["app"], namespace["ThreadingWSGIServer"]
        )
        serving = threading.Thread(target=server.serve_forever)
        serving.start()
        try:
            url = f"http://127.0.0.1:{server.server_port}/"
            answers: dict[int, str] = {}

            def ask(i: int) -> None:
                with urllib.request.urlopen(url, prompts[i].encode(), timeout=120) as response:
                    answers[i] = response.read().decode()

            run_threads([functools.partial(ask, i) for i in range(8)])
        finally:
            server.shutdown()
            serving.join()
            server.server_close()
    finally:
        llm.close()
    assert [answers[i] for i in range(8)] == alone
