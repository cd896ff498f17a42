"""Evaluation the paper's way (Appendix E): WikiText-103 perplexity, LAMBADA cloze accuracy, and generation."""
