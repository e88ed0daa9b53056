"""Dependencies point one way: compare knows nothing of batchgen, the model nothing of the engine,
the KV layer nothing of the engine or compare mode, the engine nothing of compare mode (its KV ops
are handed to it), the stateless planner only its plans and backends; batchgen's packages import
each other without a cycle, lazy imports counted, and a lazy import crosses a package only for an
optional heavy dependency."""

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
        ("batchgen.kv", ("batchgen.shadow", "batchgen.cli", "batchgen.engine"), ()),
        # the worker is handed its KV ops (batchgen.shadow.wiring builds them at the edge)
        ("batchgen.engine", ("batchgen.cli", "batchgen.shadow"), ()),
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
        # a replicated job's driver and replicas are handed what the command line builds
        ("batchgen.replicas", ("batchgen.cli",), ()),
    ],
)
def test_a_layer_imports_nothing_of_the_layers_above_it(package, forbidden, allowed):
    assert forbidden_imports(package, forbidden, allowed) == []


def test_the_kv_layer_reads_the_request_state_it_mutates_below_itself():
    readers = {
        str(path.relative_to(ROOT))
        for path in modules_in("batchgen.kv")
        if any(name.startswith("batchgen.state") for name in imports_of(path))
    }
    assert "batchgen/kv/target.py" in readers
    assert imports_of(ROOT / "batchgen" / "state.py") & {"batchgen.kv", "batchgen.engine"} == set()


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def package_of(module: str) -> str | None:
    """The batchgen package (or top-level module) ``module`` is in: ``batchgen.kv`` for
    ``batchgen.kv.plans``; None outside batchgen and for ``batchgen`` itself. Pure."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "batchgen" and len(parts) > 1 else None


def package_graph() -> dict[str, set[str]]:
    """Package -> the other packages its modules import, at their top or inside a function."""
    graph: dict[str, set[str]] = {}
    for path in modules_in("batchgen"):
        source = package_of(module_of(path))
        if source is not None:
            graph.setdefault(source, set())
    for path in modules_in("batchgen"):
        source = package_of(module_of(path))
        targets = {package_of(name) for name in imports_of(path)} & set(graph)
        if source is not None:
            graph[source] |= targets - {source}
    return graph


def a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as the nodes around it, the first repeated last; [] when none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        for target in sorted(graph[node]):
            if found := visit(target, [*path, node]):
                return found
        done.add(node)
        return []

    return next(filter(None, (visit(node, []) for node in sorted(graph))), [])


def test_batchgens_packages_import_each_other_without_a_cycle_lazy_imports_counted():
    graph = package_graph()
    assert {"batchgen.engine", "batchgen.kv", "batchgen.shadow", "batchgen.state"} <= set(graph)
    assert a_cycle(graph) == []


def test_the_cycle_check_finds_a_cycle_through_three_packages():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert a_cycle(graph) == ["a", "b", "c", "a"]
    assert a_cycle({**graph, "c": {"d"}}) == []


# module -> what it imports lazily from outside its package, and why: an optional heavy dependency
LAZY_IMPORTS = {
    "batchgen/__main__.py": {
        "batchgen.cli": "torch and the engine: the signal handlers go in before their second",
    },
    "batchgen/cli/real_model.py": {
        "batchgen.validation.hf_reference": "transformers: --hf-dir only",
    },
    "batchgen/shadow/pytest_plugin.py": {
        "batchgen.engine.worker": "torch and the engine: only a session that compares",
        "compare": "the log's reader: only a session that logs",
    },
    "batchgen/sweep/ray_backend.py": {"ray": "ray: --backend ray only"},
    "batchgen/validation/hf_oracle.py": {"transformers": "the HF oracle's extra"},
    "batchgen/validation/hf_reference.py": {
        "torch": "with transformers, the HF reference's extra",
        "transformers": "the HF reference's extra",
    },
    "batchgen/validation/real_model_check.py": {
        "batchgen.model.real_model": "the real model's extras (gguf, transformers), checked first",
        "transformers": "the real model's extra",
    },
}


def lazy_imports_across_packages() -> dict[str, set[str]]:
    """Module path -> the modules it imports inside a function from outside its package (for
    ``from m import n``: ``m``). Pure."""
    found = {}
    for path in modules_in("batchgen"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        imports = {
            node.module if isinstance(node, ast.ImportFrom) else alias.name
            for function in functions
            for node in ast.walk(function)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        outside = {name for name in imports if package_of(name) != package_of(module_of(path))}
        if outside:
            found[str(path.relative_to(ROOT))] = outside
    return found


def test_a_lazy_import_crosses_a_package_only_for_an_optional_heavy_dependency():
    assert lazy_imports_across_packages() == {
        module: set(imports) for module, imports in LAZY_IMPORTS.items()
    }


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
