"""``validate_mutation_score``'s session: a clone at one commit, cosmic-ray's databases over the
KV files, the seeded sample, what validate executes (coverage), and cosmic-ray's run.

Everything lives in the session directory (``<cache>/<commit>``): the clone (``src/``, mutated
in place by cosmic-ray, one mutant at a time), ``cosmic-ray.toml``, ``all-mutants.sqlite``
(cosmic-ray's ``init``: every mutant), ``sample.json`` (the sample, in rank order),
``session.sqlite`` (the tool's database of the sample: incremental, so a stopped run goes on
where it stopped), ``executed.json`` (lines validate executes unmutated) and ``baseline.log``.
Nothing here touches the source tree the script was started from.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import WorkerOutcome, WorkResult

# The files whose mutants are scored, relative to the repository root.
MUTATED_FILES = (
    "batchgen/kv/manager.py",
    "batchgen/kv/legacy.py",
    "batchgen/kv/appliers.py",
    "batchgen/kv/plan_path.py",
    "batchgen/kv/plan_checks.py",
    "batchgen/kv/copy_runs.py",
    "batchgen/kv/page_copy.py",
    "batchgen/kv/page_pool.py",
    "batchgen/kv/prefix_digests.py",
    "batchgen/engine/scheduler.py",
    "batchgen/engine/worker.py",
)
BATCH = 10  # mutants handed to one cosmic-ray exec
COSMIC_RAY = str(Path(sys.executable).parent / "cosmic-ray")  # the venv's
NEVER_EXECUTED = "line never executed by an unmutated validate"
# Every mutated file starts with ``from __future__ import annotations`` and holds no pydantic
# model: its annotations are strings nobody evaluates, so a mutant inside one changes nothing.
IN_ANNOTATION = "inside an annotation, never evaluated"


def session_dir(cache: Path, commit: str, since: str | None = None) -> Path:
    """A commit's session; one sampling only the lines changed since ``since`` is its own."""
    return cache / (commit[:12] if since is None else f"{commit[:12]}-since-{since[:12]}")


def changed_lines(src: Path, since: str) -> dict[str, set[int]]:
    """The lines of each mutated file the clone's HEAD added or changed since commit ``since``
    (numbers in HEAD's text). Reads git."""
    lines: dict[str, set[int]] = {path: set() for path in MUTATED_FILES}
    for path in MUTATED_FILES:
        diff = subprocess.run(
            ["git", "-C", str(src), "diff", "-U0", since, "HEAD", "--", path],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        for hunk in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.MULTILINE):
            start, count = int(hunk[1]), int(hunk[2] or 1)
            lines[path].update(range(start, start + count))
    return lines


def clone(repo: Path, commit: str, directory: Path) -> Path:
    """``directory/src``: a clone of ``repo`` at ``commit`` (made once). Returns its path."""
    src = directory / "src"
    if not src.exists():
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "clone", "-q", str(repo), str(src)], check=True)
        subprocess.run(["git", "-C", str(src), "checkout", "-q", commit], check=True)
    return src


def validate_command(src: Path, reports: Path) -> list[str]:
    """``batchgen validate --fail-fast`` importing the clone's code (PYTHONPATH and the working
    directory both point at it: the venv's editable install points elsewhere)."""
    return [
        "env", f"PYTHONPATH={src}", sys.executable, "-m", "batchgen", "validate",
        "--fail-fast", "--reports-dir", str(reports),
    ]  # fmt: skip


def check_imports_clone(src: Path) -> None:
    """RuntimeError when ``python -m batchgen`` in the clone would import another copy."""
    found = subprocess.run(
        [sys.executable, "-c", "import batchgen; print(batchgen.__file__)"],
        cwd=src, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(found).resolve().is_relative_to(src.resolve()):
        raise RuntimeError(f"the clone's validate would import {found}, not {src}")


def write_config(directory: Path, src: Path, timeout_s: float) -> Path:
    """cosmic-ray's config: the mutated files, the test command, its timeout, one local worker."""
    command = shlex.join(validate_command(src, directory / "reports"))
    paths = ", ".join(json.dumps(path) for path in MUTATED_FILES)
    config = directory / "cosmic-ray.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = [{paths}]\n"
        f"timeout = {timeout_s}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(command)}\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
    )
    return config


def measure_executed_lines(directory: Path, src: Path) -> float:
    """Run the unmutated validate once under coverage; write ``executed.json`` (file -> the
    statement lines it executed, and every statement line; whether CUDA was there). RuntimeError
    when it fails: every mutant would look killed. Returns its wall time in seconds."""
    data = directory / ".coverage"
    command = validate_command(src, directory / "reports")
    python_at = command.index(sys.executable) + 1
    command[python_at:python_at] = [
        "-m",
        "coverage",
        "run",
        f"--data-file={data}",
        "--source=batchgen",
    ]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=src, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    (directory / "baseline.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(
            f"the unmutated validate failed (exit {done.returncode}): see baseline.log"
        )
    import coverage

    measured = coverage.Coverage(data_file=str(data))
    measured.load()
    lines = {}
    for path in MUTATED_FILES:
        _, statements, _, missing, _ = measured.analysis2(str(src / path))
        lines[path] = {"statements": sorted(statements), "missing": sorted(missing)}
    import torch  # whether validate could put a pool on CUDA (the report's CUDA-only operands)

    executed = {"wall_s": wall_s, "cuda": torch.cuda.is_available(), "lines": lines}
    (directory / "executed.json").write_text(json.dumps(executed))
    return wall_s


def init_session(directory: Path, src: Path, config: Path) -> Path:
    """cosmic-ray's ``init`` (once): every mutant of the files, in ``all-mutants.sqlite``.
    Returns its path."""
    database = directory / "all-mutants.sqlite"
    if not database.exists():
        subprocess.run([COSMIC_RAY, "init", str(config), str(database)], cwd=src, check=True)
    return database


def draw_sample(
    all_mutants: Path, directory: Path, size: int, seed: int, only: dict[str, set[int]] | None
) -> list[str]:
    """The job ids of the sample, in rank order: the ``size`` mutants whose seeded rank (a hash of
    the file, the operator and the line it changes) is lowest, so that a mutant the code around it
    left alone keeps its rank at another commit and two commits' samples share it; ``only``: of
    the mutants on those lines of each file. Drawn once per session directory (``sample.json``).
    ValueError when the files have fewer mutants."""
    marker = directory / "sample.json"
    if marker.exists():
        return json.loads(marker.read_text())["job_ids"]
    with use_db(str(all_mutants), WorkDB.Mode.open) as db:
        items = db.work_items
    if only is not None:
        items = [
            item
            for item in items
            if item.mutations[0].start_pos[0] in only[str(item.mutations[0].module_path)]
        ]
    if size > len(items):
        raise ValueError(f"--sample {size}: the files have only {len(items)} mutants")
    sources = {path: git_source(directory / "src", path) for path in MUTATED_FILES}
    job_ids = rank_order(items, sources, seed)[:size]
    marker.write_text(json.dumps({"seed": seed, "size": size, "job_ids": job_ids}))
    return job_ids


def num_mutants(directory: Path) -> int:
    """How many mutants cosmic-ray's ``init`` found in the files."""
    with use_db(str(directory / "all-mutants.sqlite"), WorkDB.Mode.open) as db:
        return db.num_work_items


def rank_order(items, sources: dict[str, str], seed: int) -> list[str]:
    """The job ids of ``items`` by seeded rank: a hash of the seed and the mutant's key
    (``mutant_keys``). Pure."""
    ranks = {
        job_id: hashlib.sha256("|".join(map(str, (seed, *key))).encode()).hexdigest()
        for job_id, key in mutant_keys(items, sources).items()
    }
    return sorted(ranks, key=ranks.get)


def mutant_keys(items, sources: dict[str, str]) -> dict[str, tuple]:
    """Each job id's key, the same for the same mutant at another commit: the file, the operator,
    the text of the line it changes and which such mutant of that line it is (not its line
    number, which an edit above it moves). Pure."""
    lines = {path: source.splitlines() for path, source in sources.items()}
    seen: dict[tuple, int] = {}
    keys = {}
    for item in sorted(items, key=_spec_key):
        spec = item.mutations[0]
        path = str(spec.module_path)
        what = (path, spec.operator_name, lines[path][spec.start_pos[0] - 1].strip())
        seen[what] = seen.get(what, -1) + 1  # the k-th such mutant of that line
        keys[item.job_id] = (*what, seen[what])
    return keys


def execute(directory: Path, src: Path, config: Path, all_mutants: Path, job_ids: list[str]):
    """cosmic-ray's ``exec`` on the sample, in rank order, ``BATCH`` mutants at a time, so that a
    run stopped part way holds the first ranks: itself a random sample. Each batch is added to
    ``session.sqlite``; a sampled mutant on a line an unmutated validate never executes is recorded
    skipped (it would run exactly as unmutated: ``mutation_report`` counts it survived, or not
    executed here in CUDA-only code); cosmic-ray applies each other one in the clone and runs
    validate on it. Results land as they come; a stopped run goes on from there."""
    missing = {
        path: set(lines["missing"])
        for path, lines in json.loads((directory / "executed.json").read_text())["lines"].items()
    }
    with use_db(str(all_mutants), WorkDB.Mode.open) as db:
        by_id = {item.job_id: item for item in db.work_items}
    annotations = {path: annotation_spans(git_source(src, path)) for path in MUTATED_FILES}
    database = str(directory / "session.sqlite")
    for start in range(0, len(job_ids), BATCH):
        _restore_clone(src)  # a run killed mid-mutant leaves the mutant in place
        with use_db(database, WorkDB.Mode.create) as db:
            known = {item.job_id for item in db.work_items}
            batch = [by_id[job_id] for job_id in job_ids[start : start + BATCH]]
            db.add_work_items([item for item in batch if item.job_id not in known])
            for item in (item for item in batch if item.job_id not in known):
                spec, path = item.mutations[0], str(item.mutations[0].module_path)
                if any(start <= spec.start_pos < end for start, end in annotations[path]):
                    db.set_result(item.job_id, _skipped(IN_ANNOTATION))
                elif spec.start_pos[0] in missing[path]:
                    db.set_result(item.job_id, _skipped(NEVER_EXECUTED))
        with (directory / "exec.log").open("a") as log:
            subprocess.run(
                [COSMIC_RAY, "exec", str(config), database], cwd=src, check=True, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(line, column) start and end of every annotation in ``source`` (arguments, returns,
    annotated assignments). Pure."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg | ast.AnnAssign):
            annotations = [node.annotation]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            annotations = [node.returns]
        else:
            continue
        spans += [
            ((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset))
            for a in annotations
            if a is not None
        ]
    return spans


def _restore_clone(src: Path) -> None:
    subprocess.run(["git", "-C", str(src), "checkout", "-q", "--", *MUTATED_FILES], check=True)


def git_source(src: Path, path: str) -> str:
    """The committed text of ``path`` in the clone (its work tree may hold a mutant right now)."""
    return subprocess.run(
        ["git", "-C", str(src), "show", f"HEAD:{path}"], capture_output=True, text=True, check=True
    ).stdout


def _skipped(why: str) -> WorkResult:
    return WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=why)


def _spec_key(item) -> tuple:
    spec = item.mutations[0]
    return (str(spec.module_path), spec.start_pos, spec.operator_name, spec.occurrence)
