"""Where a command's tasks run (``sweep``, ``explore``): the backend flags and the backend."""

from __future__ import annotations

import argparse
import os

from batchgen.cli.arg_types import positive_int
from batchgen.cli.common import UsageError
from batchgen.sweep.backends import ProcessBackend, RayBackend, SweepBackend

SERIAL = "serial"  # no backend: every task in this process, one after another


def add_backend_args(parser: argparse.ArgumentParser, *, default: str, serial: bool) -> None:
    """``--backend`` (ray, processes, and serial where ``serial``), ``--ray-address`` and
    ``--num-cpus``. Mutates ``parser``."""
    choices = ("ray", "processes", SERIAL) if serial else ("ray", "processes")
    parser.add_argument(
        "--backend",
        choices=choices,
        default=default,
        help=(
            "ray: Ray tasks (needs pip install 'batchgen[ray]'); processes: a local process pool,"
            " for machines without Ray"
            + ("; serial: one after another in this process" if serial else "")
            + " (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help=(
            "join the running Ray cluster at ADDRESS (host:port, or auto: the one this machine"
            " belongs to) (default: start a local Ray instance of --num-cpus CPUs)"
        ),
    )
    parser.add_argument(
        "--num-cpus",
        type=positive_int,
        default=None,
        metavar="N",
        help=(
            "tasks at once on this machine: the local Ray instance's CPUs, or the process pool's"
            " workers (default: every CPU of the machine)"
        ),
    )


def check_backend_args(args: argparse.Namespace) -> None:
    """UsageError for backend flags that do not go together. Pure."""
    if args.backend != "ray" and args.ray_address is not None:
        raise UsageError(
            f"--ray-address applies to --backend ray; --backend {args.backend} runs here"
        )
    if args.ray_address is not None and args.num_cpus is not None:
        raise UsageError(
            "--num-cpus sizes a local Ray instance; a cluster joined with --ray-address brings its"
            " own CPUs (give one of the two)"
        )


def backend_from_args(args: argparse.Namespace) -> SweepBackend | None:
    """The backend the flags name (None for serial); BackendError when Ray cannot start."""
    if args.backend == SERIAL:
        return None
    if args.backend == "processes":
        return ProcessBackend(args.num_cpus or os.cpu_count() or 1)
    return RayBackend(address=args.ray_address, num_cpus=args.num_cpus)
