"""What the scaling model reads of a resolved run beyond its model's frozen config and spec: its parameters per GPU
and per pipeline stage and its layers' GEMM shapes, stack by stack, from the abstract model through the sharding
rules (``layout``: nothing here describes a block by formula), the communication budget's ``Shape`` of it on a
mesh (``comm_shape``), and the choices it is planned with (``with_choices``) and their flags.

The scaling model's runs are resolved without the training checks (``resolve(..., training=False)``): it reads the
model and its parallel choices, and checks the batch against each mesh itself."""

from __future__ import annotations

import dataclasses
import functools
import math

from megajax.config import RunSpec, replanned
from megajax.errors import ConfigError
from megajax.parallel.sharding import PipelineSettings, Rules, entry_axes, logical_to_spec
from megajax.tools.comm_minimum import Shape, data_gradient_elements, kv_head_elements, shape_of
from megajax.tools.memory_terms import parameters
from megajax.tools.scaling_clusters import HALF

EXPERTS = "experts"  # the logical axis a mixture of experts stacks its experts on (``models/moe.py``)


@dataclasses.dataclass(frozen=True)
class StackLayout:
    """One of a model's layer stacks (``ModelSpec.stacks``) on one of ``tensor`` model-parallel GPUs."""

    count: int  # its layers
    layer: int  # one layer's parameters on one GPU
    gemms: tuple[tuple[int, int], ...]  # one layer's weight GEMMs on one GPU, (k, n) per kernel, over every token
    routed: bool = False  # its layers' MLP is a mixture of experts (``LayerKind.routed``)
    expert_layer: int = 0  # of ``layer``, the experts' parameters (all of them: one expert shard)
    expert_gemms: tuple[tuple[int, int], ...] = ()  # one expert's weight GEMMs on one GPU, over its tokens


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the abstract model of a run says about one of ``tensor`` model-parallel GPUs (``layout``)."""

    total: int  # parameters of the whole model
    ends: int  # parameters outside the layer stacks on one GPU: embeddings, final norm, output layer
    stacks: tuple[StackLayout, ...]  # the model's layer stacks, in ``ModelSpec.stacks`` order
    tied: bool  # one (vocabulary, hidden) weight: the word embedding is the output layer
    experts: int = 0  # a mixture of experts' routed experts per routed layer (0: dense)

    @property
    def layers(self) -> int:
        """The model's layers, every stack's."""
        return sum(st.count for st in self.stacks)

    @property
    def layer(self) -> int:
        """The mean layer's parameters on one GPU (a model of one layer kind: its layer's)."""
        return sum(st.count * st.layer for st in self.stacks) // self.layers

    @property
    def expert_layer(self) -> int:
        """Of ``layer``, the mean layer's experts' parameters (all of them: one expert shard)."""
        return sum(st.count * st.expert_layer for st in self.stacks) // self.layers

    def local(self, layers: int, expert: int = 1) -> int:
        """Parameters on one GPU of a model (or pipeline stage) of ``layers`` layers and the ends, its experts split
        over ``expert`` shards: the whole model's layers exactly, a stage's as ``layers`` mean layers."""
        held = sum(st.count * (st.layer - st.expert_layer + st.expert_layer // expert) for st in self.stacks)
        return self.ends + held * layers // self.layers


def layout(run: RunSpec, tensor: int) -> Layout:
    """``run``'s parameters on one of ``tensor`` GPUs, read from its abstract model (``nnx.eval_shape``, the memory
    planner's ``parameters``) through the sharding rules, stack by stack (``RunSpec.stacks``); built once per model
    and ``tensor`` whatever the run's choices (``_on_model_shards``), so the mesh search builds each once."""
    # the rules on one model shard are the rules before the model's overrides (``_gemm``)
    return _layout(_on_model_shards(run, tensor), _on_model_shards(run, 1).rules)


@functools.lru_cache(maxsize=256)
def _layout(run: RunSpec, unsplit: Rules) -> Layout:
    params, stacks = parameters(run), []
    for stack in run.stacks:
        stacked = [p for p in params if p.module == stack.attr]
        routed = [p for p in stacked if EXPERTS in p.names]  # (layers, experts, ...): each expert's GEMMs alone
        stacks.append(StackLayout(
            count=stack.count, layer=sum(p.per_device for p in stacked) // stack.count,
            gemms=tuple(_gemm(p.names[1:], p.shape[1:], unsplit, run.mesh.model) for p in stacked
                        if p not in routed and _is_kernel(p.names[1:])),
            routed=stack.kind.routed, expert_layer=sum(p.per_device for p in routed) // stack.count,
            expert_gemms=tuple(_gemm(p.names[2:], p.shape[2:], unsplit, run.mesh.model) for p in routed
                               if _is_kernel(p.names[2:]))))
    vocab = [p for p in params if "vocab" in p.names and "embed" in p.names]
    held = sum(st.count * st.layer for st in stacks)
    return Layout(total=sum(math.prod(p.shape) for p in params), ends=sum(p.per_device for p in params) - held,
                  stacks=tuple(stacks), tied=len(vocab) == 1, experts=run.routed_experts[0])


@functools.lru_cache(maxsize=1024)
def _on_model_shards(run: RunSpec, tensor: int) -> RunSpec:
    """``run``'s model on ``tensor`` model-parallel GPUs alone (one stage, no data parallelism), what its parameters
    do not depend on (remat, sequence parallelism, the state split, the schedule) at its default: one run for every
    choice of the model. ConfigError where the model does not split so (``config.validate``'s checks of
    ``mesh.model``)."""
    return replanned(run, training=False, mesh=run.mesh.replace(pipe=1, data=1, expert=1, model=tensor),
                     pipeline=PipelineSettings(), sequence=False, shard_optimizer=False, fsdp=False,
                     model=dataclasses.replace(run.model, remat="none"))


@functools.lru_cache(maxsize=4096)
def _is_kernel(names: tuple) -> bool:
    """A layer's weight that multiplies every token's hidden state, or yields it: the hidden size (``embed``) on
    one side, other axes on the other (norm scales and biases have one side only)."""
    return len(names) > 1 and (names[0] == "embed") != (names[-1] == "embed")


def _gemm(names: tuple, shape: tuple, rules: Rules, tensor: int) -> tuple[int, int]:
    """(k, n) of a layer kernel's GEMM on one of ``tensor`` GPUs: the hidden size is the input of a column-parallel
    kernel (``embed`` first) and the output of a row-parallel one (``embed`` last). Each GPU computes with its share
    of an axis the rules split (the rules before the model's overrides: where it keeps an axis whole because the
    axis has fewer entries than GPUs, replicated key/value heads, each GPU uses its copy of one)."""
    spec = logical_to_spec(names, rules)
    local = [max(1, n // (tensor if "model" in entry_axes(entry) else 1)) for n, entry in zip(shape, spec)]
    return (local[0], math.prod(local[1:])) if names[0] == "embed" else (math.prod(local[:-1]), local[-1])


def parameters_per_gpu(run: RunSpec, tensor: int = 1, stages: int = 1, expert: int = 1) -> tuple[int, int]:
    """(total parameters, parameters on one of ``tensor`` model-parallel GPUs of one of ``stages`` pipeline stages
    and ``expert`` expert shards): the stage's L/p layers, their experts split over the expert shards, and the ends
    (megajax replicates the embeddings, final norm and output layer over pipe; Megatron-LM's first stage holds the
    embeddings, its last the final norm and the tied output layer's copy: about the same); the memory planner's
    ``params_per_device``, from the abstract model."""
    lay = layout(run, tensor)
    return lay.total, lay.local(run.model.num_layers // stages, expert)


def comm_shape(run: RunSpec, mesh: tuple[int, int], micro_batch: int, num_micro: int, layers: int,
               expert: int = 1, context: int = 1) -> Shape:
    """The communication budget's ``Shape`` (``comm_minimum.shape_of``) of ``layers`` layers of a model (and the
    ends) on a (data, model) mesh with ``expert`` expert shards and ``context`` context shards, in half precision,
    its gradients from the abstract model's parameters (as ``comm_budget.step_shape`` reads a compiled run's)."""
    cfg, tensor = run.model, mesh[1]
    lay, kv_head = layout(run, tensor), kv_head_elements(cfg, tensor)
    local = data_gradient_elements(cfg, lay.local(layers, expert), layers, kv_head)
    return shape_of(run, micro_batch=micro_batch, num_micro=num_micro, tensor=tensor, data=mesh[0], expert=expert,
                    context=context, layers=layers, activation_bytes=HALF, local_grad_elements=local,
                    expert_grad_elements=layers * lay.expert_layer // expert)


def splits_evenly(run: RunSpec, tensor: int) -> bool:
    """Whether ``tensor`` model-parallel GPUs can hold the model: the checks ``config.validate`` makes of
    ``mesh.model`` (whole heads, equal slices of hidden, MLP and vocabulary, whole key/value heads or a copy of
    one)."""
    try:
        _on_model_shards(run, tensor)
    except ConfigError:
        return False
    return True


def choices(run: RunSpec) -> tuple[str, bool, bool, bool]:
    """The memory choices a prediction is for: (``model.remat``, sequence parallelism, the moments split over data
    (``parallel.shard_optimizer``, ZeRO-1, or FSDP), the parameters too (``parallel.fsdp``, ZeRO-3))."""
    return run.model.remat, run.sequence, run.shard_optimizer, run.fsdp


@functools.lru_cache(maxsize=1024)
def with_choices(run: RunSpec, remat: str | None = None, sequence: bool | None = None,
                 shard_optimizer: bool | None = None, fsdp: bool | None = None) -> RunSpec:
    """``run`` with the choices given (None: the run's), resolved again on its mesh (``config.replanned``)."""
    if shard_optimizer is None:  # the run's ZeRO-1 (under FSDP its moments are split whatever ZeRO-1 says: off)
        shard_optimizer = run.shard_optimizer and not run.fsdp
    fsdp = run.fsdp if fsdp is None else fsdp
    return replanned(run, training=False, model=dataclasses.replace(run.model, remat=remat or run.model.remat),
                     sequence=run.sequence if sequence is None else sequence,
                     shard_optimizer=shard_optimizer or fsdp, fsdp=fsdp)


def choice_flags(run: RunSpec) -> str:
    """The config flags that give ``run``'s choices."""
    remat, sequence, shard_optimizer, fsdp = choices(run)
    return (f"--config.model.remat={remat} --config.parallel.sequence={sequence} "
            f"--config.parallel.shard_optimizer={shard_optimizer} --config.parallel.fsdp={fsdp}")
