import json
import subprocess
import sys
from pathlib import Path

import pytest

from compare.diff import diff
from compare.observation import Comparison, Observation
from compare.records import (
    SCHEMA_VERSION,
    DivergenceRecord,
    RecordError,
    RunKey,
    RunSummary,
    Timeline,
    parse_record,
)
from compare.schema import json_schema, write_json_schema
from compare.shadow import ShadowExecutor

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "docs" / "divergence.schema.json"
REGENERATE = "python -m compare.schema docs/divergence.schema.json"


def make_divergence(**changes):
    fields = dict(
        binding="kv",
        run_id="run-1",
        workload="L2-2048",
        seed=7,
        step=12,
        op="alloc",
        authoritative="plan",
        shadow="legacy",
        kind="state",
        field_paths=["requests[r17].gpu_pages[3]"],
        diff={
            "values_changed": {
                "root['requests[r17].gpu_pages[3]']": {"old_value": 13, "new_value": 14}
            }
        },
        exception=None,
        replay={"input": {"num_tokens": 3}, "pre": [1, 2.5, None]},
        created_at=1732900000.125,
    )
    return DivergenceRecord(**(fields | changes))


def make_summary(**changes):
    fields = dict(
        binding="kv",
        run_id="run-1",
        workload="L2-2048",
        seed=7,
        authoritative="plan",
        shadow="legacy",
        steps_compared={"alloc": 40, "evict": 3},
        divergences={"alloc": 1},
        harness_errors=0,
        compare_seconds=0.5,
        authoritative_seconds=2.0,
    )
    return RunSummary(**(fields | changes))


TIMELINE = Timeline(
    first_step=40, counters={"held": [3, 5, 4], "events": [0, 2, 0]}, levels={"capacity": 8}
)


@pytest.mark.parametrize(
    "record", [make_divergence(), make_summary(), make_summary(timeline=TIMELINE)]
)
def test_round_trips_each_record_type_through_one_json_line_exactly(record):
    line = record.model_dump_json()
    assert "\n" not in line
    parsed = parse_record(line)
    assert type(parsed) is type(record)
    assert parsed == record
    assert parsed.model_dump_json() == line


def test_stamps_records_with_their_type_and_the_current_schema_version():
    data = json.loads(make_divergence().model_dump_json())
    assert (data["record_type"], data["schema_version"]) == ("divergence", SCHEMA_VERSION)


def test_names_the_found_and_supported_versions_for_an_unknown_schema_version():
    data = json.loads(make_summary().model_dump_json()) | {"schema_version": 7}
    with pytest.raises(
        RecordError,
        match=r"unsupported schema_version 7 in a run_summary record; this reader supports 2, 3$",
    ):
        parse_record(json.dumps(data))


@pytest.mark.parametrize("record", [make_divergence(), make_summary()])
def test_reads_a_schema_2_record_as_one_of_the_kv_binding(record):
    data = json.loads(record.model_dump_json()) | {"schema_version": 2, "binding": "scheduler"}
    del data["binding"]  # schema 2 records name no binding
    parsed = parse_record(json.dumps(data))
    assert (parsed.schema_version, parsed.binding) == (3, "kv")
    assert parsed == record


def test_refuses_a_schema_3_record_that_names_no_binding():
    data = json.loads(make_summary().model_dump_json())
    del data["binding"]
    with pytest.raises(RecordError, match="^invalid run_summary record: binding: field required$"):
        parse_record(json.dumps(data))


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object, found list"),
        (
            '{"record_type": "verdict", "schema_version": 1}',
            "unknown record_type 'verdict'; known: 'divergence', 'run_summary'",
        ),
        ('{"record_type": "divergence"}', "a divergence record without schema_version"),
    ],
)
def test_says_what_is_wrong_with_a_line_that_is_not_a_record(line, message):
    with pytest.raises(RecordError, match=message.replace("[", r"\[")):
        parse_record(line)


def test_refuses_a_string_holding_an_unpaired_surrogate_and_reads_a_paired_one():
    line = make_divergence(workload="L2-\U0001f600").model_dump_json()
    assert parse_record(line.replace("\U0001f600", "\\ud83d\\ude00")).workload == "L2-\U0001f600"
    with pytest.raises(
        RecordError, match=r"unpaired surrogate \\ud83d, which is no Unicode character"
    ):
        parse_record(line.replace("\U0001f600", "\\ud83d"))


def test_names_missing_and_unexpected_fields():
    data = json.loads(make_divergence().model_dump_json())
    del data["op"], data["step"]
    data["colour"] = "red"
    with pytest.raises(RecordError) as raised:
        parse_record(json.dumps(data))
    message = str(raised.value)
    assert message.startswith("invalid divergence record: ")
    assert "step: field required" in message
    assert "op: field required" in message
    assert "colour: extra inputs are not permitted" in message


@pytest.mark.parametrize(
    "change, message",
    [
        ({"schema_version": True}, "unsupported schema_version True"),
        ({"step": True}, "step: input should be a valid integer"),
        ({"step": "7"}, "step: input should be a valid integer"),
        ({"seed": 1.0}, "seed: input should be a valid integer"),
    ],
)
def test_reads_fields_as_the_schema_types_them_not_as_python_would_coerce_them(change, message):
    data = json.loads(make_divergence().model_dump_json()) | change
    with pytest.raises(RecordError, match=message):
        parse_record(json.dumps(data))


def test_a_whole_number_of_seconds_is_still_a_float():
    data = json.loads(make_summary().model_dump_json()) | {"compare_seconds": 0}
    assert parse_record(json.dumps(data)).compare_seconds == 0.0


def test_builds_a_divergence_record_from_a_diverged_comparison():
    comparison = Comparison(
        "evict",
        3,
        Observation("plan", {"a": 1}),
        Observation("legacy", exception=KeyError("r17")),
        None,
        "exception",
    )
    run = RunKey("kv", "run-1", "L2-4096", 1)
    record = DivergenceRecord.from_comparison(comparison, run, replay={"pre": 1}, created_at=5.0)
    assert (record.binding, record.run_id, record.workload, record.seed) == run
    assert (record.op, record.step, record.kind) == ("evict", 3, "exception")
    assert (record.authoritative, record.shadow) == ("plan", "legacy")
    assert record.exception == "legacy raised KeyError: 'r17'"
    assert (record.field_paths, record.diff) == ([], {})


def test_carries_the_paths_and_detail_of_a_value_divergence():
    outcome = diff({"pages": [1]}, {"pages": [2]})
    comparison = Comparison(
        "alloc",
        1,
        Observation("plan", {"pages": [1]}),
        Observation("legacy", {"pages": [2]}),
        outcome,
        "state",
    )
    record = DivergenceRecord.from_comparison(
        comparison, RunKey("kv", "r", "w", 0), replay={}, created_at=0.0
    )
    assert record.field_paths == ["pages[0]"]
    assert record.diff == outcome.detail
    assert record.exception is None


def test_refuses_to_record_a_matched_comparison():
    seen = Observation("plan", {})
    with pytest.raises(ValueError, match="matched"):
        DivergenceRecord.from_comparison(
            Comparison("alloc", 1, seen, seen, None, None),
            RunKey("kv", "r", "w", 0),
            replay={},
            created_at=0.0,
        )


def test_builds_a_run_summary_from_executor_stats():
    executor = ShadowExecutor(mode="log")
    executor.run_both(
        "alloc",
        0,
        authoritative=lambda: 1,
        shadow=lambda forked: 2,
        shadow_path="legacy",
        authoritative_path="plan",
    )
    summary = RunSummary.from_stats(
        executor.stats(), RunKey("kv", "r", "w", 0), authoritative="plan", shadow="legacy"
    )
    assert (summary.steps_compared, summary.divergences) == ({"alloc": 1}, {"alloc": 1})
    assert parse_record(summary.model_dump_json()) == summary


def test_checked_in_schema_matches_the_record_models():
    assert SCHEMA_FILE.exists(), f"missing {SCHEMA_FILE}; generate it with: {REGENERATE}"
    assert json.loads(SCHEMA_FILE.read_text()) == json_schema(), (
        f"{SCHEMA_FILE} is stale; regenerate it with: {REGENERATE}"
    )


def test_schema_covers_every_record_type_by_discriminator():
    schema = json_schema()
    assert schema["discriminator"]["propertyName"] == "record_type"
    assert set(schema["discriminator"]["mapping"]) == {"divergence", "run_summary", "sample_rate"}
    assert set(schema["$defs"]) == {
        "DataChecks",
        "DivergenceRecord",
        "OutcomeCount",
        "RunSummary",
        "SampleRateRecord",
        "Timeline",
    }


def test_a_run_summary_without_a_timeline_reads_as_none():
    data = json.loads(make_summary().model_dump_json())
    del data["timeline"]
    assert parse_record(json.dumps(data)).timeline is None


def test_a_timeline_counts_its_steps_and_refuses_counters_of_different_lengths():
    assert TIMELINE.num_steps == 3
    data = json.loads(make_summary(timeline=TIMELINE).model_dump_json())
    data["timeline"]["counters"]["events"] = [0, 2]
    with pytest.raises(RecordError, match="counters hold one value per step.*'events': 2"):
        parse_record(json.dumps(data))


def test_the_run_summary_carries_the_timeline_it_is_built_with():
    executor = ShadowExecutor(mode="log")
    summary = RunSummary.from_stats(
        executor.stats(), RunKey("kv", "r", "w", 0), authoritative="plan", shadow="legacy",
        timeline=TIMELINE,
    )  # fmt: skip
    assert summary.timeline == TIMELINE


def test_writes_the_schema_file_from_the_command_line(tmp_path):
    target = tmp_path / "docs" / "schema.json"
    done = subprocess.run(
        [sys.executable, "-m", "compare.schema", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(target.read_text()) == json_schema()


def test_write_json_schema_replaces_an_existing_file(tmp_path):
    target = tmp_path / "schema.json"
    target.write_text("stale")
    write_json_schema(target)
    assert json.loads(target.read_text()) == json_schema()
    assert [p.name for p in tmp_path.iterdir()] == ["schema.json"]
