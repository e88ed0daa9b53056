"""Helpers the command's tests share."""

import json

from batchgen.cli import main
from batchgen.engine.worker import Worker
from compare import DivergenceRecord, read_log


def one_json_object(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


def run_json(capsys, *flags: str) -> dict:
    """``batchgen run --workload smoke --json FLAGS``: its summary."""
    assert main(["run", "--workload", "smoke", "--json", *flags]) == 0
    return one_json_object(capsys.readouterr().out)


def interrupt_at_step(monkeypatch, num_steps: int) -> None:
    """Make the worker's ``num_steps``-th step raise KeyboardInterrupt before it runs, as Ctrl-C
    would."""
    worker_step, steps = Worker.step, []

    def step(self):
        steps.append(1)
        if len(steps) == num_steps:
            raise KeyboardInterrupt
        worker_step(self)

    monkeypatch.setattr(Worker, "step", step)


TWO_REQUESTS = {
    "name": "two",
    "cache": {"page_size": 4, "num_gpu_pages": 16, "num_host_pages": 4},
    "requests": [
        {"uuid": "a", "prompt_ids": [1, 2, 3], "max_new_tokens": 5},
        {
            "uuid": "b",
            "prompt_ids": [4, 5],
            "max_new_tokens": 9,
            "arrival_step": 1,
            "abort_step": 3,
        },
    ],
}


def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def num_divergences(log) -> int:
    return sum(isinstance(record, DivergenceRecord) for record in read_log(log).records)
