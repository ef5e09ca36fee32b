"""The package's shape, checked from its source with ast: the layer order of DESIGN.md (no
import goes up, no import circle), no module importing another's private names or reaching
into them as attributes, no file over 700 lines and no function over 90.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mpidist"
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 90

# DESIGN.md: core (mesh, comms, collectives, topology, buffers, devices)/checkpoint/data <-
# optim (with its kernels) <- nn <- parallel (with the planner and the adapters) <- run (with
# the launcher) <- torch/cli.
LAYERS: dict[str, int] = {
    "_version": 0, "core": 0, "checkpoint": 0, "data": 0,
    "optim": 1, "nn": 2, "parallel": 3, "run": 4, "torch": 5, "cli": 5,
}
# At most 13 entries directly under mpidist/ (__init__.py, __main__.py, _version.py and
# py.typed included): the packages above, each a layer. __main__.py is `python -m mpidist`, a
# user's entry point: a count like this one never justifies removing an entry point (or an
# old import path); raise the count instead.
MAX_TOP_LEVEL = 13
# Top-level files that are not layers.
NOT_LAYERS = ("__init__.py", "__main__.py", "py.typed")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def test_top_level_is_small_and_every_package_has_a_layer():
    entries = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_TOP_LEVEL, entries
    unlisted = [e for e in entries if e.removesuffix(".py") not in LAYERS
                and e not in NOT_LAYERS]
    assert not unlisted, f"not given a layer in LAYERS: {unlisted}"
    assert "__main__.py" in entries, "python -m mpidist needs mpidist/__main__.py"


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) of every mpidist import."""
    tree = ast.parse(MODULES[module].read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names
                    if a.name.split(".")[0] == "mpidist"]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target.split(".")[0] != "mpidist":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub, None, node.lineno) if sub in MODULES
                           else (target, a.name, node.lineno))
    return out


def test_no_import_goes_up_the_layers():
    bad = []
    for module in MODULES:
        mine = _layer(module)
        if mine is None:  # the package root re-exports the public API
            continue
        for target, _, line in _imports(module):
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{module}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_no_module_imports_private_names_of_another():
    bad = [f"{m}:{line} imports {t}.{name}" for m in MODULES
           for t, name, line in _imports(m)
           if name and name.startswith("_") and not name.startswith("__") and t != m]
    bad += [f"{m}:{line} imports {t}" for m in MODULES for t, name, line in _imports(m)
            if name is None and t.split(".")[-1].startswith("_")
            and t.split(".")[-1] not in ("_version", "_comm")]
    assert not bad, "\n".join(bad)


# Attribute reaches into another module's private names that are allowed, each with why.
# (none today: every one found was given a public name instead)
REACH_EXCEPTIONS: dict[str, str] = {}


def _private_definitions() -> dict[str, set[str]]:
    """Every private name (one leading underscore) with the modules that define it: as a
    function or method, a class attribute, an attribute stored on any object, or a string
    (``__dict__["_x"]``, ``setattr(obj, "_x", ...)``)."""
    defs: dict[str, set[str]] = {}

    def add(name: str, module: str) -> None:
        if name.startswith("_") and not name.startswith("__") and name.isidentifier():
            defs.setdefault(name, set()).add(module)

    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                add(node.name, module)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                add(node.attr, module)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                add(node.value, module)
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                        [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                    for t in targets:
                        if isinstance(t, ast.Name):
                            add(t.id, module)
    return defs


def test_no_attribute_reach_into_private_names_of_another_module():
    """``obj._name`` outside ``self``/``cls`` where ``_name`` is defined only in other
    mpidist modules: another module's internals, which that module may change at will.
    (Private names of third-party libraries, e.g. torch's backend registry, are not
    counted here.)"""
    defs = _private_definitions()
    bad = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or node.attr not in defs:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if module in defs[node.attr]:
                continue
            where = f"{module}:{node.lineno}"
            if where not in REACH_EXCEPTIONS:
                bad.append(f"{where} reaches {ast.unparse(node)} (defined in "
                           f"{', '.join(sorted(defs[node.attr]))})")
    assert len(REACH_EXCEPTIONS) <= 3
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    graph = {m: {t if t in MODULES else t.rsplit(".", 1)[0] for t, _, _ in _imports(m)} - {m}
             for m in MODULES if m != "mpidist"}
    # Importing a package runs its __init__, which re-exports its modules: an edge into a
    # package from inside it is not a circle of the code, so only edges between modules
    # of different packages or between plain modules count.
    def edges(m: str) -> set[str]:
        return {t for t in graph.get(m, ()) if t in graph and not m.startswith(t + ".")}

    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges(m)):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_file_and_function_lengths(module: str):
    path = MODULES[module]
    lines = path.read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"{path.name}: {lines} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{module}: {', '.join(long)}"


def test_no_assert_guards_a_runtime_condition():
    """``assert`` vanishes under ``python -O``: library code raises instead."""
    found = [f"{module}:{node.lineno}" for module, path in MODULES.items()
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assert)]
    assert not found, f"assert statements in mpidist: {found}"
