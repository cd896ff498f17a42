"""The scaling model's pipe dimension: a pipeline's schedule (ticks, bubble, microbatches in flight), its
point-to-point time, a stage's activations (the memory planner's terms), and the config flags that give it.
``megajax.tools.scaling`` adds these to a step.

Both implementations the scaling model knows tick the same way: a schedule of p stages, M microbatches and v layer
chunks per stage (v = 1: GPipe / 1F1B; v > 1: megajax's circular schedule, Megatron-LM's interleaved one) runs
``ticks`` stage-ticks of L/(p v) layers on one microbatch each, forward and backward. megajax's GPipe and circular
loops run every stage on every tick (an idle stage computes on zeros, so a tick costs the same either way); its 1F1B
(interleaved with v > 1) skips a stage's idle halves over M v + (v + 1) p - 2 lockstep ticks (``lockstep_ticks``),
about ``ticks``' time (with ``stage_recompute`` running the chunk's forward again in its backward); Megatron-LM's
1F1B idles, and takes as long (Narayanan et al. 2021: (m + (p-1)/v) x a microbatch's time through a stage).
"""

from __future__ import annotations

import dataclasses

from megajax.config import RunSpec
from megajax.tools.memory_terms import head_bytes, largest_layer_residual_bytes, layer_residual_bytes


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipeline over the mesh's ``pipe`` axis: ``stages`` (mesh.pipe, p), ``microbatches`` per layer-stack batch
    (parallel.pipeline_microbatches, M; with accumulation, per accumulation step), ``repeats`` (parallel.
    pipeline_repeats, v: layer chunks per stage). ``megatron``: Megatron-LM PTD-P's implementation (Narayanan et al.
    2021: 1F1B / interleaved, the head on the last stage only, scatter/gather point-to-point, the tied embedding's
    gradient all-reduced between the first and last stage) instead of megajax's (``megajax.parallel.pipeline``:
    GPipe / circular in one SPMD program, the embeddings and head on every stage over its share of the batch, the
    activations round the ring and along the io column scattered and gathered as Megatron-LM's; with
    ``one_f_one_b`` its 1F1B, the head on the last stage per microbatch)."""

    stages: int = 1
    microbatches: int = 1
    repeats: int = 1
    megatron: bool = False
    one_f_one_b: bool = False  # megajax's 1F1B (``megajax.parallel.pipeline_1f1b``), interleaved with repeats > 1
    stage_recompute: bool = False  # its parallel.pipeline_stage_recompute: chunk inputs held, forwards run again

    def ticks(self) -> int:
        """Stage-ticks of L/(p v) layers: M v + p - 1 when M >= p; with fewer microbatches than stages a chunk's
        next round waits for its microbatch to come round the ring, (v - 1) p + M + p - 1."""
        p, m, v = self.stages, self.microbatches, self.repeats
        return (v - 1) * max(m, p) + m + p - 1  # megajax.parallel.pipeline.ticks where M is a multiple of p

    def lockstep_ticks(self) -> int:
        """The ticks the schedule's permutes run: ``ticks`` but megajax's 1F1B, M v + (v + 1) p - 2
        (``pipeline_1f1b.ticks``: its first v p - 1 ticks have forwards only and its last v p - 1 backwards only, so
        it takes about ``ticks``' time)."""
        if self.one_f_one_b:
            return self.microbatches * self.repeats + (self.repeats + 1) * self.stages - 2
        return self.ticks()

    def bubble(self) -> float:
        """The idle share of the stage-ticks, (p - 1) / (M v + p - 1) for M >= p (megajax's
        ``pipeline.bubble_fraction`` at v = 1). Megatron-LM's (p - 1) / (v m) is the same idle time over the ideal
        time instead of the total."""
        return 1 - self.microbatches * self.repeats / self.ticks()

    def in_flight(self) -> int:
        """Chunk-microbatches whose activations a stage keeps for its backward pass, each L/(p v) layers. megajax:
        every tick's (autodiff of the tick loop keeps them all, idle ticks included; the memory planner counts what
        each keeps). Megatron-LM's 1F1B: at most p microbatches in flight; interleaved: its warm-up of
        (p - 1) 2 + (v - 1) p chunk-steps on the first stage, plus the one it runs."""
        p, m, v = self.stages, self.microbatches, self.repeats
        if not self.megatron:
            return self.ticks()
        return min(m, p) if v == 1 else min(m * v, 2 * (p - 1) + (v - 1) * p + 1)

    @property
    def schedule(self) -> str:
        """The schedule's name: '-' without stages; megajax's 'gpipe' / 'circular' / '1f1b', Megatron-LM's '1f1b' /
        'interleaved'."""
        if self.stages == 1:
            return "-"
        if self.megatron or self.one_f_one_b:
            return "1f1b" if self.repeats == 1 else "interleaved"
        return "gpipe" if self.repeats == 1 else "circular"

    @property
    def config_schedule(self) -> str:
        """megajax's ``parallel.pipeline_schedule`` for this pipeline: 'gpipe' without stages, and for Megatron-LM's
        (whose memory ``megatron_activation_bytes`` counts) the megajax schedule of the same layer layout."""
        if self.one_f_one_b and not self.megatron:
            return "1f1b"
        return "circular" if self.repeats > 1 else "gpipe"

    def flags(self) -> str:
        """The config flags of this schedule (mesh.pipe is printed with the mesh): the repeats and the schedule
        always (a config's circular schedule must not outlive its stages), the microbatches with stages."""
        repeats = (f"--config.parallel.pipeline_repeats={self.repeats} "
                   f"--config.parallel.pipeline_schedule={self.config_schedule}"
                   + " --config.parallel.pipeline_stage_recompute=True" * self.stage_recompute)
        return repeats if self.stages == 1 else f"--config.parallel.pipeline_microbatches={self.microbatches} {repeats}"


def crosses_nodes(pipe: int, data: int, tensor: int, gpus_per_node: int) -> bool:
    """Whether a stage boundary crosses nodes on a ``Mesh(('pipe', 'data', 'model'))`` (pipe outermost: stage s is
    GPUs [s d t, (s + 1) d t)). Every boundary does where d t >= gpus_per_node; with smaller stages some boundaries
    stay in a node, but the ticks are synchronous, so one that crosses sets the pace."""
    return pipe * data * tensor > gpus_per_node


def p2p_s(nbytes: float, tensor: int, pipeline: Pipeline, inter: bool, cluster) -> float:
    """One stage-to-stage transfer of one microbatch's activations (``nbytes``, b s h in half precision) from one
    GPU of a stage: Megatron-LM's scatter/gather, as megajax's schedules do it (``pipeline_1f1b.scattered``), sends
    1/t of it over the link and all-gathers the rest over NVLink (a ring of ``tensor``). (With sequence parallelism
    ``nbytes`` is 1/t already, and nothing is gathered: ``tensor`` 1.) ``pipeline``: every schedule sends alike."""
    bandwidth, latency = (cluster.inter_bandwidth, cluster.inter_latency) if inter else (cluster.intra_bandwidth,
                                                                                         cluster.intra_latency)
    if tensor == 1:
        return nbytes / bandwidth + latency
    gather = (tensor - 1) / tensor * nbytes / cluster.intra_bandwidth + (tensor - 1) * cluster.intra_latency
    return nbytes / tensor / bandwidth + latency + gather


def megatron_activation_bytes(run: RunSpec, rows: int, pipeline: Pipeline) -> int:
    """Megatron-LM's activation bytes on one stage of ``run``'s mesh for ``rows`` sequences cut into
    ``pipeline.microbatches``: the residuals of L/(p v) layers for each chunk-microbatch in flight
    (``Pipeline.in_flight``), plus the larger of the last stage's head on one microbatch and one recomputed layer,
    counted with the memory planner's terms in the run's precision (JAX's residuals; in half precision, an estimate
    of PyTorch's)."""
    p, v, m = pipeline.stages, pipeline.repeats, run.model
    micro = rows // pipeline.microbatches
    layers = pipeline.in_flight() * (m.num_layers // (p * v)) * layer_residual_bytes(run, micro, m.remat)
    recompute = largest_layer_residual_bytes(run, micro, "none") if m.remat in ("full", "save_dots") else 0
    return layers + max(head_bytes(run, micro), recompute)
