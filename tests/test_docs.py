"""Every command in the README and ``docs/`` is run here, or checked, cheaply.

The convention, for whoever writes the docs:

* A command is a line that starts with ``$ `` inside a fenced ```` ```console ````
  block (a line ending with ``\\`` goes on on the next one). Other lines of
  the block (``# comments``, output) are not run. Indented blocks are
  synopses (``asyncstep generate [PROMPT ...]``), not commands.
* A console block whose first line is ``# (not run by tests/test_docs.py:
  REASON)`` is not run: REASON is one of :data:`REASONS`, and its commands
  are exactly :data:`NOT_RUN` (kept small and explicit).
* Every ```` ```python ```` block is executed: a page's blocks in order, in
  one namespace (an example may use what the one before it built).
* A command quoted inline (```asyncstep ...``, ```python3 benchmarks/...```,
  ```python3 -m asyncstep.bench.NAME ...```) is checked: every flag it names
  exists.

How each kind runs here:

* ``asyncstep ... --help``: in full.
* ``asyncstep generate``: in this process (``asyncstep.cli.main``), with
  ``--max-tokens 8`` unless the command gives its own, and the engine core
  in this process too (``--no-engine-process``) unless it writes
  ``--log-json`` files (a trace reads the core's). The README's main job
  (:data:`MAIN_JOB`) is run on the embedded model by
  ``tests/test_cli.py::test_main_job_answers_paris``; every other command
  that names no model, or names the placeholder ``/path/to/hf-checkpoint``,
  runs on the tests' tiny random checkpoint with
  SmolLM2's tokenizer (``tiny_hf_dir``): it loads in a second.
* ``asyncstep serve``: started in a child on any free port (``--port 0``),
  asked for ``/health``, stopped with SIGTERM (exit 0). The plain
  ``asyncstep serve`` (the embedded model) stays up for the pages' ``curl``
  commands and Python clients, which reach it through its URL in place of
  ``http://127.0.0.1:8000``.
* ``asyncstep trace``: in the page's working directory, after the commands
  before it (which wrote its logs).
* ``asyncstep bench MODE ...`` at full size takes minutes or a GPU: every
  flag it names must be one its mode takes. The small runs are
  ``tests/bench/test_bench.py``'s (marked so, and checked to be the same).
* ``python3 benchmarks/...``, ``bash benchmarks/...`` and ``python3 -m
  asyncstep.bench.NAME`` (a maintained measurement): a benchmark takes
  minutes or a GPU; the script or module must exist and take every flag
  given (its ``add_argument`` strings, and the engine's flags where it
  passes unknown ones on).
* Python examples: ``asyncstep.open_engine`` and ``asyncstep.LLM`` open the
  tiny checkpoint when given no model, with the engine core in this process.
  The ``engine.chat`` example forces a tool call, which needs a model that
  answers: ``tests/engine/test_chat_api.py`` runs it on the embedded model
  (checked here). The notebook's cells (``# %%``) and the WSGI app also run
  for real in ``tests/engine/test_llm.py``: in a Jupyter kernel, and served
  to eight threads at once.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from processes import serving_url

import asyncstep
from asyncstep.cli import build_parser, main
from asyncstep.logging import configure_logging

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Why a command may be left unrun.
REASONS = {
    "needs several machines",
    "needs a GPU",
    "takes minutes",
    ".ci/run runs it",
    "tests/bench/test_bench.py runs them",
}
#: Every command left unrun, and why.
NOT_RUN = {
    "bash scripts/setup.sh": ".ci/run runs it",
    "python3 -m pytest -q -n 2 --dist loadfile": ".ci/run runs it",
    'export ASYNCSTEP_SECRET=$(python -c "import secrets; print(secrets.token_hex(32))")': (
        "needs several machines"
    ),
    "asyncstep generate --tp 2 --pp 2 --external-ranks --listen 0.0.0.0:5555"
    ' --model /shared/model "Hello"': "needs several machines",
    "torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE --master-addr A"
    " --master-port 29500 -m asyncstep.rank --engine A:5555": "needs several machines",
    "python3 tests/faults.py aborts --model $(python3 -c 'from asyncstep.models.loader"
    " import default_model_path as p; print(p())') --aborts 200": "takes minutes",
}
MAIN_JOB = 'asyncstep generate "What is the capital of France?"'
CHAT_EXAMPLE = "engine.chat("
#: The page whose Python examples need a Ray cluster: tests/integrations/test_ray.py runs them.
RAY_PAGE = "docs/ray.md"
PLACEHOLDER = "/path/to/hf-checkpoint"
DOCS_URL = "http://127.0.0.1:8000"
MARK = re.compile(r"# \(not run by tests/test_docs\.py: (.+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(
    r"`((?:asyncstep|python3? benchmarks/|bash benchmarks/|python3? -m asyncstep\.bench\.)[^`]*)`"
)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class Command:
    page: str
    text: str
    reason: str | None  # not run, and why

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def commands(page: Path) -> list[Command]:
    found = []
    for lang, body in blocks(page):
        if lang != "console":
            continue
        lines = body.splitlines()
        mark = MARK.fullmatch(lines[0]) if lines else None
        reason = mark.group(1) if mark else None
        pending: str | None = None
        for line in lines:
            if pending is not None:  # a continued command
                pending += " " + line.strip()
            elif line.startswith("$ "):
                pending = line[2:].strip()
            else:
                continue
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip()
                continue
            found.append(Command(name(page), pending, reason))
            pending = None
    return found


def all_commands() -> list[Command]:
    return [command for page in PAGES for command in commands(page)]


def run_in_order(kind: str) -> dict[str, list[Command]]:
    """Each page's runnable commands of a kind (the program and subcommand)."""
    pages: dict[str, list[Command]] = {}
    for command in all_commands():
        runs = command.reason is None and command.argv[-1] != "--help"
        if runs and " ".join(command.argv[:2]).startswith(kind):
            pages.setdefault(command.page, []).append(command)
    return pages


def is_client_page(page: Path) -> bool:
    """A page whose Python examples are clients of a server (run in
    :func:`test_serve_commands_and_their_clients`)."""
    return any(lang == "python" and DOCS_URL in code for lang, code in blocks(page))


def outside_fences(page: Path) -> str:
    return FENCE.sub("", page.read_text())


# -- the convention ------------------------------------------------------------


def test_the_convention_holds() -> None:
    """Commands are marked as the docstring says; the unrun ones are exactly
    those listed, each for a reason stated on its block."""
    for page in PAGES:
        for lang, body in blocks(page):
            assert lang in {"console", "python", "text"}, (name(page), lang)
            if lang == "console":
                first = body.splitlines()[0]
                assert first.startswith("$ ") or MARK.fullmatch(first), (name(page), first)
        assert not re.search(r"^\$ ", outside_fences(page), re.M), f"{name(page)}: $ outside"
    unrun = {c.text: c.reason for c in all_commands() if c.reason is not None}
    assert set(unrun.values()) <= REASONS
    by_test_bench = {
        text for text, reason in unrun.items() if reason == "tests/bench/test_bench.py runs them"
    }
    assert {t: r for t, r in unrun.items() if t not in by_test_bench} == NOT_RUN
    from test_bench import readme_commands

    assert by_test_bench == {shlex.join(argv) for argv in readme_commands().values()}


def benchmark_script(text: str) -> Path | None:
    """The file a benchmark command runs: ``python3 benchmarks/X.py``'s or
    ``bash benchmarks/X.sh``'s script, ``python3 -m asyncstep.bench.X``'s
    module; None for another command."""
    words = text.split()
    if len(words) > 1 and words[1].startswith("benchmarks/"):
        return ROOT / words[1]
    if len(words) > 2 and words[1] == "-m" and words[2].startswith("asyncstep.bench."):
        return ROOT / (words[2].replace(".", "/") + ".py")
    return None


def kind(command: Command) -> str | None:
    """How a command is run or checked here (see the module's docstring)."""
    argv = command.argv
    if command.reason is not None:
        return "not run"
    if argv[0] == "asyncstep" and argv[-1] == "--help":
        return "help"
    if argv[0] == "asyncstep" and argv[1] in {"generate", "serve", "trace"}:
        return argv[1]
    if argv[0] == "curl":
        return "curl"
    if benchmark_script(command.text) is not None:
        return "benchmark"
    if argv[:2] == ["asyncstep", "bench"]:
        return "bench"
    return None


def test_every_command_is_run_or_checked() -> None:
    assert [c for c in all_commands() if kind(c) is None] == []


def test_links_between_pages_lead_somewhere() -> None:
    def slug(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?(?:#([\w-]+))?\)", page.read_text()):
            path = (page.parent / target) if target else page
            assert path.exists(), (name(page), target)
            if anchor:
                headings = re.findall(r"^#+ (.+)$", outside_fences(path), re.M)
                assert anchor in {slug(h) for h in headings}, (name(page), target, anchor)


def test_the_readme_stays_short_and_ci_runs_its_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in ("bash scripts/setup.sh", "python3 -m pytest -q -n 2 --dist loadfile"):
        assert f"$ {command}" in readme.splitlines()
        assert command in ci


# -- checked, not run ------------------------------------------------------------


@functools.cache
def engine_flags(subcommand: str = "generate") -> set[str]:
    parser = build_parser()._subparsers._group_actions[0].choices[subcommand]  # type: ignore[union-attr,index]
    return {flag for action in parser._actions for flag in action.option_strings}


def script_flags(script: Path) -> set[str]:
    """The flags a benchmark script takes: its ``add_argument`` strings (of
    every module beside it, of ``benchmarks/`` or of ``asyncstep.bench`` it
    imports), and the engine's where it passes unknown ones on."""
    flags: set[str] = set()
    sources = [script]
    tree = ast.parse(script.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            for module in modules:
                last = module.split(".")[-1]
                for local in (
                    script.parent / f"{last}.py",
                    ROOT / "benchmarks" / f"{last}.py",
                    ROOT / (module.replace(".", "/") + ".py"),
                ):
                    if local.exists() and local != script and local not in sources:
                        sources.append(local)
    for source in sources:
        text = source.read_text()
        found = set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", text))
        if "BooleanOptionalAction" in text:  # --x takes --no-x too
            found |= {f"--no-{flag[2:]}" for flag in found}
        flags |= found
        if "parse_known_args" in text or "engine_flags" in text or "add_engine" in text:
            flags |= engine_flags()
    return flags


def benchmark_commands() -> list[tuple[str, str]]:
    found = [(c.page, c.text) for c in all_commands() if benchmark_script(c.text) is not None]
    for page in PAGES:
        for text in INLINE.findall(outside_fences(page)):
            if benchmark_script(text) is not None:
                found.append((name(page), text))
    return found


def test_every_benchmark_command_names_a_script_and_flags_it_takes() -> None:
    found = benchmark_commands()
    assert len(found) >= 5
    for page, text in found:
        script = benchmark_script(text)
        assert script is not None and script.exists(), (page, text)
        if script.suffix == ".py":
            unknown = set(FLAG.findall(text)) - script_flags(script)
            assert unknown == set(), (page, text)


def bench_flags(mode: str) -> set[str]:
    from asyncstep.bench.args import CliFlags, _subparser
    from asyncstep.bench.args import build_parser as bench_parser
    from asyncstep.cli import (
        add_engine_flag,
        add_engine_flags,
        config_from_args,
        server_config_from_args,
    )

    cli = CliFlags(add_engine_flags, add_engine_flag, config_from_args, server_config_from_args)
    parser = _subparser(bench_parser(cli), mode)
    return {flag for action in parser._actions for flag in action.option_strings}


def test_every_bench_command_names_flags_its_mode_takes() -> None:
    """``asyncstep bench`` runs at full size take minutes or a GPU: checked."""
    found = [c for c in all_commands() if kind(c) == "bench"]
    assert found
    for command in found:
        unknown = set(FLAG.findall(command.text)) - bench_flags(command.argv[2])
        assert unknown == set(), command


def test_every_asyncstep_command_quoted_inline_names_flags_that_exist() -> None:
    for page in PAGES:
        for text in INLINE.findall(outside_fences(page)):
            words = text.split()
            if words[0] != "asyncstep" or len(words) < 2 or words[1].startswith("-"):
                continue
            assert words[1] in {"generate", "serve", "trace", "bench"}, (name(page), text)
            flags = set(FLAG.findall(text)) - {"--help"}
            if words[1] == "bench":
                if len(words) > 2 and words[2] in {"latency", "throughput", "serve", "startup"}:
                    assert flags <= bench_flags(words[2]), (name(page), text)
            else:
                assert flags <= engine_flags(words[1]), (name(page), text)


# -- run ----------------------------------------------------------------------------


def test_help_commands(capsys: pytest.CaptureFixture[str]) -> None:
    helps = [c for c in all_commands() if c.argv[-1] == "--help" and c.argv[0] == "asyncstep"]
    assert len(helps) >= 4
    for command in helps:
        with pytest.raises(SystemExit) as exited:
            main(command.argv[1:])
        assert exited.value.code == 0, command
        assert "usage: asyncstep" in capsys.readouterr().out, command


def local_argv(command: Command, tiny: Path) -> list[str]:
    """The command's arguments as run here (see the module's docstring)."""
    argv = [str(tiny) if word == PLACEHOLDER else word for word in command.argv[1:]]
    if argv[0] == "generate":
        argv[1:1] = ["--max-tokens", "8"]
        if "--log-json" not in argv:  # (whose ``.core`` file a trace reads)
            argv[1:1] = ["--no-engine-process"]
    if "--model" not in argv and argv[0] in {"generate", "serve"}:
        argv[1:1] = ["--model", str(tiny)]
    return argv


def test_generate_and_trace_commands(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_hf_dir: Path,
) -> None:
    pages: dict[str, list[Command]] = {}
    for kind in ("asyncstep generate", "asyncstep trace"):
        for page, found in run_in_order(kind).items():
            pages.setdefault(page, []).extend(found)
    try:
        ran = run_pages(pages, tmp_path, tiny_hf_dir, capsys, monkeypatch)
    finally:  # the commands' --log-json set-up must not outlive them
        configure_logging("warning", None, console=False)
    assert ran >= 5


def run_pages(
    pages: dict[str, list[Command]],
    tmp_path: Path,
    tiny_hf_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> int:
    ran = 0
    for page, found in pages.items():
        cwd = tmp_path / page.replace("/", "_")
        cwd.mkdir()
        monkeypatch.chdir(cwd)
        order = [c for c in all_commands() if c in found]  # the page's order
        for command in order:
            if command.text == MAIN_JOB:
                continue  # tests/test_cli.py runs it
            argv = local_argv(command, tiny_hf_dir)
            argv = [w for word in argv for w in (sorted(glob.glob(word)) or [word])]
            code = main(argv)
            out, err = capsys.readouterr()
            assert code == 0, (command, err)
            assert out, command
            ran += 1
    return ran


def test_the_main_job_is_run_on_the_embedded_model() -> None:
    """The README's main job loads the embedded model, the costliest load of
    these commands: tests/test_cli.py runs it (and finds Paris in the answer)."""
    assert any(c.text == MAIN_JOB and c.page == "README.md" for c in all_commands())
    argv = ", ".join(f'"{word}"' for word in shlex.split(MAIN_JOB)[1:])
    source = (ROOT / "tests" / "test_cli.py").read_text()
    assert "def test_main_job_answers_paris(" in source and f"run(capsys, {argv}," in source


@contextlib.contextmanager
def serving(*argvs: list[str]) -> Iterator[list[str]]:
    """``python -m asyncstep ARGS --port 0`` for each ARGS, started at once,
    while the block runs: their URLs, each answering ``/health``; each must
    then stop on SIGTERM with status 0."""
    started = [
        subprocess.Popen(
            [sys.executable, "-m", "asyncstep", *argv, "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    outputs: list[list[str]] = [[] for _ in started]
    try:
        urls = [serving_url(p, out, timeout_s=300) for p, out in zip(started, outputs, strict=True)]
        for url in urls:
            with urllib.request.urlopen(f"{url}/health", timeout=30) as health:
                assert health.status == 200
        yield urls
        for proc in started:
            proc.send_signal(signal.SIGTERM)
        for proc, output in zip(started, outputs, strict=True):
            assert proc.wait(timeout=60) == 0, "".join(output)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_serve_commands_and_their_clients(tiny_hf_dir: Path) -> None:
    serves = {c.text: c for cs in run_in_order("asyncstep serve").values() for c in cs}
    clients = [c for c in all_commands() if c.reason is None and c.argv[0] == "curl"]
    examples = [
        (name(page), code)
        for page in PAGES
        for lang, code in blocks(page)
        if lang == "python" and is_client_page(page)
    ]
    assert "asyncstep serve" in serves and clients and examples
    others = []
    for text, command in serves.items():
        if text != "asyncstep serve":
            argv = local_argv(command, tiny_hf_dir)
            if "--port" in argv:  # its port: any free one here
                at = argv.index("--port")
                del argv[at : at + 2]
            others.append(argv)
    assert others
    with serving(["serve"], *others) as (url, *_):  # the first: the embedded model
        for command in clients:
            argv = [word.replace(DOCS_URL, url) for word in command.argv]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and '"choices"' in done.stdout, (command, done)
        namespaces: dict[str, dict[str, object]] = {}
        for page, code in examples:
            exec(code.replace(DOCS_URL, url), namespaces.setdefault(page, {}))


def test_python_examples(monkeypatch: pytest.MonkeyPatch, tiny_hf_dir: Path) -> None:
    opened: list[object] = []
    llms: list[asyncstep.LLM] = []
    real, real_llm = asyncstep.open_engine, asyncstep.LLM

    def open_engine(model: object = None, **options: object) -> object:
        opened.append(model)
        options.setdefault("engine_process", False)
        return real(tiny_hf_dir if model is None else model, **options)  # type: ignore[arg-type]

    def llm(model: object = None, **options: object) -> asyncstep.LLM:
        options.setdefault("engine_process", False)
        llms.append(real_llm(tiny_hf_dir if model is None else model, **options))  # type: ignore[arg-type]
        return llms[-1]

    monkeypatch.setattr(asyncstep, "open_engine", open_engine)
    monkeypatch.setattr(asyncstep, "LLM", llm)
    seen: set[str] = set()
    try:
        for page in PAGES:
            namespace: dict[str, object] = {}
            for lang, code in blocks(page):
                if name(page) == RAY_PAGE:
                    continue  # test_the_ray_examples_are_run_where_ray_is
                if lang == "python" and not is_client_page(page) and code not in seen:
                    if CHAT_EXAMPLE in code:
                        continue  # tests/engine/test_chat_api.py runs it
                    seen.add(code)
                    exec(code, namespace)
    finally:
        for each in llms:  # (the examples leave theirs open, as a notebook or an app does)
            each.close()
    assert len(opened) >= 4 and len(llms) >= 3


def test_the_chat_example_is_run_on_the_embedded_model() -> None:
    examples = [
        code
        for page in PAGES
        for lang, code in blocks(page)
        if lang == "python" and CHAT_EXAMPLE in code
    ]
    assert len(examples) == 1
    source = (ROOT / "tests" / "engine" / "test_chat_api.py").read_text()
    assert "read_text()" in source and '"docs" / "python-api.md"' in source
    assert 'if "engine.chat(" in b' in source


def test_the_ray_examples_are_run_where_ray_is() -> None:
    """docs/ray.md's examples need a Ray cluster: they compile here, and
    tests/integrations/test_ray.py runs the Serve application's block as it
    is and the ranks' calls on its tiny checkpoint."""
    page = ROOT / RAY_PAGE
    examples = [code for lang, code in blocks(page) if lang == "python"]
    assert len(examples) == 2
    for code in examples:
        compile(code, RAY_PAGE, "exec")
    source = (ROOT / "tests" / "integrations" / "test_ray.py").read_text()
    assert '"docs" / "ray.md"' in source and 'docs_example("build_serve_app(")' in source
    assert "open_ray_engine(" in source and "open_ray_engine(" in examples[0]


def test_the_notebook_and_the_wsgi_app_run_for_real() -> None:
    """docs/python-api.md's notebook cells run in a Jupyter kernel, and its
    WSGI app serves eight threads at once, in tests/engine/test_llm.py."""
    source = (ROOT / "tests" / "engine" / "test_llm.py").read_text()
    page = ROOT / "docs" / "python-api.md"
    for marker in ("# %%", "def app(environ"):
        found = [code for lang, code in blocks(page) if lang == "python" and marker in code]
        assert len(found) == 1, marker
        assert f'docs_example("{marker}")' in source


def drawn_layers(page: str, head: str) -> dict[str, int]:
    """The table of layers on ``page`` whose second column is ``head``: each
    unit named at the start of a row's cell or after a comma (not in brackets)."""
    table = page.split(f"| layer | {head} |\n", 1)[1].split("\n\n", 1)[0]
    drawn: dict[str, int] = {}
    for layer, units in re.findall(r"^\| (\d+) \| (.+) \|$", table, re.M):
        for unit in re.findall(r"^`(\w+)`|, `(\w+)`", re.sub(r"\(.*?\)", "", units)):
            drawn[next(u for u in unit if u)] = int(layer)
    return drawn


def test_the_layers_drawn_are_those_kept() -> None:
    """docs/architecture.md's tables of layers are tests/test_layers.py's:
    the units', and the engine's sub-packages' (its ``__init__`` told in words)."""
    from test_layers import LAYERS, SUBLAYERS

    page = (ROOT / "docs" / "architecture.md").read_text()
    assert drawn_layers(page, "units") == LAYERS
    engine = {name: layer for name, layer in SUBLAYERS["engine"].items() if name != "__init__"}
    assert drawn_layers(page, "`engine/` sub-packages") == engine


def test_the_parity_matrix_names_tests_that_exist() -> None:
    """docs/python-api.md's matrix of the families against transformers
    names tests that are defined: each ``test_*`` it quotes (after a file,
    or alone) is a function of a test file the section quotes (a bare file
    name is under ``tests/models/``)."""
    page = (ROOT / "docs" / "python-api.md").read_text()
    section = page.split("### What is tested against transformers")[1].split("\n## ")[0]
    files = set(re.findall(r"`((?:tests/\w+/)?test_\w+\.py)", section))
    defined: set[str] = set()
    for name in files:
        path = ROOT / (name if name.startswith("tests/") else f"tests/models/{name}")
        assert path.is_file(), name
        tree = ast.parse(path.read_text())
        defined |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    named = set(re.findall(r"(?:::|`)(test_\w+)(?=[`\[])", section))
    assert len(named) > 20 and named <= defined, sorted(named - defined)


def test_the_multi_machine_recipe_is_the_one_test_parallel_runs() -> None:
    """Its commands need several machines; tests/channels/test_parallel.py runs the
    same recipe on one (torchrun's ranks, ``-m asyncstep.rank --engine``)."""
    recipe = [c.text for c in all_commands() if c.page == "docs/parallelism.md" and c.reason]
    (torchrun,) = [text for text in recipe if text.startswith("torchrun")]
    assert torchrun.endswith("-m asyncstep.rank --engine A:5555")
    source = (ROOT / "tests" / "channels" / "test_parallel.py").read_text()
    assert '"-m", "asyncstep.rank", "--engine"' in source
    assert "docs/parallelism.md's multi-machine recipe" in source


def test_every_results_file_a_page_names_exists() -> None:
    """A figure's source is a file that is there (``_k4.json``-style
    shorthands name a sibling of the file before them)."""
    for page in PAGES:
        for path in re.findall(r"`(benchmarks/[\w./*-]+)`", page.read_text()):
            if "*" in path:
                assert glob.glob(str(ROOT / path)), (name(page), path)
            else:
                assert (ROOT / path.rstrip("/")).exists(), (name(page), path)


def test_every_page_a_page_or_docstring_cites_is_in_the_repository() -> None:
    """A cited ``.md`` file is one the repository holds (from its root, or a
    page of ``docs/``): not a note kept elsewhere."""
    texts = {name(page): page.read_text() for page in PAGES}
    for module in (ROOT / "asyncstep").rglob("*.py"):
        texts[str(module.relative_to(ROOT))] = module.read_text()
    cited = 0
    for where, text in texts.items():
        for path in re.findall(r"`+([\w./-]+\.md)`+", text):
            cited += 1
            assert (ROOT / path).is_file() or (ROOT / "docs" / path).is_file(), (where, path)
    assert cited >= 10


def test_the_benchmarks_index_names_every_study_and_measurement() -> None:
    """``benchmarks/README.md`` indexes what is there: every study (each with
    its README: question, command, figures, decision) and its scripts, and
    every maintained measurement run with ``python3 -m asyncstep.bench.NAME``;
    no script lies loose in ``benchmarks/``."""
    index = (ROOT / "benchmarks" / "README.md").read_text()
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("*.*")) == ["README.md"]
    for study in sorted((ROOT / "benchmarks" / "studies").iterdir()):
        readme = (study / "README.md").read_text()
        for part in ("**Question.**", "**Results.**"):
            assert part in readme or study.name == "tools", (study.name, part)
        assert f"(studies/{study.name}/README.md)" in index, study.name
        for script in sorted(study.glob("*.*")):
            if script.suffix in {".py", ".sh"}:
                assert f"`{script.name}`" in index, (study.name, script.name)
    for module in sorted((ROOT / "asyncstep" / "bench").glob("*.py")):
        if 'if __name__ == "__main__":' in module.read_text():
            assert f"`python3 -m asyncstep.bench.{module.stem}`" in index, module.stem
