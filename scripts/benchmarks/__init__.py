"""The benchmarks behind ``scripts/bench.py``: a module per subcommand (its ``main(argv, prog)``),
their larger parts beside them, and what they share:

    ab_timer.py       the A/B timer: interleaved variants, timed KV ops and calls, per-repeat ratios
    output_path.py    ``--json-out``: refused when parsed if it cannot be written
    hf_checkpoint.py  seeded HF Llama checkpoints, HF greedy generate
    decode_bound.py   a decode step against its bounds (bandwidth, matmuls), where a step goes

``vllm_runner.py`` runs in vLLM's own venv (``vllm_venv.py``), by path: it imports nothing here.
"""
