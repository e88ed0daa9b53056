"""Shared test setup: hypothesis profiles (CI: 30 examples; ``--slow``: 500), one torch thread."""

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
LONGEST_MODULES = ("test_sweep.py", "test_benchmarks.py", "test_sweep_cli.py", "test_faults.py")


def pytest_collection_modifyitems(items):
    """Move the tests of ``LONGEST_MODULES`` to the front, in that order; mutates ``items``."""

    def rank(item) -> int:
        name = item.path.name
        return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)

    items.sort(key=rank)  # stable: every module keeps its own order
