"""``validate_mutation_score``'s results: each sampled mutant's outcome, the per-file table and the
survivors, read from a session directory (``mutation_session``) and ``docs/validation.md``.

Outcomes: ``killed`` (validate exited non-zero), ``timeout`` (validate ran past the timeout;
killed, listed apart), ``survived``, ``equivalent`` (a survivor the docs' table explains),
``not executed here`` (CUDA-only code a CPU validate never runs), ``error`` (cosmic-ray could not
apply or run it), ``pending`` (not run yet). The score is (killed + timeout) over (killed +
timeout + survived).
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import cosmic_ray.plugins
from cosmic_ray.mutating import mutate_code
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome
from mutation_session import IN_ANNOTATION, MUTATED_FILES, NEVER_EXECUTED, git_source

OUTCOMES = ("killed", "timeout", "survived", "equivalent", "not executed here", "error", "pending")
# Functions only a CUDA tensor reaches (a CPU validate calls none): never-executed lines in them,
# like those of an ``if`` whose test reads ``cuda``, are "not executed here".
CUDA_ONLY_FUNCTIONS = {
    "batchgen/kv/copy_runs.py": {
        "_copy_within_device",
        "_copy_runs",
        "_runs",
        "_is_consecutive_between",  # called by _runs alone
        "_on_device",
        "_max_run_pages",  # called by the CUDA paths alone
        "cuda_device",
    },  # fmt: skip
    "batchgen/kv/page_copy.py": {
        "issue_on_side_stream",
        "_side_stream",
        "_cuda_event_done",  # a CopyHandle holds a CUDA event only for a copy on a side stream
        "_cuda_event_wait",
    },
}
# docs/validation.md: | `file` | line | operator | `old` → `new` | why equivalent |
_EQUIVALENT_ROW = re.compile(r"^\| `([^`]+)` \| \d+ \| \S+ \| `(.*)` → `(.*)` \| .+\|$")


@dataclass(frozen=True)
class Mutant:
    path: str
    line: int
    operator: str
    old: str  # the mutated line, before and after (stripped)
    new: str
    diff: str
    outcome: str
    ran: bool  # False: not run (its line never executes unmutated)
    job_id: str = ""  # cosmic-ray's, in its session


def load_outcomes(directory: Path, equivalents_doc: Path) -> list[Mutant]:
    """Every sampled mutant of the session in ``directory`` with its outcome. Pure (reads)."""
    job_ids = json.loads((directory / "sample.json").read_text())["job_ids"]
    equivalents = read_equivalents(equivalents_doc)
    sources = {path: git_source(directory / "src", path) for path in MUTATED_FILES}
    cuda_lines = {path: cuda_only_lines(path, source) for path, source in sources.items()}
    # a session measured on a CUDA machine evaluates these operands: only its coverage tells
    on_cpu = not json.loads((directory / "executed.json").read_text()).get("cuda", False)
    cuda_operands = {path: cuda_only_operand_spans(source) for path, source in sources.items()}
    with use_db(str(directory / "all-mutants.sqlite"), WorkDB.Mode.open) as db:
        by_id = {item.job_id: item for item in db.work_items}
    results = {}
    if (directory / "session.sqlite").exists():
        with use_db(str(directory / "session.sqlite"), WorkDB.Mode.open) as db:
            results = dict(db.results)
    items = [by_id[job_id] for job_id in job_ids]
    mutants = []
    for item in items:
        spec = item.mutations[0]
        path = str(spec.module_path)
        diff, old, new = _diff(path, sources[path], spec)
        result = results.get(item.job_id)
        in_cuda_operand = on_cpu and any(
            start <= spec.start_pos and spec.end_pos <= end for start, end in cuda_operands[path]
        )
        outcome = _outcome(result, spec.start_pos[0] in cuda_lines[path], in_cuda_operand)
        if outcome == "survived" and (path, old, new) in equivalents:
            outcome = "equivalent"
        ran = result is None or result.output != NEVER_EXECUTED
        mutant = Mutant(
            path, spec.start_pos[0], spec.operator_name, old, new, diff, outcome, ran, item.job_id
        )
        mutants.append(mutant)
    return sorted(mutants, key=lambda m: (MUTATED_FILES.index(m.path), m.line, m.operator))


def _outcome(result, is_cuda_only: bool, in_cuda_operand: bool = False) -> str:
    """``is_cuda_only``: on a CUDA-only line (``cuda_only_lines``); ``in_cuda_operand``: inside an
    operand a CPU validate never evaluates (``cuda_only_operand_spans``), on a line it executes."""
    if result is None:
        return "pending"
    never_ran = result.worker_outcome == WorkerOutcome.SKIPPED
    if in_cuda_operand and (never_ran or result.test_outcome == TestOutcome.SURVIVED):
        return "not executed here"
    if result.worker_outcome == WorkerOutcome.SKIPPED:
        if result.output == IN_ANNOTATION:
            return "equivalent"
        return "not executed here" if is_cuda_only else "survived"
    if result.worker_outcome != WorkerOutcome.NORMAL:
        return "error"
    if result.test_outcome == TestOutcome.SURVIVED:
        return "survived"
    if result.test_outcome == TestOutcome.KILLED:
        return "timeout" if result.output == "timeout" else "killed"
    return "error"


def read_equivalents(doc: Path) -> set[tuple[str, str, str]]:
    """(file, old line, new line) of each row of the docs' equivalent-mutant table."""
    if not doc.exists():
        return set()
    rows = (_EQUIVALENT_ROW.match(line) for line in doc.read_text().splitlines())
    return {(m[1], _cell(m[2]), _cell(m[3])) for m in rows if m}


def _cell(text: str) -> str:
    """A table cell's code as written in the source: ``\\|`` is a ``|`` the table escaped."""
    return text.replace("\\|", "|")


def cuda_only_lines(path: str, source: str) -> set[int]:
    """Lines of ``source`` inside a CUDA-only function or the body of an ``if`` whose test reads
    ``cuda``. Pure."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name in CUDA_ONLY_FUNCTIONS.get(path, ()):
            lines.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.If) and "cuda" in ast.unparse(node.test):
            lines.update(range(node.body[0].lineno, node.body[-1].end_lineno + 1))
    return lines


def cuda_only_operand_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(line, column) start and end of each operand of an ``and`` that comes after an operand
    ``<tensor>.is_cuda``: Python evaluates it only when that tensor is on CUDA, so on a CPU its
    line executes while a mutant inside it never runs (``src.is_cuda and dst.is_cuda and
    src.device != dst.device``: the comparison). Pure."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And)):
            continue
        guarded = False
        for operand in node.values:
            if guarded:
                start = (operand.lineno, operand.col_offset)
                spans.append((start, (operand.end_lineno, operand.end_col_offset)))
            guarded |= isinstance(operand, ast.Attribute) and operand.attr == "is_cuda"
    return spans


def _diff(path: str, source: str, spec) -> tuple[str, str, str]:
    """The mutant's unified diff and its first changed line before and after (stripped)."""
    operator = cosmic_ray.plugins.get_operator(spec.operator_name)(**spec.operator_args)
    mutated = mutate_code(source, operator, spec.occurrence) or source
    diff = list(
        difflib.unified_diff(
            source.splitlines(), mutated.splitlines(), path, path, n=1, lineterm=""
        )
    )
    # the first changed line that is not blank (a removed decorator takes a blank line with it)
    old = next((line[1:].strip() for line in diff[2:] if line[:1] == "-" and line[1:].strip()), "")
    new = next((line[1:].strip() for line in diff[2:] if line[:1] == "+" and line[1:].strip()), "")
    return "\n".join(diff), old, new


def score(counts: dict[str, int]) -> float | None:
    killed = counts["killed"] + counts["timeout"]
    denominator = killed + counts["survived"]
    return killed / denominator if denominator else None


def render_table(mutants: list[Mutant]) -> str:
    """One row per file and a total: the count of each outcome and the score."""
    widths = [len(name) + 2 for name in OUTCOMES]
    rows = [f"{'file':<30}" + "".join(f"{n:>{w}}" for n, w in zip(OUTCOMES, widths)) + "   score"]
    groups = [(path, [m for m in mutants if m.path == path]) for path in MUTATED_FILES]
    for path, mine in [*groups, ("total", mutants)]:
        counts = {name: sum(m.outcome == name for m in mine) for name in OUTCOMES}
        value = score(counts)
        cells = "".join(f"{counts[n]:>{w}}" for n, w in zip(OUTCOMES, widths))
        rows.append(f"{path:<30}{cells}{'-' if value is None else f'{value:.1%}':>8}")
    return "\n".join(rows)


def render_survivors(mutants: list[Mutant]) -> str:
    """The survivors as markdown: file, line, operator, whether validate ran it, the diff."""
    survivors = [m for m in mutants if m.outcome == "survived"]
    parts = [f"# {len(survivors)} survivors\n"]
    for m in survivors:
        how = "ran, validate passed" if m.ran else "not run: the line never executes"
        parts.append(f"## {m.path}:{m.line} {m.operator} ({how})\n\n```diff\n{m.diff}\n```\n")
    return "\n".join(parts)
