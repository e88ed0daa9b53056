"""``batchgen run``'s KV flags: the gate options (over the ``BATCHGEN_WORKER_KV_*`` environment),
prefix caching's pair (``sweep`` and ``explore`` take it too), the engine overrides, the scale a run
applies, and the ``--help`` epilog."""

from __future__ import annotations

import argparse
import os
import sys
import typing

from batchgen.cli.arg_types import non_negative_int, positive_int
from batchgen.config import EngineConfig
from batchgen.engine import faults as faults_module
from batchgen.engine.runner import MAX_IDLE_STEPS
from batchgen.engine.workloads import BUILTIN_WORKLOADS
from batchgen.finish.gate import FINISH_GATES
from batchgen.kv.gate import GATE_FLAGS, GateError, KvGateConfig, gate_config
from batchgen.kv.known_bugs import DEMO_BUGS
from compare.gates import BREAKER_DEFAULTS, PRODUCTION_FIELDS

SCHEDULE_POLICIES = typing.get_args(EngineConfig.model_fields["schedule_policy"].annotation)

# Gate field -> (metavar, what the option means); the variable, option and allowed values come from
# GATE_FLAGS. Prefix caching's options are a pair (``add_prefix_caching_args``).
KV_FLAG_HELP = {
    "path": ("plan|legacy", "the authoritative KV path"),
    "compare": (
        "off|log|raise",
        "shadow the other path every step: log divergences, or stop at the first",
    ),
    "compare_sample": (
        "P",
        (
            "fraction of steps compared (all ops of a compared step), in (0, 1]; seeded, so "
            "reproducible"
        ),
    ),
    "compare_log": ("FILE", "divergence log, JSON Lines, appended to"),
    "compare_ops": ("OPS", "comma list of the ops compared: poll,release,evict,migrate,alloc"),
    "load_failure": (
        "recompute|fail",
        "after a failed load's last retry: recompute the request, or fail it",
    ),
    "compare_budget": (
        "FRACTION|off",
        "compare mode's share of step time: above it the sample rate goes down, below half of it"
        " back up (never above --kv-compare-sample); each change is logged",
    ),
    "compare_breaker_errors": (
        "N|off",
        "turn compare mode off for the rest of the run after N compared ops in a row with a"
        " harness error",
    ),
    "compare_breaker_seconds": (
        "S|off",
        "turn compare mode off for the rest of the run after one compared op whose harness time"
        " is over S seconds",
    ),
    "verify": (
        "off|sample|all",
        "page-content oracle: digest pages stored to host and check them when their load lands,"
        " and check the pages a flush appends into; on every step, or on the compare-sampled ones;"
        " data divergences go to the divergence log",
    ),
    "compare_demo_bug": (
        "NAME|off",
        "plant a known bug in the shadow path only (the output stays right) to see compare mode,"
        f" report, replay and minimize at work; the log records it. NAME: {', '.join(DEMO_BUGS)}",
    ),
}


def add_kv_args(
    parser: argparse.ArgumentParser, *, prefix_caching: str = "the workload's cache config"
) -> None:
    """The gate options (default None: the environment, then the built-in default, decides; for
    prefix caching ``prefix_caching`` names that default) and engine overrides."""
    for field, (env, option, _) in GATE_FLAGS.items():
        if field == "prefix_cache":
            add_prefix_caching_args(parser, default=prefix_caching)
            continue
        metavar, meaning = KV_FLAG_HELP[field]
        parser.add_argument(
            option,
            dest=f"kv_{field}",
            metavar=metavar,
            default=None,
            help=f"{meaning} (default: ${env}, else {_gate_default(field)})",
        )
    parser.add_argument(
        "--kv-load-retries",
        type=non_negative_int,
        metavar="N",
        default=None,
        help=(
            "retries of a failed host->GPU load before the --kv-load-failure policy applies "
            "(default: the workload's engine config)"
        ),
    )
    parser.add_argument(
        "--schedule-policy",
        choices=SCHEDULE_POLICIES,
        default=None,
        help=(
            "admission order of waiting requests: fcfs (oldest first) or lof (longest output first:"
            " most new tokens still allowed; fewer steps when max_new_tokens differ) (default: the"
            " workload's engine config)"
        ),
    )
    parser.add_argument(
        "--kv-load-timeout-steps",
        type=positive_int,
        metavar="N",
        default=None,
        help=(
            "steps a load may stay incomplete before it counts as failed "
            "(default: the workload's engine config)"
        ),
    )
    FINISH_GATES.add_options(parser)  # the finish step's gate: --finish-path, --finish-compare, ...


def add_prefix_caching_args(parser: argparse.ArgumentParser, *, default: str) -> None:
    """vLLM's pair ``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` (one or the other)
    into ``args.kv_prefix_cache`` (on, off; None: neither given); ``default``: what decides without
    them or the variable. Mutates ``parser``."""
    env, option, _ = GATE_FLAGS["prefix_cache"]
    pair = parser.add_mutually_exclusive_group()
    pair.add_argument(
        option,
        dest="kv_prefix_cache",
        action="store_const",
        const="on",
        default=None,
        help=(
            "reuse the KV of full prompt pages any earlier request computed (vLLM's automatic"
            f" prefix caching) (default: ${env}, on or off, else {default})"
        ),
    )
    pair.add_argument(
        "--no-" + option.removeprefix("--"),
        dest="kv_prefix_cache",
        action="store_const",
        const="off",
        default=None,
        help="compute every prompt whole: no prefix caching",
    )


def prefix_caching_from_args(args: argparse.Namespace) -> bool | None:
    """Prefix caching as the pair's option, else ``BATCHGEN_WORKER_KV_PREFIX_CACHE``, sets it; None:
    neither does (the workload's). GateError naming a bad variable of the family."""
    setting = gate_config(os.environ, {"prefix_cache": args.kv_prefix_cache}).prefix_cache
    return None if setting is None else setting == "on"


def _gate_default(field: str) -> str:
    default = BREAKER_DEFAULTS.get(field, KvGateConfig.model_fields[field].default)
    if default is None:
        return "off" if field in OFF_FIELDS else "the workload's engine config"
    return ",".join(default) if isinstance(default, tuple) else str(default)


def run_epilog() -> str:
    return (
        "KV path options: the BATCHGEN_WORKER_KV_* environment overrides the defaults and an"
        " option overrides\nthe environment; a bad value or an unknown BATCHGEN_WORKER_KV_* name"
        " exits 2.\n\nfault SPEC (--faults): comma-separated"
        f" KEY=VALUE\n{_fault_grammar()}\nProbabilities are in [0, 1], and load_fail +"
        " load_fail_late + load_hang <= 1; the same SPEC\nreplays the same faults.\n\noutputs FILE"
        ' (--outputs): one JSON line per released request, in release order, e.g.\n  {"uuid":'
        ' "smoke-r0", "phase": "finished", "finish_reason": "length", "output_ids": [413, 431,'
        " 16]}\nphase is finished (finish_reason length, eos or abort) or failed (finish_reason:"
        " the failure, e.g.\n'load failed: ...'); output_ids are the generated tokens, prompt"
        " excluded. The file is created or\ntruncated when the run starts, and each line is"
        " written as its request is released: a run stopped\nearly leaves a whole line for every"
        " request released before it stopped.\n\nExit status: 0 when the run finished, even where"
        " requests failed (a warning says how many and why;\nfailed_requests counts them); 1 on a"
        " divergence (--kv-compare raise), a plan the plan path\nrejected, a divergence log or"
        " --outputs file that stops taking writes (a full disk), or a run that\nstalls (requests"
        f" live and nothing progressing for {MAX_IDLE_STEPS} steps, or twice the load timeout"
        " if\nlonger; e.g. under gpu_refuse=1); 2 on bad input; 130 on Ctrl-C; 143 on SIGTERM."
    )


def _fault_grammar() -> str:
    """The SPEC table of ``batchgen.engine.faults``' docstring (its indented block after ``::``)."""
    block = (faults_module.__doc__ or "").partition("::")[2].strip("\n").splitlines()
    lines = []
    for line in block:
        if line.strip() and not line.startswith(" "):
            break
        lines.append(line)
    return "\n".join(lines).rstrip() + "\n"


# read only while compare mode is on
COMPARE_SETTINGS = (
    "compare_sample",
    "compare_log",
    "compare_ops",
    *PRODUCTION_FIELDS,
    "compare_demo_bug",
)
# gate fields whose None is "off"
OFF_FIELDS = (*PRODUCTION_FIELDS, "compare_demo_bug")


def refuse_production_settings(command: str, environ=os.environ) -> None:
    """GateError (exit 2) naming each budget or breaker variable set in ``environ``: ``command``
    (validate, explore, minimize, sweep) compares every op it runs, and a validation that stops
    comparing must not pass. Pure."""
    given = [GATE_FLAGS[field][0] for field in PRODUCTION_FIELDS if GATE_FLAGS[field][0] in environ]
    if given:
        raise GateError(
            f"batchgen {command} compares every op it runs, so it refuses {', '.join(given)}: a"
            " budget or a breaker stops comparing, and a validation that stops comparing must not"
            " pass (unset it; batchgen run takes it)"
        )


def applied_scale(args: argparse.Namespace) -> float:
    """``--scale`` for a built-in workload; 1.0 for a workload file, which runs as written. Pure."""
    return args.scale if args.workload in BUILTIN_WORKLOADS else 1.0


def warn_unused_compare_settings(gate: KvGateConfig, cli: dict[str, object]) -> None:
    """A warning on stderr naming each compare setting given (option or variable) while compare mode
    is off, but those the page-content oracle reads (``--kv-verify``: the log; sample: the sample
    too)."""
    if gate.compare != "off":
        return
    read_by_verify = {
        "off": (),
        "all": ("compare_log",),
        "sample": ("compare_log", "compare_sample"),
    }
    given = [
        GATE_FLAGS[field][1] if cli[field] is not None else GATE_FLAGS[field][0]
        for field in COMPARE_SETTINGS
        if (cli[field] is not None or GATE_FLAGS[field][0] in os.environ)
        and field not in read_by_verify[gate.verify]
    ]
    if given:
        print(
            f"batchgen: warning: compare mode is off, so {', '.join(given)}"
            f" {'is' if len(given) == 1 else 'are'} ignored and no divergence log is written"
            " (--kv-compare log or raise turns it on)",
            file=sys.stderr,
        )


def gate_from_args(args: argparse.Namespace) -> KvGateConfig:
    """The KV gate: the gate options over the ``BATCHGEN_WORKER_KV_*`` environment (GateError
    naming a bad value), with a warning for compare settings given while compare mode is off."""
    cli = {field: getattr(args, f"kv_{field}") for field in GATE_FLAGS}
    gate = gate_config(os.environ, cli)
    warn_unused_compare_settings(gate, cli)
    return gate


def engine_config_from_args(engine, args: argparse.Namespace):
    overrides = {
        "max_load_retries": args.kv_load_retries,
        "load_timeout_steps": args.kv_load_timeout_steps,
        "schedule_policy": args.schedule_policy,
    }
    return engine.model_copy(
        update={name: value for name, value in overrides.items() if value is not None}
    )
