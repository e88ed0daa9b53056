"""Replicated batch jobs: ``batchgen generate --replicas N`` over Ray actors or local processes
(``driver``: blocks, retries, the one writer; ``pools``: where replicas run; ``replica``: one
loaded model running blocks; ``metrics``: the driver's per-replica counters)."""
