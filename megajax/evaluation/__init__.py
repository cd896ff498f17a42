"""Evaluation: the paper's (WikiText-103 perplexity, LAMBADA cloze accuracy, MLM), the fine-tuning tasks' with their
official metrics, generation, and the lm-evaluation-harness adapter. ``runner.py`` is eval.py's library side."""
