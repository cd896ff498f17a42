"""Data: the embedded default corpus and GPT training batches from a token array."""
