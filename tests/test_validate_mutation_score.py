"""``scripts/validate_mutation_score.py``: its refusals, and the pure parts of its method (which
mutants are CUDA-only or inside annotations, the sample's ranks, the outcomes and the table). The
mutation run itself takes an hour and is not run here."""

import sys
from pathlib import Path

import pytest
from cosmic_ray.work_item import MutationSpec, WorkerOutcome, WorkItem, WorkResult
from cosmic_ray.work_item import TestOutcome as CrOutcome

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def scripts(monkeypatch):
    """The script and its two modules, imported from scripts/."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import mutation_report
    import mutation_session
    import validate_mutation_score

    return validate_mutation_score, mutation_session, mutation_report


def refusal(scripts, capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        scripts[0].main(list(args))
    return exited.value.code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "args, error",
    [
        (("--sample", "0"), "argument --sample: needs an integer of at least 1, got 0"),
        (("--timeout", "0"), "argument --timeout: needs seconds in [1, 7200], got 0"),
        (("--commit", "no-such-commit"), "--commit no-such-commit: not a commit of "),
    ],
)
def test_bad_flags_are_refused_naming_the_flag_and_what_it_takes(scripts, capsys, args, error):
    code, line = refusal(scripts, capsys, *args)
    assert code == 2 and line.startswith(f"validate_mutation_score.py: error: {error}"), line


def test_report_only_without_a_session_is_refused_naming_the_cache(scripts, capsys, tmp_path):
    code, line = refusal(scripts, capsys, "--report-only", "--cache-dir", str(tmp_path))
    assert code == 2 and line.endswith(f"no session for {line.split()[-3]} in {tmp_path}")


def test_help_names_the_tool_the_test_command_and_every_flag(scripts, capsys):
    with pytest.raises(SystemExit):
        scripts[0].main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--commit", "--sample", "--seed", "--timeout", "--cache-dir", "--report-only"):
        assert flag in out
    assert "batchgen validate" in scripts[0].__doc__ and "cosmic-ray" in scripts[0].__doc__


CUDA_SOURCE = """\
def issue(src, dst):
    if src.is_cuda:
        cuda_path()
        more_cuda()
    else:
        host_path()


def _copy_within_device(src, dst):
    body()
"""


def test_cuda_only_lines_are_an_if_on_cuda_s_body_and_the_cuda_only_functions(scripts):
    lines = scripts[2].cuda_only_lines("batchgen/kv/copy_runs.py", CUDA_SOURCE)
    assert lines == {3, 4, 9, 10}


def test_a_copy_handle_s_cuda_event_branches_are_cuda_only_and_its_future_branch_is_not(scripts):
    path = "batchgen/kv/page_copy.py"
    source = (SCRIPTS.parent / path).read_text()
    lines = scripts[2].cuda_only_lines(path, source)
    numbered = list(enumerate(source.splitlines(), start=1))

    def line_of(text: str) -> int:
        return next(n for n, line in numbered if line.strip() == text)

    cuda = ["return self._completion.query()", "self._completion.synchronize()"]
    host = ["return self._completion.done()", "cause = self._completion.exception()"]
    assert [line_of(text) in lines for text in cuda + host] == [True, True, False, False]


def test_annotation_spans_cover_argument_and_return_annotations_only(scripts):
    source = "def f(x: int | None, y=1 | 2) -> str | None:\n    return x | y\n"
    spans = scripts[1].annotation_spans(source)
    inside = [(1, 13), (1, 38)]  # the | of x's annotation, of the return's
    outside = [(1, 24), (2, 13)]  # the | of y's default, of the body
    assert [any(a <= pos < b for a, b in spans) for pos in inside + outside] == [
        True,
        True,
        False,
        False,
    ]


def item(job_id: str, path: str, line: int, operator: str = "core/AddNot") -> WorkItem:
    spec = MutationSpec(path, operator, 0, (line, 0), (line, 1))
    return WorkItem.single(job_id, spec)


def test_a_mutant_keeps_its_rank_when_an_edit_above_it_moves_its_line(scripts):
    rank_order = scripts[1].rank_order
    before = {"a.py": "x = 1\ny = 2\nz = 3\n"}
    after = {"a.py": "w = 0\nx = 1\ny = 2\nz = 3\n"}  # one line added on top
    old = [item("x", "a.py", 1), item("y", "a.py", 2), item("z", "a.py", 3)]
    new = [item("w", "a.py", 1), item("x", "a.py", 2), item("y", "a.py", 3), item("z", "a.py", 4)]
    kept = [job for job in rank_order(new, after, seed=0) if job != "w"]
    assert kept == rank_order(old, before, seed=0)
    orders = {tuple(rank_order(old, before, seed=seed)) for seed in range(8)}
    assert len(orders) > 1  # the seed draws the order


def result(outcome: CrOutcome | None, output: str = "", worker=WorkerOutcome.NORMAL):
    return WorkResult(worker_outcome=worker, output=output, test_outcome=outcome)


def test_each_result_gets_its_outcome(scripts):
    _, session, report = scripts
    skipped = WorkerOutcome.SKIPPED
    cases = [
        (result(CrOutcome.KILLED, "FAIL ..."), False, "killed"),
        (result(CrOutcome.KILLED, "timeout"), False, "timeout"),
        (result(CrOutcome.SURVIVED), False, "survived"),
        (result(None, session.NEVER_EXECUTED, skipped), False, "survived"),
        (result(None, session.NEVER_EXECUTED, skipped), True, "not executed here"),
        (result(None, session.IN_ANNOTATION, skipped), False, "equivalent"),
        (result(CrOutcome.INCOMPETENT), False, "error"),
        (result(None, "boom", WorkerOutcome.EXCEPTION), False, "error"),
        (None, False, "pending"),
    ]
    assert [report._outcome(r, cuda) for r, cuda, _ in cases] == [want for *_, want in cases]


OPERAND_SOURCE = """\
def check(src, dst):
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise ValueError
    if not src.is_cuda and src.numel() > 0:
        pass
"""


def test_an_operand_after_an_is_cuda_operand_of_an_and_is_cuda_only_and_the_rest_is_not(scripts):
    spans = scripts[2].cuda_only_operand_spans(OPERAND_SOURCE)
    # dst.is_cuda and the device comparison; `not src.is_cuda` is true on a CPU: nothing after it
    assert spans == [((2, 23), (2, 34)), ((2, 39), (2, 63))]


def test_a_survivor_inside_a_cuda_only_operand_is_not_executed_here_and_a_kill_stays_a_kill(
    scripts,
):
    _, session, report = scripts
    skipped = result(None, session.NEVER_EXECUTED, WorkerOutcome.SKIPPED)
    cases = [
        (result(CrOutcome.SURVIVED), "not executed here"),
        (skipped, "not executed here"),
        (result(CrOutcome.KILLED, "FAIL ..."), "killed"),
        (result(None, "boom", WorkerOutcome.EXCEPTION), "error"),
        (None, "pending"),
    ]
    outcomes = [report._outcome(r, False, in_cuda_operand=True) for r, _ in cases]
    assert outcomes == [want for _, want in cases]


def test_the_equivalents_table_is_read_by_file_and_changed_line(scripts, tmp_path):
    doc = tmp_path / "validation.md"
    doc.write_text(
        "| file | line | operator | change | why equivalent |\n|---|---|---|---|---|\n"
        "| `batchgen/kv/plan_checks.py` | 130 | ReplaceComparisonOperator_IsNot_NotEq |"
        " `if a is not B:` → `if a != B:` | an enum member is only equal to itself |\n"
        "| `batchgen/kv/copy_runs.py` | 280 | core/ReplaceComparisonOperator_GtE_NotEq |"
        " `(i < 0) \\| (i >= n)` → `(i < 0) \\| (i != n)` | a message only |\n"
    )
    assert scripts[2].read_equivalents(doc) == {
        ("batchgen/kv/plan_checks.py", "if a is not B:", "if a != B:"),
        ("batchgen/kv/copy_runs.py", "(i < 0) | (i >= n)", "(i < 0) | (i != n)"),
    }
    assert scripts[2].read_equivalents(tmp_path / "none.md") == set()


def test_the_table_counts_each_outcome_per_file_and_scores_killed_over_non_equivalent(scripts):
    Mutant = scripts[2].Mutant
    path = "batchgen/kv/manager.py"
    outcomes = ["killed"] * 3 + ["timeout", "survived", "equivalent", "not executed here"]
    mutants = [Mutant(path, 1, "op", "a", "b", "", outcome, True) for outcome in outcomes]
    rows = scripts[2].render_table(mutants).splitlines()
    manager = next(row for row in rows if row.startswith(path)).split()
    total = rows[-1].split()
    assert manager[1:] == ["3", "1", "1", "1", "1", "0", "0", "80.0%"]
    assert total[1:] == manager[1:]
    assert sys.modules["mutation_report"].score({"killed": 0, "timeout": 0, "survived": 0}) is None


def test_carry_copies_killed_and_equivalent_results_to_the_same_mutants_and_leaves_survivors(
    scripts, monkeypatch, tmp_path
):
    import mutation_carry as carry  # scripts/ is on the path (the fixture)
    from cosmic_ray.work_db import WorkDB, use_db

    Mutant = scripts[2].Mutant
    path = "batchgen/kv/manager.py"
    earlier, later = tmp_path / "aaaaaaaaaaaa", tmp_path / "bbbbbbbbbbbb"
    outcomes = {"k": "killed", "t": "timeout", "e": "equivalent", "s": "survived"}
    results = {
        "k": result(CrOutcome.KILLED, "FAIL"),
        "t": result(CrOutcome.KILLED, "timeout"),
        "e": result(CrOutcome.SURVIVED),
        "s": result(CrOutcome.SURVIVED),
    }
    for directory, ids in ((earlier, "ktes"), (later, "KTESN")):
        directory.mkdir()
        with use_db(str(directory / "all-mutants.sqlite"), WorkDB.Mode.create) as db:
            db.add_work_items([item(i, path, line) for line, i in enumerate(ids, 1)])
    with use_db(str(earlier / "session.sqlite"), WorkDB.Mode.create) as db:
        db.add_work_items([item(i, path, 1) for i in results])
        for job_id, outcome in results.items():
            db.set_result(job_id, outcome)
    # the same mutants under other job ids at the later commit; "N" is new there
    keys = {
        earlier: {i: (path, "op", i, 0) for i in "ktes"},
        later: {i: (path, "op", i.lower(), 0) for i in "KTESN"},
    }
    monkeypatch.setattr(carry, "_sample_keys", lambda directory: keys[directory])
    monkeypatch.setattr(
        carry,
        "load_outcomes",
        lambda directory, doc: [
            Mutant(path, 1, "op", "a", "b", "", outcomes[i], True, i) for i in "ktes"
        ],
    )

    assert carry.carry_results(earlier, later, tmp_path / "validation.md") == 3
    with use_db(str(later / "session.sqlite"), WorkDB.Mode.open) as db:
        copied = dict(db.results)
    assert sorted(copied) == ["E", "K", "T"]  # the survivor and the new mutant run again
    assert copied["T"].output == "timeout" and copied["K"].test_outcome == CrOutcome.KILLED
    assert carry.carried_from(later) == {"aaaaaaaaaaaa": 3}
    assert carry.carry_results(earlier, later, tmp_path / "validation.md") == 0  # already there
