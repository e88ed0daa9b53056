#!/usr/bin/env bash
# GPU validation recipe for H20-class nodes: Llama-2-7B geometry in bfloat16, the L2 workloads scaled up,
# compare mode throughout. See --help.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: scripts/h20_validate.sh [--model NAME|DIR] [--scale X] [--seed N] [--kv-path plan|legacy] [--reports-dir DIR]

Runs on one CUDA GPU (H20-class: ~96 GB; the model, the scaled pools and the no-eviction
reference pools must fit), in bfloat16:

  1. batchgen validate --device cuda --model MODEL --dtype bfloat16 --scale X --reports-dir DIR --json
     L2-2048 then L2-4096 back-to-back on one worker per compare direction (legacy serving with the
     plan shadowed, plan serving with legacy shadowed, plan/plan A/A noise check), pools clean after
     each workload, tokens vs a no-eviction reference (bfloat16 near-tie rule), L2-4096 on the
     shared worker == a fresh worker. JSON verdict: DIR/validate.json; divergence log and reports:
     DIR/divergences.{jsonl,md,xml,json}.
  2. batchgen run --workload L2-2048, then L2-4096, each on a fresh worker in compare mode "log"
     (--kv-path serves, the other path is shadowed): DIR/run-L2-2048.json, DIR/run-L2-4096.json;
     their divergences go to DIR/runs.jsonl, reported in DIR/runs.md and DIR/runs.xml (JUnit).

Options:
  --model NAME|DIR   a built-in model or an HF-format checkpoint directory (config.json +
                     *.safetensors) (default: llama2-7b-geometry, random weights drawn from --seed)
  --scale X          workload scale: requests, arrival waves, pools and max_num_seqs grow with it
                     together, so the KV pressure holds (default: 4)
  --seed N           seeds the random weights and the traces (default: 0)
  --kv-path P        authoritative path of the two runs in step 2 (default: plan, the production path)
  --reports-dir DIR  where everything is written (default: reports/h20)
  -h, --help         this text

Environment: PYTHON (default: .venv/bin/python, else python3). BATCHGEN_WORKER_KV_* variables are
cleared so that only the flags above decide. Exit status: 0 when validation passed and neither run
diverged; 1 otherwise; 2 on bad input or no CUDA device.
USAGE
}

MODEL=llama2-7b-geometry
SCALE=4
SEED=0
KV_PATH=plan
OUT=reports/h20
while [ $# -gt 0 ]; do
    case "$1" in
        --model|--scale|--seed|--kv-path|--reports-dir)
            [ $# -ge 2 ] || { echo "h20_validate: $1 needs a value (see --help)" >&2; exit 2; }
            case "$1" in
                --model) MODEL=$2 ;;
                --scale) SCALE=$2 ;;
                --seed) SEED=$2 ;;
                --kv-path) KV_PATH=$2 ;;
                --reports-dir) OUT=$2 ;;
            esac
            shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "h20_validate: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$KV_PATH" in  # used only by step 2: a typo would otherwise surface after the long validation
    plan|legacy) ;;
    *) echo "h20_validate: --kv-path takes plan or legacy, not '$KV_PATH' (see --help)" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
while read -r name; do unset "$name"; done < <(env | sed -n 's/^\(BATCHGEN_WORKER_KV_[A-Za-z0-9_]*\)=.*/\1/p')
# The flags as batchgen parses them (its own ranges and messages), before anything runs or is written.
"$PY" -c 'import sys; from batchgen.cli import build_parser; build_parser().parse_args(sys.argv[1:])' \
    validate --model "$MODEL" --scale "$SCALE" --seed "$SEED" --reports-dir "$OUT" || exit 2
mkdir -p "$OUT" 2>/dev/null || { echo "h20_validate: --reports-dir $OUT: cannot create the directory" >&2; exit 2; }

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'h20_validate: no CUDA device visible to torch')" \
    || exit 2
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
echo "model: $MODEL, bfloat16, scale $SCALE, seed $SEED; reports in $OUT/"
common=(--device cuda --model "$MODEL" --dtype bfloat16 --scale "$SCALE" --seed "$SEED")
start=$(date +%s)
status=0

# 1. back-to-back validation, every compare direction (stdout: one JSON object)
validate_status=0
"$PY" -m batchgen validate "${common[@]}" --reports-dir "$OUT" --json > "$OUT/validate.json" || validate_status=$?
cat "$OUT/validate.json"
if [ "$validate_status" -eq 2 ]; then  # bad input (the model, say): the runs below would refuse it too
    echo "h20_validate: batchgen validate refused its input (exit 2); nothing else runs" >&2
    exit 2
elif [ "$validate_status" -ne 0 ]; then
    echo "h20_validate: batchgen validate exited $validate_status (failures: $OUT/validate.json, $OUT/divergences.md)" >&2
    status=$validate_status
fi

# 2. the two L2 workloads on fresh workers in compare mode
rm -f "$OUT/runs.jsonl"
for workload in L2-2048 L2-4096; do
    run_status=0
    "$PY" -m batchgen run --workload "$workload" "${common[@]}" --kv-path "$KV_PATH" --kv-compare log \
        --kv-compare-log "$OUT/runs.jsonl" --json > "$OUT/run-$workload.json" || run_status=$?
    cat "$OUT/run-$workload.json"
    if [ "$run_status" -ne 0 ]; then
        echo "h20_validate: batchgen run --workload $workload exited $run_status" >&2
        [ "$status" -ge "$run_status" ] || status=$run_status
    fi
done
report_status=0
"$PY" -m batchgen report "$OUT/runs.jsonl" --format md --out "$OUT/runs.md" || report_status=$?
"$PY" -m batchgen report "$OUT/runs.jsonl" --format junit --out "$OUT/runs.xml" || true
if [ "$report_status" -ne 0 ]; then
    echo "h20_validate: the compare runs diverged or their log is unreadable (report exited $report_status): $OUT/runs.md" >&2
    [ "$status" -ge "$report_status" ] || status=$report_status
fi

echo "h20_validate: exit $status after $(( $(date +%s) - start )) s"
exit "$status"
