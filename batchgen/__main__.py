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
        return EXIT_INTERRUPTED
    return run_command()


if __name__ == "__main__":
    sys.exit(main())
