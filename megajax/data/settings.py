"""``DataSettings``: what the data pipeline reads, resolved once from ``config.data`` (``megajax.config.resolve``)
with the model's vocabulary and sequence length and the global batch the loaders cut. Every function of
``megajax.data`` that opens or batches a run's data takes it; none reads the ConfigDict."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """``config.data``'s fields (their meaning: ``megajax.config.defaults.base_config``) and what the data is cut
    for: ``vocab_size`` and ``max_seq_len`` (the model's), ``num_classes`` (a classifier's, else 0) and
    ``global_batch_size`` (``train.global_batch_size``)."""

    source: str
    path: str
    tokenizer: str
    task: str
    task_dir: str
    tfds_name: str
    tfds_split: str
    tfds_feature: str
    tfds_data_dir: str
    min_tokens: int
    seed: int
    valid_fraction: float
    blend: str
    allow_blend_change: bool
    mask_prob: float
    max_ngram: int
    short_seq_prob: float
    max_dropped_fraction: float
    document_masking: bool
    reset_position_ids: bool
    eod_mask_loss: bool
    sft_packing: bool
    sft_truncate: bool
    sft_skip_bad_rows: bool
    tokenizer_fingerprint: str  # recorded by training: the data's tokenizer's vocabulary fingerprint
    vocab_size: int
    max_seq_len: int
    num_classes: int
    global_batch_size: int

    @property
    def packed(self) -> bool:
        """Whether the batches are packed rows (``megajax.data.documents``): windows with document masking, or
        fine-tuning examples (``data.source=sft``)."""
        return self.document_masking or self.source == "sft"
