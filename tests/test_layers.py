"""The import structure: no module imports itself back through others (no
circle), and no package imports one of a higher layer. Every import counts:
at the top, inside a function, and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "asyncstep"

#: Each top-level unit's layer: a unit imports only units of its layer or below.
LAYERS: dict[str, int] = {
    "integrations": 14,  # asyncstep run by other systems (Ray): nothing imports it
    "__main__": 13,
    "cli": 12,
    "bench": 11,  # ``asyncstep bench``: the CLI lends it its flag builder (no import up)
    "server": 10,
    "__init__": 9,  # the package's face: what users import
    "rank": 9,  # ``python -m asyncstep.rank``
    "engine": 8,
    "nursery": 7,
    "runner": 6,
    "models": 5,
    "channels": 4,
    "datatypes": 3,
    "structured_params": 2,
    "config": 1,
    "checks": 1,
    "ops": 1,  # the kernels: over the device runtime, under the models
    "cpu_features": 0,
    "kv_cache_interface": 0,  # the KV cache groups: the scheduler's and the runner's
    "device": 0,
    "logging": 0,
    "errors": 0,
    "procs": 0,
    "progress": 0,
}

#: The layers inside a unit that is a package of sub-packages, checked as the
#: units' own: a sub-package imports only sub-packages of its layer or below.
SUBLAYERS: dict[str, dict[str, int]] = {
    "engine": {
        "__init__": 6,  # imports nothing (test_the_engine_package_imports_nothing)
        "front_end": 5,  # Engine, open_engine, LLM, the door
        "transport": 4,  # the front end and the core in two processes
        "executor": 3,  # the ranks the core drives: the engine's way down to the runner
        "core": 2,  # the scheduler, the KV blocks, the step loop
        "structured_output": 1,
        "spec_decode": 1,
        "chat": 1,  # what a chat reads and writes (templates, tools, reasoning)
        "messages": 0,  # the core's messages, the caller's outputs, the text markers
    },
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` (or a name in a module) stands for."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The asyncstep modules that module ``name`` imports (anywhere in it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
        for target in targets:
            if target.split(".")[0] == "asyncstep":
                module = resolve(target, known)
                if module is not None and module != name:
                    found.add(module)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def sub_unit(module: str) -> str:
    """The sub-package of its unit that ``module`` belongs to."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_unit_has_a_layer() -> None:
    assert {unit(m) for m in modules()} <= LAYERS.keys()


def test_no_module_imports_itself_back() -> None:
    assert circles(graph()) == []


def test_no_import_runs_up_a_layer() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(graph().items())
        for target in sorted(targets)
        if LAYERS[unit(target)] > LAYERS[unit(module)]
    ]
    assert upward == []


def test_every_sub_package_has_a_layer() -> None:
    for name, layers in SUBLAYERS.items():
        assert {sub_unit(m) for m in modules() if unit(m) == name} == layers.keys()


def test_no_import_runs_up_a_sub_layer() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(graph().items())
        if unit(module) in SUBLAYERS
        for target in sorted(targets)
        if unit(target) == unit(module)
        and SUBLAYERS[unit(module)][sub_unit(target)] > SUBLAYERS[unit(module)][sub_unit(module)]
    ]
    assert upward == []


def test_no_sub_package_imports_a_peer() -> None:
    """Sub-packages of one layer are apart: neither imports the other."""
    across = [
        f"{module} -> {target}"
        for module, targets in sorted(graph().items())
        if unit(module) in SUBLAYERS
        for target in sorted(targets)
        if unit(target) == unit(module)
        and sub_unit(target) != sub_unit(module)
        and SUBLAYERS[unit(module)][sub_unit(target)] == SUBLAYERS[unit(module)][sub_unit(module)]
    ]
    assert across == []


def test_the_engine_package_imports_nothing() -> None:
    """Importing any part of the engine runs ``asyncstep/engine/__init__.py``:
    it imports nothing, so that it ties no sub-package to another."""
    assert graph()["asyncstep.engine"] == set()


def test_the_walk_sees_imports_of_every_kind() -> None:
    """The checks above are only as good as the walk: it finds lazy,
    ``TYPE_CHECKING`` and relative imports."""
    edges = graph()
    api = edges["asyncstep.engine.front_end.api"]
    assert "asyncstep.models.model_loader" in api  # in a function
    assert "asyncstep.models.model_info" in api  # TYPE_CHECKING
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: The op-set implementations: whoever runs a model selects one
#: (:mod:`asyncstep.ops.select`); the models hold weights and call it.
IMPLEMENTATIONS = ("asyncstep.ops.cpu", "asyncstep.ops.triton")


def test_models_import_the_op_set_protocol_never_an_implementation() -> None:
    """``asyncstep.models`` imports ``asyncstep.ops``' protocol, reference,
    formats and selection, never the CPU library's or Triton's modules (the
    runner imports neither: it selects through :mod:`asyncstep.ops.select`)."""
    edges = graph()
    found = [
        f"{module} -> {target}"
        for module, targets in sorted(edges.items())
        if module.startswith(("asyncstep.models", "asyncstep.runner.model_runner"))
        for target in sorted(targets)
        if target.startswith(IMPLEMENTATIONS)
    ]
    assert found == []


def test_the_runner_imports_no_layer_class() -> None:
    """The runner hands its model an op set (``use_ops``): it sets nothing on the layers."""
    edges = graph()
    found = [
        f"{module} -> {target}"
        for module, targets in sorted(edges.items())
        if module.startswith("asyncstep.runner")
        for target in sorted(targets)
        if target.startswith("asyncstep.models.layers")
    ]
    assert found == []
