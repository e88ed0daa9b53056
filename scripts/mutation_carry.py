"""``validate_mutation_score --carry-from``: an earlier commit's results, reused at a later one.

A mutant keeps its key (``mutation_session.mutant_keys``: file, operator, the text of the line it
changes) at another commit, and so its rank: two commits' samples share every mutant of a line
neither changed. When the commits between them only add to what validate checks, a mutant validate
killed at the earlier commit is killed at the later one too, and a survivor the equivalents table
explains is still invisible. Those results are copied into the later session (``carried.json``
lists them, with the commit they come from); the survivors the table does not explain, and every
mutant not run at the earlier commit, run at the later one. The report says how many were carried:
the claim that validate only gained checks is the reader's to check (``git log`` between the two).
"""

from __future__ import annotations

import json
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import WorkerOutcome
from mutation_report import load_outcomes
from mutation_session import MUTATED_FILES, git_source, mutant_keys

CARRIED = ("killed", "timeout", "equivalent")  # outcomes a stronger validate keeps


def carry_results(earlier: Path, later: Path, equivalents_doc: Path) -> int:
    """Copy each result of the session in ``earlier`` whose outcome is in ``CARRIED`` (and that
    cosmic-ray ran: results skipped there are recomputed here) to the same mutant of the sample in
    ``later``, where that mutant has no result yet. Mutates ``later/session.sqlite`` and
    ``later/carried.json``; returns how many results it copied."""
    earlier_results = _results(earlier)
    earlier_keys = _sample_keys(earlier)
    carried = {
        earlier_keys[m.job_id]: earlier_results[m.job_id]
        for m in load_outcomes(earlier, equivalents_doc)
        if m.outcome in CARRIED and earlier_results[m.job_id].worker_outcome == WorkerOutcome.NORMAL
    }
    later_keys = _sample_keys(later)
    with use_db(str(later / "all-mutants.sqlite"), WorkDB.Mode.open) as db:
        by_id = {item.job_id: item for item in db.work_items}
    with use_db(str(later / "session.sqlite"), WorkDB.Mode.create) as db:
        known = {item.job_id for item in db.work_items}
        copied = [
            job_id for job_id, key in later_keys.items() if key in carried and job_id not in known
        ]
        db.add_work_items([by_id[job_id] for job_id in copied])
        for job_id in copied:
            db.set_result(job_id, carried[later_keys[job_id]])
    _record(later, earlier.name, copied)
    return len(copied)


def carried_from(directory: Path) -> dict[str, int]:
    """How many of the session's results came from each earlier commit (its hash, short). Pure
    read."""
    marker = directory / "carried.json"
    if not marker.exists():
        return {}
    return {commit: len(ids) for commit, ids in json.loads(marker.read_text()).items()}


def _sample_keys(directory: Path) -> dict[str, tuple]:
    """The key of each mutant in the session's sample (keys are counted over every mutant, as
    ranks are). Pure read."""
    job_ids = json.loads((directory / "sample.json").read_text())["job_ids"]
    with use_db(str(directory / "all-mutants.sqlite"), WorkDB.Mode.open) as db:
        items = db.work_items
    sources = {path: git_source(directory / "src", path) for path in MUTATED_FILES}
    keys = mutant_keys(items, sources)
    return {job_id: keys[job_id] for job_id in job_ids}


def _results(directory: Path) -> dict:
    if not (directory / "session.sqlite").exists():
        return {}
    with use_db(str(directory / "session.sqlite"), WorkDB.Mode.open) as db:
        return dict(db.results)


def _record(directory: Path, commit: str, job_ids: list[str]) -> None:
    """Add ``job_ids`` under ``commit`` to ``carried.json``. Mutates it."""
    marker = directory / "carried.json"
    record = json.loads(marker.read_text()) if marker.exists() else {}
    record[commit] = sorted({*record.get(commit, []), *job_ids})
    marker.write_text(json.dumps(record))
