#!/usr/bin/env bash
# GPU check: model parity against HF on CUDA, then the back-to-back L2-2048 + L2-4096 validation
# on CUDA with its JSON summary. Runs in under five minutes on one H200-class GPU.
# Usage: scripts/gpu_check.sh            (uses .venv if present, else python3)
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,4s/^# \{0,1\}//p' "$0"; echo "Environment: PYTHON (default: .venv/bin/python, else python3)."; exit 0 ;;
    "") ;;
    *) echo "gpu_check: takes no arguments, not '$1' (see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device visible to torch')"
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
start=$(date +%s)
"$PY" -m pytest -q -m gpu tests/test_gpu.py tests/test_page_copy.py
"$PY" -m batchgen validate --device cuda --json
"$PY" scripts/bench.py migration --device cuda
echo "gpu_check: done in $(( $(date +%s) - start )) s"
