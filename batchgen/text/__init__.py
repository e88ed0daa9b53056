"""The text edge of the engine: a checkpoint's tokenizer and chat template, sampling options as
OpenAI names them, stop strings on decoded text, and the loop that runs text prompts on a worker.
The engine below stays token ids in, token ids out."""
