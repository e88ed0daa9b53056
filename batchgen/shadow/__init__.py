"""Compare mode for the KV ops: the binding of ``compare`` to the KV paths, canonical forms, replay,
minimize, validation and the pytest plugin."""
