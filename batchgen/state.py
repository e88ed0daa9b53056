"""The worker's mutable state: requests, their phases and page tables, counters.

Request lifecycle::

    WAITING -> RUNNING (prefill, then decode) -> FINISHED
    RUNNING -> SWAPPED (KV evicted to host) -> LOADING (async load) -> RUNNING
    RUNNING | LOADING -> WAITING (preempted for recompute; KV dropped)
    any     -> FAILED (with a reason)

Token ranges of a request with ``n = num_tokens``::

    [0, num_cached_tokens)   K/V computed (in pages, or pending append)
    [num_cached_tokens, n)   not computed yet: the next forward processes them
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from batchgen.sampling_params import DEFAULT_SAMPLING, SamplingParams


class AsyncHandle(Protocol):
    """A copy in flight: a request's host->GPU load (``HostKvBackend.load_to_gpu_async``)."""

    def done(self) -> bool: ...
    def wait(self) -> None: ...  # raises when the copy failed


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    LOADING = "loading"
    FINISHED = "finished"
    FAILED = "failed"


DONE_PHASES = (Phase.FINISHED, Phase.FAILED)
# finish_reason of a request FINISHED by an abort (the workload's abort_step, or a fault)
ABORT_REASON = "abort"


@dataclass(frozen=True, slots=True)
class Request:
    """What a client submits."""

    uuid: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0  # 0 (or below sampler.GREEDY_BELOW) = greedy
    seed: int = 0  # with uuid and position, the key of each random draw (sampler.draw_key)
    sampling: SamplingParams = DEFAULT_SAMPLING  # top-k/p, min-p, min tokens, stops, logprobs


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Top-2 log-probabilities at one sampled position (for the near-tie rule), and, for a request
    that asks for them (``SamplingParams.num_logprobs``), the sampled token's and the top N's. All
    are of the model's distribution, before temperature and masks."""

    top_ids: tuple[int, int]
    top_logprobs: tuple[float, float]
    token_logprob: float | None = None  # the sampled token's; None when not asked for
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


@dataclass(slots=True)
class RequestState:
    request: Request
    arrival_index: int  # submission order: lower = older = higher priority
    phase: Phase = Phase.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    gpu_page_ids: tuple[int, ...] = ()  # page table (tuple: shared, never copied, by snapshots)
    host_page_ids: tuple[int, ...] = ()
    load_handle: AsyncHandle | None = None
    load_started_step: int | None = None  # step the in-flight load was issued
    num_load_retries: int = 0
    swapped_step: int | None = None  # step the KV went to host
    finish_reason: str | None = None  # "length", "eos", "abort", or the failure
    first_token_step: int | None = None  # the step that sampled its first token (metrics' TTFT)
    # with prefix caching: its full prompt pages' digests (``batchgen.kv.prefix_digests``), and
    # the prompt tokens its first admission took from the cache (usage's ``cached_tokens``)
    prompt_digests: tuple[str, ...] = ()
    num_cached_prompt_tokens: int = 0
    # Derived, kept as fields: snapshots read them for thousands of requests per step.
    uuid: str = field(init=False)  # request.uuid
    num_tokens: int = field(init=False)  # prompt + outputs; append_token keeps it

    def __post_init__(self):
        self.uuid = self.request.uuid
        self.num_tokens = len(self.request.prompt_ids) + len(self.output_ids)

    def append_token(self, token: int, logprobs: TokenLogprobs) -> None:
        """Mutates output_ids, output_logprobs, num_tokens."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprobs)
        self.num_tokens += 1

    def drain_load(self) -> None:
        """Wait for an in-flight load to land (its pages may be reused next), then forget it.
        Mutates ``load_handle``. A failed copy is ignored: the request is being retired."""
        if self.load_handle is not None:
            try:
                self.load_handle.wait()
            except Exception:
                pass  # a failed copy into pages about to be freed is harmless
            self.load_handle = None

    def copy(self) -> RequestState:
        """A shallow copy: the output lists are shared (KV ops never write them). Every field is
        set directly, derived ones included: ``__post_init__`` would recompute them."""
        new = object.__new__(RequestState)
        new.request = self.request
        new.arrival_index = self.arrival_index
        new.phase = self.phase
        new.output_ids = self.output_ids
        new.output_logprobs = self.output_logprobs
        new.num_cached_tokens = self.num_cached_tokens
        new.gpu_page_ids = self.gpu_page_ids
        new.host_page_ids = self.host_page_ids
        new.load_handle = self.load_handle
        new.load_started_step = self.load_started_step
        new.num_load_retries = self.num_load_retries
        new.swapped_step = self.swapped_step
        new.finish_reason = self.finish_reason
        new.first_token_step = self.first_token_step
        new.prompt_digests = self.prompt_digests
        new.num_cached_prompt_tokens = self.num_cached_prompt_tokens
        new.uuid = self.uuid
        new.num_tokens = self.num_tokens
        return new

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            uuid=self.uuid,
            phase=self.phase,
            finish_reason=self.finish_reason,
            output_ids=tuple(self.output_ids),
            output_logprobs=tuple(self.output_logprobs),
            first_token_step=self.first_token_step,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
        )

    def load_page_ids(self) -> tuple[int, ...]:
        """The GPU pages its load fills: one per host page, the last of its page table (the ones
        before are cached pages it shares)."""
        return self.gpu_page_ids[len(self.gpu_page_ids) - len(self.host_page_ids) :]

    def token_ids(self, start: int = 0) -> list[int]:
        """Tokens from position ``start`` on (prompt, then outputs)."""
        prompt = self.request.prompt_ids
        if start >= len(prompt):
            return self.output_ids[start - len(prompt) :]
        return [*prompt[start:], *self.output_ids]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A released request: what it produced and how it ended."""

    uuid: str
    phase: Phase
    finish_reason: str | None
    output_ids: tuple[int, ...]
    output_logprobs: tuple[TokenLogprobs, ...]
    # when it came, not what: outputs of equal tokens are equal whichever step sampled them first
    first_token_step: int | None = field(default=None, compare=False)
    # prompt tokens taken from the prefix cache: how, not what
    num_cached_prompt_tokens: int = field(default=0, compare=False)


@dataclass(slots=True)
class WorkerStats:
    """Counters over the worker's lifetime."""

    evictions: int = 0  # RUNNING -> SWAPPED
    loads: int = 0  # async host->GPU loads started (retries included)
    load_failures: int = 0
    recompute_preemptions: int = 0
    tokens_generated: int = 0
    peak_gpu_pages: int = 0
    peak_host_pages: int = 0
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up (vLLM's count)
    prefix_cache_hits: int = 0  # of those, tokens taken from cached pages

    def copy(self) -> WorkerStats:
        """Every counter, copied (compare mode forks them for each compared op)."""
        return WorkerStats(
            self.evictions,
            self.loads,
            self.load_failures,
            self.recompute_preemptions,
            self.tokens_generated,
            self.peak_gpu_pages,
            self.peak_host_pages,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
        )


@dataclass(slots=True)
class WorkerState:
    step: int = 0
    requests: dict[str, RequestState] = field(default_factory=dict)  # live, in submission order
    outputs: dict[str, RequestOutput] = field(default_factory=dict)  # released
    stats: WorkerStats = field(default_factory=WorkerStats)
    num_submitted: int = 0

    def edit(self, uuid: str) -> RequestState:
        """The live request ``uuid``, for the caller to mutate. KV ops write requests only through
        this and :meth:`remove` (compare mode's wrappers of a state record those writes, and its
        forks copy what they write: ``batchgen.shadow.recording``). Pure."""
        return self.requests[uuid]

    def remove(self, uuid: str) -> RequestState:
        """Take the live request ``uuid`` out. Mutates ``requests``."""
        return self.requests.pop(uuid)

    def in_phase(self, *phases: Phase) -> list[RequestState]:
        return [r for r in self.requests.values() if r.phase in phases]
