"""How long this process has run, from its start (the interpreter's, before any import): what a
user waits from typing a command, so start-up figures include the imports."""

from __future__ import annotations

import os


def process_age_s() -> float | None:
    """Seconds since this process started, from Linux's /proc (10 ms resolution); None where it
    does not say. Reads files only."""
    try:
        with open("/proc/uptime") as uptime, open("/proc/self/stat") as stat:
            up = float(uptime.read().split()[0])
            # the command name (field 2) may hold spaces: count the fields after its ')'
            started_ticks = int(stat.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, up - started_ticks / os.sysconf("SC_CLK_TCK"))
