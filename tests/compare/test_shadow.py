import ast
import dataclasses
import importlib
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest

from compare.errors import UNCLASSIFIED, DivergenceError, HarnessWarning
from compare.observation import Comparison, Observation, exception_text
from compare.shadow import ShadowExecutor

shadow_module = importlib.import_module("compare.shadow")

SAME = {"pages": [1, 2]}
OTHER = {"pages": [1, 3]}


def raising(error):
    def call(*args, **kwargs):
        raise error

    return call


def make(mode="log", **options):
    """An executor, and a recorder of what it reports through its hooks."""
    recorder = SimpleNamespace(divergences=[], harness_errors=[])
    options.setdefault("on_divergence", lambda *report: recorder.divergences.append(report))
    options.setdefault("on_harness_error", lambda *error: recorder.harness_errors.append(error))
    return ShadowExecutor(mode=mode, **options), recorder


def run(executor, *, auth=SAME, shadow=SAME, op="alloc", step=0, **kwargs):
    """One step where the authoritative path returns "result" canonicalized as ``auth`` and the
    shadow returns ``shadow`` (already canonical); either raises its value if an exception."""
    authoritative = raising(auth) if isinstance(auth, BaseException) else lambda: "result"
    other = raising(shadow) if isinstance(shadow, BaseException) else lambda forked: shadow
    kwargs.setdefault("canonicalize", lambda seen, other_seen: (auth, other_seen.value))
    return executor.run_both(
        op,
        step,
        authoritative=authoritative,
        shadow=other,
        shadow_path="legacy",
        authoritative_path="plan",
        **kwargs,
    )


def test_returns_the_authoritative_result_when_the_paths_agree():
    executor, recorder = make()
    assert run(executor) == "result"
    assert recorder.divergences == []


def test_returns_the_authoritative_result_and_reports_a_divergence_in_log_mode():
    executor, recorder = make()
    assert run(executor, shadow=OTHER, step=7) == "result"
    [(comparison, _)] = recorder.divergences
    assert (comparison.op, comparison.step, comparison.kind) == ("alloc", 7, "state")
    assert comparison.field_paths == ("pages[1]",)
    assert (comparison.authoritative.path, comparison.authoritative.value) == ("plan", SAME)
    assert (comparison.shadow.path, comparison.shadow.value) == ("legacy", OTHER)


def test_runs_context_fork_shadow_authoritative_then_canonicalize():
    executor, _ = make()
    order = []

    def canonicalize(seen, shadow_seen):
        order.append(("canonicalize", seen.value, shadow_seen.value))
        return SAME, SAME

    executor.run_both(
        "alloc",
        0,
        authoritative=lambda: order.append("authoritative") or "result",
        shadow=lambda forked: order.append(("shadow", forked)) or "shadow result",
        fork=lambda: order.append("fork") or "the fork",
        canonicalize=canonicalize,
        context=lambda: order.append("context"),
        shadow_path="legacy",
        authoritative_path="plan",
    )
    assert order == [
        "context",
        "fork",
        ("shadow", "the fork"),
        "authoritative",
        ("canonicalize", "result", "shadow result"),
    ]


def test_compares_the_canonical_forms_not_the_raw_results():
    executor, recorder = make()
    # "result" vs SAME raw; SAME vs SAME canonical
    assert run(executor, auth=SAME, shadow=SAME) == "result"
    assert recorder.divergences == []
    run(executor, auth=SAME, shadow=OTHER)
    [(comparison, _)] = recorder.divergences
    assert (comparison.authoritative.value, comparison.shadow.value) == (SAME, OTHER)


def test_a_failing_fork_is_a_harness_error_and_the_authoritative_path_runs_alone():
    executor, recorder = make("raise")
    error = MemoryError("no room for a fork")
    called = []
    result = executor.run_both(
        "alloc",
        0,
        authoritative=lambda: "result",
        shadow=lambda forked: called.append(forked),
        fork=raising(error),
        shadow_path="legacy",
        authoritative_path="plan",
    )
    assert result == "result"
    assert called == []
    assert recorder.harness_errors == [("fork", error)]
    assert recorder.divergences == []
    assert executor.stats().num_compared == {}


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_a_failing_canonicalize_is_a_harness_error_not_a_divergence(mode):
    executor, recorder = make(mode)
    error = RuntimeError("bug in the canonical form")
    assert run(executor, shadow=OTHER, canonicalize=raising(error)) == "result"
    assert recorder.harness_errors == [("canonicalize", error)]
    assert recorder.divergences == []
    assert (executor.stats().num_compared, executor.stats().num_divergences) == ({}, {})


def test_a_canonicalize_that_returns_no_pair_is_a_harness_error():
    executor, recorder = make()
    assert run(executor, canonicalize=lambda seen, other: None) == "result"
    [(operation, error)] = recorder.harness_errors
    assert (operation, type(error)) == ("canonicalize", TypeError)
    assert executor.stats().num_compared == {}


def test_a_failing_canonicalize_leaves_the_authoritative_exception_unchanged():
    executor, recorder = make("raise")
    error = ValueError("pool exhausted")
    with pytest.raises(ValueError) as raised:
        run(executor, auth=error, canonicalize=raising(RuntimeError("canonical form bug")))
    assert raised.value is error
    assert [operation for operation, _ in recorder.harness_errors] == ["canonicalize"]


def test_a_fatal_harness_hook_leaves_the_authoritative_exception_unchanged():
    def fail(operation, error):
        raise error

    executor, _ = make("log", on_harness_error=fail)
    error = ValueError("pool exhausted")
    with pytest.raises(ValueError) as raised:
        run(executor, auth=error, canonicalize=raising(RuntimeError("canonical form bug")))
    assert raised.value is error
    assert executor.stats().num_harness_errors == 1


def test_hooks_raising_the_authoritative_exception_again_leave_its_traceback_and_context():
    def kind(error):  # the usual way to classify an exception: by the handler that catches it
        try:
            raise error
        except LookupError:
            return "lookup"

    def canonicalize(seen, shadow_seen):
        try:
            raise RuntimeError("no form for an exception")
        except RuntimeError:
            raise seen.exception  # noqa: B904 (its context becomes this RuntimeError)

    def authoritative():
        raise KeyError("r17")

    outer = RuntimeError("being handled by the caller")
    for hooks in ({"exception_kind": kind}, {"canonicalize": canonicalize}):
        executor, recorder = make(
            exception_kind=hooks.get("exception_kind", lambda error: "exception")
        )
        try:
            raise outer
        except RuntimeError:
            with pytest.raises(KeyError) as raised:
                executor.run_both(
                    "alloc",
                    0,
                    authoritative=authoritative,
                    shadow=lambda forked: SAME,
                    canonicalize=hooks.get("canonicalize", lambda seen, shadow_seen: (None, SAME)),
                    shadow_path="legacy",
                    authoritative_path="plan",
                )
        names = [entry.name for entry in traceback.extract_tb(raised.value.__traceback__)]
        assert names[1:] == ["run_both", "_timed", "authoritative"]
        assert raised.value.__context__ is outer


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str")

    def __repr__(self):
        raise RuntimeError("no repr")


def test_an_unprintable_harness_error_is_still_only_warned_about():
    executor = ShadowExecutor(mode="log", classify=raising(Unprintable()))
    with pytest.warns(HarnessWarning, match="classify: Unprintable: <unprintable>"):
        assert run(executor, shadow=OTHER) == "result"


def test_an_unprintable_shadow_exception_still_raises_divergence_error_in_raise_mode():
    executor, _ = make("raise")
    with pytest.raises(DivergenceError, match="legacy raised Unprintable: <unprintable>"):
        run(executor, shadow=Unprintable())


@pytest.mark.parametrize(
    "error, text",
    [
        (KeyError("r17"), "KeyError: 'r17'"),
        (KeyboardInterrupt(), "KeyboardInterrupt"),  # Ctrl-C: no message, no dangling colon
        (Unprintable(), "Unprintable: <unprintable>"),
    ],
)
def test_an_exception_is_named_by_its_type_and_message(error, text):
    assert exception_text(error) == text


def test_canonicalize_sees_the_exception_of_a_side_that_raised_and_its_form_is_ignored():
    executor, recorder = make()
    error = KeyError("r17")
    seen = []

    def canonicalize(authoritative, shadow):
        seen.append((authoritative.value, shadow.exception))
        return SAME, "ignored: the shadow raised"

    run(executor, shadow=error, canonicalize=canonicalize)
    assert seen == [("result", error)]
    [(comparison, _)] = recorder.divergences
    assert (comparison.kind, comparison.shadow.value, comparison.authoritative.value) == (
        "exception",
        None,
        SAME,
    )


def test_passes_the_captured_context_to_on_divergence():
    executor, recorder = make()
    run(executor, shadow=OTHER, context=lambda: {"pre": "state"})
    assert recorder.divergences[0][1] == {"pre": "state"}


def test_continues_without_context_when_capturing_it_fails():
    executor, recorder = make()
    error = RuntimeError("no snapshot")
    assert run(executor, shadow=OTHER, context=raising(error)) == "result"
    assert recorder.harness_errors == [("context", error)]
    assert recorder.divergences[0][1] is None


def test_swallows_exceptions_raised_by_the_shadow():
    executor, recorder = make()
    error = KeyError("r17")
    assert run(executor, shadow=error) == "result"
    [(comparison, _)] = recorder.divergences
    assert comparison.kind == "exception"
    assert comparison.shadow.exception is error
    assert comparison.diff is None


def test_raises_divergence_error_not_the_shadow_exception_in_raise_mode():
    executor, _ = make("raise")
    error = KeyError("r17")
    with pytest.raises(DivergenceError) as raised:
        run(executor, shadow=error)
    assert raised.value.__cause__ is error
    assert raised.value.comparison.shadow.exception is error


def test_lets_keyboard_interrupt_from_the_shadow_through():
    executor, _ = make()
    with pytest.raises(KeyboardInterrupt):
        run(executor, shadow=KeyboardInterrupt())


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_reraises_the_authoritative_exception_unchanged_after_recording_it(mode):
    executor, recorder = make(mode)
    error = ValueError("pool exhausted")
    with pytest.raises(ValueError) as raised:
        run(executor, auth=error)
    assert raised.value is error
    [(comparison, _)] = recorder.divergences
    assert comparison.kind == "exception"
    assert comparison.authoritative.exception is error


def test_matches_when_both_paths_raise_the_same_exception_type():
    executor, recorder = make("raise")
    with pytest.raises(ValueError, match="plan"):
        run(executor, auth=ValueError("plan"), shadow=ValueError("legacy"))
    assert recorder.divergences == []
    assert executor.stats().num_compared == {"alloc": 1}


def test_names_exception_divergences_with_exception_kind():
    executor, recorder = make(exception_kind=lambda error: type(error).__name__)
    with pytest.raises(ValueError):
        run(executor, auth=ValueError("plan"), shadow=KeyError("legacy"))
    assert recorder.divergences[0][0].kind == "KeyError"


def test_raises_divergence_error_naming_op_step_kind_and_each_paths_values_in_raise_mode():
    executor, recorder = make("raise")
    with pytest.raises(DivergenceError) as raised:
        run(executor, shadow=OTHER, op="evict", step=12)
    message = str(raised.value)
    assert "evict step 12: state divergence" in message
    assert "\npages[1]  plan: 2  legacy: 3" in message
    assert isinstance(raised.value, AssertionError)
    assert len(recorder.divergences) == 1


def test_names_value_divergences_with_the_classifier():
    executor, recorder = make(
        classify=lambda paths: "copies" if paths[0].startswith("copies") else "state"
    )
    run(executor, auth={"copies": [1]}, shadow={"copies": [2]})
    assert recorder.divergences[0][0].kind == "copies"


def test_ignores_differences_at_ignored_paths():
    executor, recorder = make(ignore=["stats.*"])
    run(executor, auth={"stats": {"t": 1}}, shadow={"stats": {"t": 2}})
    assert recorder.divergences == []


def test_funnels_a_broken_classifier_and_keeps_the_divergence_unclassified():
    error = RuntimeError("classifier bug")
    executor, recorder = make(classify=raising(error))
    assert run(executor, shadow=OTHER) == "result"
    assert recorder.harness_errors == [("classify", error)]
    assert recorder.divergences[0][0].kind == UNCLASSIFIED


def test_funnels_a_broken_divergence_hook_and_still_returns_the_result():
    error = OSError("disk full")
    executor, recorder = make(on_divergence=raising(error))
    assert run(executor, shadow=OTHER) == "result"
    assert recorder.harness_errors == [("on_divergence", error)]
    assert executor.stats().num_divergences == {"alloc": 1}


def test_funnels_a_failing_diff_and_still_returns_the_result(monkeypatch):
    error = RecursionError("too deep")
    monkeypatch.setattr(importlib.import_module("compare.observation"), "diff", raising(error))
    executor, recorder = make("raise")
    assert run(executor, shadow=OTHER) == "result"
    assert recorder.harness_errors == [("compare", error)]
    assert (executor.stats().num_harness_errors, executor.stats().num_compared) == (1, {})


def test_equal_forms_match_without_running_diff(monkeypatch):
    monkeypatch.setattr(
        importlib.import_module("compare.observation"), "diff", raising(AssertionError("diff ran"))
    )
    executor, recorder = make("raise")
    assert run(executor) == "result"
    assert (recorder.harness_errors, recorder.divergences) == ([], [])
    assert executor.stats().num_compared == {"alloc": 1}


class _Incomparable:
    def __eq__(self, other):
        raise TypeError("cannot compare")

    __hash__ = None


def test_forms_that_cannot_be_compared_are_a_harness_error():
    executor, recorder = make("raise")
    assert run(executor, auth=_Incomparable()) == "result"
    assert [(operation, str(error)) for operation, error in recorder.harness_errors] == [
        ("compare", "cannot compare")
    ]
    assert (executor.stats().num_harness_errors, executor.stats().num_compared) == (1, {})


def test_leaves_that_agree_in_unequal_forms_are_a_match():
    nan = float("nan")
    executor, recorder = make("raise")
    assert run(executor, auth={"x": [nan]}, shadow={"x": [float("nan")]}) == "result"
    assert (recorder.harness_errors, recorder.divergences) == ([], [])
    assert executor.stats().num_compared == {"alloc": 1}


def test_run_both_compares_whatever_the_sampling_says():
    executor, recorder = make(sample=0.0, ops={"evict"})
    result = executor.run_both(
        "alloc",
        3,
        authoritative=lambda: "result",
        shadow=lambda forked: OTHER,
        canonicalize=lambda seen, other_seen: (SAME, other_seen.value),
        shadow_path="legacy",
        authoritative_path="plan",
    )
    assert result == "result"
    assert [comparison.step for comparison, _ in recorder.divergences] == [3]
    assert executor.stats().num_divergences == {"alloc": 1}


def test_warns_about_harness_errors_by_default():
    executor = ShadowExecutor(mode="log", classify=raising(RuntimeError("classifier bug")))
    with pytest.warns(HarnessWarning, match="classify"):
        assert run(executor, shadow=OTHER) == "result"
    assert executor.stats().num_harness_errors == 1


def test_a_raising_harness_hook_makes_harness_errors_fatal():
    def fail(operation, error):
        raise error

    executor = ShadowExecutor(
        mode="log", classify=raising(RuntimeError("classifier bug")), on_harness_error=fail
    )
    with pytest.raises(RuntimeError, match="classifier bug"):
        run(executor, shadow=OTHER)


@pytest.mark.parametrize("namer", ["classify", "exception_kind"])
def test_a_fatal_harness_hook_is_called_and_counted_once_for_a_broken_classifier(namer):
    calls = []

    def fail(operation, error):
        calls.append(operation)
        raise error

    executor = ShadowExecutor(
        mode="log", on_harness_error=fail, **{namer: raising(RuntimeError("classifier bug"))}
    )
    with pytest.raises(RuntimeError, match="classifier bug"):
        run(executor, shadow=OTHER if namer == "classify" else KeyError("r17"))
    assert calls == [namer]
    assert executor.stats().num_harness_errors == 1


def test_samples_steps_as_a_function_of_seed_and_step_only():
    first, _ = make(sample=0.3, seed=1)
    second, _ = make(sample=0.3, seed=1)
    keys = [(op, step) for op in ("alloc", "evict") for step in range(400)]
    picked = {key for key in keys if first.should_compare(*key)}
    assert picked == {key for key in reversed(keys) if second.should_compare(*key)}
    assert 0.2 < len(picked) / len(keys) < 0.4
    assert {step for op, step in picked if op == "alloc"} == {
        step for op, step in picked if op == "evict"
    }
    other_seed, _ = make(sample=0.3, seed=2)
    assert picked != {key for key in keys if other_seed.should_compare(*key)}
    assert all(make(sample=1.0)[0].should_compare(*key) for key in keys)
    assert not any(make(sample=0.0)[0].should_compare(*key) for key in keys)


def test_reports_no_divergence_when_one_path_is_compared_with_itself():
    executor, recorder = make("raise")

    def path():  # one path on both sides
        return {"pages": [1, 2], "free": {3: "x"}}

    for step in range(5):
        executor.run_both(
            "alloc",
            step,
            authoritative=path,
            shadow=lambda forked: path(),
            shadow_path="legacy",
            authoritative_path="legacy",
        )
    assert recorder.divergences == []
    assert executor.stats().num_compared == {"alloc": 5}


def test_counts_compared_steps_and_divergences_per_op():
    executor, _ = make()
    run(executor, op="alloc")
    run(executor, op="alloc", shadow=OTHER)
    run(executor, op="evict", shadow=OTHER)
    stats = executor.stats()
    assert stats.num_compared == {"alloc": 2, "evict": 1}
    assert stats.num_divergences == {"alloc": 1, "evict": 1}
    assert stats.num_harness_errors == 0


def test_measures_shadow_authoritative_and_harness_time_with_the_injected_clock():
    now = [100.0]
    executor, recorder = make(clock=lambda: now[0])

    def advance(seconds, value):
        now[0] += seconds
        return value

    executor.run_both(
        "alloc",
        0,
        authoritative=lambda: advance(5.0, SAME),
        shadow=lambda forked: advance(2.0, OTHER),
        shadow_path="legacy",
        authoritative_path="plan",
    )
    comparison = recorder.divergences[0][0]
    assert (comparison.shadow.duration_s, comparison.authoritative.duration_s) == (2.0, 5.0)
    stats = executor.stats()
    assert (stats.compare_seconds, stats.authoritative_seconds) == (2.0, 5.0)


def test_counts_the_time_of_an_interrupted_authoritative_path_as_authoritative():
    now = [100.0]
    executor, _ = make(clock=lambda: now[0])

    def interrupted():
        now[0] += 5.0
        raise KeyboardInterrupt

    def shadow(forked):
        now[0] += 2.0
        return SAME

    with pytest.raises(KeyboardInterrupt):
        executor.run_both(
            "alloc",
            0,
            authoritative=interrupted,
            shadow=shadow,
            shadow_path="legacy",
            authoritative_path="plan",
        )
    stats = executor.stats()
    assert (stats.compare_seconds, stats.authoritative_seconds) == (2.0, 5.0)


def test_stats_is_an_immutable_snapshot():
    executor, _ = make()
    run(executor)
    stats = executor.stats()
    run(executor)
    assert stats.num_compared == {"alloc": 1}
    with pytest.raises(TypeError):
        stats.num_compared["alloc"] = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_harness_errors = 3


def test_observations_and_comparisons_are_immutable():
    seen = Observation("plan", SAME)
    comparison = Comparison("alloc", 0, seen, seen, None, None)
    assert comparison.matched and not seen.raised
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen.value = OTHER
    with pytest.raises(dataclasses.FrozenInstanceError):
        comparison.kind = "state"


def test_rejects_an_unknown_mode_or_a_sample_outside_zero_to_one():
    with pytest.raises(ValueError, match="mode"):
        ShadowExecutor(mode="loud")
    with pytest.raises(ValueError, match="sample"):
        ShadowExecutor(mode="log", sample=1.5)
    with pytest.raises(ValueError, match="not the string 'alloc'"):
        ShadowExecutor(mode="log", ops="alloc")  # would filter on its letters


def test_compare_package_never_imports_batchgen():
    package = Path(shadow_module.__file__).parent
    for source in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(name.split(".")[0] == "batchgen" for name in names), source.name


def test_a_divergence_in_values_json_cannot_hold_is_still_a_divergence():
    executor, recorder = make("raise")
    with pytest.raises(DivergenceError, match='t  plan: "1j"  legacy: "2j"'):
        run(executor, auth={"t": 1j}, shadow={"t": 2j})
    assert (recorder.harness_errors, executor.stats().num_divergences) == ([], {"alloc": 1})
