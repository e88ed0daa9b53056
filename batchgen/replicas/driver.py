"""The driver of a replicated job: the input read as a stream into blocks, the blocks handed to
replicas (``pools``), their result lines written by the job's one writer as they come back.

::

    input lines -> (the lines done skipped, --resume) -> blocks of block_lines lines
    a replica with room (PIPELINE blocks each, run in order) <- the next block
    a block back      -> its result lines written, each whole (the one durable writer)
    a replica ended   -> the block it was running: its lines queued one at a time, attempts + 1
                         (a line at 1 + max_retries attempts gets its own error line, status 500)
                         blocks queued behind it: queued again, whole; blocks it had finished: kept
                         the replica started again in its slot (one that cannot start: slot lost)
    every slot lost   -> ReplicasLost, naming the lines left

A block's lines are written only when the whole block comes back, so a line is written once: a
replica that ends takes no written line with it, and the lines it took are run again.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from batchgen.openai.batch_job import JobCounts, read_numbered
from batchgen.openai.batch_lines import resume_key
from batchgen.openai.batch_output import line_error_line, request_error_line
from batchgen.replicas.pools import ReplicaDied, ReplicaPool
from batchgen.replicas.replica import COUNTER_FIELDS, Block, BlockResult, ReplicaInfo

PIPELINE = 2  # blocks in flight per replica: the next one waits there while the driver writes
POLL_S = 0.5  # longest wait for a replica before the loop looks again (Ctrl-C stays prompt)
SETTLE_S = 30.0  # longest wait for a dead replica's other calls to end
FINISH_S = 120.0  # longest wait for the replicas' compare summaries at the end
LOAD, RUN, LOST = "load", "run", "lost"


class ReplicasLost(Exception):
    """Every replica ended and none could start again, lines left; the message says how many."""


@dataclass(slots=True)
class _Slot:
    state: str = LOAD  # LOAD (starting), RUN (ready) or LOST (could not start)
    blocks: list[tuple[Any, Block]] = field(default_factory=list)  # in flight, in order
    info: ReplicaInfo | None = None


@dataclass(slots=True)
class ReplicaTotals:
    """What the replicas did besides the result lines. Mutated as the job runs."""

    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTER_FIELDS, 0))
    text_cpu_s: float = 0.0
    cpu_s: float = 0.0  # the replicas' CPU seconds over the blocks that came back
    replica_restarts: int = 0  # replicas started again after one ended
    replicas_lost: int = 0  # slots whose replica could not start
    lines_retried: int = 0  # lines run again one at a time
    last_error: str = ""  # how the last replica ended, or could not start


class ReplicatedJob:
    """Input lines through ``pool``'s replicas into ``out`` (open; one writer). Mutates ``out``,
    the replicas, ``counts`` and ``totals``. Callbacks: ``on_progress(counts)`` after each
    block; ``on_records(slot, records, counters)`` with each block's compare records and counter
    increases, and with each replica's last records; ``on_warning(text)`` for a replica that ended
    or could not start."""

    def __init__(
        self,
        pool: ReplicaPool,
        out,
        *,
        block_lines: int,
        max_retries: int,
        num_lines: int,
        skip: set[str] = frozenset(),
        on_warning: Callable[[str], None] | None = None,
    ):
        self.pool, self.out = pool, out
        self.block_lines, self.max_retries, self.num_lines = block_lines, max_retries, num_lines
        self.skip = skip
        self.on_warning = on_warning or _warn
        self.on_progress: Callable[[JobCounts], None] | None = None
        self.on_records: Callable[[int, tuple[str, ...], dict[str, int]], None] | None = None
        self.counts, self.totals = JobCounts(), ReplicaTotals()
        self.slots = [_Slot() for _ in range(pool.num_replicas)]
        self._tasks: dict[Any, tuple[str, int]] = {}  # handle -> (LOAD or RUN, slot)
        self._queue: deque[Block] = deque()  # blocks to run before the input's next ones
        self._source: Iterator[Block] = iter(())
        self._next_id = 0
        self.first_ready_at: float | None = None  # time.perf_counter() of the first replica ready

    def run(self, lines: Iterable[tuple[int, str | None]]) -> JobCounts:
        """Every line of ``lines`` to one result line in ``out``, then the replicas' last compare
        records. ReplicasLost when every replica ended with lines left."""
        self._source = self._blocks(lines)
        self._start(list(range(len(self.slots))))
        while True:
            self._dispatch()
            if not self._tasks:
                if self._work_left():
                    raise ReplicasLost(self._lost_message())
                break
            for handle in self.pool.wait(list(self._tasks), POLL_S):
                if handle in self._tasks:
                    self._settle(handle)
        self._finish()
        return self.counts

    # ---- blocks ----------------------------------------------------------------------------------
    def _blocks(self, lines: Iterable[tuple[int, str | None]]) -> Iterator[Block]:
        """The input's lines not done yet, in blocks, read as they are needed. Mutates the
        skipped count."""
        batch = []
        for number, text in lines:
            if self.skip and resume_key(read_numbered(number, text).custom_id, number) in self.skip:
                self.counts.lines_skipped += 1
                continue
            batch.append((number, text))
            if len(batch) == self.block_lines:
                yield self._block(batch)
                batch = []
        if batch:
            yield self._block(batch)

    def _block(self, lines: list, attempts: int = 0) -> Block:
        self._next_id += 1
        return Block(self._next_id, tuple(lines), attempts)

    def _take_block(self) -> Block | None:
        return self._queue.popleft() if self._queue else next(self._source, None)

    def _work_left(self) -> bool:
        block = self._take_block()
        if block is not None:
            self._queue.appendleft(block)
        return block is not None

    def _dispatch(self) -> None:
        """Hand blocks to the ready replicas, a first one to each before a second. Mutates the
        queue, the slots and the tasks."""
        for depth in range(PIPELINE):
            for number, slot in enumerate(self.slots):
                if slot.state == RUN and len(slot.blocks) <= depth:
                    block = self._take_block()
                    if block is None:
                        return
                    handle = self.pool.run_block(number, block)
                    self._tasks[handle] = (RUN, number)
                    slot.blocks.append((handle, block))

    # ---- what comes back -------------------------------------------------------------------------
    def _start(self, numbers: list[int]) -> None:
        for number, handle in self.pool.start(numbers).items():
            self.slots[number] = _Slot()
            self._tasks[handle] = (LOAD, number)

    def _settle(self, handle) -> None:
        """Take one ended call: a replica loaded (or not), a block's results (or its replica's
        end). Mutates the slots, the tasks, the queue and ``out``."""
        kind, number = self._tasks.pop(handle)
        slot = self.slots[number]
        try:
            value = self.pool.result(handle)
        except ReplicaDied as died:
            if kind == LOAD:
                self._lose(number, f"replica {number} could not start {died}")
            else:
                self._replica_ended(number, handle, str(died))
            return
        if kind == LOAD:
            slot.state, slot.info = RUN, value
            if self.first_ready_at is None:
                self.first_ready_at = time.perf_counter()
                if value.warning is not None:
                    self.on_warning(value.warning)
        else:
            slot.blocks = [(h, b) for h, b in slot.blocks if h != handle]
            self._write(number, value)

    def _write(self, number: int, result: BlockResult) -> None:
        """Take a block's results: its lines written, its counters and records passed on. Mutates
        ``out`` and the totals."""
        self._write_lines(result.result_lines, result.lines_failed, result.tokens_generated)
        self.totals.text_cpu_s += result.text_cpu_s
        self.totals.cpu_s += result.cpu_s
        for name, increase in result.counters.items():
            self.totals.counters[name] += increase
        if self.on_records is not None:
            self.on_records(number, result.records, result.counters)

    def _write_lines(self, lines: tuple[str, ...], num_failed: int, num_tokens: int) -> None:
        """Write result lines (each whole, durably) and count them. Mutates ``out``."""
        for line in lines:
            self.out.write_line(line)
        self.counts.lines_done += len(lines)
        self.counts.lines_failed += num_failed
        self.counts.tokens_generated += num_tokens
        if self.on_progress is not None:
            self.on_progress(self.counts)

    def _replica_ended(self, number: int, failed, reason: str) -> None:
        """The replica of slot ``number`` ended (``failed``: the call that said so): keep what it
        finished, retry the lines it was running one at a time, queue the rest again, start
        another replica in the slot. Mutates everything the job holds."""
        slot = self.slots[number]
        self.pool.stop(number)
        self.pool.wait([h for h, _ in slot.blocks if h != failed], SETTLE_S, every=True)
        running, again = None, []
        for handle, block in slot.blocks:
            self._tasks.pop(handle, None)
            result = None if handle == failed else self._result_or_none(handle)
            if result is not None:
                self._write(number, result)
            elif running is None:
                running = block
            else:
                again.append(block)
        slot.blocks = []
        self._queue.extendleft(reversed(again))
        self.totals.replica_restarts += 1
        self.totals.last_error = f"replica {number} ended: {reason}"
        self.on_warning(f"{self.totals.last_error}; starting another")
        if running is not None:
            self._retry_one_at_a_time(running, reason)
        self._start([number])

    def _result_or_none(self, handle) -> BlockResult | None:
        try:
            return self.pool.result(handle)
        except ReplicaDied:
            return None

    def _retry_one_at_a_time(self, block: Block, reason: str) -> None:
        """Queue each line of ``block`` first, as a block of its own with one more attempt; a line
        past ``max_retries`` gets its error line instead. Mutates the queue and ``out``."""
        attempts = block.attempts + 1
        singles = []
        for line in block.lines:
            if attempts > self.max_retries:
                self._write_ended_line(*line, attempts, reason)
            else:
                singles.append(self._block([line], attempts))
        self.totals.lines_retried += len(singles)
        self._queue.extendleft(reversed(singles))

    def _write_ended_line(self, number: int, text: str | None, attempts: int, reason: str) -> None:
        """The error line of a line that ended its replica each time it ran. Mutates ``out``."""
        message = (
            f"this line ended its replica {attempts} times (the last: {reason}); it is not run"
            f" again (--max-retries {self.max_retries})"
        )
        custom_id = read_numbered(number, text).custom_id
        if custom_id is None:
            line = line_error_line(number, None, message)
        else:
            line = request_error_line(custom_id, 500, message, None)
        self._write_lines((json.dumps(line),), 1, 0)

    def _lose(self, number: int, why: str) -> None:
        """Slot ``number`` has no replica from now on. Mutates the slot and the pool."""
        self.pool.stop(number)
        self.slots[number].state = LOST
        self.totals.replicas_lost += 1
        self.totals.last_error = why
        self.on_warning(why)

    def _lost_message(self) -> str:
        left = self.num_lines - self.counts.lines_done - self.counts.lines_skipped
        gone = "no replica could start" if self.first_ready_at is None else "every replica ended"
        return (
            f"{gone} and none can start again (the last: {self.totals.last_error}); {left} lines"
            " have no result line (--resume continues the job)"
        )

    def _finish(self) -> None:
        """Collect each ready replica's last compare records. Mutates the callbacks' state."""
        calls = {self.pool.finish(n): n for n, slot in enumerate(self.slots) if slot.state == RUN}
        self.pool.wait(list(calls), FINISH_S, every=True)
        for handle, number in calls.items():
            try:
                records = self.pool.result(handle)
            except ReplicaDied as died:
                self.on_warning(f"replica {number} ended before its compare summary: {died}")
                continue
            if self.on_records is not None:
                self.on_records(number, records, {})


def _warn(text: str) -> None:
    print(f"batchgen: warning: {text}", file=sys.stderr)
