"""Every bad input the ``batchgen`` command must refuse, and how: one list, ``CASES``.

Each case builds its input files in an empty working directory (paths in ``argv``
are relative to it, so messages are the same on every machine), runs
``batchgen.cli.main(argv)`` with ``env`` as the only ``BATCHGEN_WORKER_KV_*``
variables, and expects exit code 2 with one ``batchgen: error:`` line holding every
``expected`` fragment: what was wrong and what is allowed. ``outputs`` are files the
command was asked to write; none may exist afterwards.

Used by ``tests/test_bad_input.py`` (the assertions) and
``scripts/gen_reliability_doc.py`` (the table in ``docs/reliability.md``).
A case with ``known_bug`` is not handled as it should be yet: the test expects it
to fail (strict xfail) and the table says so.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchgen.cli import main
from batchgen.config import ModelConfig
from batchgen.kv.gate import ENV_PREFIX
from batchgen.kv.plans import (
    KvGeometry,
    KvPreState,
    KvSnapshot,
    ReleaseRequest,
    RequestKvView,
    to_jsonable,
)
from batchgen.model.llama import LlamaForCausalLM
from batchgen.model.stacked import hf_tensors
from compare import DivergenceRecord, RunSummary

CATEGORIES = (
    "CLI argument",
    "gate variable",
    "workload file",
    "checkpoint directory",
    "divergence log",
    "fault spec",
)
# Variables that would change what a case does: the gate family (by prefix) and the report's step
# summary.
ISOLATED_ENV = ("GITHUB_STEP_SUMMARY",)
# Internals that make a message unclear: a traceback, or a pydantic error rendered whole.
NOISE = ("Traceback", "validation error for", "input_value=", "errors.pydantic.dev")
# Warnings Python hides by default (outside __main__); any other warning is printed, as a real
# process would.
HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
Builder = Callable[[Path], None]


@dataclass(frozen=True, slots=True)
class BadInput:
    id: str
    category: str  # one of CATEGORIES
    description: str  # one line: what is wrong with the input
    argv: tuple[str, ...]  # after ``batchgen``; paths relative to the working directory
    expected: tuple[str, ...]  # fragments the error line must hold
    # the BATCHGEN_WORKER_KV_* variables set (all others unset)
    env: tuple[tuple[str, str], ...] = ()
    build: Builder | None = None  # writes the input files into the working directory
    outputs: tuple[str, ...] = ()  # files the command was asked to write: none may exist afterwards
    known_bug: str | None = None  # why this case is not handled yet (the test is a strict xfail)

    @property
    def command(self) -> str:
        """The shell command line of the case."""
        return " ".join(
            [
                *(f"{name}={shlex.quote(value)}" for name, value in self.env),
                "batchgen",
                *map(shlex.quote, self.argv),
            ]
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one run of a case printed and returned; an exception escaping ``main`` counts as exit
    1."""

    exit_code: int
    stdout: str
    stderr: str


# ---- input builders ------------------------------------------------------------------------------
def write(name: str, content: str | bytes) -> Builder:
    def build(workdir: Path) -> None:
        path = workdir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())

    return build


def both(*builders: Builder) -> Builder:
    def build(workdir: Path) -> None:
        for builder in builders:
            builder(workdir)

    return build


def workload(request: dict | None = None, **top) -> Builder:
    """A small valid workload file with ``request`` merged into its one request and ``top`` into the
    object."""
    data = {
        "name": "bad",
        "cache": {"page_size": 4, "num_gpu_pages": 16, "num_host_pages": 4},
        "requests": [
            {"uuid": "r0", "prompt_ids": [1, 2, 3], "max_new_tokens": 4, **(request or {})}
        ],
        **top,
    }
    return write("workload.json", json.dumps(data))


HF_CONFIG = dict(
    model_type="llama",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    max_position_embeddings=256,
)
DROPPED = "model.layers.1.mlp.down_proj.weight"


def checkpoint(
    *, config: dict | None = None, tensors: Callable[[dict], dict] | None = None
) -> Builder:
    """An HF-format directory (config.json + model.safetensors) of a 2-layer model; ``tensors``
    edits the state dict."""

    def build(workdir: Path) -> None:
        path = workdir / "ckpt"
        path.mkdir(parents=True)
        torch.manual_seed(0)
        model = LlamaForCausalLM(ModelConfig.from_hf_dict(HF_CONFIG))
        named = hf_tensors(dict(model.named_parameters()), model.config)
        state = {name: tensor.detach().clone() for name, tensor in named.items()}
        (path / "config.json").write_text(json.dumps(config if config is not None else HF_CONFIG))
        save_file(tensors(state) if tensors else state, path / "model.safetensors")

    return build


def log_line(record) -> str:
    return record.model_dump_json() + "\n"


SUMMARY = RunSummary(
    binding="kv",
    run_id="smoke-0",
    workload="smoke",
    seed=0,
    authoritative="legacy",
    shadow="plan",
    steps_compared={"alloc": 10},
    divergences={"alloc": 1},
    harness_errors=0,
    compare_seconds=0.0,
    authoritative_seconds=0.0,
)
DIVERGENCE = DivergenceRecord(
    binding="kv",
    run_id="smoke-0",
    workload="smoke",
    seed=0,
    step=3,
    op="alloc",
    authoritative="legacy",
    shadow="plan",
    kind="state",
    field_paths=["requests[r0].gpu_page_ids[0]"],
    diff={},
    exception=None,
    replay={},
    created_at=0.0,
)
GOOD_LOG = log_line(DIVERGENCE) + log_line(SUMMARY)
_SNAPSHOT = KvSnapshot(
    step=3,
    geometry=KvGeometry(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype_size=4,
        num_gpu_pages=16,
        num_host_pages=4,
        watermark=0.0,
        max_num_seqs=8,
        max_load_retries=1,
    ),
    num_free_gpu_pages=16,
    num_free_host_pages=4,
)
# A payload replay can rebuild (a release of nothing, on empty pools): cases change one field of it.
REPLAYABLE = {
    "op": "release",
    "request_type": "ReleaseRequest",
    "request": to_jsonable(ReleaseRequest(_SNAPSHOT, ())),
    "pre_state": to_jsonable(KvPreState(_SNAPSHOT, ())),
    "kv_path": "plan",
    "shadow_path": "legacy",
}
# what minimize reruns
SMOKE_RUN = {"workload_source": "smoke", "kv_path": "legacy", "shadow_path": "plan"}
SMOKE_LOG = log_line(DIVERGENCE.model_copy(update={"replay": SMOKE_RUN})) + log_line(SUMMARY)


def divergence_log(*lines: str) -> Builder:
    return write("div.jsonl", "".join(lines))


# ---- the cases -----------------------------------------------------------------------------------
def case(
    case_id: str,
    category: str,
    description: str,
    argv: str | list[str],
    expected: tuple[str, ...] | str,
    **fields,
) -> BadInput:
    argv = tuple(shlex.split(argv)) if isinstance(argv, str) else tuple(argv)
    expected = (expected,) if isinstance(expected, str) else tuple(expected)
    env = tuple(sorted(fields.pop("env", {}).items()))
    outputs = tuple(fields.pop("outputs", ()))
    return BadInput(
        case_id, category, description, argv, expected, env=env, outputs=outputs, **fields
    )


CLI, GATE, WORKLOAD, CHECKPOINT, LOG, FAULTS = CATEGORIES
RUN = "run --workload smoke"
SWEEP = "sweep --workload smoke --reports-dir reports"
# one /v1/completions line of a batch file for generate: custom_id "a", the prompt to fill in
GENERATE_LINE = (
    '{"custom_id": "a", "method": "POST", "url": "/v1/completions",'
    ' "body": {"model": "ckpt", "prompt": "%s"}}\n'
)
GENERATE = "generate -i in.jsonl -o out.jsonl --model ckpt"
LONG_NAME = "x" * 256  # one byte past the longest file name Linux file systems take

CASES: tuple[BadInput, ...] = (
    # ---- CLI arguments ----
    case("no-command", CLI, "no subcommand", [], ("required: COMMAND",)),
    case(
        "unknown-command",
        CLI,
        "a subcommand that does not exist",
        "frobnicate",
        ("invalid choice: 'frobnicate'", "run", "validate", "report", "replay", "minimize"),
    ),
    case("missing-workload", CLI, "run without --workload", "run", ("required: --workload",)),
    case(
        "unknown-flag",
        CLI,
        "an option run does not have",
        f"{RUN} --workers 4",
        ("unrecognized arguments: --workers 4",),
    ),
    case(
        "negative-scale",
        CLI,
        "--scale below zero",
        f"{RUN} --scale -1",
        ("--scale", "must be a number in (0, 1000]", "'-1'"),
    ),
    case(
        "scale-above-the-cap",
        CLI,
        "--scale above 1000",
        f"{RUN} --scale 1e9",
        ("--scale", "must be a number in (0, 1000]", "'1e9'"),
    ),
    case(
        "infinite-scale",
        CLI,
        "--scale that is not finite",
        f"{RUN} --scale inf",
        ("--scale", "must be a number in (0, 1000]", "'inf'"),
    ),
    case(
        "seed-not-integer",
        CLI,
        "--seed that is not a number",
        f"{RUN} --seed abc",
        ("--seed", "must be an integer >= 0", "'abc'"),
    ),
    case(
        "negative-seed",
        CLI,
        "--seed below zero",
        f"{RUN} --seed -3",
        ("--seed", "must be an integer >= 0", "'-3'"),
    ),
    case(
        "seed-beyond-64-bits",
        CLI,
        "--seed of 2**64 (torch generators take 64-bit seeds)",
        f"{RUN} --seed {2**64}",
        ("--seed", "must be an integer in [0, 2**64 - 1]", f"'{2**64}'"),
    ),
    case(
        "zero-threads",
        CLI,
        "--threads 0",
        f"{RUN} --threads 0",
        ("--threads", "must be an integer >= 1", "'0'"),
    ),
    case(
        "huge-threads",
        CLI,
        "--threads beyond what torch can take (2**64)",
        f"{RUN} --threads 18446744073709551616",
        ("--threads", "must be an integer in [1, 1024]", "'18446744073709551616'"),
    ),
    case(
        "unknown-device",
        CLI,
        "a device batchgen cannot run on",
        f"{RUN} --device tpu",
        ("--device", "invalid choice: 'tpu'", "cpu", "cuda"),
    ),
    case(
        "unknown-dtype",
        CLI,
        "a weight/KV dtype that is not supported",
        f"{RUN} --dtype float64",
        ("--dtype", "invalid choice: 'float64'", "float32", "bfloat16", "float16"),
    ),
    case(
        "kv-path-typo",
        CLI,
        "--kv-path misspelt",
        f"{RUN} --kv-path lgacy",
        ("--kv-path='lgacy'", "allowed: plan, legacy", "did you mean 'legacy'?"),
    ),
    case(
        "faults-key-twice",
        CLI,
        "a --faults KEY given twice",
        f"{RUN} --faults seed=1,seed=2",
        ("--faults", "seed is given twice"),
    ),
    case(
        "kv-compare-sample-above-1",
        CLI,
        "--kv-compare-sample above 1",
        f"{RUN} --kv-compare-sample 2",
        ("--kv-compare-sample='2'", "allowed: a float in (0, 1]"),
    ),
    case(
        "kv-load-retries-negative",
        CLI,
        "--kv-load-retries below zero",
        f"{RUN} --kv-load-retries -1",
        ("--kv-load-retries", "must be an integer >= 0", "'-1'"),
    ),
    case(
        "kv-load-timeout-zero",
        CLI,
        "--kv-load-timeout-steps of 0",
        f"{RUN} --kv-load-timeout-steps 0",
        ("--kv-load-timeout-steps", "must be an integer >= 1", "'0'"),
    ),
    case(
        "schedule-policy-unknown",
        CLI,
        "--schedule-policy that is neither fcfs nor lof",
        f"{RUN} --schedule-policy sjf",
        ("--schedule-policy", "invalid choice: 'sjf'", "'fcfs', 'lof'"),
    ),
    case(
        "report-format",
        CLI,
        "a report format that does not exist",
        "report div.jsonl --format pdf",
        ("--format", "invalid choice: 'pdf'", "text", "md", "junit", "json", "html"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "report-out-is-a-directory",
        CLI,
        "report --out names an existing directory",
        "report div.jsonl --out reports",
        ("--out reports", "cannot write the report", "Is a directory"),
        build=both(divergence_log(GOOD_LOG), write("reports/keep.txt", "kept\n")),
    ),
    case(
        "report-out-is-the-working-directory",
        CLI,
        "report --out names the working directory",
        "report div.jsonl --out .",
        ("--out .", "cannot write the report", "Is a directory"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "report-out-ends-in-a-slash",
        CLI,
        "report --out names a directory that does not exist yet",
        "report div.jsonl --out reports/",
        ("--out reports/", "cannot write the report", "Is a directory"),
        build=divergence_log(GOOD_LOG),
        outputs=["reports"],
    ),
    case(
        "report-out-under-a-file",
        CLI,
        "report --out inside a path whose parent is a file",
        "report div.jsonl --out div.jsonl/report.md",
        ("--out div.jsonl/report.md", "not a directory"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "replay-no-index",
        CLI,
        "replay without --index",
        "replay div.jsonl",
        ("required: --index",),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "replay-index-out-of-range",
        CLI,
        "replay --index past the log's last divergence",
        "replay div.jsonl --index 5",
        ("--index 5 is out of range", "holds 1 divergence records", "--index is 0 to 0"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "minimize-index-out-of-range",
        CLI,
        "minimize --index past the log's last divergence",
        "minimize div.jsonl --index 1 --out-dir minimized",
        ("--index 1 is out of range", "--index is 0 to 0"),
        build=divergence_log(GOOD_LOG),
        outputs=["minimized"],
    ),
    case(
        "kv-compare-log-under-a-file",
        CLI,
        "--kv-compare-log below a path whose ancestor is a file",
        f"{RUN} --kv-compare log --kv-compare-log div.jsonl/runs/kv.jsonl",
        ("--kv-compare-log", "div.jsonl is not a directory"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "outputs-is-a-directory",
        CLI,
        "run --outputs names an existing directory",
        f"{RUN} --outputs reports",
        ("--outputs reports", "cannot write the outputs", "Is a directory"),
        build=write("reports/keep.txt", "kept\n"),
    ),
    case(
        "outputs-under-a-file",
        CLI,
        "run --outputs inside a path whose parent is a file",
        f"{RUN} --outputs div.jsonl/outputs.jsonl",
        ("--outputs div.jsonl/outputs.jsonl", "not a directory"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "outputs-is-the-workload-file",
        CLI,
        "run --outputs names the workload file it reads",
        "run --workload workload.json --outputs workload.json",
        ("--outputs workload.json", "it is the workload file", "name another file"),
        build=workload(),
    ),
    case(
        "outputs-is-the-divergence-log",
        CLI,
        "run --outputs names the divergence log compare mode appends to",
        f"{RUN} --kv-compare log --kv-compare-log div.jsonl --outputs div.jsonl",
        ("--outputs div.jsonl", "it is the divergence log", "name another file"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "validate-reports-dir-is-a-file",
        CLI,
        "validate --reports-dir names a file",
        "validate --reports-dir div.jsonl",
        ("--reports-dir div.jsonl", "div.jsonl is not a directory"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "validate-reports-dir-under-a-file",
        CLI,
        "validate --reports-dir below a file",
        "validate --reports-dir div.jsonl/reports",
        ("--reports-dir div.jsonl/reports", "div.jsonl is not a directory"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "minimize-out-dir-empty",
        CLI,
        "minimize --out-dir given as an empty string",
        ["minimize", "div.jsonl", "--index", "0", "--out-dir", ""],
        ("--out-dir is empty", "name a directory"),
        build=divergence_log(SMOKE_LOG),
    ),
    case(
        "minimize-out-dir-is-a-file",
        CLI,
        "minimize --out-dir names a file",
        "minimize div.jsonl --index 0 --out-dir div.jsonl",
        ("--out-dir div.jsonl", "div.jsonl is not a directory"),
        build=divergence_log(SMOKE_LOG),
    ),
    case(
        "report-out-is-its-log",
        CLI,
        "report --out names the log being read",
        "report div.jsonl --out div.jsonl",
        ("--out div.jsonl", "one of the logs being read"),
        build=divergence_log(GOOD_LOG),
    ),
    case(
        "workload-name-too-long",
        CLI,
        "--workload naming a file whose name is longer than the system allows",
        f"{RUN.split()[0]} --workload {LONG_NAME}",
        ("--workload", "File name too long", "(256 characters)", "at most 255 bytes"),
    ),
    case(
        "validate-reports-dir-name-too-long",
        CLI,
        "validate --reports-dir whose name is longer than the system allows",
        f"validate --reports-dir {LONG_NAME}",
        ("--reports-dir", "File name too long", "at most 255 bytes"),
    ),
    case(
        "minimize-out-dir-name-too-long",
        CLI,
        "minimize --out-dir whose name is longer than the system allows",
        f"minimize div.jsonl --index 0 --out-dir out/{LONG_NAME}",
        ("--out-dir", "cannot create the directory", "File name too long"),
        build=divergence_log(SMOKE_LOG),
        outputs=["out"],
    ),
    case(
        "validate-scale-zero",
        CLI,
        "validate --scale 0",
        "validate --scale 0 --reports-dir reports",
        ("--scale", "must be a number in (0, 1000]", "'0'"),
        outputs=["reports"],
    ),
    # ---- gate variables ----
    case(
        "gate-name-typo",
        GATE,
        "a misspelt BATCHGEN_WORKER_KV_* name",
        RUN,
        ("unknown variable BATCHGEN_WORKER_KV_PAHT", "did you mean BATCHGEN_WORKER_KV_PATH?"),
        env={"BATCHGEN_WORKER_KV_PAHT": "plan"},
    ),
    case(
        "gate-name-lower-case",
        GATE,
        "a BATCHGEN_WORKER_KV_* name in lower case (names are case-sensitive)",
        RUN,
        (
            "unknown variable batchgen_worker_kv_path",
            "did you mean BATCHGEN_WORKER_KV_PATH? names are upper-case",
        ),
        env={"batchgen_worker_kv_path": "legacy"},
    ),
    case(
        "gate-path-value",
        GATE,
        "a path that does not exist",
        RUN,
        ("BATCHGEN_WORKER_KV_PATH='shadow'", "allowed: plan, legacy"),
        env={"BATCHGEN_WORKER_KV_PATH": "shadow"},
    ),
    case(
        "gate-compare-value",
        GATE,
        "a compare mode that does not exist",
        RUN,
        ("BATCHGEN_WORKER_KV_COMPARE='loud'", "allowed: off, log, raise"),
        env={"BATCHGEN_WORKER_KV_COMPARE": "loud"},
    ),
    case(
        "gate-sample-zero",
        GATE,
        "a compare sample of 0",
        RUN,
        ("BATCHGEN_WORKER_KV_COMPARE_SAMPLE='0'", "greater than 0", "allowed: a float in (0, 1]"),
        env={"BATCHGEN_WORKER_KV_COMPARE_SAMPLE": "0"},
    ),
    case(
        "gate-sample-above-1",
        GATE,
        "a compare sample above 1",
        RUN,
        (
            "BATCHGEN_WORKER_KV_COMPARE_SAMPLE='1.5'",
            "less than or equal to 1",
            "allowed: a float in (0, 1]",
        ),
        env={"BATCHGEN_WORKER_KV_COMPARE_SAMPLE": "1.5"},
    ),
    case(
        "gate-sample-not-number",
        GATE,
        "a compare sample that is not a number",
        RUN,
        ("BATCHGEN_WORKER_KV_COMPARE_SAMPLE='abc'", "allowed: a float in (0, 1]"),
        env={"BATCHGEN_WORKER_KV_COMPARE_SAMPLE": "abc"},
    ),
    case(
        "gate-budget-above-1",
        GATE,
        "a compare budget of more than all of step time",
        RUN,
        (
            "BATCHGEN_WORKER_KV_COMPARE_BUDGET='1.5'",
            "less than 1",
            "allowed: a fraction of step time in (0, 1), e.g. 0.02, or off",
        ),
        env={"BATCHGEN_WORKER_KV_COMPARE_BUDGET": "1.5"},
    ),
    case(
        "gate-breaker-errors-zero",
        GATE,
        "a breaker that trips on no harness error at all",
        f"{RUN} --kv-compare log --kv-compare-breaker-errors 0",
        (
            "--kv-compare-breaker-errors='0'",
            "greater than or equal to 1",
            "an integer >= 1, or off",
        ),
    ),
    case(
        "gate-budget-in-validate",
        GATE,
        "a compare budget given to validate, which must compare every op",
        "validate",
        (
            "batchgen validate compares every op it runs, so it refuses"
            " BATCHGEN_WORKER_KV_COMPARE_BUDGET",
            "a validation that stops comparing must not pass",
        ),
        env={"BATCHGEN_WORKER_KV_COMPARE_BUDGET": "0.02"},
    ),
    case(
        "metrics-port-out-of-range",
        CLI,
        "a metrics port past 65535",
        f"{RUN} --metrics-port 70000",
        ("--metrics-port='70000'", "allowed: a port number, 0 to 65535"),
    ),
    case(
        "metrics-variable-typo",
        CLI,
        "a misspelt BATCHGEN_METRICS_* variable",
        RUN,
        ("unknown variable BATCHGEN_METRICS_PROT", "did you mean BATCHGEN_METRICS_PORT?"),
        env={"BATCHGEN_METRICS_PROT": "9100"},
    ),
    case(
        "gate-ops-typo",
        GATE,
        "a misspelt op in the compared ops",
        RUN,
        (
            "BATCHGEN_WORKER_KV_COMPARE_OPS='evcit'",
            "unknown ops ['evcit']",
            "allowed: a comma list of poll, release, evict, migrate, alloc",
        ),
        env={"BATCHGEN_WORKER_KV_COMPARE_OPS": "evcit"},
    ),
    case(
        "gate-ops-empty",
        GATE,
        "a compared-ops list naming no op",
        RUN,
        ("BATCHGEN_WORKER_KV_COMPARE_OPS=','", "no ops named", "allowed: a comma list of"),
        env={"BATCHGEN_WORKER_KV_COMPARE_OPS": ","},
    ),
    case(
        "gate-log-empty",
        GATE,
        "an empty divergence log path",
        RUN,
        ("BATCHGEN_WORKER_KV_COMPARE_LOG=''", "allowed: a file path"),
        env={"BATCHGEN_WORKER_KV_COMPARE_LOG": ""},
    ),
    case(
        "gate-demo-bug-typo",
        GATE,
        "a misspelt demo bug",
        RUN,
        (
            "BATCHGEN_WORKER_KV_COMPARE_DEMO_BUG='reverse-grants'",
            "did you mean 'reversed-grants'?",
        ),
        env={"BATCHGEN_WORKER_KV_COMPARE_DEMO_BUG": "reverse-grants"},
    ),
    case(
        "gate-load-failure-value",
        GATE,
        "a load-failure policy that does not exist",
        RUN,
        ("BATCHGEN_WORKER_KV_LOAD_FAILURE='retry'", "allowed: recompute, fail"),
        env={"BATCHGEN_WORKER_KV_LOAD_FAILURE": "retry"},
    ),
    case(
        "gate-prefix-cache-value",
        GATE,
        "a prefix-caching setting that is neither on nor off",
        RUN,
        ("BATCHGEN_WORKER_KV_PREFIX_CACHE='yes'", "allowed: on, off"),
        env={"BATCHGEN_WORKER_KV_PREFIX_CACHE": "yes"},
    ),
    case(
        "gate-prefix-cache-in-sweep",
        GATE,
        "a misspelt prefix-caching setting given to sweep, which applies it to every run",
        SWEEP,
        ("BATCHGEN_WORKER_KV_PREFIX_CACHE='of'", "allowed: on, off", "did you mean 'off'?"),
        env={"BATCHGEN_WORKER_KV_PREFIX_CACHE": "of"},
        outputs=("reports",),
    ),
    case(
        "prefix-caching-on-and-off",
        CLI,
        "--enable-prefix-caching and --no-enable-prefix-caching together",
        "generate -i in.jsonl -o out.jsonl --model ckpt --enable-prefix-caching"
        " --no-enable-prefix-caching",
        ("argument --no-enable-prefix-caching: not allowed with argument --enable-prefix-caching",),
        outputs=("out.jsonl",),
    ),
    case(
        "gate-log-is-a-directory",
        GATE,
        "the divergence log path is a directory",
        "run --workload workload.json",
        ("BATCHGEN_WORKER_KV_COMPARE_LOG", "logdir", "directory"),
        env={"BATCHGEN_WORKER_KV_COMPARE": "log", "BATCHGEN_WORKER_KV_COMPARE_LOG": "logdir"},
        build=both(write("logdir/keep.txt", ""), workload({"prompt_ids": [1, 600]})),
    ),
    case(
        "gate-option-beats-bad-env",
        GATE,
        "a bad option value is named as the option, not the variable",
        f"{RUN} --kv-compare loud",
        ("--kv-compare='loud'", "allowed: off, log, raise"),
        env={"BATCHGEN_WORKER_KV_COMPARE": "log"},
    ),
    # ---- workload files ----
    case(
        "workload-missing",
        WORKLOAD,
        "a workload file that does not exist",
        "run --workload nope.json",
        ("workload file 'nope.json' does not exist",),
    ),
    case(
        "workload-unknown-name",
        WORKLOAD,
        "neither a built-in workload nor a file",
        "run --workload L2-8192",
        (
            "unknown workload 'L2-8192'",
            "smoke, L2-2048, L2-4096, shared-prefix",
            "workload JSON file",
        ),
    ),
    case(
        "workload-directory",
        WORKLOAD,
        "the workload path is a directory",
        "run --workload traces.json",
        ("workload file 'traces.json' cannot be read", "Is a directory"),
        build=write("traces.json/keep.txt", ""),
    ),
    case(
        "workload-empty-name",
        WORKLOAD,
        "--workload given as an empty string",
        ["run", "--workload", ""],
        (
            "no workload named (an empty string)",
            "smoke, L2-2048, L2-4096, shared-prefix",
            "a workload JSON file",
        ),
    ),
    case(
        "workload-not-json",
        WORKLOAD,
        "a file that is not JSON",
        "run --workload workload.json",
        ("workload file 'workload.json' is not valid JSON", "line 1, column 10"),
        build=write("workload.json", '{"name": '),
    ),
    case(
        "workload-nested-too-deeply",
        WORKLOAD,
        "arrays nested 100,000 deep (beyond Python's recursion limit)",
        "run --workload workload.json",
        ("workload file 'workload.json' nests arrays or objects too deeply",),
        build=write("workload.json", '{"name": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ),
    case(
        "workload-invalid-utf8",
        WORKLOAD,
        "a file with bytes that are not UTF-8",
        "run --workload workload.json",
        ("workload file 'workload.json' is not valid UTF-8", "at byte 10"),
        build=write("workload.json", b'{"name": "\xff\xfe"}'),
    ),
    case(
        "workload-not-object",
        WORKLOAD,
        "a JSON array where the workload object belongs",
        "run --workload workload.json",
        ("workload file 'workload.json' is invalid", "valid dictionary"),
        build=write("workload.json", "[]"),
    ),
    case(
        "workload-string-max-new-tokens",
        WORKLOAD,
        "max_new_tokens given as a string",
        "run --workload workload.json",
        ("requests.0.max_new_tokens", "valid integer"),
        build=workload({"max_new_tokens": "4"}),
    ),
    case(
        "workload-string-token-ids",
        WORKLOAD,
        "prompt token ids given as strings",
        "run --workload workload.json",
        ("requests.0.prompt_ids.0", "valid integer"),
        build=workload({"prompt_ids": ["1", "2"]}),
    ),
    case(
        "workload-float-token-id",
        WORKLOAD,
        "a fractional token id",
        "run --workload workload.json",
        ("requests.0.prompt_ids.1", "valid integer"),
        build=workload({"prompt_ids": [1, 2.5]}),
    ),
    case(
        "workload-negative-max-new-tokens",
        WORKLOAD,
        "max_new_tokens below 1",
        "run --workload workload.json",
        ("requests.0.max_new_tokens", "greater than or equal to 1"),
        build=workload({"max_new_tokens": -5}),
    ),
    case(
        "workload-negative-arrival",
        WORKLOAD,
        "a negative arrival_step",
        "run --workload workload.json",
        ("requests.0.arrival_step", "greater than or equal to 0"),
        build=workload({"arrival_step": -1}),
    ),
    case(
        "workload-huge-max-new-tokens",
        WORKLOAD,
        "max_new_tokens of 10**12",
        "run --workload workload.json --kv-compare log --kv-compare-log div.jsonl",
        ("requests.0.max_new_tokens", "less than or equal to 1000000"),
        build=workload({"max_new_tokens": 10**12}),
        outputs=["div.jsonl"],
    ),
    case(
        "workload-context-overflow",
        WORKLOAD,
        "prompt plus max_new_tokens beyond the model's context",
        "run --workload workload.json --kv-compare log --kv-compare-log div.jsonl",
        ("request 'r0'", "max_new_tokens (5000)", "exceeds the model's context of 4608 tokens"),
        build=workload({"max_new_tokens": 5000}),
        outputs=["div.jsonl"],
    ),
    case(
        "workload-token-beyond-vocab",
        WORKLOAD,
        "a token id beyond the model's vocabulary",
        "run --workload workload.json",
        ("request 'r0'", "token ids [600]", "outside the vocabulary [0, 512)"),
        build=workload({"prompt_ids": [1, 600]}),
    ),
    case(
        "workload-negative-token",
        WORKLOAD,
        "a negative token id",
        "run --workload workload.json",
        ("request 'r0'", "token ids [-1]", "outside the vocabulary [0, 512)"),
        build=workload({"prompt_ids": [-1, 2]}),
    ),
    case(
        "workload-too-big-for-pool",
        WORKLOAD,
        "a request needing more KV pages than the GPU pool has",
        "run --workload workload.json",
        ("request 'r0'", "needs 26 KV pages", "GPU pool has 15 usable pages"),
        build=workload({"prompt_ids": list(range(1, 101))}),
    ),
    case(
        "workload-reserved-uuid",
        WORKLOAD,
        "a uuid in the namespace fault injection reserves pool pages under",
        "run --workload workload.json",
        ("requests.0.uuid", "uuids starting with 'fault:' are reserved"),
        build=workload({"uuid": "fault:gpu-refuse:1"}),
    ),
    case(
        "workload-infinite-temperature",
        WORKLOAD,
        "a temperature of 1e999 (infinite)",
        "run --workload workload.json",
        ("requests.0.temperature", "finite number"),
        build=write(
            "workload.json",
            json.dumps(
                {
                    "name": "bad",
                    "cache": {"page_size": 4, "num_gpu_pages": 16, "num_host_pages": 4},
                    "requests": [
                        {
                            "uuid": "r0",
                            "prompt_ids": [1, 2, 3],
                            "max_new_tokens": 4,
                            "temperature": 1.0,
                        }
                    ],
                }
            ).replace('"temperature": 1.0', '"temperature": 1e999'),
        ),
    ),
    case(
        "workload-no-requests",
        WORKLOAD,
        "an empty requests list",
        "run --workload workload.json",
        ("requests", "at least 1 item"),
        build=workload(requests=[]),
    ),
    case(
        "workload-duplicate-uuids",
        WORKLOAD,
        "two requests with the same uuid",
        "run --workload workload.json",
        ("request uuid 'r0' appears twice",),
        build=write(
            "workload.json",
            json.dumps(
                {
                    "name": "bad",
                    "cache": {"num_gpu_pages": 16, "num_host_pages": 4},
                    "requests": [{"uuid": "r0", "prompt_ids": [1], "max_new_tokens": 2}] * 2,
                }
            ),
        ),
    ),
    case(
        "workload-unknown-field",
        WORKLOAD,
        "a request field that does not exist",
        "run --workload workload.json",
        ("requests.0.max_tokens", "Extra inputs are not permitted"),
        build=workload({"max_tokens": 4}),
    ),
    case(
        "workload-missing-cache",
        WORKLOAD,
        "no cache geometry",
        "run --workload workload.json",
        ("cache", "Field required"),
        build=write(
            "workload.json",
            json.dumps(
                {
                    "name": "bad",
                    "requests": [{"uuid": "r0", "prompt_ids": [1], "max_new_tokens": 2}],
                }
            ),
        ),
    ),
    case(
        "workload-zero-gpu-pages",
        WORKLOAD,
        "a GPU pool of 0 pages",
        "run --workload workload.json",
        ("cache.num_gpu_pages", "greater than 0"),
        build=workload(cache={"num_gpu_pages": 0, "num_host_pages": 4}),
    ),
    case(
        "workload-huge-gpu-pool",
        WORKLOAD,
        "a GPU pool of 10**12 pages (petabytes of KV)",
        "run --workload workload.json",
        (
            "the KV pools need",
            "1000000000000 GPU-tier + 4 host-tier pages",
            "GiB is available",
            "lower num_gpu_pages",
        ),
        build=workload(cache={"num_gpu_pages": 10**12, "num_host_pages": 4}),
    ),
    case(
        "workload-bool-page-size",
        WORKLOAD,
        "a cache page_size of true (a bool where an integer belongs)",
        "run --workload workload.json",
        ("cache.page_size", "valid integer"),
        build=workload(cache={"page_size": True, "num_gpu_pages": 16, "num_host_pages": 4}),
    ),
    case(
        "workload-string-gpu-pages",
        WORKLOAD,
        "a GPU pool size given as a string",
        "run --workload workload.json",
        ("cache.num_gpu_pages", "valid integer"),
        build=workload(cache={"page_size": 4, "num_gpu_pages": "16", "num_host_pages": 4}),
    ),
    case(
        "workload-float-max-num-seqs",
        WORKLOAD,
        "an engine max_num_seqs given as 8.0",
        "run --workload workload.json",
        ("engine.max_num_seqs", "valid integer"),
        build=workload(engine={"max_num_seqs": 8.0}),
    ),
    case(
        "workload-page-size-beyond-int64",
        WORKLOAD,
        "a page_size of 10**30 (no tensor dimension is that long)",
        "run --workload workload.json",
        ("cache.page_size", "less than or equal to 9223372036854775807"),
        build=workload(cache={"page_size": 10**30, "num_gpu_pages": 16, "num_host_pages": 4}),
    ),
    case(
        "workload-host-pool-beyond-int64",
        WORKLOAD,
        "a host pool of 10**30 pages (no tensor dimension is that long)",
        "run --workload workload.json",
        ("cache.num_host_pages", "less than or equal to 9223372036854775807"),
        build=workload(cache={"page_size": 4, "num_gpu_pages": 16, "num_host_pages": 10**30}),
    ),
    case(
        "workload-watermark-keeps-every-page",
        WORKLOAD,
        "a watermark that keeps every GPU page free",
        "run --workload workload.json",
        (
            "cache",
            "watermark 0.6 keeps ceil(0.6 x 2) = 2",
            "leaving none to use",
            "lower the watermark",
        ),
        build=workload(
            cache={"page_size": 4, "num_gpu_pages": 2, "num_host_pages": 4, "watermark": 0.6}
        ),
    ),
    case(
        "workload-nan-watermark",
        WORKLOAD,
        "a watermark of NaN",
        "run --workload workload.json",
        ("cache.watermark", "finite number"),
        build=workload(
            cache={
                "page_size": 4,
                "num_gpu_pages": 16,
                "num_host_pages": 4,
                "watermark": float("nan"),
            }
        ),
    ),
    case(
        "workload-name-unpaired-surrogate",
        WORKLOAD,
        "a workload name holding an unpaired surrogate (\\ud800)",
        "run --workload workload.json",
        ("name:", "unpaired surrogate \\ud800"),
        build=workload(name="w\ud800"),
    ),
    case(
        "workload-uuid-unpaired-surrogate",
        WORKLOAD,
        "a request uuid holding an unpaired surrogate (\\udc00)",
        "run --workload workload.json",
        ("requests.0.uuid", "unicode string"),
        build=workload({"uuid": "r\udc00"}),
    ),
    case(
        "workload-bad-load-failure",
        WORKLOAD,
        "an engine load-failure policy that does not exist",
        "run --workload workload.json",
        ("engine.load_failure", "'recompute' or 'fail'"),
        build=workload(engine={"load_failure": "retry"}),
    ),
    case(
        "generate-missing-input",
        CLI,
        "generate with a batch file that does not exist",
        "generate -i in.jsonl -o out.jsonl --model ckpt",
        ("--input in.jsonl: no such file",),
        build=checkpoint(),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-duplicate-custom-ids",
        CLI,
        "a batch file where two lines share one custom_id",
        "generate -i in.jsonl -o out.jsonl --model ckpt",
        ("--input in.jsonl", "used by more than one line ('a')", "each line needs its own"),
        build=both(checkpoint(), write("in.jsonl", (GENERATE_LINE % "x") + (GENERATE_LINE % "y"))),
        outputs=("out.jsonl",),
    ),
    # generate on replicas (--replicas N, --backend): docs/replicas.md
    case(
        "generate-zero-replicas",
        CLI,
        "generate --replicas 0",
        f"{GENERATE} --replicas 0",
        ("--replicas", "must be an integer >= 1, got '0'"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-unknown-backend",
        CLI,
        "generate --backend that does not exist",
        f"{GENERATE} --replicas 2 --backend slurm",
        ("--backend", "invalid choice: 'slurm'", "ray", "processes"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-num-cpus-in-this-process",
        CLI,
        "generate --num-cpus for a job that runs in this process",
        f"{GENERATE} --num-cpus 4",
        ("--num-cpus applies to a job on replicas", "this one runs in this process"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-block-lines-in-this-process",
        CLI,
        "generate --block-lines for a job that runs in this process",
        f"{GENERATE} --block-lines 8",
        ("--block-lines applies to a job on replicas", "this one runs in this process"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-max-retries-in-this-process",
        CLI,
        "generate --max-retries for a job that runs in this process",
        f"{GENERATE} --max-retries 1",
        ("--max-retries applies to a job on replicas", "this one runs in this process"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-zero-block-lines",
        CLI,
        "generate --block-lines 0",
        f"{GENERATE} --replicas 2 --block-lines 0",
        ("--block-lines", "must be an integer >= 1, got '0'"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-negative-max-retries",
        CLI,
        "generate --max-retries below zero",
        f"{GENERATE} --replicas 2 --max-retries -1",
        ("--max-retries", "must be an integer >= 0, got '-1'"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-ray-address-with-processes",
        CLI,
        "generate --ray-address for replicas on local processes",
        f"{GENERATE} --replicas 2 --backend processes --ray-address auto",
        ("--ray-address applies to --backend ray", "--backend processes runs here"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-num-cpus-with-ray-address",
        CLI,
        "generate --num-cpus while joining a Ray cluster",
        f"{GENERATE} --replicas 2 --ray-address auto --num-cpus 4",
        ("--num-cpus sizes a local Ray instance", "give one of the two"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-replicas-compare-raise",
        CLI,
        "generate on replicas with compare mode raising at the first divergence",
        f"{GENERATE} --replicas 2 --kv-compare raise",
        ("--kv-compare raise stops a job at its first divergence", "on replicas: log"),
        outputs=("out.jsonl",),
    ),
    case(
        "generate-more-replicas-than-cpus",
        CLI,
        "generate with more replicas on local processes than the CPUs given them",
        f"{GENERATE} --replicas 2 --backend processes --num-cpus 1",
        ("--replicas 2 of --threads 1 need 2 CPUs", "this machine gives them 1 (--num-cpus)"),
        build=write("in.jsonl", GENERATE_LINE % "x"),
        outputs=("out.jsonl",),
    ),
    # ---- checkpoint directories ----
    case(
        "generate-model-without-tokenizer",
        CHECKPOINT,
        "generate on a checkpoint directory without tokenizer.json",
        "generate -i in.jsonl -o out.jsonl --model ckpt",
        ("ckpt/tokenizer.json: missing", "needs the checkpoint's fast tokenizer"),
        build=both(checkpoint(), write("in.jsonl", GENERATE_LINE % "x")),
        outputs=("out.jsonl",),
    ),
    case(
        "model-unknown-name",
        CHECKPOINT,
        "neither a built-in model nor a directory",
        f"{RUN} --model llama3",
        ("unknown model name 'llama3'", "tiny, llama2-7b-geometry", "HF-format model directory"),
    ),
    case(
        "model-missing-directory",
        CHECKPOINT,
        "a model directory that does not exist",
        f"{RUN} --model ./ckpt",
        ("./ckpt: directory does not exist",),
    ),
    case(
        "model-is-a-file",
        CHECKPOINT,
        "a file where the model directory belongs",
        f"{RUN} --model ckpt.bin",
        ("ckpt.bin: is a file", "config.json and *.safetensors"),
        build=write("ckpt.bin", "weights"),
    ),
    case(
        "model-no-config",
        CHECKPOINT,
        "a directory without config.json",
        f"{RUN} --model ckpt",
        ("ckpt/config.json: missing", "needs config.json"),
        build=write("ckpt/model.safetensors", ""),
    ),
    case(
        "model-config-not-json",
        CHECKPOINT,
        "a config.json that is not JSON",
        f"{RUN} --model ckpt",
        ("ckpt/config.json: not valid JSON",),
        build=write("ckpt/config.json", "{vocab_size: 32}"),
    ),
    case(
        "model-config-nested-too-deeply",
        CHECKPOINT,
        "a config.json nesting arrays 100,000 deep",
        f"{RUN} --model ckpt",
        ("ckpt/config.json: nests arrays or objects too deeply",),
        build=write("ckpt/config.json", "[" * 100_000 + "]" * 100_000),
    ),
    case(
        "model-index-nested-too-deeply",
        CHECKPOINT,
        "a shard index nesting arrays 100,000 deep",
        f"{RUN} --model ckpt",
        ("model.safetensors.index.json: not a safetensors index",),
        build=both(
            write("ckpt/config.json", json.dumps(HF_CONFIG)),
            write("ckpt/model.safetensors.index.json", "[" * 100_000 + "]" * 100_000),
        ),
    ),
    case(
        "model-config-not-object",
        CHECKPOINT,
        "a config.json holding a list",
        f"{RUN} --model ckpt",
        ("ckpt/config.json: must hold a JSON object, got list",),
        build=write("ckpt/config.json", "[]"),
    ),
    case(
        "model-config-missing-key",
        CHECKPOINT,
        "a config.json without hidden_size",
        f"{RUN} --model ckpt",
        ("ckpt/config.json: missing key 'hidden_size'",),
        build=write(
            "ckpt/config.json",
            json.dumps({k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}),
        ),
    ),
    case(
        "model-config-bad-heads",
        CHECKPOINT,
        "attention heads not a multiple of the KV heads",
        f"{RUN} --model ckpt",
        (
            "ckpt/config.json: invalid model config",
            "num_heads (3) must be a multiple of num_kv_heads (2)",
        ),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, num_attention_heads=3))),
    ),
    case(
        "model-config-odd-head-dim",
        CHECKPOINT,
        "an odd head_dim, which RoPE cannot rotate in pairs",
        f"{RUN} --model ckpt",
        ("ckpt/config.json: invalid model config", "head_dim (5) must be even"),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, head_dim=5))),
    ),
    case(
        "model-config-zero-heads",
        CHECKPOINT,
        "num_attention_heads of 0",
        f"{RUN} --model ckpt",
        ("ckpt/config.json", "num_attention_heads"),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, num_attention_heads=0))),
    ),
    case(
        "model-config-infinite-rope-theta",
        CHECKPOINT,
        "a rope_theta of Infinity (every position rotated alike)",
        f"{RUN} --model ckpt",
        ("ckpt/config.json: invalid model config", "rope_theta", "finite number"),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, rope_theta=float("inf")))),
    ),
    case(
        "model-config-infinite-norm-eps",
        CHECKPOINT,
        "an rms_norm_eps of Infinity (every hidden state zeroed)",
        f"{RUN} --model ckpt",
        ("ckpt/config.json: invalid model config", "rms_norm_eps", "finite number"),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, rms_norm_eps=float("inf")))),
    ),
    case(
        "model-config-zero-layers",
        CHECKPOINT,
        "num_hidden_layers of 0",
        f"{RUN} --model ckpt",
        (
            "ckpt/config.json: invalid model config",
            "num_hidden_layers: Input should be greater than 0",
        ),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, num_hidden_layers=0))),
    ),
    case(
        "model-config-bool-layers",
        CHECKPOINT,
        "num_hidden_layers of true (a bool where an integer belongs)",
        f"{RUN} --model ckpt",
        (
            "ckpt/config.json: invalid model config",
            "num_hidden_layers: Input should be a valid integer",
        ),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, num_hidden_layers=True))),
    ),
    case(
        "model-config-string-vocab",
        CHECKPOINT,
        'vocab_size of "32" (a string)',
        f"{RUN} --model ckpt",
        ("ckpt/config.json: invalid model config", "vocab_size: Input should be a valid integer"),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, vocab_size="32"))),
    ),
    case(
        "model-config-null-context",
        CHECKPOINT,
        "max_position_embeddings of null",
        f"{RUN} --model ckpt",
        (
            "ckpt/config.json: invalid model config",
            "max_position_embeddings: Input should be a valid integer",
        ),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, max_position_embeddings=None))),
    ),
    case(
        "model-config-activation",
        CHECKPOINT,
        "an activation the decoder does not implement",
        f"{RUN} --model ckpt",
        ("error: ckpt/config.json: hidden_act 'gelu' is not supported", "allowed: 'silu'"),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, hidden_act="gelu"))),
    ),
    case(
        "model-config-rope-scaling-not-object",
        CHECKPOINT,
        "a rope_scaling that is a string, not an object",
        f"{RUN} --model ckpt",
        ("ckpt/config.json: rope_scaling must be a JSON object or null, got str",),
        build=write("ckpt/config.json", json.dumps(dict(HF_CONFIG, rope_scaling="linear"))),
    ),
    case(
        "model-no-safetensors",
        CHECKPOINT,
        "config.json but no safetensors file",
        f"{RUN} --model ckpt",
        ("ckpt: no safetensors files", "expected model.safetensors"),
        build=write("ckpt/config.json", json.dumps(HF_CONFIG)),
    ),
    case(
        "model-safetensors-is-a-directory",
        CHECKPOINT,
        "a directory named model.safetensors, no safetensors file",
        f"{RUN} --model ckpt",
        ("ckpt: no safetensors files", "expected model.safetensors"),
        build=both(
            write("ckpt/config.json", json.dumps(HF_CONFIG)),
            write("ckpt/model.safetensors/keep.txt", ""),
        ),
    ),
    case(
        "model-corrupt-safetensors",
        CHECKPOINT,
        "a model.safetensors that is not a safetensors file",
        f"{RUN} --model ckpt",
        ("ckpt/model.safetensors: not a readable safetensors file",),
        build=both(
            write("ckpt/config.json", json.dumps(HF_CONFIG)),
            write("ckpt/model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00not a header"),
        ),
    ),
    case(
        "model-missing-tensor",
        CHECKPOINT,
        "a checkpoint missing one layer's weight",
        f"{RUN} --model ckpt",
        ("1 tensor(s) missing from the checkpoint", DROPPED),
        build=checkpoint(tensors=lambda state: {k: v for k, v in state.items() if k != DROPPED}),
    ),
    case(
        "model-unexpected-tensor",
        CHECKPOINT,
        "a checkpoint with a tensor the model does not have",
        f"{RUN} --model ckpt",
        ("1 tensor(s) the model does not have", "model.layers.2.mlp.up_proj.weight"),
        build=checkpoint(
            tensors=lambda state: {**state, "model.layers.2.mlp.up_proj.weight": torch.zeros(2)}
        ),
    ),
    case(
        "model-wrong-shape",
        CHECKPOINT,
        "a tensor whose shape does not match config.json",
        f"{RUN} --model ckpt",
        ("tensor model.norm.weight has shape [8], expected [16] from config.json",),
        build=checkpoint(tensors=lambda state: {**state, "model.norm.weight": torch.ones(8)}),
    ),
    case(
        "model-integer-tensor",
        CHECKPOINT,
        "an int8 tensor where float weights belong",
        "run --workload workload.json --model ckpt",
        ("model.norm.weight", "dtype I8", "must be one of F64, F32, F16, BF16"),
        build=both(
            checkpoint(
                tensors=lambda state: {
                    **state,
                    "model.norm.weight": torch.ones(16, dtype=torch.int8),
                }
            ),
            workload({"prompt_ids": [1, 100]}),
        ),
    ),
    case(
        "model-missing-shard",
        CHECKPOINT,
        "a shard index naming a file that is not there",
        f"{RUN} --model ckpt",
        (
            "model.safetensors.index.json: names 1 shard(s) missing",
            "model-00002-of-00002.safetensors",
        ),
        build=both(
            write("ckpt/config.json", json.dumps(HF_CONFIG)),
            write(
                "ckpt/model.safetensors.index.json",
                json.dumps(
                    {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
                ),
            ),
        ),
    ),
    case(
        "model-index-shard-not-a-name",
        CHECKPOINT,
        "a shard index mapping a tensor to a number, not a file name",
        f"{RUN} --model ckpt",
        ("model.safetensors.index.json: not a safetensors index", "shard file names"),
        build=both(
            write("ckpt/config.json", json.dumps(HF_CONFIG)),
            write(
                "ckpt/model.safetensors.index.json",
                json.dumps({"weight_map": {"model.norm.weight": 2}}),
            ),
        ),
    ),
    case(
        "model-context-too-short",
        CHECKPOINT,
        "a model whose context is shorter than the workload's requests",
        "run --workload smoke --model ckpt",
        ("exceeds the model's context of 16 tokens",),
        build=checkpoint(config=dict(HF_CONFIG, max_position_embeddings=16)),
    ),
    case(
        "validate-missing-model",
        CHECKPOINT,
        "validate with a model directory that does not exist",
        "validate --model ./ckpt --reports-dir reports",
        ("./ckpt: directory does not exist",),
        outputs=["reports"],
    ),
    # ---- divergence logs ----
    case(
        "log-missing",
        LOG,
        "a log file that does not exist",
        "report div.jsonl",
        ("div.jsonl: cannot read divergence log", "No such file or directory"),
    ),
    case(
        "log-directory",
        LOG,
        "the log path is a directory",
        "report div.jsonl",
        ("div.jsonl: cannot read divergence log", "Is a directory"),
        build=write("div.jsonl/keep.txt", ""),
    ),
    case(
        "log-empty",
        LOG,
        "replay on an empty log",
        "replay div.jsonl --index 0",
        ("div.jsonl: no divergence record to pick; it holds no record",),
        build=write("div.jsonl", ""),
    ),
    case(
        "log-garbage-line",
        LOG,
        "a garbage line between two good records",
        "report div.jsonl --out report.txt",
        ("div.jsonl:2: not JSON",),
        build=divergence_log(log_line(DIVERGENCE), "garbage\n", log_line(SUMMARY)),
        outputs=["report.txt"],
    ),
    case(
        "log-nested-too-deeply",
        LOG,
        "a line nesting arrays 100,000 deep",
        "report div.jsonl",
        ("div.jsonl:1: not JSON this reader can parse", "nest too deeply"),
        build=divergence_log("[" * 100_000 + "]" * 100_000 + "\n"),
    ),
    case(
        "log-not-object",
        LOG,
        "a line holding a JSON array",
        "report div.jsonl",
        ("div.jsonl:1: expected a JSON object, found list",),
        build=divergence_log("[1, 2]\n", log_line(SUMMARY)),
    ),
    case(
        "log-unknown-record-type",
        LOG,
        "a record type the reader does not know",
        "report div.jsonl",
        ("div.jsonl:1: unknown record_type 'summary'", "known: 'divergence', 'run_summary'"),
        build=divergence_log(json.dumps({**SUMMARY.model_dump(), "record_type": "summary"}) + "\n"),
    ),
    case(
        "log-unknown-schema-version",
        LOG,
        "a record of a newer schema version",
        "report div.jsonl",
        (
            "div.jsonl:1: unsupported schema_version 9 in a run_summary record",
            "this reader supports 2, 3",
        ),
        build=divergence_log(json.dumps({**SUMMARY.model_dump(), "schema_version": 9}) + "\n"),
    ),
    case(
        "log-no-schema-version",
        LOG,
        "a record without schema_version",
        "report div.jsonl",
        ("div.jsonl:1: a run_summary record without schema_version",),
        build=divergence_log(
            json.dumps({k: v for k, v in SUMMARY.model_dump().items() if k != "schema_version"})
            + "\n"
        ),
    ),
    case(
        "log-missing-fields",
        LOG,
        "a divergence record missing its fields",
        "report div.jsonl",
        ("div.jsonl:1: invalid divergence record", "run_id: field required"),
        build=divergence_log('{"record_type": "divergence", "schema_version": 2}\n'),
    ),
    case(
        "log-invalid-utf8",
        LOG,
        "a line with bytes that are not UTF-8",
        "report div.jsonl --format json",
        ("div.jsonl:1: invalid UTF-8 at byte",),
        build=write("div.jsonl", b'{"record_type": "\xff"}\n' + log_line(SUMMARY).encode()),
    ),
    case(
        "log-unpaired-surrogate",
        LOG,
        "a record whose string escapes half a UTF-16 surrogate pair",
        "report div.jsonl --out report.txt",
        (
            "div.jsonl:1: a string holds the unpaired surrogate \\ud800",
            "surrogates must come in pairs",
        ),
        build=divergence_log(
            log_line(DIVERGENCE).replace('"smoke"', '"smoke\\ud800"', 1), log_line(SUMMARY)
        ),
        outputs=("report.txt",),
    ),
    case(
        "log-replay-garbage",
        LOG,
        "replay of a log with a garbage line",
        "replay div.jsonl --index 0",
        ("div.jsonl:1: not JSON",),
        build=divergence_log("garbage\n", log_line(DIVERGENCE)),
    ),
    case(
        "log-replay-no-payload",
        LOG,
        "replay of a divergence record with an empty replay payload",
        "replay div.jsonl --index 0",
        ("record of step 3: unknown op None", "poll, release, evict, migrate, alloc"),
        build=divergence_log(log_line(DIVERGENCE.model_copy(update={"replay": {}}))),
    ),
    case(
        "log-replay-bad-payload",
        LOG,
        "replay of a record whose op request is not valid",
        "replay div.jsonl --index 0",
        ("op 'alloc'", "not a valid AllocRequest", "snapshot", "batch"),
        build=divergence_log(
            log_line(
                DIVERGENCE.model_copy(
                    update={
                        "replay": {"op": "alloc", "request_type": "AllocRequest", "request": {}}
                    }
                )
            )
        ),
    ),
    case(
        "log-minimize-no-workload",
        LOG,
        "minimize of a record that names no workload",
        "minimize div.jsonl --index 0 --out-dir minimized",
        ("divergence record 0 names no workload_source",),
        build=divergence_log(log_line(DIVERGENCE.model_copy(update={"replay": {}}))),
        outputs=["minimized"],
    ),
    case(
        "log-minimize-missing-workload",
        LOG,
        "minimize of a record whose workload file is gone",
        "minimize div.jsonl --index 0 --out-dir minimized",
        ("workload file 'gone.json' does not exist",),
        build=divergence_log(
            log_line(DIVERGENCE.model_copy(update={"replay": {"workload_source": "gone.json"}}))
        ),
        outputs=["minimized"],
    ),
    case(
        "log-replay-pools-not-an-object",
        LOG,
        "replay of a record whose pools are not an object",
        "replay div.jsonl --index 0",
        ("the record's pools must map authoritative and shadow", "'x'"),
        build=divergence_log(
            log_line(DIVERGENCE.model_copy(update={"replay": {**REPLAYABLE, "pools": "x"}}))
        ),
    ),
    case(
        "log-replay-no-kv-path",
        LOG,
        "replay of a record that names no authoritative KV path",
        "replay div.jsonl --index 0",
        ("the record's kv_path must be plan or legacy", "None"),
        build=divergence_log(
            log_line(
                DIVERGENCE.model_copy(
                    update={
                        "replay": {
                            key: value for key, value in REPLAYABLE.items() if key != "kv_path"
                        }
                    }
                )
            )
        ),
    ),
    case(
        "log-replay-bad-geometry",
        LOG,
        "replay of a record whose load-failure policy does not exist",
        "replay div.jsonl --index 0",
        ("the recorded geometry is not valid", "load_failure", "'recompute' or 'fail'"),
        build=divergence_log(
            log_line(
                DIVERGENCE.model_copy(
                    update={
                        "replay": {
                            **REPLAYABLE,
                            "pre_state": to_jsonable(
                                KvPreState(
                                    replace(
                                        _SNAPSHOT,
                                        geometry=replace(_SNAPSHOT.geometry, load_failure="retry"),
                                    ),
                                    (),
                                )
                            ),
                        }
                    }
                )
            )
        ),
    ),
    case(
        "log-replay-unknown-phase",
        LOG,
        "replay of a record whose request is in a phase that does not exist",
        "replay div.jsonl --index 0",
        ("request r0: unknown phase 'flying'", "known: waiting, running"),
        build=divergence_log(
            log_line(
                DIVERGENCE.model_copy(
                    update={
                        "replay": {
                            **REPLAYABLE,
                            "pre_state": to_jsonable(
                                KvPreState(
                                    _SNAPSHOT,
                                    (RequestKvView("r0", "flying", 0, 4, 0, (), (), 0, None, 4),),
                                )
                            ),
                        }
                    }
                )
            )
        ),
    ),
    case(
        "log-replay-page-ids-not-integers",
        LOG,
        "replay of a record whose pool events hold page ids as strings",
        "replay div.jsonl --index 0",
        ("the record's authoritative gpu pool events are not records", "'7'"),
        build=divergence_log(
            log_line(
                DIVERGENCE.model_copy(
                    update={
                        "replay": {
                            **REPLAYABLE,
                            "pools": {
                                "authoritative": {
                                    "gpu": [{"kind": "alloc", "uuid": "r0", "page_ids": ["7"]}]
                                }
                            },
                        }
                    }
                )
            )
        ),
    ),
    case(
        "log-minimize-no-kv-path",
        LOG,
        "minimize of a record that names no authoritative KV path",
        "minimize div.jsonl --index 0 --out-dir minimized",
        ("the record's kv_path must be plan or legacy", "None"),
        build=divergence_log(
            log_line(DIVERGENCE.model_copy(update={"replay": {"workload_source": "smoke"}}))
        ),
        outputs=["minimized"],
    ),
    case(
        "log-minimize-bad-faults",
        LOG,
        "minimize of a record whose fault SPEC is not valid",
        "minimize div.jsonl --index 0 --out-dir minimized",
        ("the recorded fault SPEC is not valid", "'load_fial=1'"),
        build=divergence_log(
            log_line(
                DIVERGENCE.model_copy(update={"replay": {**SMOKE_RUN, "faults": "load_fial=1"}})
            )
        ),
        outputs=["minimized"],
    ),
    case(
        "log-minimize-faults-not-a-string",
        LOG,
        "minimize of a record whose fault SPEC is a number",
        "minimize div.jsonl --index 0 --out-dir minimized",
        ("the recorded fault SPEC must be a string, not 5",),
        build=divergence_log(
            log_line(DIVERGENCE.model_copy(update={"replay": {**SMOKE_RUN, "faults": 5}}))
        ),
        outputs=["minimized"],
    ),
    case(
        "log-minimize-bad-engine",
        LOG,
        "minimize of a record whose engine config is not valid",
        "minimize div.jsonl --index 0 --out-dir minimized",
        ("the recorded engine config is not valid", "max_num_seqs"),
        build=divergence_log(
            log_line(
                DIVERGENCE.model_copy(
                    update={"replay": {"workload_source": "smoke", "engine": {"max_num_seqs": 0}}}
                )
            )
        ),
        outputs=["minimized"],
    ),
    case(
        "log-minimize-bad-scale",
        LOG,
        "minimize of a record whose scale is not a number",
        "minimize div.jsonl --index 0 --out-dir minimized",
        ("scale must be a number", "'abc'"),
        build=divergence_log(
            log_line(
                DIVERGENCE.model_copy(
                    update={"replay": {"workload_source": "smoke", "scale": "abc"}}
                )
            )
        ),
        outputs=["minimized"],
    ),
    case(
        "log-minimize-bad-vocab",
        LOG,
        "minimize of a record whose vocabulary size is 1",
        "minimize div.jsonl --index 0 --out-dir minimized",
        ("vocab_size must be an integer >= 2", "got 1"),
        build=divergence_log(
            log_line(
                DIVERGENCE.model_copy(
                    update={"replay": {"workload_source": "smoke", "vocab_size": 1}}
                )
            )
        ),
        outputs=["minimized"],
    ),
    case(
        "log-minimize-bad-source",
        LOG,
        "minimize of a record whose workload_source is not a string",
        "minimize div.jsonl --index 0 --out-dir minimized",
        ("workload_source must be a workload name or file", "123"),
        build=divergence_log(
            log_line(DIVERGENCE.model_copy(update={"replay": {"workload_source": 123}}))
        ),
        outputs=["minimized"],
    ),
    case(
        "log-replay-summaries-only",
        LOG,
        "replay of a log holding run summaries only",
        "replay div.jsonl --index 0",
        ("div.jsonl: no divergence record to pick",),
        build=divergence_log(log_line(SUMMARY)),
    ),
    # ---- fault specs ----
    case(
        "faults-unknown-key",
        FAULTS,
        "a misspelt fault name",
        f"{RUN} --faults load_fial=0.1",
        ("--faults: 'load_fial=0.1' is not KEY=VALUE", "abort, abort_phases"),
    ),
    case(
        "faults-no-value",
        FAULTS,
        "a fault without =VALUE",
        f"{RUN} --faults load_fail",
        ("--faults: 'load_fail' is not KEY=VALUE",),
    ),
    case(
        "faults-probability-above-1",
        FAULTS,
        "a probability above 1",
        f"{RUN} --faults load_fail=2",
        ("--faults: load_fail=2 must be a probability in [0, 1]",),
    ),
    case(
        "faults-load-outcomes-above-1",
        FAULTS,
        "load fault probabilities summing above 1",
        f"{RUN} --faults load_fail=0.6,load_fail_late=0.6",
        ("--faults: load_fail + load_fail_late + load_hang = 1.2 must be at most 1",),
    ),
    case(
        "faults-negative-probability",
        FAULTS,
        "a negative probability",
        f"{RUN} --faults abort=-0.1",
        ("--faults: abort=-0.1 must be a probability in [0, 1]",),
    ),
    case(
        "faults-not-a-number",
        FAULTS,
        "a probability that is not a number",
        f"{RUN} --faults abort=often",
        ("--faults: abort='often' is not a number",),
    ),
    case(
        "faults-seed-not-integer",
        FAULTS,
        "a fractional schedule seed",
        f"{RUN} --faults seed=1.5",
        ("--faults: seed='1.5' is not an integer",),
    ),
    case(
        "faults-huge-delay",
        FAULTS,
        "a store delay beyond 10 s",
        f"{RUN} --faults slow_store=1,store_delay_ms=1e9",
        ("--faults: store_delay_ms=1e9 must be in [0, 10000]",),
    ),
    case(
        "faults-bad-phase",
        FAULTS,
        "an abort phase that does not exist",
        f"{RUN} --faults abort=0.1,abort_phases=running",
        ("--faults: abort_phases='running'", "waiting+prefilling+decoding+swapped+loading"),
    ),
    # ---- sweep (each refused before the reports directory or a backend is made) ----
    case(
        "sweep-seeds-backwards",
        CLI,
        "sweep --seeds with a range whose end comes before its start",
        f"{SWEEP} --seeds 5-2",
        ("--seeds", "must be N, A-B (0 <= A <= B <= 2**64 - 1) or a comma list of them, got '5-2'"),
        outputs=("reports",),
    ),
    case(
        "sweep-seeds-not-a-range",
        CLI,
        "sweep --seeds that is no number",
        f"{SWEEP} --seeds all",
        ("--seeds", "must be N, A-B (0 <= A <= B <= 2**64 - 1) or a comma list of them, got 'all'"),
        outputs=("reports",),
    ),
    case(
        "sweep-workload-twice",
        CLI,
        "sweep with one workload given twice",
        f"{SWEEP} --workload smoke",
        ("workload 'smoke' is in the sweep twice", "each workload needs its own name"),
        outputs=("reports",),
    ),
    case(
        "sweep-empty-corpus",
        CLI,
        "sweep --workload naming a directory without workload files",
        f"{SWEEP.replace('smoke', 'corpus')}",
        ("--workload corpus: a directory without workload files (*.json)",),
        build=write("corpus/notes.txt", "no workload here"),
        outputs=("reports",),
    ),
    case(
        "sweep-workload-beyond-the-model",
        WORKLOAD,
        "sweep with a workload file holding a request longer than the tiny model's context",
        "sweep --workload workload.json --reports-dir reports",
        (
            "workload file workload.json: request 'r0'",
            "exceeds the model's context of 4608 tokens (the sweep's model: tiny)",
        ),
        build=workload({"max_new_tokens": 5000}),
        outputs=("reports",),
    ),
    case(
        "sweep-bad-fault-spec",
        FAULTS,
        "sweep --faults with a key that does not exist",
        f"{SWEEP} --faults load_fial=0.5",
        ("--faults: 'load_fial=0.5' is not KEY=VALUE", "load_fail"),
        outputs=("reports",),
    ),
    case(
        "sweep-ray-address-with-processes",
        CLI,
        "sweep --ray-address with the process backend",
        f"{SWEEP} --backend processes --ray-address auto",
        ("--ray-address applies to --backend ray",),
        outputs=("reports",),
    ),
    case(
        "sweep-num-cpus-with-ray-address",
        CLI,
        "sweep --num-cpus while joining a cluster",
        f"{SWEEP} --ray-address auto --num-cpus 4",
        ("--num-cpus sizes a local Ray instance", "give one of the two"),
        outputs=("reports",),
    ),
    case(
        "sweep-time-budget-zero",
        CLI,
        "sweep --time-budget of no time",
        f"{SWEEP} --time-budget 0",
        ("--time-budget", "must be a number of seconds > 0, got '0'"),
        outputs=("reports",),
    ),
    case(
        "sweep-reports-dir-is-a-file",
        CLI,
        "sweep --reports-dir names a file",
        f"{SWEEP} --reports-dir div.jsonl",
        ("--reports-dir div.jsonl", "div.jsonl is not a directory"),
        build=divergence_log(GOOD_LOG),
    ),
)


# ---- running a case ------------------------------------------------------------------------------
def invoke(argv: tuple[str, ...], stderr) -> int:
    """``main(argv)`` as a process would end: warnings and an escaping exception (exit 1) written to
    ``stderr``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exit_code = main(list(argv))
        except Exception:  # noqa: BLE001 - a bad input must never get here; record what it did
            stderr.write(traceback.format_exc())
            exit_code = 1
    for warning in caught:
        if not issubclass(warning.category, HIDDEN_WARNINGS):
            stderr.write(
                warnings.formatwarning(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
            )
    return exit_code


@contextlib.contextmanager
def isolated(case: BadInput, workdir: Path) -> Iterator[None]:
    """Run in ``workdir`` with the case's gate variables as the only ones; restores the process
    after."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX) or n in ISOLATED_ENV]:
        del os.environ[name]
    os.environ.update(dict(case.env))
    os.chdir(workdir)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def run_case(case: BadInput, workdir: Path) -> Outcome:
    """Build the case's input in ``workdir`` (empty) and run it there; mutates ``workdir`` and
    nothing else."""
    if case.build is not None:
        case.build(workdir)
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        isolated(case, workdir),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        exit_code = invoke(case.argv, stderr)
    return Outcome(exit_code, stdout.getvalue(), stderr.getvalue())


# ---- the reliability table -----------------------------------------------------------------------
REGEN_COMMAND = "OMP_NUM_THREADS=1 .venv/bin/python scripts/gen_reliability_doc.py"

INTRO = f"""# Reliability: bad inputs and their messages

Every bad input ends a command with exit code 2 (the exit codes: [cli.md](cli.md)).

The table below lists every bad input the test suite feeds the command and the exact line it prints.
Paths are relative to the directory the command ran in.

This file is generated: `{REGEN_COMMAND}` runs each case of
`tests/bad_inputs.py` and writes it. `tests/test_bad_input.py` checks every case (exit 2, one error
line holding the expected fragments, nothing on stdout, nothing written) and that this file is up to
date. A case marked **not handled yet** is a known bug; its test is a strict xfail until it is
fixed.
"""


def code(text: str) -> str:
    """``text`` as a markdown code span inside a table cell."""
    text = text.replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def message_cell(case: BadInput, outcome: Outcome) -> str:
    """The case's message; for a known bug, what happens instead (exit code, last stderr line) and
    why."""
    lines = outcome.stderr.strip().splitlines() or ["(nothing on stderr)"]
    if case.known_bug is None:
        return " ".join(code(line) for line in lines)
    return (
        f"**not handled yet**: {case.known_bug}. Now: exit {outcome.exit_code}, {code(lines[-1])}"
    )


def render_doc(outcomes: dict[str, Outcome]) -> str:
    """The whole of ``docs/reliability.md`` from every case's outcome (keyed by case id)."""
    rows = ["| category | case | input | message |", "|---|---|---|---|"]
    for category in CATEGORIES:
        for bad in (c for c in CASES if c.category == category):
            rows.append(
                f"| {category} | {code(bad.id)}: {bad.description} | {code(bad.command)} | "
                f"{message_cell(bad, outcomes[bad.id])} |"
            )
    return INTRO + "\n" + "\n".join(rows) + "\n"
