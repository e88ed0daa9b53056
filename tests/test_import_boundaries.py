"""Dependencies point one way: compare knows nothing of batchgen, the model nothing of the engine,
the KV layer nothing of compare mode, and the stateless planner only its plans and backends."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function (absolute names); for
    ``from m import n``, both ``m`` and ``m.n`` (``n`` may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules_in(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def forbidden_imports(package: str, forbidden: tuple[str, ...], allowed=()) -> list[str]:
    """``module: import`` for each import of ``package`` under one of ``forbidden`` and none of
    ``allowed`` (module prefixes)."""
    return [
        f"{path.relative_to(ROOT)}: {name}"
        for path in modules_in(package)
        for name in sorted(imports_of(path))
        if name.startswith(forbidden) and not name.startswith(tuple(allowed) or "\0")
    ]


@pytest.mark.parametrize(
    ("package", "forbidden", "allowed"),
    [
        ("compare", ("batchgen",), ()),
        (
            "batchgen.model",
            ("batchgen.engine", "batchgen.kv", "batchgen.shadow", "batchgen.cli"),
            (),
        ),
        ("batchgen.kv", ("batchgen.shadow", "batchgen.cli", "compare"), ()),
        ("batchgen.engine", ("batchgen.cli",), ()),
        # the worker builds compare mode, imported only when the gate turns it on
        ("batchgen.engine", ("batchgen.shadow",), ("batchgen.shadow.kv_compare",)),
        ("batchgen.shadow", ("batchgen.cli",), ()),
        # validation, triage and sweeps use compare mode; compare mode and what it binds use none
        *(
            (layer, ("batchgen.validation", "batchgen.triage", "batchgen.sweep"), ())
            for layer in ("batchgen.model", "batchgen.kv", "batchgen.engine", "batchgen.shadow")
        ),
        ("batchgen.validation", ("batchgen.cli",), ()),
        ("batchgen.triage", ("batchgen.cli",), ()),
        ("batchgen.sweep", ("batchgen.cli",), ()),
        # the engine is token ids in, token ids out: text, OpenAI shapes and the LLM API sit above
        ("batchgen.engine", ("batchgen.text", "batchgen.openai", "batchgen.entrypoints"), ()),
        ("batchgen.text", ("batchgen.openai", "batchgen.entrypoints", "batchgen.cli"), ()),
        ("batchgen.openai", ("batchgen.entrypoints", "batchgen.cli"), ()),
        # metrics watch a run from the edge: what they watch is handed to them, not imported
        ("batchgen.engine", ("batchgen.metrics",), ()),
        ("batchgen.kv", ("batchgen.metrics",), ()),
        ("batchgen.shadow", ("batchgen.metrics",), ()),
        ("batchgen.text", ("batchgen.metrics",), ()),
        ("batchgen.metrics", ("batchgen.cli",), ()),
    ],
)
def test_a_layer_imports_nothing_of_the_layers_above_it(package, forbidden, allowed):
    assert forbidden_imports(package, forbidden, allowed) == []


def test_the_kv_layer_reads_of_the_engine_only_the_request_state_it_mutates():
    engine = {
        name
        for path in modules_in("batchgen.kv")
        for name in imports_of(path)
        if name.startswith("batchgen.engine.")
    }
    assert engine and all(name.startswith("batchgen.engine.state") for name in engine)


def test_the_manager_imports_only_its_plans_and_backend_protocols():
    ours = {
        name
        for name in imports_of(ROOT / "batchgen" / "kv" / "manager.py")
        if name.startswith(("batchgen", "compare")) and name != "batchgen.kv"
    }
    plans, backends = "batchgen.kv.plans", "batchgen.kv.backends"
    assert {plans, backends} <= ours and all(name.startswith((plans, backends)) for name in ours)


def test_the_legacy_path_is_imported_only_by_the_gate_and_compare_modes_tests():
    importers = [
        str(path.relative_to(ROOT))
        for package in ("batchgen", "compare")
        for path in modules_in(package)
        if any(name.startswith("batchgen.kv.legacy") for name in imports_of(path))
    ]
    assert importers == ["batchgen/kv/gate.py"]


def test_the_check_sees_a_planted_import(tmp_path):
    planted = tmp_path / "module.py"
    planted.write_text("def f():\n    from batchgen.shadow import kv_compare\n")
    assert "batchgen.shadow.kv_compare" in imports_of(planted)
