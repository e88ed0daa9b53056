"""A minimized divergence as a pytest regression test: the minimal workload and a test that
replays it in compare mode ``raise`` and fails until the bug is fixed."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

from batchgen.kv.gate import KV_OPS
from batchgen.triage.minimize_search import MinimizeResult
from compare import write_atomic

_TEST_TEMPLATE = '''\
"""Regression test written by batchgen minimize: fails until the KV divergence below is fixed."""

# The workload makes the shadow path diverge from the authoritative one:
#   authoritative: {kv_path}
#   shadow:        {shadow_path}
#   op:            {op}
#   kind:          {kind}
#   field paths:   {paths}
{demo_bug}
from pathlib import Path

from batchgen.model.loader import load_model
from batchgen.engine.runner import run_workload
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.kv.gate import KvGateConfig
from batchgen.engine.workloads import load_workload
from batchgen.shadow.wiring import gated_worker

WORKLOAD = Path(__file__).parent / {workload_literal}
FAULTS = {faults_literal}  # the fault SPEC the divergence needs (None: none)


def test_no_{slug}_divergence(tmp_path):
    workload = load_workload(str(WORKLOAD))
    # compare="raise" on this op alone: the test fails at this divergence (a data divergence: on
    # every op, and at the end, from the page-content oracle's count)
    gate = KvGateConfig(path={kv_path_literal}, compare="raise", compare_ops={ops_literal},
                        compare_log=str(tmp_path / "kv-divergences.jsonl"), verify="all",
                        compare_demo_bug={demo_bug_literal})
    faults = FaultInjector(FaultSpec.parse(FAULTS)) if FAULTS is not None else None
    worker = gated_worker(load_model("tiny"), cache_config=workload.cache,
                          engine_config=workload.engine, kv_gate=gate,
                          shadow_path={shadow_path_literal}, faults=faults)
    result = run_workload(worker, workload, source=str(WORKLOAD))
    assert not result.compare_summary.divergences
    assert not result.compare_summary.data.divergences
'''


def write_regression(
    result: MinimizeResult, workload_path: str | Path, test_path: str | Path
) -> None:
    """Write the minimal workload (JSON) and a pytest file that replays it in compare mode
    ``raise``, comparing the signature's op only (a divergence of another op, another bug's, does
    not fail it).

    Both files are replaced atomically. The test names the workload by its path
    relative to the test file, is named after the signature
    (``test_no_<slug>_divergence``), and runs the tiny model: KV decisions depend
    on the workload alone while the model emits no EOS (the tiny one has none).
    """
    for path, text in _regression_files(result, Path(workload_path), Path(test_path)).items():
        write_atomic(path, text)


def write_regression_into(out_dir: str | Path, result: MinimizeResult) -> tuple[Path, Path]:
    """:func:`write_regression` into ``out_dir`` as ``<slug>.json`` and ``test_kv_<slug>.py``, or
    with ``_2``, ``_3``... when those files hold another regression (one with the same signature
    from another record or direction): nothing is overwritten but the same files again. Returns the
    workload and test paths."""
    out_dir, slug = Path(out_dir), result.signature.slug
    for number in itertools.count(1):
        name = slug if number == 1 else f"{slug}_{number}"
        workload_path, test_path = out_dir / f"{name}.json", out_dir / f"test_kv_{name}.py"
        files = _regression_files(result, workload_path, test_path)
        if all(
            not path.exists() or path.read_text(encoding="utf-8") == text
            for path, text in files.items()
        ):
            write_regression(result, workload_path, test_path)
            return workload_path, test_path


def _regression_files(
    result: MinimizeResult, workload_path: Path, test_path: Path
) -> dict[Path, str]:
    """The text of the workload file and of the test file :func:`write_regression` writes. Pure."""
    relative = Path(os.path.relpath(workload_path.resolve(), test_path.resolve().parent)).as_posix()
    signature = result.signature
    source = _TEST_TEMPLATE.format(
        slug=signature.slug,
        op=_comment(signature.op),
        kind=_comment(signature.kind),
        kv_path=_comment(result.kv_path),
        shadow_path=_comment(result.shadow_path),
        paths="\n#                  ".join(map(_comment, signature.field_paths))
        or "(none: a side raised)",
        workload_literal=json.dumps(relative),
        kv_path_literal=json.dumps(result.kv_path),
        # a data divergence's op (poll, flush) is where the oracle saw it, not a compared op
        ops_literal=json.dumps(",".join(KV_OPS) if signature.kind == "data" else signature.op),
        # a JSON string is a Python string literal
        shadow_path_literal=json.dumps(result.shadow_path),
        faults_literal=json.dumps(result.faults) if result.faults is not None else "None",
        demo_bug=_demo_bug_comment(result.demo_bug),
        demo_bug_literal=json.dumps(result.demo_bug) if result.demo_bug is not None else "None",
    )
    return {workload_path: result.workload.to_json(), test_path: source}


def _demo_bug_comment(name: str | None) -> str:
    """The template's lines naming the demo bug the divergence needs, if any. Pure."""
    if name is None:
        return ""
    return (
        f"#   demo bug:      {_comment(name)}, planted in the shadow path by the gate below:\n"
        "#                  the test fails until compare_demo_bug is removed\n"
    )


def _comment(text: str) -> str:
    """``text`` on one line, safe inside a ``#`` comment."""
    return " ".join(text.split())
