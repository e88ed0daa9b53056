"""``batchgen validate``: its runs and checks, the report, the near-tie output oracle, and the
corpus with the search (``batchgen explore``) that grows it."""
