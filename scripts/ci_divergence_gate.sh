#!/usr/bin/env bash
# CI divergence gate: the back-to-back validation in compare mode (both KV directions + the A/A noise check),
# then its divergence log rendered for the CI job: markdown on stdout and in the job summary
# ($GITHUB_STEP_SUMMARY, appended to by `batchgen report --format md` when it is set) and JUnit XML for a
# test reporter.
#
# Usage: scripts/ci_divergence_gate.sh [VALIDATE FLAGS...]     e.g. --seed 3, --scale 2
#   REPORTS_DIR   where the log and reports go (default: the checkout's reports/; --reports-dir is refused: set
#                 this); a relative path is taken from the directory the gate is run in
#   PYTHON        the interpreter with batchgen installed (default: the checkout's .venv/bin/python, else
#                 python3); a relative path with a slash is taken from the directory the gate is run in
#
# Writes REPORTS_DIR/divergences.{jsonl,md,xml,json} and report.html (a page of charts). Exits with
# `batchgen validate`'s status: 0 when every check passed, 1 on any divergence or failed check, 2 on bad
# input, 130 when interrupted; a log that `batchgen report` fails (divergences, harness errors, a run that
# did not end: 1; unreadable: 2) fails the gate too, and a validation that did not finish (its
# divergences.jsonl.partial left behind) or refused its input renders nothing.
set -uo pipefail
for arg in "$@"; do
    case "$arg" in
        -h|--help) sed -n '2,18s/^# \{0,1\}//p' "$0"; exit 0 ;;  # this header; validate's own flags: batchgen validate --help
    esac
    name=${arg%%=*}
    if [ "${#name}" -ge 3 ] && [[ "--reports-dir" == "$name"* ]]; then  # argparse takes a prefix (--rep) too
        # validate would write there while the gate renders REPORTS_DIR's log
        echo "ci_divergence_gate: set REPORTS_DIR instead of passing --reports-dir (the gate renders the log" \
             "it finds there)" >&2
        exit 2
    fi
done
caller=$PWD
from_caller() {  # a relative path as the caller meant it: from the directory the gate was run in
    case "$1" in /*) echo "$1" ;; *) echo "$caller/$1" ;; esac
}
[ -n "${REPORTS_DIR:-}" ] && REPORTS_DIR=$(from_caller "$REPORTS_DIR")
[[ "${PYTHON:-}" == */* ]] && PYTHON=$(from_caller "$PYTHON")  # a bare name (python3) is looked up on PATH
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
REPORTS_DIR=${REPORTS_DIR:-reports}
if ! "$PY" -c "import batchgen.cli" 2>/dev/null; then  # .cli: the package alone imports from the checkout
    echo "ci_divergence_gate: $PY cannot import batchgen; set PYTHON to the interpreter it is installed in" >&2
    exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # tiny models on shared CI cores: one thread is fastest

"$PY" -m batchgen validate --reports-dir "$REPORTS_DIR" "$@"
status=$?

log="$REPORTS_DIR/divergences.jsonl"
if [ "$status" -eq 2 ]; then
    # bad input (a flag, the model, the reports directory): validate ran nothing, so a log there is an earlier run's
    echo "ci_divergence_gate: validate refused its input; nothing rendered" >&2
elif [ -f "$log.partial" ]; then
    # validate stopped before its last run (interrupted, or a crash): the log beside it is an earlier run's
    echo "ci_divergence_gate: validate did not finish; its partial log is $log.partial (not rendered)" >&2
    [ "$status" -eq 0 ] && status=1
elif [ -f "$log" ]; then
    # validate's own status stands when it failed; a passing one still fails on the report's verdict
    # (1: divergences, harness errors, or a run that did not end; 2: an unreadable log).
    "$PY" -m batchgen report "$log" --format md
    md_status=$?
    "$PY" -m batchgen report "$log" --format junit --out "$REPORTS_DIR/divergences.xml"
    junit_status=$?
    for report_status in "$md_status" "$junit_status"; do
        if [ "$report_status" -ne 0 ] && [ "$status" -eq 0 ]; then
            status=$report_status
        fi
    done
else
    echo "ci_divergence_gate: no divergence log at $log (validate stopped before any compare run)" >&2
    [ "$status" -eq 0 ] && status=1
fi

echo "ci_divergence_gate: exit $status; reports in $REPORTS_DIR/" >&2
exit "$status"
