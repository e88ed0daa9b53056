"""An OpenAI batch job: input lines streamed into a text engine with a bounded number in flight,
one result line written (durably) as each input line finishes, in finishing order.

::

    read  a line -> error?  -> its error line, written now
                 -> prompts -> TextEngine (at most max_in_flight lines at once)
    step  the engine -> prompts done -> a line whose prompts are all done -> its result line

``--resume`` reads the keys of OUT's result lines first (``result_keys``: custom_ids, or line
numbers for lines without one) and skips those input lines. Duplicate custom_ids are found by
``scan_input`` before the job starts: results could not be told apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.engine.request_checks import RequestError
from batchgen.openai.batch_lines import BatchLine, LineError, read_line, resume_key
from batchgen.openai.batch_output import line_error_line, request_error_line, success_line
from batchgen.openai.prompts import line_seed, prompt_ids
from batchgen.openai.request_body import NO_DEFAULTS, BodyError, parse_body, sampling_of
from batchgen.text.generation import PromptResult, TextEngine, TextPrompt
from batchgen.text.generation_defaults import GenerationDefaults
from compare.jsonl_writer import JsonLinesFile


@dataclass(slots=True)
class JobCounts:
    """What a job did. Mutated as it runs."""

    lines_done: int = 0  # result lines written, error lines included
    lines_failed: int = 0  # error lines among them
    lines_skipped: int = 0  # already in OUT (--resume)
    tokens_generated: int = 0


@dataclass(slots=True)
class _InFlight:
    line: BatchLine
    num_prompts: int
    results: dict[int, PromptResult] = field(default_factory=dict)


def numbered_lines(path: str | Path) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text without its newline) for each line of ``path`` that is not
    blank; text None for a line that is not UTF-8. Reads as a stream."""
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            if raw.strip():
                try:
                    yield number, raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    yield number, None


def read_numbered(number: int, text: str | None) -> BatchLine | LineError:
    if text is None:
        return LineError(number, None, None, f"line {number}: not UTF-8")
    return read_line(number, text)


@dataclass(frozen=True, slots=True)
class InputScan:
    num_lines: int  # lines that are not blank
    duplicates: tuple[str, ...]  # custom_ids more than one line uses, in first-seen order


def scan_input(path: str | Path) -> InputScan:
    """Count the lines of ``path`` and find its duplicate custom_ids (one streaming pass)."""
    seen: set[str] = set()
    duplicates: dict[str, None] = {}
    num_lines = 0
    for number, text in numbered_lines(path):
        num_lines += 1
        custom_id = read_numbered(number, text).custom_id
        if custom_id is not None:
            if custom_id in seen:
                duplicates[custom_id] = None
            seen.add(custom_id)
    return InputScan(num_lines, tuple(duplicates))


def result_keys(path: str | Path) -> set[str]:
    """The keys of the result lines in ``path`` (see ``resume_key``); ValueError naming a line that
    is no result line. A torn last line must have been cut off already."""
    keys = set()
    for number, text in numbered_lines(path):
        try:
            data = json.loads(text) if text is not None else None
        except json.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or "custom_id" not in data:
            raise ValueError(f"{path}:{number}: not a result line (a JSON object with custom_id)")
        error = data.get("error") or {}
        keys.add(resume_key(data["custom_id"], error.get("line", number)))
    return keys


class BatchJob:
    """Runs input lines through ``engine``, writing result lines to ``out`` (open). Mutates the
    engine, ``out`` and ``counts``."""

    def __init__(
        self,
        engine: TextEngine,
        out: JsonLinesFile,
        *,
        served_model: str,
        seed: int,
        max_in_flight: int,
        skip: set[str] = frozenset(),
        defaults: GenerationDefaults = NO_DEFAULTS,
        on_progress: Callable[[JobCounts], None] | None = None,
    ):
        self.engine, self.out = engine, out
        self.defaults = defaults
        self.served_model, self.seed, self.max_in_flight = served_model, seed, max_in_flight
        self.skip = skip
        self.on_progress = on_progress
        self.counts = JobCounts()
        self._in_flight: dict[str, _InFlight] = {}

    def run(self, lines: Iterable[tuple[int, str | None]]) -> JobCounts:
        """Every line of ``lines`` to its result line. Returns the counts."""
        source = iter(lines)
        exhausted = False
        while True:
            while not exhausted and len(self._in_flight) < self.max_in_flight:
                line = next(source, None)
                if line is None:
                    exhausted = True
                else:
                    self._admit(*line)
            if not self.engine.has_unfinished():
                if exhausted:
                    return self.counts
                continue
            for result in self.engine.step():
                self._prompt_done(result)

    def _admit(self, number: int, text: str | None) -> None:
        """Read one input line: write its error line, or queue its prompts. Mutates self."""
        with self.engine.text_cpu:
            line = read_numbered(number, text)
        if resume_key(line.custom_id, number) in self.skip:
            self.counts.lines_skipped += 1
            return
        if isinstance(line, LineError):
            if line.status is None:
                self._write(line_error_line(number, line.custom_id, line.message), failed=True)
            else:
                self._refuse(line.custom_id, BodyError(line.status, line.message, line.param))
            return
        try:
            prompts = self._prompts(line)
            for prompt in prompts:
                self.engine.check(prompt)
        except BodyError as error:
            self._refuse(line.custom_id, error)
            return
        except RequestError as error:
            self._refuse(line.custom_id, BodyError(400, str(error).split(": ", 1)[-1]))
            return
        for prompt in prompts:
            self.engine.add(prompt)
        self._in_flight[line.custom_id] = _InFlight(line, len(prompts))

    def _prompts(self, line: BatchLine) -> list[TextPrompt]:
        """The line's prompts, tokenized (on the text CPU clock). BodyError for a bad body."""
        body = parse_body(line.url, line.body, self.served_model)
        sampling = sampling_of(body, line_seed(self.seed, line.custom_id), self.defaults)
        with self.engine.text_cpu:
            ids = prompt_ids(body, self.engine.tokenizer)
        return [
            TextPrompt(f"{p}:{line.custom_id}", prompt, sampling) for p, prompt in enumerate(ids)
        ]

    def _prompt_done(self, result: PromptResult) -> None:
        """Note a finished prompt; write its line's result once it was the last. Mutates self."""
        index, _, custom_id = result.key.partition(":")
        pending = self._in_flight[custom_id]
        pending.results[int(index)] = result
        self.counts.tokens_generated += sum(len(c.token_ids) for c in result.completions)
        if len(pending.results) < pending.num_prompts:
            return
        del self._in_flight[custom_id]
        results = [pending.results[p] for p in range(pending.num_prompts)]
        failed = next((r.error for r in results if r.error is not None), None)
        if failed is not None:
            self._refuse(custom_id, BodyError(500, f"the engine failed the request: {failed}"))
            return
        decode = self.engine.tokenizer.decode
        with self.engine.text_cpu:
            line = success_line(
                custom_id, pending.line.url, self.served_model, results, lambda t: decode([t])
            )
        self._write(line, failed=False)

    def _refuse(self, custom_id: str, error: BodyError) -> None:
        self._write(request_error_line(custom_id, error.status, str(error), error.param), True)

    def _write(self, line: dict, failed: bool) -> None:
        """Write one result line (durably) and count it. Mutates ``out`` and the counts."""
        self.out.write_line(json.dumps(line))
        self.counts.lines_done += 1
        self.counts.lines_failed += failed
        if self.on_progress is not None:
            self.on_progress(self.counts)
