"""What the data pipeline reads: ``DataSource``, ``config.data``'s fields (a run's ``RunSpec.data``), and
``DataSettings``, the same with what the data is cut for (the model's vocabulary, sequence length and classes, and
the global batch), which a run derives when it is asked (``RunSpec.dataset``), from the facts it holds once. Every
function of ``megajax.data`` that opens or batches a run's data takes a DataSettings; none reads the ConfigDict."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataSource:
    """``config.data``'s fields (their meaning: ``megajax.config.defaults.base_config``)."""

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
    pairs_per_row: int  # source=preference
    tokenizer_fingerprint: str  # recorded by training: the data's tokenizer's vocabulary fingerprint

    @property
    def packed(self) -> bool:
        """Whether the batches are packed rows (``megajax.data.documents``): windows with document masking, or
        fine-tuning examples (``data.source=sft``, ``preference``)."""
        return self.document_masking or self.source in FILE_SOURCES


SFT, PREFERENCE = "sft", "preference"
FILE_SOURCES = (SFT, PREFERENCE)  # a decoder's fine-tuning rows, from a JSONL file read with data.tokenizer


@dataclasses.dataclass(frozen=True)
class DataSettings(DataSource):
    """A ``DataSource`` and what its data is cut for: ``vocab_size`` and ``max_seq_len`` (the model's),
    ``num_classes`` (a classifier's, else 0) and ``global_batch_size`` (rows per step). Derived, never stored: built
    by ``RunSpec.dataset``, ``StoredRun.dataset`` and ``config.data_settings`` (from a ConfigDict)."""

    vocab_size: int
    max_seq_len: int
    num_classes: int
    global_batch_size: int

    @classmethod
    def cut(cls, source: DataSource, vocab_size: int, max_seq_len: int, num_classes: int,
            global_batch_size: int) -> DataSettings:
        """``source`` cut for a model's vocabulary, rows and classes and a batch of ``global_batch_size`` rows."""
        return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(DataSource)},
                   vocab_size=vocab_size, max_seq_len=max_seq_len, num_classes=num_classes,
                   global_batch_size=global_batch_size)
