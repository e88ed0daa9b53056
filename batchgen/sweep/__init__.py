"""``batchgen sweep``: compare mode over a matrix of workloads x seeds x faults x directions, on
Ray tasks or a local process pool, merged into one log and its reports."""
