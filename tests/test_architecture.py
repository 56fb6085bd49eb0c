"""The package graph: no import cycle, and every import points down the layers of docs/design.md.

Imports are read from the source (inside functions too), so the rule holds for lazy imports as
well. ``from afdc.x import y`` counts as importing ``afdc.x.y`` when that is a module, else
``afdc.x``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import afdc

ROOT = Path(afdc.__file__).parent

# Lowest first. A module may import modules of its own layer and of the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("afdc.errors", "afdc.version", "afdc.plan", "afdc.segment", "afdc.mixer", "afdc.ops")),
    ("kernels", ("afdc.codegen",)),
    ("capture", ("afdc.capture",)),
    ("passes", ("afdc.passes",)),
    ("partition", ("afdc.partition", "afdc.report")),
    ("lowering", ("afdc.lowering",)),
    ("runtime", ("afdc.runtime",)),
    ("artifact", ("afdc.artifact",)),
    ("serve", ("afdc.serve",)),
    ("drivers", ("afdc.api", "afdc.compile", "afdc.source", "afdc.planner", "afdc.demo", "afdc.equivalence")),
    ("entry points", ("afdc.cli", "afdc")),
]

# Imports the layers allow but a package must not make: (importer, imported, why).
APART: list[tuple[str, str, str]] = [
    ("afdc.planner", "afdc.runtime", "the planner reads graphs (afdc.api.Built), not a runnable model"),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ["afdc", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            base = base if node.level else node.module
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [s for s in subs if s in mods] or [base]
        else:
            continue
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _layer(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS here and to docs/design.md"
    return best[0]


def test_every_module_has_a_layer():
    for module in _graph():
        _layer(module)


def test_imports_point_down_the_layers():
    wrong = [
        f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
        for m, targets in _graph().items()
        for t in targets
        if _layer(t) > _layer(m)
    ]
    assert not wrong, "imports pointing up the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """The rule is live: a kernel module importing the runtime is reported."""
    fake = tmp_path / "afdc"
    for path in ROOT.rglob("*.py"):
        target = fake / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    (fake / "codegen" / "bad.py").write_text("from afdc.runtime import programs\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    graph = _graph()
    assert "afdc.runtime.programs" in graph["afdc.codegen.bad"]
    assert _layer("afdc.runtime.programs") > _layer("afdc.codegen.bad")



def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _apart_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {t}: {why}"
        for m, targets in graph.items()
        for t in targets
        for importer, imported, why in APART
        if _within(m, importer) and _within(t, imported)
    )


def test_packages_kept_apart_import_nothing_of_each_other():
    wrong = _apart_violations(_graph())
    assert not wrong, "imports between packages kept apart:\n" + "\n".join(wrong)


def test_the_checker_sees_the_planner_import_the_runtime(tmp_path, monkeypatch):
    """The rule is live: a planner module importing the runtime is reported, which the layers
    alone allow (the runtime lies below the drivers, where the planner is)."""
    fake = tmp_path / "afdc"
    for package in ("", "planner", "runtime"):
        (fake / package).mkdir(parents=True, exist_ok=True)
        (fake / package / "__init__.py").write_text("")
    (fake / "runtime" / "model.py").write_text("class DisaggregatedModel: ...\n")
    (fake / "planner" / "bad.py").write_text("from afdc.runtime.model import DisaggregatedModel\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    graph = _graph()
    assert _layer("afdc.runtime.model") < _layer("afdc.planner.bad")  # not an upward import
    assert _apart_violations(graph) == [f"afdc.planner.bad imports afdc.runtime.model: {APART[0][2]}"]
