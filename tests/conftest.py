"""Shared test setup: hypothesis profiles (CI: 30 examples; ``--slow``: 500)."""

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="long property runs: hypothesis tests without their own example count run 500 examples")


def pytest_configure(config):
    settings.load_profile("slow" if config.getoption("--slow") else "ci")
