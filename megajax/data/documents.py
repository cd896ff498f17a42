"""Packed rows: which document each token belongs to, its position in it, and which targets the loss counts.

A packed row holds the ends and beginnings of several documents (pretraining windows over concatenated documents,
fine-tuning examples placed one after another). With document masking (``data.document_masking``, Llama 3's
intra-document attention; Megatron's ``reset_attention_mask``) a token attends only to the earlier tokens of its
own document, and its position restarts at each document (Megatron's ``reset_position_ids``;
``data.reset_position_ids=False`` keeps the row's positions). ``data.eod_mask_loss`` (Megatron's) drops the
targets that cross a boundary: the prediction of a document's first token from the end of the one before it.
These are the batch fields the model reads (``megajax.models.objectives``); they are cut here, in numpy, with the
batch, so the step derives nothing from token ids.
"""

from __future__ import annotations

import numpy as np

PACKED_FIELDS = ("segments", "positions", "loss_weights")  # beside ``tokens`` (S + 1 ids: inputs and targets)


def packed_row(doc_ids: np.ndarray, reset_positions: bool, eod_mask_loss: bool) -> dict[str, np.ndarray]:
    """The packed fields of one row from the document index of each of its S + 1 tokens (non-decreasing; the
    inputs are the first S, the targets the last S): ``segments`` (S,) int32 numbered from 1 in the row,
    ``positions`` (S,) int32 (from 0 at each document's first token in the row, or the row's 0..S-1),
    ``loss_weights`` (S,) float32 (0 where ``eod_mask_loss`` and the target is in another document than its
    input)."""
    doc_ids = np.asarray(doc_ids)
    inputs = doc_ids[:-1]
    s = len(inputs)
    index = np.arange(s)
    if reset_positions:
        first = np.r_[True, inputs[1:] != inputs[:-1]]  # each document's first token in the row
        positions = index - np.maximum.accumulate(np.where(first, index, 0))
    else:
        positions = index
    weights = np.ones(s, np.float32)
    if eod_mask_loss:
        weights[doc_ids[1:] != inputs] = 0.0
    return {"segments": (np.cumsum(np.r_[True, inputs[1:] != inputs[:-1]])).astype(np.int32),
            "positions": positions.astype(np.int32), "loss_weights": weights}


def window_documents(offsets: np.ndarray, start: int, length: int) -> np.ndarray:
    """The document index of tokens ``start .. start + length - 1`` of a corpus whose documents begin at
    ``offsets`` (the indexed format's, ending with the token count)."""
    return np.searchsorted(offsets, np.arange(start, start + length), side="right") - 1
