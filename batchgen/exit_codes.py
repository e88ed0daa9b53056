"""The ``batchgen`` command's exit codes, and the interrupt SIGTERM raises (a module of its own: the
entry point reads them before the engine, torch included, is imported)."""

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, a CI runner cancelling a job), raised by the entry point's handler as
    Ctrl-C would be, so that the same cleanup runs: logs end with their run summaries, reports stay
    whole."""
