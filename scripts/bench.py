"""The benchmarks: ``python scripts/bench.py SUBCOMMAND [FLAGS]`` (``SUBCOMMAND --help``: its own).

Each subcommand is a module of ``benchmarks/``, imported only when it runs (one benchmark's
dependencies, Ray or transformers, are not another's). Every one measures its variants side by
side in one process with the shared A/B timer (``benchmarks/ab_timer.py``), prints its tables
and verdicts, and most write every sample behind them with ``--json-out``.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module of benchmarks/, what it measures)
SUBCOMMANDS = {
    "kv-ops": ("kv_ops", "KV bookkeeping per step, plan path against legacy"),
    "compare": ("compare_cost", "compare mode's cost: bookkeeping, coverage, end to end, budget"),
    "kv-verify": ("kv_verify", "the page-content oracle's cost: verify all against off"),
    "scale": ("scale", "4096 requests over a 1,000,000-page pool: memory stays flat"),
    "migration": ("migration", "offload and reload copies of KV pages against the raw copy"),
    "decode-attention": ("decode_attention", "decode attention: in-place kernel, padded batches"),
    "throughput": ("throughput", "tokens/s against HF transformers' generate"),
    "vllm": ("vllm_bench", "tokens/s against vLLM's CPU backend, tokens compared"),
    "prefix": ("prefix", "prefix caching on and off, batchgen against vLLM's CPU backend"),
    "generate": ("generate", "batchgen generate against run: the text edge's CPU share"),
    "replicas": ("replicas", "generate --replicas: lines/s against one process; the driver"),
    "sweep": ("sweep", "sweep throughput at 1 and 2 CPUs; the driver's cost per record"),
}


def usage() -> str:
    lines = ["usage: python scripts/bench.py SUBCOMMAND [FLAGS]  (SUBCOMMAND --help: its flags)"]
    lines += ["", "subcommands:"]
    lines += [f"  {name:<17} {about}" for name, (_, about) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand ``argv[0]`` with the flags after it; its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, flags = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        choices = ", ".join(SUBCOMMANDS)
        print(f"bench.py: error: no subcommand {name!r} (choose from {choices})", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{SUBCOMMANDS[name][0]}")
    return module.main(flags, f"bench.py {name}")


if __name__ == "__main__":
    sys.exit(main())
