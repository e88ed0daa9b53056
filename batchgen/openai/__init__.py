"""OpenAI batch files at the edge: a line's request checked and mapped onto text prompts, its
result written in the batch output shape, and the job that streams one file into the other."""
