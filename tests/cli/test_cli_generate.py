"""``batchgen generate``: OpenAI batch lines in, result lines out; bad lines get their own error
lines, duplicates stop the job, --resume after a SIGKILL, seeds, compare mode."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from batchgen.cli import main
from batchgen.text.generation import TextEngine
from batchgen.text.tiny_checkpoint import make_checkpoint
from batchgen.text.tokenizer import TextTokenizer

POOLS = ["--gpu-pages", "256", "--host-pages", "32", "--threads", "1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-ckpt")


def completion(custom_id: str, **body) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": 6, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def chat(custom_id: str, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_input(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def generate(checkpoint, input_path, output_path, *extra) -> int:
    argv = ["generate", "-i", input_path, "-o", str(output_path), "--model", str(checkpoint)]
    return main([*argv, *POOLS, "--json", *extra])


def results(path) -> dict[str, dict]:
    """custom_id (or 'line N') -> its result line, with the clock's ``created`` left out."""
    by_key = {}
    for text in path.read_text().splitlines():
        line = json.loads(text)
        body = (line["response"] or {}).get("body", {})
        body.pop("created", None)
        by_key[line["custom_id"] or f"line {line['error']['line']}"] = line
    return by_key


def test_every_bad_line_gets_its_own_error_and_the_rest_complete(checkpoint, tmp_path, capsys):
    lines = [
        completion("ok-1"),
        completion("other-model", model="gpt-4o"),
        completion("too-hot", temperature=2.5),
        completion("unknown", frequency_penalty=0.5),
        '{"custom_id": "torn-json", "method": "POST", "url": ',
        chat("ok-2"),
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        chat("too-many-logprobs", logprobs=True, top_logprobs=21),
        completion("too-long", max_tokens=5000),
    ]
    out = tmp_path / "out.jsonl"
    assert generate(checkpoint, write_input(tmp_path / "in.jsonl", lines), out) == 0
    summary = json.loads(capsys.readouterr().out)
    got = results(out)

    def refusal(key):
        response = got[key]["response"]
        return response["status_code"], response["body"]["error"]["param"]

    assert (summary["lines_done"], summary["lines_failed"]) == (9, 7)
    assert got["ok-1"]["response"]["status_code"] == 200
    assert got["ok-2"]["response"]["body"]["object"] == "chat.completion"
    assert refusal("other-model") == (404, None)
    assert refusal("too-hot") == (400, "temperature")
    assert refusal("unknown") == (400, "frequency_penalty")
    assert refusal("bad-url") == (400, "url")
    assert refusal("too-many-logprobs") == (400, "top_logprobs")
    assert refusal("too-long")[0] == 400
    assert "exceeds the model's context" in got["too-long"]["response"]["body"]["error"]["message"]
    torn = got["torn-json"]
    assert torn["response"] is None and torn["error"]["line"] == 5
    assert torn["error"]["message"].startswith("line 5: not JSON")


def test_a_result_line_has_the_openai_batch_output_shape(checkpoint, tmp_path, capsys):
    lines = [completion("c", n=2, logprobs=2), chat("h", logprobs=True, top_logprobs=1)]
    out = tmp_path / "out.jsonl"
    assert generate(checkpoint, write_input(tmp_path / "in.jsonl", lines), out) == 0
    got = results(out)
    body = got["c"]["response"]["body"]
    assert set(got["c"]) == {"id", "custom_id", "response", "error"}
    assert got["c"]["id"].startswith("batch_req_") and got["c"]["error"] is None
    assert body["object"] == "text_completion" and body["model"] == "tiny-ckpt"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 6
    logprobs = body["choices"][0]["logprobs"]
    # keyed by token text, as OpenAI's shape is: two tokens of one text share a key
    for top, token_logprob in zip(logprobs["top_logprobs"], logprobs["token_logprobs"]):
        assert 1 <= len(top) <= 2 and max(top.values()) >= token_logprob
    num_prompt = len(TextTokenizer(checkpoint).encode("Once upon a time"))  # BOS included
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 12,
        "total_tokens": num_prompt + 12,
        "prompt_tokens_details": {"cached_tokens": 0},  # a prompt shorter than a page
    }
    message = got["h"]["response"]["body"]["choices"][0]
    assert message["message"]["role"] == "assistant"
    assert len(message["logprobs"]["content"]) == 5
    assert all(len(e["top_logprobs"]) == 1 for e in message["logprobs"]["content"])


def test_duplicate_custom_ids_stop_the_job_before_it_starts(checkpoint, tmp_path, capsys):
    lines = [completion("a"), completion("b"), completion("a"), completion("b"), completion("c")]
    out = tmp_path / "out.jsonl"
    assert generate(checkpoint, write_input(tmp_path / "in.jsonl", lines), out) == 2
    error = capsys.readouterr().err
    assert "2 custom_ids are used by more than one line ('a', 'b')" in error
    assert not out.exists()


def test_a_line_without_seed_draws_from_the_job_seed_and_its_custom_id(checkpoint, tmp_path):
    lines = [completion(f"s{i}", temperature=1.0) for i in range(3)]
    input_path = write_input(tmp_path / "in.jsonl", lines)
    runs = {}
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert generate(checkpoint, input_path, tmp_path / f"{name}.jsonl", "--seed", seed) == 0
        runs[name] = results(tmp_path / f"{name}.jsonl")
    alone = tmp_path / "alone.jsonl"
    one = write_input(tmp_path / "one.jsonl", lines[1:2])
    assert generate(checkpoint, one, alone, "--seed", "1") == 0

    def texts(run):
        return {k: v["response"]["body"]["choices"][0]["text"] for k, v in run.items()}

    assert texts(runs["a"]) == texts(runs["b"])
    assert texts(runs["a"]) != texts(runs["c"])
    assert texts(results(alone))["s1"] == texts(runs["a"])["s1"]  # another batch composition


def test_resume_after_a_sigkill_gives_exactly_the_lines_of_an_uninterrupted_run(
    checkpoint, tmp_path
):
    lines = [completion(f"k{i}", max_tokens=12 + i % 5) for i in range(40)]
    lines[7] = completion("k7", temperature=9)  # an error line is a result too
    input_path = write_input(tmp_path / "in.jsonl", lines)
    whole = tmp_path / "whole.jsonl"
    assert generate(checkpoint, input_path, whole, "--max-in-flight", "2") == 0

    killed = tmp_path / "killed.jsonl"
    argv = [sys.executable, "-m", "batchgen", "generate", "-i", input_path, "-o", str(killed)]
    child = subprocess.Popen(
        [*argv, "--model", str(checkpoint), *POOLS, "--max-in-flight", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while not (killed.exists() and killed.read_text().count("\n") >= 5):
            assert child.poll() is None and time.monotonic() < deadline, "ended before the kill"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    num_before = killed.read_text().count("\n")
    with open(killed, "a") as file:
        file.write('{"id": "batch_req_x", "custom_id": "k3')  # as if killed mid-write

    assert generate(checkpoint, input_path, killed, "--max-in-flight", "2", "--resume") == 0

    assert 5 <= num_before < 40
    assert results(killed) == results(whole)
    assert killed.read_text().count("\n") == 40


def test_compare_mode_shadows_the_job_and_leaves_the_text_unchanged(
    checkpoint, tmp_path, monkeypatch
):
    lines = [completion(f"p{i}", max_tokens=20, temperature=0.8) for i in range(12)]
    input_path = write_input(tmp_path / "in.jsonl", lines)
    pressure = ["--gpu-pages", "12", "--host-pages", "4", "--page-size", "4"]
    outputs = {}
    for name, path_flag, compare in (("off", "plan", "off"), ("plan", "plan", "log")):
        log = tmp_path / f"{name}.log"
        flags = ["--kv-path", path_flag, "--kv-compare", compare, "--kv-compare-log", str(log)]
        argv = ["generate", "-i", input_path, "-o", str(tmp_path / f"{name}.jsonl")]
        assert main([*argv, "--model", str(checkpoint), *pressure, *flags, "--json"]) == 0
        outputs[name] = results(tmp_path / f"{name}.jsonl")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE", "log")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_PATH", "legacy")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE_LOG", str(tmp_path / "legacy.log"))
    argv = ["generate", "-i", input_path, "-o", str(tmp_path / "legacy.jsonl")]
    assert main([*argv, "--model", str(checkpoint), *pressure, "--json"]) == 0
    outputs["legacy"] = results(tmp_path / "legacy.jsonl")

    assert outputs["plan"] == outputs["off"] == outputs["legacy"]
    for name in ("plan", "legacy"):
        records = [json.loads(x) for x in (tmp_path / f"{name}.log").read_text().splitlines()]
        summary = records[-1]
        assert summary["record_type"] == "run_summary" and summary["workload"] == "in.jsonl"
        assert sum(summary["steps_compared"].values()) > 0
        assert sum(summary["divergences"].values()) == 0
        assert sum(summary["timeline"]["counters"]["evictions"]) > 0  # the pools were pressed


def test_ctrl_c_mid_job_leaves_out_in_whole_lines_and_the_log_its_summary(
    checkpoint, tmp_path, monkeypatch, capsys
):
    lines = [completion(f"i{i}", max_tokens=10) for i in range(20)]
    input_path = write_input(tmp_path / "in.jsonl", lines)
    real_step, calls = TextEngine.step, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 25:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(TextEngine, "step", interrupted)
    log, out = tmp_path / "kv.log", tmp_path / "out.jsonl"
    flags = ["--max-in-flight", "4", "--kv-compare", "log", "--kv-compare-log", str(log)]
    assert generate(checkpoint, input_path, out, *flags) == 130
    assert "batchgen: interrupted" in capsys.readouterr().err
    done = results(out)  # every line parses
    assert 0 < len(done) < 20 and out.read_text().endswith("\n")
    summary = json.loads(log.read_text().splitlines()[-1])
    assert summary["record_type"] == "run_summary" and "KeyboardInterrupt" in summary["stopped_by"]
