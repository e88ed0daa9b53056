"""``python -m batchgen`` and the ``batchgen`` console script.

The CLI (``batchgen.cli``) imports torch and the engine, about a second on a CPU machine. Ctrl-C or
SIGTERM in that second ends the process at once (one line, exit 130 or 143): nothing has been
written yet, and an exception raised inside torch's or numpy's import can be swallowed there or
leave a half-imported module behind. Once the CLI is imported, Ctrl-C raises KeyboardInterrupt and
SIGTERM raises :class:`Terminated` (a KeyboardInterrupt), so that the same cleanup runs before the
same line and exit code. A signal the process was started with ignored stays ignored.
"""

import contextlib
import os
import signal
import sys

from batchgen.exit_codes import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated

EXITS_WHILE_IMPORTING = {
    signal.SIGINT: (EXIT_INTERRUPTED, b"batchgen: interrupted\n"),
    signal.SIGTERM: (EXIT_TERMINATED, b"batchgen: terminated\n"),
}


def main() -> int:
    inherited = {signum: signal.getsignal(signum) for signum in EXITS_WHILE_IMPORTING}
    handled = [
        signum for signum, handler in inherited.items() if handler not in (signal.SIG_IGN, None)
    ]
    for signum in handled:
        signal.signal(signum, _exit_while_importing)
    from batchgen.cli import main as run_command

    if signal.SIGINT in handled:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.SIGTERM in handled:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        code = run_command()
    finally:  # past this point a signal has nothing left to clean up
        for signum in handled:
            signal.signal(signum, inherited[signum])
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        _forget_caught_interrupt()
    return code


def _exit_while_importing(signum, frame) -> None:
    code, line = EXITS_WHILE_IMPORTING[signum]
    with contextlib.suppress(OSError):  # stderr may be closed
        os.write(2, line)
    os._exit(code)


def _raise_terminated(signum, frame) -> None:
    raise Terminated("SIGTERM")


def _forget_caught_interrupt() -> None:
    """Clear CPython's mark of an unhandled KeyboardInterrupt, set when Ctrl-C ends a string
    ``exec`` even if the interrupt is then caught (dataclasses and namedtuples build their methods
    with one, so the engine runs many). Under ``python -m batchgen`` that mark makes the interpreter
    end by SIGINT (status -2) instead of with exit code 130. Each string eval that completes clears
    it."""
    eval("None")


if __name__ == "__main__":
    sys.exit(main())
