"""The scaling model (``megajax.tools.scaling``) against published measurements of Megatron-LM, each paper's
configurations run through ``predict`` on its cluster.

**Megatron-LM 2019** (Shoeybi et al., DGX-2H V100s, ``PAPER_PUBLISHED``): Figure 5's model-parallel and model + data
weak scaling, Table 7 (heads), Table 8 (strong scaling), the 1-GPU baseline and the abstract's 512 GPUs;
``bench/scaling_plot.py`` prints each beside its prediction. ``DGX2H_V100``'s three constants were fitted to three of
them: ``gemm_efficiency`` 0.88 (a large fp16 GEMM on a V100; sets the 1-GPU baseline, 39 TFLOP/s = 30% of peak, read
as transformer_flops / step), ``layer_overhead_s`` 6 ms per layer and micro-batch that does not shrink with t
(Table 8's strong scaling), ``dp_overlap`` 0.3 (Figure 5's model + data curve; the paper all-reduced fp16 gradients:
``grad_bytes=2``); Figure 5's model-parallel curve, Table 7 and the abstract are held out. Every published figure is
predicted within 8 percentage points (speedups within 3%). The worst are Figure 5's 128 GPUs (+7.7: its 12-point
drop from data parallelism is 3x the other sizes' and exceeds even an unoverlapped all-reduce) and 512 GPUs (-7.6):
one overlap fraction splits the difference.

**Megatron-LM PTD-P 2021** (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC21), Table 1 (``PTDP_TABLE1``): GPT models from 1.7B to 1T parameters, sequence 2048, vocabulary
51,200, activation recomputation, tensor x pipeline x data parallelism on up to 3,072 A100 80GB (``DGX_A100``), the
achieved TFLOP/s per GPU counted with the paper's eq. (3), F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), which counts
the recomputed forward pass (``ptdp_flops``; megajax's model FLOPs do not): predicted = F / predicted step / GPUs.
Provenance: the ten rows (heads, hidden, layers, t, p, GPUs, batch, TFLOP/s, % of peak) as recalled by the brief of
this work match, digit for digit with their aggregate PFLOP/s, the table as transcribed in public notes found here
(BigScience's Megatron-LM notes in github.com/bigscience-workshop/bigscience, an earlier experiments/README.md,
citing arXiv 2104.04473v2, and two paper summaries); the paper's own text was not available here to check them.

Assumed where the table is silent (none chosen per row to fit it):

* Micro-batch sizes 16, 16, 16, 8, 4, 2, 2, 1, 1, 1: the "Micro BS" column of BigScience's transcription (not in
  the SC21 table; unconfirmed). With p = 1 the rows accumulate the rest of a replica's batch; with p > 1 a replica's
  batch is one pipeline flush of m = B / (d b) microbatches, a multiple of p in every row (as the interleaved
  schedule requires).
* The schedule: Megatron-LM's interleaved 1F1B with the scatter/gather optimization (``Pipeline(megatron=True)``;
  Section 5.1 of the paper, as recalled, not checked here). v is not published: each row takes the v the model
  predicts fastest among those Megatron-LM accepts (L divisible by p v), as the authors tuned their runs; with
  scatter/gather the point-to-point time is small, so that is nearly always one layer per chunk. ``ptdp_predictions``
  with ``repeats=1`` gives plain 1F1B (bench/README.md lists both).
* Gradients all-reduced in fp16 (2 bytes) and not overlapped (``DGX_A100.dp_overlap`` 0), at most 4% of a row's
  step (7.5B's); fp32 gradients would lower the predictions by up to 1.8 points of peak (7.5B), a 0.3 overlap raise
  them by up to 0.6. The head on the last stage, the embedding on the first, their tied gradient all-reduced between
  them (``scaling._pipeline_step``).

Fitted: ``DGX_A100.gemm_efficiency`` and ``layer_overhead_s`` on the odd rows (``PTDP_FITTED``: 1.7B, 7.5B, 39.1B,
145.6B, 529.6B), least squares in points of peak (``bench/ptdp_fit.py``); the even rows (3.6B, 18.4B, 76.1B, 310.1B,
1T) are held out of every fit. The trend (44% -> 52% as hidden grows) comes from the counted terms: the element-wise
passes, narrow attention GEMMs and tensor-parallel all-reduces shrink against the h^2 GEMMs, against a bubble of
(p - 1) / (m v + p - 1). Errors: ``ptdp_errors``; bench/README.md's table.
"""

from __future__ import annotations

import dataclasses
import functools

from megajax.config import RunSpec, base_config, replanned, resolve
from megajax.models import TransformerConfig
from megajax.parallel.mesh import MeshShape
from megajax.tools.scaling import DGX2H_V100, DGX_A100, Cluster, Prediction, predict
from megajax.tools.scaling_layout import with_choices
from megajax.tools.scaling_pipeline import Pipeline


def gpt_model(hidden: int, layers: int, heads: int, seq: int = 1024, remat: str = "full") -> RunSpec:
    """A GPT-2 of the papers' models (``base_config``) resolved on one GPU (the scaling model places it on each
    mesh): ``hidden``, ``layers``, ``heads``, sequence ``seq``, the vocabulary padded to 51,200 (Megatron-LM's GPT-2
    vocabulary), ``remat`` (both papers checkpoint every layer), fp16 (both papers', and given, so that resolving it
    starts no jax backend). The scaling model reads its parameters, FLOPs and activations from the model this run
    builds."""
    config = base_config()
    config.model.update(hidden_size=hidden, num_layers=layers, num_heads=heads, max_seq_len=seq, vocab_size=51200,
                        remat=remat)
    config.train.precision = "fp16"
    return resolve(config, 1, training=False)


def with_heads(run: RunSpec, heads: int) -> RunSpec:
    """``run`` with ``heads`` attention heads (Table 7's 8.3B variants)."""
    return replanned(run, training=False, model=dataclasses.replace(run.model, num_heads=heads))


# The paper's scaling experiments (Section 5.1 and Appendix D): Table 1's models (96 per head), seq 1024, the
# vocabulary padded to 51,200, checkpointing every layer, and fp16 gradients all-reduced (Megatron-LM 2019).
PAPER_MODELS = {"1.2B": gpt_model(1536, 40, 16), "2.5B": gpt_model(1920, 54, 20), "4.2B": gpt_model(2304, 64, 24),
                "8.3B": gpt_model(3072, 72, 32)}
PAPER_PUBLISHED = {
    "baseline TFLOP/s": {1: 39.0},  # Section 5.1.1: 1.2B on one GPU, 30% of peak
    "figure 5 model": {1: 100, 2: 95, 4: 82, 8: 77},  # weak scaling %, batch 8, Table 1's model per GPU count
    "figure 5 model+data": {64: 96, 128: 83, 256: 79, 512: 74},  # the same x 64-way data, global batch 512
    "table 7": {16: 82, 24: 80, 32: 77},  # 8.3B at 8-way, by attention heads
    "table 8": {1: 1.0, 2: 1.64, 4: 2.34, 8: 2.98},  # 1.2B, batch 8, speedup by model-parallel GPUs
    "abstract": {512: 76},  # 15.1 PFLOP/s on 512 GPUs: Table 2's 8.3B (24 heads) on 64 x 8, global batch 512
}


def paper_predictions(cluster: Cluster = DGX2H_V100) -> dict[str, dict[int, float]]:
    """The model's values for ``PAPER_PUBLISHED``'s keys (efficiencies in %, relative to the 1.2B 1-GPU run)."""
    def predicted(model: RunSpec, mesh: tuple[int, int], batch: int) -> Prediction:  # (data, model)
        return predict(model, MeshShape(*mesh), batch, cluster, grad_bytes=2, baseline_tflops=1.0, memory=False,
                       reduce_once=True)

    base = predicted(PAPER_MODELS["1.2B"], (1, 1), 8)
    weak = lambda p: 100 * p.tflops_per_gpu / base.tflops_per_gpu  # noqa: E731
    sizes = dict(zip((1, 2, 4, 8), PAPER_MODELS.values()))
    return {
        "baseline TFLOP/s": {1: base.tflops_per_gpu},
        "figure 5 model": {t: weak(predicted(m, (1, t), 8)) for t, m in sizes.items()},
        "figure 5 model+data": {64 * t: weak(predicted(m, (64, t), 512)) for t, m in sizes.items()},
        "table 7": {a: weak(predicted(with_heads(PAPER_MODELS["8.3B"], a), (1, 8), 8)) for a in (16, 24, 32)},
        "table 8": {t: base.step_s / predicted(PAPER_MODELS["1.2B"], (1, t), 8).step_s for t in (1, 2, 4, 8)},
        "abstract": {512: weak(predicted(with_heads(PAPER_MODELS["8.3B"], 24), (64, 8), 512))},
    }


@dataclasses.dataclass(frozen=True)
class PtdpRow:
    """One row of PTD-P's Table 1 (``micro_batch``: assumed, module docstring)."""

    name: str  # parameters, billions
    heads: int
    hidden: int
    layers: int
    tensor: int
    pipe: int
    gpus: int
    batch: int
    tflops: float  # achieved TFLOP/s per GPU, eq. (3)'s FLOPs
    percent: int  # of the 312 TFLOP/s peak, as published
    micro_batch: int

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipe)

    @property
    def mesh(self) -> MeshShape:
        """The row's mesh: pipe x data x tensor."""
        return MeshShape(self.data, self.tensor, pipe=self.pipe)

    @property
    def microbatches(self) -> int:
        """m: microbatches per replica per step (one pipeline flush)."""
        return self.batch // self.data // self.micro_batch


PTDP_TABLE1 = (
    PtdpRow("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 44, 16),
    PtdpRow("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 44, 16),
    PtdpRow("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 46, 16),
    PtdpRow("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 8),
    PtdpRow("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 4),
    PtdpRow("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 2),
    PtdpRow("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 2),
    PtdpRow("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 1),
    PtdpRow("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 1),
    PtdpRow("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 1),
)
PTDP_FITTED = ("1.7B", "7.5B", "39.1B", "145.6B", "529.6B")  # DGX_A100's constants were fitted to these only
PTDP_GRAD_BYTES = 2


def ptdp_flops(model: TransformerConfig, batch: int) -> float:
    """The paper's eq. (3): FLOPs of one step with activation recomputation (the forward pass counted twice)."""
    b, s, L, h, V = batch, model.max_seq_len, model.num_layers, model.hidden_size, model.padded_vocab_size
    return 96 * b * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))


@functools.lru_cache(maxsize=None)
def ptdp_model(row: PtdpRow) -> RunSpec:
    """A row's GPT: sequence 2048, vocabulary 51,200, full recomputation (resolved once per row, as
    ``PAPER_MODELS``: the fit predicts each row thousands of times)."""
    return gpt_model(row.hidden, row.layers, row.heads, seq=2048, remat="full")


def ptdp_prediction(row: PtdpRow, cluster: Cluster = DGX_A100, repeats: int | None = None) -> Prediction:
    """A row's predicted step: Megatron-LM's 1F1B (``repeats=1``) or interleaved schedule (``repeats=v``; None: the
    fastest v that splits the layers evenly)."""
    model, mesh = ptdp_model(row), row.mesh
    if row.pipe == 1:
        return predict(model, mesh, row.batch, cluster, row.micro_batch, PTDP_GRAD_BYTES, memory=False,
                       reduce_once=True)
    options = [repeats] if repeats else [v for v in range(1, row.layers // row.pipe + 1)
                                         if row.layers % (row.pipe * v) == 0]
    return min((predict(model, mesh, row.batch, cluster, None, PTDP_GRAD_BYTES, memory=False,
                        pipeline=Pipeline(row.pipe, row.microbatches, v, megatron=True), reduce_once=True)
                for v in options),
               key=lambda p: p.step_s)


def ptdp_tflops(row: PtdpRow, prediction: Prediction) -> float:
    """Predicted TFLOP/s per GPU in the paper's count (eq. 3)."""
    return ptdp_flops(prediction.run.model, row.batch) / prediction.step_s / row.gpus / 1e12


def ptdp_predictions(cluster: Cluster = DGX_A100, repeats: int | None = None) -> dict[str, float]:
    """Each row's predicted TFLOP/s per GPU (eq. 3's FLOPs)."""
    return {row.name: ptdp_tflops(row, ptdp_prediction(row, cluster, repeats)) for row in PTDP_TABLE1}


def ptdp_errors(predicted: dict[str, float], peak: float = DGX_A100.peak_flops) -> dict[str, tuple[float, float]]:
    """Per row of ``predicted``, (predicted - published in points of peak, predicted / published - 1)."""
    return {row.name: (100 * (predicted[row.name] - row.tflops) * 1e12 / peak, predicted[row.name] / row.tflops - 1)
            for row in PTDP_TABLE1 if row.name in predicted}


def ptdp_megajax_prediction(row: PtdpRow, cluster: Cluster = DGX_A100,
                            sequence: tuple[bool, ...] = (False, True)) -> Prediction:
    """A row's predicted step with megajax's own pipeline (GPipe, the circular schedule at each v, or 1F1B,
    interleaved at each v, with full recomputation, none or selective, holding residuals or recomputing the chunks:
    ``megajax.parallel.pipeline``), with sequence parallelism or without (``sequence``: the choices tried; PTD-P's
    rows had none), at the row's mesh, batch and microbatches: the fastest that fits the cluster's memory, else the
    fastest (its ``fits`` False)."""
    model, mesh = ptdp_model(row), row.mesh
    if row.pipe == 1:
        return predict(model, mesh, row.batch, cluster, row.micro_batch, PTDP_GRAD_BYTES, reduce_once=True)
    options = []
    for sequence in sequence:  # SP: the stage boundary's message 1/t (as Megatron-LM's scatter/gather sends)
        base = with_choices(model, sequence=sequence)
        options += [predict(base, mesh, row.batch, cluster, None, PTDP_GRAD_BYTES,
                            pipeline=Pipeline(row.pipe, row.microbatches, v), reduce_once=True)
                    for v in range(1, row.layers // row.pipe + 1) if row.layers % (row.pipe * v) == 0]
        # 1F1B, interleaved at each v, holding its microbatches' residuals under each policy, or their chunk inputs
        # (stage_recompute: each chunk's forward again in its backward, so remat=none recomputes as much as
        # Megatron's full)
        options += [predict(with_choices(base, remat=remat), mesh, row.batch, cluster, None, PTDP_GRAD_BYTES,
                            pipeline=Pipeline(row.pipe, row.microbatches, v, one_f_one_b=True, stage_recompute=again),
                            reduce_once=True)
                    for v in range(1, row.layers // row.pipe + 1) if row.layers % (row.pipe * v) == 0
                    for remat in ("full", "none", "selective") for again in (False, True)]
    fitting = [p for p in options if p.fits]
    return min(fitting or options, key=lambda p: p.step_s)
