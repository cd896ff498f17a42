"""The scaling model (``megajax.tools.scaling``) on H100s against published BF16 runs of three other frameworks,
which ``DGX_H100``'s three constants are fitted to (``bench/h100_fit.py``; FP8 runs are left out of the fit).

Each row's published figure becomes a step time through its publisher's own FLOP count (``H100Row.flops``); the
error is the predicted minus the published figure in points of the 989 TFLOP/s BF16 peak, both in that count.

* **Megatron-LM's weak-scaling table** (README "Performance Benchmarking", images/model_table.png, added in
  NVIDIA/Megatron-LM f2e5db4, 2024-07-15): GPT models of 1.7B to 462B parameters, sequence 4096, vocabulary
  131,072, data 48, tensor 1-8, pipeline 1-16, per-GPU TFLOP/s in Megatron's count at that commit
  (``megatron/training/training.py``: 72 B s L h^2 + 12 B s^2 L h + 6 B s h V: no recomputation, attention not
  halved for causality, the output layer counted). Stated there: ``--overlap-grad-reduce --overlap-param-gather``
  (so the distributed optimizer: ZeRO-1, whose gradients' reduce-scatter and parameters' all-gather are an
  all-reduce's traffic, both overlapped: timed as the overlapped all-reduce of plain data parallelism, its memory
  ZeRO-1's) and ``--tp-comm-overlap`` (so sequence parallelism). Not published
  (NVIDIA/Megatron-LM#1571 asks for them): the micro-batch, the recomputation and the interleaved schedule's v, so
  each row takes the ones the model predicts fastest that fit 80 GB (as PTD-P's rows take v,
  ``scaling_papers``), from micro-batches of 1-8 sequences, recomputation none / selective / full, and every v
  that splits the stage's layers. Megatron's GPTs have an untied output layer; megajax's GPT ties it (the same
  FLOPs, 131,072 h parameters fewer in the gradients' reduction).
* **MaxText's Llama 2 7B on one A3 host** (8 H100 80GB; AI-Hypercomputer/maxtext
  MaxText/configs/a3/llama_2_7b/README.md at efb6d9e, 2024-04-09, 1vm.sh): 492 TFLOP/s per GPU; FSDP over the 8
  GPUs, 4 sequences of 4096 each, cuDNN flash attention, ``remat_policy=minimal_flash`` (every weight GEMM's output
  and the attention's kept: ``save_dots``); MaxText's count there (maxtext_utils.py): 6 N T b over all parameters
  plus the attention's 12 H L d T^2 b halved for causality.
* **torchtitan's Llama 3.1 8B on 8 H100s** (pytorch/torchtitan docs/performance.md at d4c86e3, 2025-01-30, Table
  1): FSDP with torch.compile, 6,667 tokens/s per GPU, 2 sequences of 8192 per GPU (the train config's seq_len at
  the tested 9dec370), selective activation checkpointing per op (every other GEMM's output kept: between
  ``save_dots`` and ``selective``; timed as ``save_dots``). Its GPUs are Grand Teton's H100 96GB HBM2e at 500 W
  (2.4 TB/s of HBM), timed with that bandwidth and the SXM peak (the doc's own MFU uses it too).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from megajax.config import RunSpec, base_config, resolve
from megajax.models import llama
from megajax.parallel.mesh import MeshShape
from megajax.tools.scaling import DGX_H100, Cluster, Prediction, memory_bytes, predict
from megajax.tools.scaling_layout import parameters_per_gpu, with_choices
from megajax.tools.scaling_pipeline import Pipeline

MEGATRON_SEQ, MEGATRON_VOCAB = 4096, 131072


@dataclasses.dataclass(frozen=True)
class H100Row:
    """One published H100 run: its model (``model()``), mesh, global batch, the choices it is timed with
    (``choices``: ``scaling_layout.with_choices`` keywords; ``remats`` / ``micro_batches`` / ``pipelined``: the
    unpublished settings the model picks the fastest of), its figure as a step time, and its publisher's FLOPs."""

    name: str
    source: str
    model: Callable[[], RunSpec]
    mesh: MeshShape
    batch: int
    published: float  # TFLOP/s per GPU in the publisher's count, or (``tokens``) tokens/s per GPU
    flops: Callable[[RunSpec, int], float]  # the publisher's FLOPs of a step of ``batch`` sequences
    choices: tuple[tuple[str, object], ...] = ()
    remats: tuple[str, ...] = ()  # the policies tried; () : the one ``choices`` sets
    micro_batches: tuple[int | None, ...] = (None,)  # sequences per data shard per accumulation step; None: all
    megatron: bool = False  # with stages: Megatron-LM's interleaved 1F1B (every v that splits the layers)
    hbm_bandwidth: float | None = None  # where the GPUs are not DGX H100's
    tokens: bool = False

    @property
    def published_step_s(self) -> float:
        """The published figure as the step's time."""
        if self.tokens:
            return self.batch * self.model().model.max_seq_len / (self.published * self.mesh.devices)
        return self.flops(self.model(), self.batch) / (self.published * 1e12 * self.mesh.devices)


def megatron_flops(run: RunSpec, batch: int) -> float:
    """Megatron-LM's FLOPs of a step of a plain GPT (training.py at f2e5db4): 72 B s L h^2 + 12 B s^2 L h
    + 6 B s h V."""
    m = run.model
    b, s, L, h, V = batch, m.max_seq_len, m.num_layers, m.hidden_size, MEGATRON_VOCAB
    return 72 * b * s * L * h**2 + 12 * b * s**2 * L * h + 6 * b * s * h * V


def maxtext_flops(run: RunSpec, batch: int) -> float:
    """MaxText's FLOPs of a step (maxtext_utils.py at efb6d9e): 6 N T b over every parameter, plus the attention's
    12 H L d T^2 b halved for causality."""
    m = run.model
    attention = 12 * m.num_heads * m.num_layers * m.head_dim * m.max_seq_len**2 * batch / 2
    return 6 * parameters_per_gpu(run)[0] * m.max_seq_len * batch + attention


def torchtitan_flops(run: RunSpec, batch: int) -> float:
    """torchtitan's FLOPs of a step (utils.py at 9dec370): (6 N + 12 L h s) per token, N without the token
    embedding, the attention not halved."""
    m = run.model
    n = parameters_per_gpu(run)[0] - m.padded_vocab_size * m.hidden_size
    return (6 * n + 12 * m.num_layers * m.hidden_size * m.max_seq_len) * batch * m.max_seq_len


@functools.cache
def megatron_gpt(hidden: int, layers: int, heads: int) -> RunSpec:
    """A GPT of Megatron-LM's table: sequence 4096, vocabulary 131,072, bf16 (its output layer tied: megajax's
    GPT's), without dropout, so timed with flash attention (Megatron-LM's runs use Transformer Engine's fused
    attention, which drops inside the kernel; megajax's cuDNN attention has no dropout)."""
    config = base_config()
    config.model.update(hidden_size=hidden, num_layers=layers, num_heads=heads, max_seq_len=MEGATRON_SEQ,
                        vocab_size=MEGATRON_VOCAB, dropout=0.0)
    config.train.precision = "bf16"
    return resolve(config, 1, training=False)


def _llama(**fields) -> RunSpec:
    """A Llama (the family's defaults: 32 layers of 4096, 32 heads) with ``fields``, bf16, on one device."""
    config = base_config(llama.NAME)
    config.model.update(**fields)
    config.train.precision = "bf16"
    return resolve(config, 1, training=False)


@functools.cache
def llama2_7b() -> RunSpec:
    """Llama 2 7B at 4096 positions (MaxText's llama2-7b: 32 layers of 4096, 32 heads, MLP 11008, vocabulary
    32,000, untied output)."""
    return _llama(vocab_size=32000, num_kv_heads=32, ffn_hidden_size=11008, max_seq_len=4096)


@functools.cache
def llama3_8b() -> RunSpec:
    """Llama 3.1 8B at 8192 positions (configs/llama3_8b.py's model)."""
    return _llama(vocab_size=128256, num_kv_heads=8, ffn_hidden_size=14336, rope_theta=500000.0, max_seq_len=8192)


def _megatron(name: str, heads: int, hidden: int, layers: int, tensor: int, pipe: int, batch: int,
              tflops: float) -> H100Row:
    model = functools.partial(megatron_gpt, hidden, layers, heads)
    return H100Row(f"megatron {name}", "NVIDIA/Megatron-LM README, images/model_table.png (f2e5db4)", model,
                   MeshShape(48, tensor, pipe=pipe), batch, tflops, megatron_flops,
                   choices=(("sequence", tensor > 1),), remats=("none", "selective", "full"),
                   micro_batches=(1, 2, 4, 8), megatron=True)


# (name, heads, hidden, layers, tensor, pipe, global batch, TFLOP/s per GPU) as the table gives them (data 48)
H100_ROWS = (
    _megatron("1.7B", 16, 2048, 24, 1, 1, 192, 408.8),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 192, 465.9),
    _megatron("16B", 48, 6144, 32, 4, 1, 192, 489.1),
    _megatron("32B", 56, 7168, 48, 8, 1, 192, 459.6),
    _megatron("70B", 64, 8192, 84, 8, 2, 384, 419.7),
    _megatron("119B", 80, 10240, 92, 8, 4, 768, 420.5),
    _megatron("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
    _megatron("314B", 128, 16384, 96, 8, 8, 1536, 474.4),
    _megatron("462B", 144, 18432, 112, 8, 16, 3072, 459.9),
    H100Row("maxtext llama2 7B", "AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md (efb6d9e)",
            llama2_7b, MeshShape(8, 1), 32, 492.0, maxtext_flops,
            choices=(("remat", "save_dots"), ("shard_optimizer", True), ("fsdp", True))),
    H100Row("torchtitan llama3.1 8B", "pytorch/torchtitan docs/performance.md Table 1 (d4c86e3)", llama3_8b,
            MeshShape(8, 1), 16, 6667.0, torchtitan_flops,
            choices=(("remat", "save_dots"), ("shard_optimizer", True), ("fsdp", True)), hbm_bandwidth=2.4e12,
            tokens=True),
)


def row_prediction(row: H100Row, cluster: Cluster = DGX_H100) -> Prediction:
    """The row's predicted step on ``cluster``: its choices, and of the unpublished settings the fastest that fits
    the GPU's memory (else the fastest)."""
    if row.hbm_bandwidth:
        cluster = dataclasses.replace(cluster, hbm_bandwidth=row.hbm_bandwidth)
    options = []
    for run, micro, pipeline in _settings(row):
        p = predict(run, row.mesh, row.batch, cluster, micro, 2, memory=False, pipeline=pipeline, reduce_once=True)
        options.append((not _fits(row, run, micro, pipeline), p.step_s, p))
    return min(options, key=lambda o: o[:2])[2]


@functools.cache
def _settings(row: H100Row) -> tuple[tuple[RunSpec, int | None, Pipeline | None], ...]:
    """Every (run with its choices, micro-batch, pipeline) the row is timed under."""
    base = with_choices(row.model(), **dict(row.choices))
    runs = [with_choices(base, remat=r) for r in row.remats] or [base]
    shard = row.batch // row.mesh.batch_shards
    out = []
    for run in runs:
        for micro in row.micro_batches:
            if micro is not None and shard % micro:
                continue
            if row.mesh.pipe == 1:
                out.append((run, micro, None))
                continue
            p, layers = row.mesh.pipe, run.model.num_layers
            m = shard // (micro or shard) if micro else shard
            out += [(run, None, Pipeline(p, m, v, megatron=row.megatron)) for v in range(1, layers // p + 1)
                    if layers % (p * v) == 0 and m % p == 0]
    return tuple(out)


@functools.cache
def _fits(row: H100Row, run: RunSpec, micro: int | None, pipeline: Pipeline | None) -> bool:
    """Whether the setting fits the GPU's memory (the planner's estimate; constants-free, so cached)."""
    shard = row.batch // row.mesh.batch_shards
    rows = shard if pipeline is not None or not micro else micro
    if row.megatron:  # the distributed optimizer's state
        run = with_choices(run, shard_optimizer=True)
    return memory_bytes(run, row.mesh, rows, pipeline, gpu=True, num_micro=shard // rows,
                        apart=False) <= DGX_H100.hbm_bytes


def row_errors(cluster: Cluster = DGX_H100) -> dict[str, tuple[float, float, float]]:
    """Per row, (published, predicted: the publisher's TFLOP/s per GPU, predicted - published in points of the
    peak)."""
    out = {}
    for row in H100_ROWS:
        p = row_prediction(row, cluster)
        work = row.flops(p.run, row.batch) / row.mesh.devices / 1e12
        published, predicted = work / row.published_step_s, work / p.step_s
        out[row.name] = (published, predicted, 100 * (predicted - published) * 1e12 / cluster.peak_flops)
    return out


def squared_error(cluster: Cluster = DGX_H100) -> float:
    """The sum over the rows of (predicted - published, in points of peak)^2: what ``bench/h100_fit.py``
    minimizes."""
    return sum(points**2 for _, _, points in row_errors(cluster).values())
