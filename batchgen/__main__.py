"""``python -m batchgen`` and the ``batchgen`` console script.

The CLI (``batchgen.cli``) imports torch and the engine, about a second on a CPU machine;
Ctrl-C in that second ends the command the way it does later: one line, exit 130. SIGTERM
raises :class:`Terminated` (a KeyboardInterrupt) from the first moment too: the same cleanup,
one line, exit 143.
"""

import signal
import sys

from batchgen.exit_codes import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated


def main() -> int:
    inherited = signal.getsignal(signal.SIGTERM)
    handled = inherited in (signal.SIG_DFL, signal.default_int_handler)  # an ignored SIGTERM stays ignored
    if handled:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        from batchgen.cli import main as run_command
    except Terminated:
        print("batchgen: terminated", file=sys.stderr)
        code = EXIT_TERMINATED
    except KeyboardInterrupt:
        print("batchgen: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    else:
        code = run_command()
    finally:
        if handled:  # past this point a SIGTERM has nothing left to clean up
            signal.signal(signal.SIGTERM, inherited)
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        _forget_caught_interrupt()
    return code


def _raise_terminated(signum, frame) -> None:
    raise Terminated("SIGTERM")


def _forget_caught_interrupt() -> None:
    """Clear CPython's mark of an unhandled KeyboardInterrupt, set when Ctrl-C ends a string ``exec`` even if
    the interrupt is then caught (dataclasses and namedtuples build their methods with one, so imports run
    many). Under ``python -m batchgen`` that mark makes the interpreter end by SIGINT (status -2) instead of
    with exit code 130. Each string eval that completes clears it."""
    eval("None")


if __name__ == "__main__":
    sys.exit(main())
