"""``batchgen validate``: L2-2048 and L2-4096 back-to-back, then the corpus, in compare mode, in
every KV direction, judged by what the runs showed and by the decisions they reached.

The runs, one model::

    role         worker                          workload  pool             checks (and, every
                                                                                run: pools sound
                                                                                after every step)
    -----------  ------------------------------  --------  ---------------  -----------------------
    legacy/plan  one worker per direction runs   L2-2048   L2-4096's        evicted; clean after; no
    plan/legacy  both workloads in compare mode  L2-4096   (see below)      divergence; tokens ==
    plan/plan    "log" (authoritative/shadow;                               reference's
                 plan/plan: the A/A check)
    the same     a fresh worker per corpus file  corpus    the file's       clean after; no
    three                                        files                      divergence
    reference    a fresh worker per workload     both L2   every request    no eviction, load,
                                                           fits             recompute
    fresh        a fresh worker, plan path       L2-4096   the shared       == each direction's
                                                           workers'         L2-4096

A direction's worker serves with its authoritative path and shadows every KV op of every step
with the other path on a bookkeeping fork; plan/plan shadows the plan path with itself, so any
divergence it reports is noise in the harness. Each worker's finish step (``batchgen.finish``)
is shadowed in the same direction, in raise mode: its first divergence stops the run and fails it,
and the summary counts its ``finish`` op beside the KV ops. The shared workers' cache is
L2-4096's, so L2-2048 runs under less pressure (still enough to evict: checked). The corpus
(``corpus/``, found by ``batchgen explore``) reaches the decisions the L2 traces do not: its
files carry their own pools, engine limits and fault schedules. Together the runs must reach
every required outcome of the decision catalog (``batchgen.shadow.coverage``), and none the
catalog rules out.

First, the self-checks (``self_checks``): malformed plans the plan checks must refuse and
corrupted workers the integrity check must catch; and after every run, its counters against its
outputs. Last, the HF oracle (``hf_oracle``): the tiny model's greedy tokens on a short workload
under KV pressure against HF transformers on the same checkpoint, when transformers is installed.

"Clean after": no GPU or host page held, no load in flight, no live request, and
``worker.check_integrity()`` passes. The reference allows near-ties (``output_check``); the fresh
run batches exactly like a shared one, so it must match token for token, counters included.

Every compare run appends its divergences and its ``RunSummary`` to one log,
``divergences.jsonl.partial`` in the reports directory, renamed ``divergences.jsonl`` once every
run is done; the reports are rendered from it (``validation_report``). An interrupted validation
leaves the last complete log and its reports as they were.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from batchgen.config import CacheConfig
from batchgen.engine.workloads import BUILTIN_WORKLOADS, Workload, load_workload
from batchgen.kv.copy_patterns import issuable_patterns
from batchgen.model.loader import SUPPORTED_DTYPES
from batchgen.shadow.coverage import CATALOG
from batchgen.shadow.report_page import write_reports
from batchgen.shadow.wiring import DIRECTIONS
from batchgen.validation.checks import copy_pattern_failures, coverage_failures
from batchgen.validation.output_check import NEAR_TIE_TOLERANCES
from batchgen.validation.real_model_check import DTYPES as REAL_MODEL_DTYPES
from batchgen.validation.real_model_check import check_real_model
from batchgen.validation.report import (
    PARTIAL_LOG,
    ValidationReport,
    complete_log,
    reports_directory,
)
from batchgen.validation.session import FailFast, ProgressCallback, Session
from compare import LogRecord, Report, aggregate

# Built-in names or workload files, run in this order on each shared worker (the last one's pool
# and engine).
BACK_TO_BACK_WORKLOADS = ("L2-2048", "L2-4096")
CORPUS_DIR = Path(__file__).parent / "corpus"  # the checked-in corpus


def validate_back_to_back(
    model,
    *,
    seed: int = 0,
    scale: float = 1.0,
    device: str | torch.device = "cpu",
    reports_dir: str | Path | None = None,
    corpus_dir: str | Path | None = None,
    on_progress: ProgressCallback | None = None,
    fail_fast: bool = False,
    metrics=None,
    real_model: bool = False,
) -> ValidationReport:
    """Run the validation on ``model`` (already on ``device``) in every direction and judge it.
    Builds its own workers (explicit gates: the ``BATCHGEN_WORKER_KV_*`` environment does not
    apply). Writes the divergence log and its reports into ``reports_dir`` (replacing earlier
    ones; None: a temporary directory). ``corpus_dir``: the corpus's workload files (None: the
    checked-in corpus; an empty directory: none). Raises only for bad input (WorkloadError for a
    bad scale or workload file, RequestError for a model whose context or vocabulary cannot serve
    the traces); every check that fails is a line in ``failures``. ``fail_fast``: stop at the
    first failed check (its compare runs raise at their first divergence); the report then holds
    that one failure and the runs before it, and the coverage check is skipped. ``metrics`` (a
    ``batchgen.metrics.WorkerMetrics``) watches every run, labelled by its workload and role.
    ``real_model``: the real-model pass (``real_model_check``) runs last."""
    started = time.perf_counter()
    workloads = tuple(
        load_workload(name, seed=seed, scale=scale, vocab_size=model.config.vocab_size)
        for name in BACK_TO_BACK_WORKLOADS
    )
    corpus_dir = CORPUS_DIR if corpus_dir is None else corpus_dir
    corpus = corpus_workloads(corpus_dir)
    cache = workloads[-1].cache.model_copy(update={"dtype": _dtype_name(model)})
    with reports_directory(reports_dir) as directory:
        sources = _sources(workloads, corpus, corpus_dir)
        log = directory / PARTIAL_LOG
        session = Session(
            model, device, log, sources, on_progress, fail_fast=fail_fast, metrics=metrics
        )
        _run_checks(session, workloads, corpus, cache, scale, real_model)
        session.log = complete_log(directory)  # an interrupted validation leaves the last one
        records = session.read_log()
        compare = _judge_coverage(session, records, device)
        written = {}
        if reports_dir is not None:
            written = _write_reports(session, directory, compare, records)
    wall_s = time.perf_counter() - started
    return _report(session, cache, workloads, corpus, compare, written, wall_s)


def _report(
    session: Session,
    cache: CacheConfig,
    workloads: Sequence[Workload],
    corpus: Sequence[Workload],
    compare: Report,
    written: dict[str, str],
    wall_s: float,
) -> ValidationReport:
    """The validation's report: the shared workers' ``cache``, the back-to-back ``workloads`` and
    the ``corpus`` by name, what ``session`` ran and found, the aggregated log ``compare``, the
    reports ``written``. Pure."""
    return ValidationReport(
        cache=cache,
        near_tie_tolerance=NEAR_TIE_TOLERANCES[cache.dtype],
        workloads=tuple(w.name for w in workloads),
        corpus=tuple(w.name for w in corpus),
        runs=tuple(session.runs),
        failures=list(session.failures),
        compare=compare,
        reports=written,
        wall_s=wall_s,
        hf_oracle=session.hf_oracle,
        real_model=tuple(session.real_model),
        self_checks=dict(session.self_checks),
    )


def _run_checks(
    session: Session,
    workloads: Sequence[Workload],
    corpus: Sequence[Workload],
    cache: CacheConfig,
    scale: float,
    real_model: bool,
) -> None:
    """Every direction's runs and checks, then the real-model pass if asked for; a fail-fast
    session stops at its first failure. Mutates ``session``."""
    try:
        _run_every_direction(session, workloads, corpus, cache, scale)
        if real_model:
            _check_real_model(session)
    except FailFast:
        pass  # the failure is in session.failures


def _check_real_model(session: Session) -> None:
    """The real-model pass (``real_model_check``) in each of its dtypes on the session's device;
    says so and fails nothing where the model or the dev extras cannot be had. Mutates
    ``session``."""
    for dtype in REAL_MODEL_DTYPES:
        verdict = check_real_model(session.device, dtype)
        session.real_model.append(verdict.line)
        session.failures += verdict.failures
        session.stop_at_failure()


def _judge_coverage(
    session: Session, records: Sequence[LogRecord], device: str | torch.device
) -> Report:
    """The compare runs' log aggregated; unless a fail-fast session stopped at a failure (it
    reached only some), every reachable outcome, interaction and copy pattern must be in it.
    Mutates ``session.failures``."""
    compare = aggregate(records, CATALOG)
    if not (session.fail_fast and session.failures):
        session.failures += coverage_failures(compare)
        issuable = issuable_patterns(host_to_host=torch.device(device).type == "cpu")
        session.failures += copy_pattern_failures(compare, issuable)
    return compare


def _sources(
    workloads: Sequence[Workload], corpus: Sequence[Workload], corpus_dir: str | Path
) -> dict[str, str]:
    """Each workload's name -> what replay and minimize reload it from: a built-in name or a
    file. Pure."""
    sources = {w.name: _source(spec) for spec, w in zip(BACK_TO_BACK_WORKLOADS, workloads)}
    return sources | {w.name: str(Path(corpus_dir, f"{w.name}.json").resolve()) for w in corpus}


def _run_every_direction(
    session: Session,
    workloads: Sequence[Workload],
    corpus: Sequence[Workload],
    cache: CacheConfig,
    scale: float,
) -> None:
    """The self-checks (``self_checks``), the back-to-back runs and the corpus in each direction,
    then (on a shared worker) the output checks against the references and a fresh worker, then
    the HF oracle (``hf_oracle``). Mutates ``session``."""
    session.run_self_checks()
    for direction in DIRECTIONS:
        session.run_back_to_back(direction, workloads, cache, workloads[-1].engine, scale)
        session.run_corpus(direction, corpus)
    if session.shared:
        dtype = cache.dtype
        session.check_against_references(workloads, dtype, NEAR_TIE_TOLERANCES[dtype])
        session.check_against_fresh(workloads[-1], cache)
    session.check_against_hf(NEAR_TIE_TOLERANCES[cache.dtype])


def corpus_workloads(corpus_dir: str | Path) -> list[Workload]:
    """The corpus's workload files, by name; each named after its file (its divergences name the
    file replay and minimize reload). WorkloadError for one that is not a valid workload."""
    paths = sorted(Path(corpus_dir).glob("*.json"))
    return [load_workload(str(path)).model_copy(update={"name": path.stem}) for path in paths]


def _write_reports(
    session: Session, directory: Path, compare: Report, records: tuple[LogRecord, ...]
) -> dict[str, str]:
    """``write_reports``; a report that cannot be written (a full disk, say) is a failure of the
    validation, not a crash: the summary is still printed. Mutates ``session.failures``."""
    try:
        return write_reports(directory, compare, records)
    except OSError as error:
        session.failures.append(f"reports: cannot write {error.filename}: {error.strerror}")
        return {}


def _source(name: str) -> str:
    """How ``replay``/``minimize`` reload a workload: its built-in name, or its file's absolute
    path."""
    return name if name in BUILTIN_WORKLOADS else str(Path(name).resolve())


def _dtype_name(model) -> str:
    torch_dtype = next(model.parameters()).dtype
    return next(name for name, dtype in SUPPORTED_DTYPES.items() if dtype == torch_dtype)
