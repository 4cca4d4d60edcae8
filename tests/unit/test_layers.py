"""The package's import graph: every package imports only the layers below it, and no module
imports itself back through others (function-level imports included)."""

import ast
from pathlib import Path

import deadpool_megatron

ROOT = Path(deadpool_megatron.__file__).resolve().parent

# Lowest first. A unit (a sub-package, or a top-level module) may import its own modules and
# the units of lower layers only: megatron/ adapts megatron-core for everything above it,
# control/ and checkpoint/ never reach into a training loop, the agent and the processes are
# the top.
LAYERS = [
    {"errors"},
    {"runtime", "topology", "endpoints", "logging_setup", "metrics", "events", "agreement"},
    {"failure"},
    {"config"},
    {"flags", "validation", "control", "checkpoint", "sim", "report"},
    {"megatron"},
    {"recovery"},
    {"process", "agent"},
    {"launch", "hooks", "__init__"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (relative imports resolved)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package[: len(package) - node.level + 1] if node.level > 1 else package
            target = [*base, *(node.module.split(".") if node.module else [])]
            for alias in node.names:  # `from . import keys` names a module
                candidate = ".".join([*target, alias.name])
                found.add(candidate if candidate in modules else ".".join(target))
        out[name] = {m for m in found if m in modules and m != name}
    return out


def _unit(module: str) -> str:
    return module.split(".")[0]


def test_every_unit_is_in_a_layer():
    units = {_unit(m) for m in _imports()}
    assert units == set().union(*LAYERS), units ^ set().union(*LAYERS)


def test_units_import_only_lower_layers():
    level = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    wrong = sorted(
        f"{m} -> {t}"
        for m, targets in _imports().items()
        for t in targets
        if _unit(t) != _unit(m) and level[_unit(t)] >= level[_unit(m)]
    )
    assert wrong == []


def test_no_module_imports_itself_back():
    graph = _imports()
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join([*stack[stack.index(t) :], t]))
            elif t not in state:
                visit(t, [*stack, t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []
