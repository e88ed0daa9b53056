"""The ``batchgen`` command's exit codes (a module of its own: the entry point reads them before the
engine, torch included, is imported)."""

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
