"""Seeded request traces: ``smoke``, ``L2-2048``, ``L2-4096``, or a JSON file.

A workload carries its requests (explicit token ids, arrival steps, optional
abort steps) and the cache geometry it is sized against: the L2 traces give
the GPU pool a fraction of their peak demand, so eviction, migration, recompute
preemption and decode -> prefill turnover each happen many times.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from batchgen.config import CacheConfig, EngineConfig, pages_needed, validation_summary
from batchgen.engine.faults import OWNER_PREFIX as FAULT_OWNER_PREFIX
from batchgen.engine.faults import FaultSpec
from batchgen.state import Request

MAX_STEPS = 1_000_000  # bound on any step count in a workload (arrivals, aborts, new tokens)
MAX_SCALE = 1000.0


class WorkloadError(ValueError):
    """An unknown workload name or an invalid workload file."""


def _unicode_text(text: str) -> str:
    """``text``, if it is Unicode text (JSON's ``\\ud800`` reads as a lone surrogate, which no log
    or report can write); ValueError otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"holds the unpaired surrogate \\u{ord(text[error.start]):04x}; surrogates must come in"
            " pairs"
        ) from None
    return text


class WorkloadRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    uuid: str = Field(min_length=1)
    prompt_ids: list[int] = Field(min_length=1)
    max_new_tokens: int = Field(ge=1, le=MAX_STEPS)
    arrival_step: int = Field(default=0, ge=0, le=MAX_STEPS)
    abort_step: int | None = Field(
        default=None, ge=0, le=MAX_STEPS, description="step (relative to arrival) to abort at"
    )
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    seed: int = 0

    @field_validator("uuid")
    @classmethod
    def _not_a_fault_owner(cls, uuid: str) -> str:
        if uuid.startswith(FAULT_OWNER_PREFIX):
            raise ValueError(
                f"uuids starting with {FAULT_OWNER_PREFIX!r} are reserved (fault injection holds"
                " pool pages under them)"
            )
        return uuid

    def to_request(self) -> Request:
        return Request(
            self.uuid, tuple(self.prompt_ids), self.max_new_tokens, self.temperature, self.seed
        )


class Workload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    seed: int = 0
    cache: CacheConfig
    engine: EngineConfig = EngineConfig()
    requests: list[WorkloadRequest] = Field(min_length=1)
    # a fault SPEC (the --faults grammar) the workload runs under; batchgen run --faults replaces it
    faults: str | None = None

    _name_is_text = field_validator("name")(_unicode_text)

    @field_validator("faults")
    @classmethod
    def _a_fault_spec(cls, spec: str | None) -> str | None:
        if spec is not None:
            FaultSpec.parse(spec)  # FaultSpecError (a ValueError) names the bad part
        return spec

    @model_validator(mode="after")
    def _unique_uuids(self) -> Workload:
        seen: set[str] = set()
        for req in self.requests:
            if req.uuid in seen:
                raise ValueError(f"request uuid {req.uuid!r} appears twice")
            seen.add(req.uuid)
        return self

    @property
    def max_context(self) -> int:
        return max(len(r.prompt_ids) + r.max_new_tokens for r in self.requests)

    def to_json(self) -> str:
        """The workload as a file holds it: fields at their defaults left out, one request per
        line. Pure."""
        data = self.model_dump(mode="json", exclude_defaults=True)
        requests = ",\n".join(f"  {json.dumps(request)}" for request in data.pop("requests"))
        return f'{json.dumps(data, indent=1)[:-2]},\n "requests": [\n{requests}\n ]\n}}\n'

    def with_cache(self, **changes) -> Workload:
        """A copy with cache fields replaced (e.g. a pool large enough to never evict)."""
        return self.model_copy(update={"cache": self.cache.model_copy(update=changes)})


def _l2_trace(name: str, max_context: int, *, seed: int, scale: float, vocab_size: int) -> Workload:
    """Mixed prompt/output lengths up to ``max_context``, arrivals in waves, tight pools.

    The GPU pool holds about 1.1 full contexts and the host pool 0.15, while
    each wave asks for several: decode growth keeps pushing the youngest
    requests out (to host, or to recompute once the host pool is full) and
    finishes pull them back. ``scale`` above 1 multiplies the pools, the waves'
    sizes and ``max_num_seqs`` together: more concurrency, the same pressure.
    """
    rng = random.Random(f"{name}:{seed}")
    num_requests = max(4, round(32 * scale))
    # requests per wave grow with the pools, so the pressure holds at any scale
    wave = max(8, round(8 * scale))
    page_size = 16
    requests = []
    for i in range(num_requests):
        if i == 0:  # one request reaches the full context
            prompt_len, max_new = max_context - 32, 32
        elif rng.random() < 0.25:
            max_new = rng.randint(16, 64)
            prompt_len = rng.randint(max_context // 4, max_context - max_new)
        else:
            max_new = rng.randint(64, 256)
            prompt_len = rng.randint(8, max_context // 8)
        requests.append(
            WorkloadRequest(
                uuid=f"{name}-r{i}",
                prompt_ids=[rng.randrange(1, vocab_size) for _ in range(prompt_len)],
                max_new_tokens=max_new,
                arrival_step=(i // wave) * 60 + rng.randint(0, 8),
            )
        )
    full = pages_needed(max_context, page_size)
    cache = CacheConfig(
        page_size=page_size,
        num_gpu_pages=round(full * 1.1 * max(1.0, scale)),
        num_host_pages=round(full * 0.15 * max(1.0, scale)),
        watermark=0.02,
    )
    return Workload(
        name=name,
        seed=seed,
        cache=cache,
        engine=EngineConfig(max_num_seqs=max(16, round(16 * scale))),
        requests=requests,
    )


def _smoke_trace(*, seed: int, scale: float, vocab_size: int) -> Workload:
    rng = random.Random(f"smoke:{seed}")
    requests = [
        WorkloadRequest(
            uuid=f"smoke-r{i}",
            prompt_ids=[rng.randrange(1, vocab_size) for _ in range(rng.randint(3, 40))],
            max_new_tokens=rng.randint(4, 24),
            arrival_step=i,
        )
        for i in range(max(2, round(8 * scale)))
    ]
    cache = CacheConfig(
        page_size=4,
        num_gpu_pages=round(24 * max(1.0, scale)),
        num_host_pages=round(16 * max(1.0, scale)),
        watermark=0.05,
    )
    return Workload(
        name="smoke", seed=seed, cache=cache, engine=EngineConfig(max_num_seqs=8), requests=requests
    )


BUILTIN_WORKLOADS = ("smoke", "L2-2048", "L2-4096", "shared-prefix")


def builtin_workload(
    name: str, *, seed: int = 0, scale: float = 1.0, vocab_size: int = 512
) -> Workload:
    """A named, seeded trace; ``scale`` grows request count and pools (e.g. for a GPU)."""
    if type(scale) not in (int, float) or not 0 < scale <= MAX_SCALE:
        raise WorkloadError(f"scale must be a number in (0, {MAX_SCALE:g}], got {scale!r}")
    if type(vocab_size) is not int or vocab_size < 2:
        raise WorkloadError(
            "vocab_size must be an integer >= 2 (token ids are drawn from [1, vocab_size)), "
            f"got {vocab_size!r}"
        )
    if name == "smoke":
        return _smoke_trace(seed=seed, scale=scale, vocab_size=vocab_size)
    if name == "shared-prefix":  # imported here: that module builds on this one
        from batchgen.engine.shared_prefix_workload import shared_prefix_trace

        return shared_prefix_trace(seed=seed, scale=scale, vocab_size=vocab_size)
    if name in ("L2-2048", "L2-4096"):
        return _l2_trace(
            name, int(name.split("-")[1]), seed=seed, scale=scale, vocab_size=vocab_size
        )
    raise WorkloadError(
        f"unknown workload {name!r}; built-in workloads are {', '.join(BUILTIN_WORKLOADS)}, "
        "or give the path of a workload JSON file"
    )


def load_workload(
    spec: str, *, seed: int = 0, scale: float = 1.0, vocab_size: int = 512
) -> Workload:
    """A built-in name, or a JSON file validated strictly against :class:`Workload` (its cache and
    engine too: no ``true``, ``"16"`` or ``16.0`` where an integer belongs)."""
    if spec in BUILTIN_WORKLOADS:
        return builtin_workload(spec, seed=seed, scale=scale, vocab_size=vocab_size)
    if not spec:
        raise WorkloadError(
            "no workload named (an empty string); name a built-in workload "
            f"({', '.join(BUILTIN_WORKLOADS)}) or a workload JSON file"
        )
    path = Path(spec)
    if not path.suffix and not path.exists():
        # raises: unknown name
        return builtin_workload(spec, seed=seed, scale=scale, vocab_size=vocab_size)
    try:
        # a byte-order mark, as some editors write, is not content
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise WorkloadError(f"workload file {spec!r} does not exist") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(
            f"workload file {spec!r} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    except OSError as exc:
        raise WorkloadError(f"workload file {spec!r} cannot be read: {exc.strerror}") from None
    try:
        return Workload.model_validate(json.loads(text), strict=True)
    except json.JSONDecodeError as exc:
        raise WorkloadError(
            f"workload file {spec!r} is not valid JSON: {exc.msg} (line {exc.lineno}, column"
            f" {exc.colno})"
        ) from None
    except RecursionError:
        raise WorkloadError(
            f"workload file {spec!r} nests arrays or objects too deeply to parse"
        ) from None
    except ValidationError as exc:
        raise WorkloadError(
            f"workload file {spec!r} is invalid: {validation_summary(exc)}"
        ) from None
