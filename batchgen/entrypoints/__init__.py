"""Entry points that embed the engine for text: ``LLM`` (the Python API) and the pool sizing that
it and ``batchgen generate`` share."""
