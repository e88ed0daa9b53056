"""``python -m batchgen`` and the ``batchgen`` console script.

The CLI (``batchgen.cli``) imports torch and the engine, about a second on a CPU machine;
Ctrl-C in that second ends the command the way it does later: one line, exit 130.
"""

import sys

from batchgen.exit_codes import EXIT_INTERRUPTED


def main() -> int:
    try:
        from batchgen.cli import main as run_command
    except KeyboardInterrupt:
        print("batchgen: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    else:
        code = run_command()
    if code == EXIT_INTERRUPTED:
        _forget_caught_interrupt()
    return code


def _forget_caught_interrupt() -> None:
    """Clear CPython's mark of an unhandled KeyboardInterrupt, set when Ctrl-C ends a string ``exec`` even if
    the interrupt is then caught (dataclasses and namedtuples build their methods with one, so imports run
    many). Under ``python -m batchgen`` that mark makes the interpreter end by SIGINT (status -2) instead of
    with exit code 130. Each string eval that completes clears it."""
    eval("None")


if __name__ == "__main__":
    sys.exit(main())
