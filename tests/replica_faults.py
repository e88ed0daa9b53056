"""Replicas that end their process on purpose, for ``test_generate_replicas.py``: a test hands one
to the driver as its replica factory (``generate_on_replicas(args, replica=...)``); nothing of
batchgen's flags or environment reaches them. Ray's workers import this module from the tests
directory (the Ray fixture puts it on their PYTHONPATH); a process replica through the sys.path
its forkserver was started with.

Both faults are decided by the lines a replica is given, never by timing.
"""

from __future__ import annotations

import os

from batchgen.replicas.replica import Block, BlockResult, Replica


class DiesOnceAfter(Replica):
    """Runs the block that takes it past ``after_lines`` lines, then ends its process before
    returning the results (the work done is lost): once per job, the first replica to get there
    creates ``marker`` (atomically) and dies; every later one finds it and runs on."""

    def __init__(self, spec, share, *, after_lines: int, marker: str):
        super().__init__(spec, share)
        self.after_lines, self.marker = after_lines, marker
        self.num_lines = 0

    def run_block(self, block: Block) -> BlockResult:
        result = super().run_block(block)
        self.num_lines += len(block.lines)
        if self.num_lines > self.after_lines:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return result
            os._exit(1)
        return result


class EndsOnPoison(Replica):
    """Ends its process whenever it is given a line whose custom_id starts with ``poison``."""

    def run_block(self, block: Block) -> BlockResult:
        if any(text is not None and '"custom_id": "poison' in text for _, text in block.lines):
            os._exit(1)
        return super().run_block(block)
