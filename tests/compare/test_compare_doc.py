"""docs/compare.md's walkthrough holds: each excerpt is still its file's code, its example runs
as written and prints what the page says, and its glue count is the files' count."""

import ast
import re
from pathlib import Path

import batchgen.finish.planner as planner

ROOT = Path(__file__).parents[2]
DOC = (ROOT / "docs" / "compare.md").read_text()
BLOCKS = [block.split("```", 1)[0] for block in DOC.split("```python\n")[1:]]
EXCERPT = re.compile(r"# (batchgen/\S+\.py)\n")


def code_lines(path: Path) -> int:
    """Lines of ``path`` that are not blank, comments or docstrings (a module's, class's or
    function's first string). Pure."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def test_every_excerpt_of_the_walkthrough_is_still_its_files_code():
    excerpts = [(EXCERPT.match(block), block) for block in BLOCKS]
    assert [match[1] for match, _ in excerpts if match] == [
        "batchgen/finish/legacy.py",
        "batchgen/finish/planner.py",
        "batchgen/finish/gate.py",
        "batchgen/finish/shadow.py",
        "batchgen/finish/shadow.py",
        "batchgen/engine/worker.py",
        "batchgen/engine/worker.py",
    ]
    for match, block in excerpts:
        if match:
            assert block[match.end() :] in (ROOT / match[1]).read_text(), match[1]


def test_the_walkthroughs_example_runs_and_prints_what_the_page_says(tmp_path, monkeypatch, capsys):
    [example] = [block for block in BLOCKS if not EXCERPT.match(block)]
    printed = DOC.split(example, 1)[1].split("```\n")[2]  # the block after "prints"
    monkeypatch.chdir(tmp_path)  # the example's log goes to the working directory
    monkeypatch.setattr(planner, "finish_reason_of", planner.finish_reason_of)  # restored after
    exec(compile(example, str(DOC), "exec"), {})
    assert capsys.readouterr().out == printed


def test_the_glue_count_on_the_page_is_the_files_count():
    counts = {
        path: int(count)
        for path, count in re.findall(
            r"^\| `(batchgen/finish/\w+\.py)` \| [^|]+ \| (\d+) \|$", DOC, re.M
        )
    }
    assert counts == {path: code_lines(ROOT / path) for path in counts}
    assert list(counts) == ["batchgen/finish/gate.py", "batchgen/finish/shadow.py"]
    total = int(re.search(r"\| \*\*glue\*\* \| \*\*(\d+)\*\* \|", DOC)[1])
    assert total == sum(counts.values()) <= 60
