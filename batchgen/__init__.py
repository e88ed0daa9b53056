"""batchgen: a batch-generation LLM worker over a paged two-tier KV cache.

``batchgen.LLM`` and ``batchgen.Sampling`` embed it in a program (``batchgen.entrypoints.llm``);
they are imported on first use, so ``import batchgen`` stays light (the entry point reads its exit
codes before torch is imported).
"""

import importlib
from typing import Any

_LAZY = {"LLM": "batchgen.entrypoints.llm", "Sampling": "batchgen.text.sampling"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
