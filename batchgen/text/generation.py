"""Text prompts on a worker: each prompt's ``n`` samples as engine requests, stop strings watched on
the decoded text, and each prompt's completions once all its samples are released.

The engine stays token ids in, token ids out; this loop is its text edge. After every worker
step, the samples that have stop strings get their new tokens decoded (``StopStringWatch``); one
that completed a stop string is aborted before the next step, so it gets no further token. A
prompt's result is ready when its last sample is released. In compare mode the loop is one run, as
``run``'s workload is: ``start_run`` / ``finish_run`` open and close its divergence-log summary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from batchgen.engine.runner import MAX_IDLE_STEPS, RunStalled
from batchgen.engine.timeline import TimelineRecorder
from batchgen.engine.worker import Worker
from batchgen.state import Phase, Request, RequestOutput, TokenLogprobs
from batchgen.text.detokenize import StopStringWatch
from batchgen.text.sampling import Sampling, engine_requests
from batchgen.text.tokenizer import TextTokenizer
from compare import RunSummary

# the engine's finish reasons -> OpenAI's
FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop"}


@dataclass(frozen=True, slots=True)
class TextPrompt:
    key: str  # unique in the run: a custom_id, or the LLM call's prompt index
    prompt_ids: tuple[int, ...]
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class Completion:
    """One sample of a prompt."""

    index: int
    text: str
    token_ids: tuple[int, ...]  # generated, prompt excluded (an EOS or stop token included)
    finish_reason: str  # "stop" (EOS, stop token id or stop string) or "length"
    logprobs: tuple[TokenLogprobs, ...] | None  # per token, when the sampling asked for them


@dataclass(frozen=True, slots=True)
class PromptResult:
    key: str
    prompt_ids: tuple[int, ...]
    completions: tuple[Completion, ...]  # by sample index
    error: str | None = None  # a sample the engine failed (a KV load, say): no completions
    # prompt tokens taken from the prefix cache, the prompt counted once (its first sample's)
    num_cached_tokens: int = 0


class CpuClock:
    """CPU seconds of this thread spent inside ``with clock:`` blocks (``time.thread_time``).
    Mutates itself."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> CpuClock:
        self._started = time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds += time.thread_time() - self._started


class TextEngine:
    """Prompts in, completions out, on ``worker`` with ``tokenizer``. ``text_cpu`` accumulates the
    CPU time of detokenization and stop checks (a caller adds tokenization to it). Mutates the
    worker."""

    def __init__(self, worker: Worker, tokenizer: TextTokenizer, text_cpu: CpuClock | None = None):
        self.worker = worker
        self.tokenizer = tokenizer
        self.text_cpu = text_cpu or CpuClock()
        self._prompts: dict[str, TextPrompt] = {}
        self._done: dict[str, dict[int, RequestOutput]] = {}  # key -> released samples
        self._watches: dict[str, StopStringWatch] = {}  # sample uuid -> its stop-string watch
        self._recorder: TimelineRecorder | None = None
        self._idle_steps = 0
        self.live = None  # the run as batchgen.metrics watches it (a LiveRun), or None

    @property
    def num_in_flight(self) -> int:
        """Prompts added whose results were not returned yet."""
        return len(self._prompts)

    def check(self, prompt: TextPrompt) -> list[Request]:
        """``prompt``'s engine requests; RequestError naming what the engine refuses. Pure."""
        requests = engine_requests(
            prompt.key,
            prompt.prompt_ids,
            prompt.sampling,
            eos_ids=self.tokenizer.eos_token_ids,
            max_context=self.worker.model_config.max_context,
        )
        for request in requests:
            self.worker.validate_request(request)
        return requests

    def add(self, prompt: TextPrompt) -> None:
        """Queue ``prompt``'s samples. RequestError (nothing queued) when the engine refuses one.
        Mutates the worker and self."""
        for request in self.check(prompt):
            self.worker.add_request(request)
            if self.live is not None:
                self.live.submitted(request)
            if prompt.sampling.stop:
                self._watches[request.uuid] = StopStringWatch(
                    self.tokenizer.tokenizer, prompt.sampling.stop
                )
        self._prompts[prompt.key] = prompt
        self._done[prompt.key] = {}

    def step(self) -> list[PromptResult]:
        """One worker step; returns the prompts whose last sample it released. RunStalled after
        ``MAX_IDLE_STEPS`` steps with work and no progress. Mutates the worker and self."""
        worker = self.worker
        progress = (worker.state.stats.tokens_generated, len(worker.state.outputs))
        worker.step()
        if self._recorder is not None:
            self._recorder.record(worker)
        self._watch_stop_strings()
        outputs = worker.take_outputs().values()
        if self.live is not None:
            for output in outputs:
                self.live.release(output)
            self.live.end_step()
        results = [r for r in map(self._collect, outputs) if r is not None]
        stuck = (worker.state.stats.tokens_generated, len(worker.state.outputs)) == progress
        self._idle_steps = self._idle_steps + 1 if stuck and not results else 0
        if self._idle_steps >= MAX_IDLE_STEPS:
            raise RunStalled(f"no progress in {MAX_IDLE_STEPS} steps with prompts in flight")
        return results

    def has_unfinished(self) -> bool:
        return bool(self._prompts) or self.worker.has_unfinished()

    def start_run(self, name: str, *, seed: int, source: str | None = None) -> None:
        """In compare mode, begin a run in the divergence log and record its timeline. Mutates
        the worker's compare state and self."""
        if self.worker.finish_compare is not None:  # the finish step's compare mode: its run too
            self.worker.finish_compare.begin_run(name, seed=seed)
        if self.worker.kv_compare is not None:
            self.worker.kv_compare.begin_run(name, seed=seed, source=source)
            self._recorder = TimelineRecorder(self.worker)

    def finish_run(self, stopped_by: str | None = None) -> RunSummary | None:
        """In compare mode, write the run's summary (``stopped_by``: why it ended early) and return
        it (the KV slice's); None otherwise. Mutates the log."""
        if self.worker.finish_compare is not None:
            self.worker.finish_compare.experiment.close(stopped_by=stopped_by)
        compare = self.worker.kv_compare
        if compare is None or self._recorder is None:
            return None
        return compare.end_run(stopped_by=stopped_by, timeline=self._recorder.timeline())

    def _watch_stop_strings(self) -> None:
        """Feed each watched sample's new tokens; abort the ones that completed a stop string.
        Mutates the watches and the worker."""
        if not self._watches:
            return
        with self.text_cpu:
            requests = self.worker.state.requests
            for uuid, watch in self._watches.items():
                req = requests.get(uuid)
                if req is None or watch.stopped or len(req.output_ids) == watch.num_tokens:
                    continue
                if watch.feed(req.output_ids[watch.num_tokens :]):
                    self.worker.abort(uuid)  # no-op on a request already done

    def _collect(self, output: RequestOutput) -> PromptResult | None:
        """Note a released sample; the prompt's result once it was the last. Mutates self."""
        key, _, index = output.uuid.rpartition("/")
        samples = self._done[key]
        samples[int(index)] = output
        prompt = self._prompts[key]
        if len(samples) < prompt.sampling.n:
            return None
        del self._prompts[key], self._done[key]
        failed = [o for o in samples.values() if o.phase is Phase.FAILED]
        if failed:
            for i in range(prompt.sampling.n):
                self._watches.pop(f"{key}/{i}", None)
            return PromptResult(key, prompt.prompt_ids, (), error=failed[0].finish_reason)
        with self.text_cpu:
            completions = tuple(
                self._completion(i, samples[i], prompt) for i in range(prompt.sampling.n)
            )
        cached = samples[0].num_cached_prompt_tokens
        return PromptResult(key, prompt.prompt_ids, completions, num_cached_tokens=cached)

    def _completion(self, index: int, output: RequestOutput, prompt: TextPrompt) -> Completion:
        """Sample ``index``'s text and finish reason. Mutates the watches (drops its own)."""
        watch = self._watches.pop(output.uuid, None)
        if watch is not None and watch.stopped:
            text, reason = watch.text, "stop"
        else:
            text = self.tokenizer.decode(output.output_ids)
            reason = FINISH_REASONS.get(output.finish_reason, output.finish_reason)
        logprobs = output.output_logprobs if prompt.sampling.logprobs is not None else None
        return Completion(index, text, output.output_ids, reason, logprobs)
