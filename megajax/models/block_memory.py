"""What the trunk's layer (``transformer.Block``: GPT-2's, BERT's and the task models') keeps for its backward
pass: the default ``LayerKind.residuals`` (``spec.BLOCK``'s), which ``tools.memory_planner`` asks (a layer kind
with another block states its own, as Llama's does)."""

from __future__ import annotations

from megajax.models.transformer import TransformerConfig, attention_core_residual_bytes

FP32 = 4
MLP_GELU_RESIDUALS = {"gelu_tanh": 6, "gelu": 4}  # (b, s, 4h) tensors autodiff keeps: input, intermediates, output


def block_residual_bytes(cfg: TransformerConfig, rows: int, tp: int, split: int, remat: str, cd: int,
                         attention: str = "xla") -> int:
    """Bytes one ``Block`` keeps for its backward pass on one device: ``rows`` sequences, ``tp`` model shards,
    the residual stream split ``split`` ways (sequence parallelism), ``cd`` bytes per compute-dtype value,
    ``attention`` the attention core's implementation; the same as the traced jaxpr
    (tests/test_memory_planner.py).

    Per layer, with b*s*h-sized tensors replicated over ``model`` and head / MLP ones split by it: ``none`` keeps
    8 (b, s, h) tensors (LayerNorm inputs, centred and normalised values, outputs: 6 in fp32, 2 in the compute
    dtype), q, k, v and the attention context, 6 (b, s, 4h) tensors for tanh-GeLU (4 for erf), the attention
    core's residuals (``transformer.attention_core_residual_bytes``: with XLA's attention the softmax probabilities
    in fp32 and in the compute dtype, a*s*s*b each), with dropout a 1-byte mask of both residual branches, the
    LayerNorm statistics (and the LayerNorm scales broadcast to (1, 1, h)), and in 16-bit the compute-dtype copies
    of the four weight matrices. ``selective`` drops the attention core's (it is recomputed); ``full`` keeps only
    the layer's input; ``save_dots`` two (b, s, h) tensors (the input and a projection's output) and the QKV and
    MLP-up outputs (the matmuls with no batch dimensions).

    Korthikanti et al. 2022 (Eq. 2) count 34*s*b*h + 5*a*s*s*b bytes at 16 bits: JAX keeps more (the GeLU's and
    the LayerNorms' intermediates, the softmax in fp32), 146*s*b*h + 9*a*s*s*b bytes in fp32.

    With sequence parallelism the residual stream's tensors (the LayerNorms', the dropout masks, the layer's input
    under ``full``) are split over ``model`` too; the two LayerNorm outputs are kept as the all-gathered inputs of
    QKV and MLP-up, whole (the paper gathers them again in the backward pass instead, for 2L more all-gathers).
    """
    s, b, h, f = cfg.max_seq_len, rows, cfg.hidden_size, cfg.ffn_size
    sbh, dropout = s * b * h, cfg.dropout > 0
    if remat == "full":
        return sbh * cd // split
    if remat == "save_dots":
        return 2 * sbh * cd + (3 * sbh + s * b * f) * cd // tp
    kept = sbh * 2 * cd + (sbh * (6 * FP32 + (2 if dropout else 0)) + 4 * s * b * FP32) // split  # LayerNorms, masks
    kept += 2 * h * FP32  # the LayerNorm scales broadcast to (1, 1, h)
    kept += (4 * sbh + MLP_GELU_RESIDUALS[cfg.activation] * s * b * f) * cd // tp  # q, k, v, context; the MLP
    if remat != "selective":
        kept += attention_core_residual_bytes(cfg, b, tp, attention)
    if cd < FP32:
        kept += (4 * h * h + 2 * h * f) * cd // tp  # compute-dtype copies of QKV, out, MLP-up and MLP-down
    return kept
