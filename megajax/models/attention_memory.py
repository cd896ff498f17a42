"""What the trunk's attention core holds on one device beyond the residuals its layer keeps (``block_memory``,
``transformer.attention_core_residual_bytes``): its backward working set, what drawing its dropout masks holds, and
what context parallelism adds to a layer. ``tools.memory_terms`` asks these of a run's mesh and sums them; every
function takes the model's frozen config, the device's sequences and the mesh's degrees, never a run."""

from __future__ import annotations

from megajax.models.transformer import TransformerConfig

FP32 = 4
# 32-bit tensors of attention dropout bits (``dropout_bits_bytes``) drawing a layer's mask holds beside the working
# set at the peak, those a circular stage holds beside all it keeps (measured, XLA's attention on the CPU), and those
# as compiled for an H100 (compiled, not measured; the circular stage's not examined there)
DRAWN_BITS, CIRCULAR_BITS, GPU_DRAWN_BITS = 3, 4, 1


def _scores(cfg: TransformerConfig, rows: int, tp: int, context: int) -> int:
    """Elements of one device's attention scores: b x a/t x s/C x s."""
    return cfg.num_heads * (cfg.max_seq_len // context) * cfg.max_seq_len * rows // tp


def attention_backward_bytes(cfg: TransformerConfig, rows: int, tp: int, context: int, attention: str) -> int:
    """The attention core's working set in a layer's backward pass beyond what the layer kept, on one device of
    ``tp`` model and ``context`` context shards (``rows`` sequences; ``attention`` its implementation): with XLA's
    attention the gradients of the probabilities and of the scores (fp32, b x a/t x s/C x s each), and under
    ``remat=selective`` the recomputed scores and probabilities too (two more); nothing with cuDNN's flash
    attention (it never makes them). What dominates at long sequences (s=4096: 4 of them, 1.08 GB of gpt_tiny's
    compiled 1.08 GB at one layer)."""
    if attention != "xla":
        return 0
    copies = 4 if cfg.remat == "selective" else 2
    return copies * _scores(cfg, rows, tp, context) * FP32


def dropout_bits_bytes(cfg: TransformerConfig, rows: int, tp: int, context: int, attention: str, gpu: bool = False,
                       circular: bool = False) -> int:
    """What drawing attention dropout masks holds on one device (``rows`` sequences), in 32-bit tensors of the
    probabilities' shape (b x a/t x s/C x s, whatever the compute dtype): drawing a layer's mask about three (the
    bits and threefry's intermediates, ``DRAWN_BITS``) beside the working set where the peak is (a layer's
    backward; under 1F1B a forward half beside a backward); with ``circular``, four the stage holds beside all it
    keeps (``CIRCULAR_BITS``). Measured as compiled temp less the formula without them, in such tensors, at s = 256
    (8 heads, h = 64, where they dominate): the plain step 3.4 under `none` and `selective`; GPipe under `full` /
    `selective` 2.3 to 2.5; 1F1B 3.5 (4.7 under `selective`), the circular schedule 2.9 to 4.3, whatever the layers
    per stage (4 to 16 layers; counting the stage's 2 L/p masks had made 1F1B and circular 0.53 to 0.78 at 8 and 16
    layers; GPipe under `full` without them 1.27 to 1.34). As compiled for an H100 (``gpu``) one tensor
    (``GPU_DRAWN_BITS``; gpt_tiny on 2 x 4 at s = 1024 and 2048 under `none`: compiled / formula 1.08 and 1.02 with
    one, 0.89 and 0.82 with three, 1.20 and 1.17 with none). 0 without dropout or with cuDNN's attention (which has
    none)."""
    if cfg.dropout == 0 or attention != "xla":
        return 0
    tensors = GPU_DRAWN_BITS if gpu else CIRCULAR_BITS if circular else DRAWN_BITS
    return tensors * _scores(cfg, rows, 1, context) * 4 // tp


def context_attention_bytes(cfg: TransformerConfig, rows: int, tp: int, context: int, remat: str, attention: str,
                            cd: int) -> int:
    """What a layer keeps under ``context`` context shards beyond its inventory at one device's s / C positions: the
    attention core's queries against every key, not only the device's (its (b, a, s/C, s) residuals, C times those
    at s / C), and the keys and values all-gathered whole, which the core keeps as its inputs (the local chunks are
    in the inventory). Nothing with ``full`` (the layer's input only) or ``save_dots`` (the gathered keys and
    values are recomputed); 0 without context shards. ``cd``: bytes per compute-dtype value."""
    c = context
    if c == 1 or remat in ("full", "save_dots"):
        return 0
    s = cfg.max_seq_len // c  # one device's queries
    core = 0
    if remat != "selective" and attention == "xla":  # the (s/C x s) probabilities' copies and dropout mask
        per_score = 4 + cd + (1 if cfg.dropout > 0 else 0)
        core = (c - 1) * cfg.num_heads * s * s * rows * per_score // tp
    heads = 1 if cfg.kv_replicated(tp) else cfg.kv_heads // tp
    gathered = 2 * rows * (cfg.max_seq_len - s) * heads * cfg.head_dim * cd
    return core + gathered
