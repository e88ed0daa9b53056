"""``batchgen generate --replicas 2`` on a local Ray instance of 2 CPUs and on local processes: the
lines of a run in this process, a replica that dies after K lines, a poison line, ``--resume``
after a SIGKILL of the driver, and the refusals at start.

Faults come from test replicas (``replica_faults``) handed to the driver as its replica factory.
Results are compared line by line: equal where each line ran alone in both runs (the same batch
composition), else under the project's near-tie rule (``agree``).
"""

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from replica_faults import DiesOnceAfter, EndsOnPoison

from batchgen.cli import build_parser, main
from batchgen.cli.generate_replicas import generate_on_replicas
from batchgen.text.tiny_checkpoint import make_checkpoint
from batchgen.validation.output_check import NEAR_TIE_TOLERANCES

POOLS = ["--gpu-pages", "256", "--host-pages", "32", "--threads", "1"]
TWO = ["--replicas", "2", "--block-lines", "4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-ckpt")


def batch_line(i: int) -> dict:
    """Line ``i`` of the job: completions with log-probabilities (greedy, or seeded draws, two
    samples), a chat line, a line refused for its temperature."""
    if i % 6 == 5:
        body = {"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 5}
        return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    body = {"prompt": f"Once upon a time {i}", "max_tokens": 6 + i % 5, "logprobs": 2}
    if i % 3 == 1:
        body.update(temperature=0.8, n=2)
    if i == 7:
        body["temperature"] = 9
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}


def write_input(path: Path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def argv(checkpoint, input_path, output_path, *extra) -> list[str]:
    files = ["generate", "-i", str(input_path), "-o", str(output_path)]
    return [*files, "--model", str(checkpoint), *POOLS, "--json", *extra]


def generate(checkpoint, input_path, output_path, *extra, replica=None) -> int:
    """``batchgen generate``; with ``replica``, on the driver with that replica factory."""
    if replica is None:
        return main(argv(checkpoint, input_path, output_path, *extra))
    args = build_parser().parse_args(argv(checkpoint, input_path, output_path, *extra))
    return generate_on_replicas(args, replica=replica)


def results(path: Path) -> dict[str, dict]:
    """custom_id -> its result line (the clock's ``created`` left out); fails on a custom_id
    written twice."""
    by_key = {}
    for text in path.read_text().splitlines():
        line = json.loads(text)
        (line["response"] or {}).get("body", {}).pop("created", None)
        assert line["custom_id"] not in by_key, f"{line['custom_id']} written twice"
        by_key[line["custom_id"]] = line
    return by_key


def agree(reference: dict[str, dict], candidate: dict[str, dict]) -> list[str]:
    """The custom_ids whose lines differ beyond the near-tie rule: each completion's tokens equal
    up to a first difference where each run's token is among the other's top 2 and the
    reference's two log-probabilities differ by less than float32's tolerance. Pure."""
    assert set(candidate) == set(reference)
    return [key for key in reference if not _lines_agree(reference[key], candidate[key])]


def _lines_agree(reference: dict, candidate: dict) -> bool:
    if reference == candidate:
        return True
    choices = [r["response"]["body"].get("choices", []) for r in (reference, candidate)]
    if not choices[0] or len(choices[0]) != len(choices[1]):
        return False
    return all(_near_tie(a.get("logprobs"), b.get("logprobs")) for a, b in zip(*choices))


def _near_tie(reference: dict | None, candidate: dict | None) -> bool:
    if reference is None or candidate is None or "tokens" not in reference:
        return reference == candidate
    pairs = list(zip(reference["tokens"], candidate["tokens"]))
    i = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    if i is None:
        return reference["tokens"] == candidate["tokens"]
    ours, theirs = reference["top_logprobs"][i], candidate["top_logprobs"][i]
    mine, other = pairs[i]
    if other not in ours or mine not in theirs:
        return False
    return abs(ours[mine] - ours[other]) < NEAR_TIE_TOLERANCES["float32"]


@pytest.fixture(scope="module")
def job(tmp_path_factory, checkpoint):
    """24 lines, and their results in this process with one line in flight (each line alone)."""
    directory = tmp_path_factory.mktemp("job")
    input_path = write_input(directory / "in.jsonl", [batch_line(i) for i in range(24)])
    out = directory / "reference.jsonl"
    assert generate(checkpoint, input_path, out, "--max-in-flight", "1") == 0
    return input_path, results(out)


@pytest.mark.parametrize(
    "backend, in_flight, exact", [("ray", "1", True), ("processes", "4", False)]
)
def test_two_replicas_give_the_lines_of_a_run_in_this_process(
    backend, in_flight, exact, job, checkpoint, tmp_path, capsys, request
):
    if backend == "ray":
        request.getfixturevalue("ray_instance")
    input_path, reference = job
    out, log, metrics = tmp_path / "out.jsonl", tmp_path / "kv.log", tmp_path / "metrics.prom"
    compare = ["--kv-compare", "log", "--kv-compare-log", str(log), "--metrics-file", str(metrics)]
    flags = [*TWO, "--backend", backend, "--max-in-flight", in_flight, *compare]
    assert generate(checkpoint, input_path, out, *flags) == 0
    summary = json.loads(capsys.readouterr().out)

    got = results(out)
    assert got == reference if exact else agree(reference, got) == []
    assert (summary["lines_done"], summary["lines_failed"], summary["replicas"]) == (24, 1, 2)
    assert summary["replica_restarts"] == 0 and summary["divergences"] == 0
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["record_type"] for r in runs] == ["run_summary"] * 2  # one per replica
    assert {r["workload"] for r in runs} == {"in.jsonl"}
    assert sum(sum(r["steps_compared"].values()) for r in runs) == summary["steps_compared"] > 0
    tokens = [
        x
        for x in metrics.read_text().splitlines()
        if x.startswith("batchgen:generation_tokens_total{")
    ]
    by_replica = {line.split('replica="')[1][0]: float(line.split()[-1]) for line in tokens}
    assert set(by_replica) == {"0", "1"} and all(by_replica.values())
    assert sum(by_replica.values()) == summary["tokens_generated"]


@pytest.mark.parametrize("backend", ["ray", "processes"])
def test_a_replica_that_dies_after_k_lines_has_its_lines_run_again_and_none_twice(
    backend, job, checkpoint, tmp_path, capsys, request
):
    if backend == "ray":
        request.getfixturevalue("ray_instance")
    input_path, reference = job
    dies = partial(DiesOnceAfter, after_lines=6, marker=str(tmp_path / "died"))
    out = tmp_path / "out.jsonl"
    assert generate(checkpoint, input_path, out, *TWO, "--backend", backend, replica=dies) == 0
    summary = json.loads(capsys.readouterr().out)

    assert agree(reference, results(out)) == []  # results() fails on a line written twice
    assert (summary["replica_restarts"], summary["lines_retried"]) == (1, 4)  # its block, alone
    assert summary["lines_done"] == 24


def test_a_poison_line_gets_its_error_line_after_its_retries_and_the_others_are_whole(
    job, checkpoint, tmp_path, capsys
):
    input_path, reference = job
    lines = Path(input_path).read_text().splitlines()
    lines.insert(9, json.dumps({**batch_line(0), "custom_id": "poison"}))
    poisoned = tmp_path / "in.jsonl"
    poisoned.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    flags = [*TWO, "--backend", "processes", "--max-retries", "1"]
    assert generate(checkpoint, poisoned, out, *flags, replica=EndsOnPoison) == 0
    summary = json.loads(capsys.readouterr().out)

    got = results(out)
    error = got.pop("poison")["response"]
    assert error["status_code"] == 500
    assert "ended its replica 2 times" in error["body"]["error"]["message"]
    assert agree(reference, got) == []
    assert (summary["lines_done"], summary["replica_restarts"]) == (25, 2)


def stopped_at(command: list[str], out: Path, num_lines: int, signum: int) -> int:
    """Run ``command``, send it ``signum`` once ``out`` holds ``num_lines`` lines; its status."""
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= num_lines):
            assert child.poll() is None and time.monotonic() < deadline, "ended before the signal"
            time.sleep(0.01)
        os.kill(child.pid, signum)
    finally:
        child.wait()
    return child.returncode


def test_sigterm_then_resume_then_sigkill_then_resume_in_this_process_gives_the_same_lines(
    job, checkpoint, tmp_path
):
    input_path, reference = job
    out = tmp_path / "out.jsonl"
    flags = [*TWO, "--backend", "processes", "--block-lines", "2", "--max-in-flight", "1"]
    command = [sys.executable, "-m", "batchgen", *argv(checkpoint, input_path, out, *flags)]

    assert stopped_at(command, out, 2, signal.SIGTERM) == 143
    num_terminated = out.read_text().count("\n")
    assert out.read_text().endswith("\n")
    stopped_at([*command, "--resume"], out, num_terminated + 2, signal.SIGKILL)
    num_killed = out.read_text().count("\n")
    with open(out, "a") as file:
        file.write('{"id": "batch_req_x", "custom_id": "r3')  # as if killed mid-write
    assert generate(checkpoint, input_path, out, "--resume") == 0  # in this process

    assert 2 <= num_terminated < num_killed < 24
    assert agree(reference, results(out)) == []


def test_more_replicas_than_cpus_are_refused_at_start_with_one_line(
    job, checkpoint, tmp_path, capsys, ray_instance
):
    input_path, _ = job
    out = tmp_path / "out.jsonl"
    assert generate(checkpoint, input_path, out, "--replicas", "3") == 2
    assert capsys.readouterr().err == (
        "batchgen: error: --replicas 3 of --threads 1 need 3 CPUs; the local Ray instance has 2"
        " (--num-cpus)\n"
    )
    flags = ["--replicas", "2", "--backend", "processes", "--num-cpus", "1"]
    assert generate(checkpoint, input_path, out, *flags) == 2
    assert "need 2 CPUs; this machine gives them 1 (--num-cpus)" in capsys.readouterr().err
    assert not out.exists()


def test_without_ray_the_job_is_refused_with_sweeps_message(job, checkpoint, tmp_path, capsys):
    input_path, _ = job
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "ray", None)  # import ray fails
        assert generate(checkpoint, input_path, tmp_path / "out.jsonl", "--replicas", "2") == 2
    assert capsys.readouterr().err == (
        "batchgen: error: --backend ray needs Ray, which is not installed: pip install"
        " 'batchgen[ray]' (or use --backend processes)\n"
    )


def test_a_model_missing_on_the_node_names_it_and_no_replica_left_exits_1(
    job, checkpoint, tmp_path, capsys
):
    input_path, _ = job
    missing = tmp_path / "not-here"
    files = ["generate", "-i", input_path, "-o", str(tmp_path / "out.jsonl")]
    flags = [*TWO, "--backend", "processes", "--model", str(missing)]
    assert main([*files, *flags]) == 1
    err = capsys.readouterr().err
    node = os.uname().nodename
    for replica in (0, 1):  # each names the node once in its warning, whichever fails last
        warning = f"batchgen: warning: replica {replica} could not start on node {node}: "
        assert err.count(warning) == 1, err
    assert str(missing) in err.splitlines()[0]
    assert err.splitlines()[-1].startswith("batchgen: error: no replica could start")
    assert "24 lines have no result line (--resume continues the job)" in err
