"""The package graph: no import cycle, and every import points down the layers of docs/design.md.

Imports are read from the source (inside functions too), so the rule holds for lazy imports as
well. ``from afdc.x import y`` counts as importing ``afdc.x.y`` when that is a module, else
``afdc.x``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import afdc

ROOT = Path(afdc.__file__).parent

# Lowest first. A module may import modules of its own layer and of the layers below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", (
        "afdc.errors", "afdc.version", "afdc.plan", "afdc.segment", "afdc.mixer_site", "afdc.ops", "afdc.quant",
        "afdc.model_class",
    )),
    ("kernels", ("afdc.codegen",)),
    ("capture", ("afdc.capture",)),
    ("passes", ("afdc.passes",)),
    ("partition", ("afdc.partition", "afdc.report")),
    ("lowering", ("afdc.lowering",)),
    ("runtime", ("afdc.runtime",)),
    ("artifact", ("afdc.artifact",)),
    ("serve", ("afdc.serve",)),
    ("drivers", ("afdc.api", "afdc.compile", "afdc.source", "afdc.mtp", "afdc.planner", "afdc.demo",
                 "afdc.equivalence")),
    ("entry points", ("afdc.cli", "afdc")),
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


# Beyond the layers: what a package must not import although the table would allow it.
FORBIDDEN: list[tuple[tuple[str, ...], str, str]] = [
    (("afdc.runtime", "afdc.serve"), "afdc.passes",
     "the runtime and the serving side take programs as they are lowered; graph analyses decide the split"),
    (("afdc.planner",), "afdc.runtime",
     "the planner reads graphs and segments (afdc.api.Built), not a runnable model"),
    (("afdc.serve",), "afdc.lowering",
     "the serving side takes programs as the runtime prepares them for its steps (afdc.runtime.flat_batches)"),
    (("afdc.runtime.transport",), "afdc.runtime.options",
     "the transports are what the runtime's options choose among (ConnectorKind lives with them)"),
]


def _within(module: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(module == p or module.startswith(p + ".") for p in prefixes)


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


def _forbidden(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} imports {t}: {why}"
        for importers, banned, why in FORBIDDEN
        for m, targets in graph.items()
        if _within(m, importers)
        for t in targets
        if _within(t, banned)
    )


def test_no_forbidden_imports():
    wrong = _forbidden(_graph())
    assert not wrong, "forbidden imports:\n" + "\n".join(wrong)


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


def _planted(tmp_path, monkeypatch, module: str, source: str) -> dict[str, set[str]]:
    """The package's import graph with one more module, ``module``, holding ``source``."""
    fake = tmp_path / "afdc"
    for path in ROOT.rglob("*.py"):
        target = fake / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    (fake / Path(*module.split(".")[1:])).with_suffix(".py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    return _graph()


@pytest.mark.parametrize(("importer", "imported"), [
    ("afdc.runtime.bad", "afdc.passes.classify"),
    ("afdc.serve.bad", "afdc.passes.classify"),
    ("afdc.planner.bad", "afdc.runtime.model"),
    ("afdc.serve.bad", "afdc.lowering.backends"),
    ("afdc.runtime.transport.bad", "afdc.runtime.options"),
])
def test_the_checker_sees_a_forbidden_import(tmp_path, monkeypatch, importer, imported):
    """Each rule beyond the layers is live: a planted import it forbids is reported."""
    module, _, name = imported.rpartition(".")
    graph = _planted(tmp_path, monkeypatch, importer, f"from {module} import {name}\n")
    assert any(w.startswith(f"{importer} imports {imported}:") for w in _forbidden(graph))


def test_the_checker_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """The rule is live: a kernel module importing the runtime is reported."""
    graph = _planted(tmp_path, monkeypatch, "afdc.codegen.bad", "from afdc.runtime import programs\n")
    assert "afdc.runtime.programs" in graph["afdc.codegen.bad"]
    assert _layer("afdc.runtime.programs") > _layer("afdc.codegen.bad")


def test_every_public_name_resolves_and_import_afdc_stays_light():
    """``afdc``'s public names load at first use: each one listed resolves (a name in ``__all__``
    that its lazy table lacks would fail only when a user reached for it), and importing the
    package alone loads neither the compiler nor the runtime."""
    code = ("import sys, afdc; assert not any(m.startswith(('afdc.compile', 'afdc.runtime', 'afdc.api')) "
            "for m in sys.modules), sorted(m for m in sys.modules if m.startswith('afdc'))")
    subprocess.run([sys.executable, "-c", code], check=True)
    for name in afdc.__all__:
        assert getattr(afdc, name) is not None, name
    assert sorted(afdc.__all__) == sorted(set(afdc.__all__)) and set(afdc.__all__) <= set(dir(afdc))
