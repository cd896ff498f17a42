"""The scaling model's expert dimension (``megajax.tools.scaling_experts``): a mixture of experts' GEMMs add up to its
spec's (active) FLOPs on every (expert, model) split, its parameters and state on expert shards are the memory
planner's, its communication is the budget's bytes timed by hand, and the planner prints a plan for Mixtral 8x7B on
64 H100s whose flags train.py takes (pure Python: nothing compiles)."""

import dataclasses
import json
import math

import pytest
from conftest import run_on

from megajax.cli import check_config_overrides, load_config
from megajax.config import validate
from megajax.parallel.mesh import MeshShape
from megajax.tools import scaling, scaling_experts, scaling_layout, scaling_plan
from megajax.tools.comm_minimum import minimum
from megajax.tools.memory_planner import memory_report
from megajax.tools.memory_terms import params_per_device
from megajax.tools.scaling import DGX_H100, predict
from megajax.tools.scaling_layout import with_choices

MIXTRAL = load_config("mixtral_8x7b")


@pytest.mark.parametrize("name,tensor,expert", [("mixtral_8x7b", 1, 1), ("mixtral_8x7b", 2, 8),
                                                ("mixtral_8x7b", 8, 2), ("qwen3_30b_a3b", 4, 16),
                                                ("mixtral_tiny", 2, 4)])
def test_gemms_add_up_to_the_specs_active_flops(name, tensor, expert):
    """Each GPU's dense GEMMs (with the router), attention core and its experts' GEMMs over balanced rows, summed
    over an expert group's e x t GPUs (e batch shards of 8 sequences), are the spec's model FLOPs of 8 e sequences:
    the active parameters', the MFU numerator. The router (H x E) is whole on every model shard: counted once."""
    run = run_on(load_config(name))
    m = run.model
    dense, attention, logits = scaling.gemms(run, tensor, 8)
    routed = scaling_experts.routed_gemms(run, tensor, 8, expert)
    assert routed and all(g[0] == run.routed_experts[0] // expert for g in routed)
    router = [g for g in dense if g[2:] == (m.hidden_size, run.routed_experts[0])]
    assert len(router) == 1
    layer = sum(2 * math.prod(g) for g in dense + attention + routed)
    per_gpu = 3 * (m.num_layers * layer + 2 * math.prod(logits))
    repeated = 3 * m.num_layers * 2 * math.prod(router[0]) * (tensor - 1)
    want = run.model_spec.flops(m, 8 * expert, m.max_seq_len)
    assert (per_gpu * tensor - repeated) * expert == pytest.approx(want, rel=1e-12)
    assert scaling.flops(run, 8 * expert) == want


@pytest.mark.parametrize("name,data,tensor,expert", [("mixtral_tiny", 2, 1, 4), ("mixtral_tiny", 1, 2, 2),
                                                     ("mixtral_8x7b", 4, 2, 8), ("qwen3_30b_a3b", 2, 4, 8)])
def test_expert_shards_parameters_and_state_are_the_planners(name, data, tensor, expert):
    """The experts split over the expert shards, the rest whole: the abstract model's count on the mesh; the state
    (plain and ZeRO-1) as ``megajax.info`` reports it there."""
    config = load_config(name)
    placed = run_on(config, data, tensor, expert=expert)
    assert scaling_layout.parameters_per_gpu(run_on(config), tensor, 1, expert) == params_per_device(placed)
    for zero in (False, True):
        config.parallel.shard_optimizer = zero
        report = memory_report(run_on(config, data, tensor, expert=expert), micro_batch=1)
        assert scaling.state_bytes(run_on(config), tensor, data, 1, expert) == report.param_bytes + \
            report.grad_bytes + report.optimizer_bytes


def test_all_to_all_and_routing_statistics_by_hand():
    """Mixtral 8x7B, one sequence per batch shard, no recomputation. On 8 expert shards of one node (t = 1): per
    layer the e m x h blocks there and back forward and backward (bf16) and their int32 expert ids (m = n / 2: one
    expert a shard takes at most one of a token's two rows), 5 exchanges of 7 NVLink steps; the routing statistics'
    2E fp32 summed over the 32 batch shards (4 x 8). On 4 expert shards of 4 model shards (e t = 16, two nodes):
    half of each GPU's blocks leave the node on its InfiniBand, the slower link; the top-k weights' gradient summed
    over the model shards. That is the blocks exchange
    (``model.expert_exchange=blocks``); the ragged one, the default on GPUs, moves the n x h routed rows alone, there
    and back, forward and backward, with 11 exchanges' latency a layer (4 of rows, 7 of counts and offsets)."""
    blocks = MIXTRAL.copy_and_resolve_references()
    blocks.model.expert_exchange = "blocks"
    run, c = with_choices(run_on(blocks), remat="none"), DGX_H100
    layers, n, h = 32, 4096 * 2, 4096
    moved = layers * (4 * 8 * n // 2 * h * 2 + 8 * n // 2 * 4)
    assert minimum(scaling_layout.comm_shape(run, (4, 1), 1, 1, layers, 8))["expert all-to-all"] == moved
    exchange = 7 / 8 * moved / c.intra_bandwidth + 5 * layers * 7 * c.intra_latency
    stats = layers * (scaling.ring_allreduce_s(64, 8, c.intra_bandwidth, c.intra_latency) +
                      scaling.ring_allreduce_s(64 / 8, 4, c.inter_bandwidth, c.inter_latency))
    assert scaling_experts.expert_comm_s(run, (4, 1), 1, 8, c) == pytest.approx(exchange + stats, rel=1e-12)

    moved = layers * (4 * 4 * n * h * 2 + 4 * n * 4)
    assert minimum(scaling_layout.comm_shape(run, (1, 4), 1, 1, layers, 4))["expert all-to-all"] == moved
    exchange = 2 / 4 * moved / c.inter_bandwidth + 5 * layers * 3 * c.inter_latency
    stats = layers * (scaling.ring_allreduce_s(64, 2, c.intra_bandwidth, c.intra_latency) +
                      scaling.ring_allreduce_s(32, 2, c.inter_bandwidth, c.inter_latency))
    stats += layers * scaling.ring_allreduce_s(4 * n, 4, c.intra_bandwidth, c.intra_latency)
    assert scaling_experts.expert_comm_s(run, (1, 4), 1, 4, c) == pytest.approx(exchange + stats, rel=1e-12)
    ragged = with_choices(run_on(MIXTRAL), remat="none")
    exchange = 7 / 8 * layers * 4 * n * h * 2 / c.intra_bandwidth + 11 * layers * 7 * c.intra_latency
    stats = layers * (scaling.ring_allreduce_s(64, 8, c.intra_bandwidth, c.intra_latency) +
                      scaling.ring_allreduce_s(64 / 8, 4, c.inter_bandwidth, c.inter_latency))
    assert scaling_experts.expert_comm_s(ragged, (4, 1), 1, 8, c) == pytest.approx(exchange + stats, rel=1e-12)
    # remat=full redoes the forward's three exchanges and the statistics' sums
    full = scaling_experts.expert_comm_s(with_choices(run, remat="full"), (4, 1), 1, 8, c)
    assert full > scaling_experts.expert_comm_s(run, (4, 1), 1, 8, c) * 1.5


def test_data_parallel_gradients_split_by_hand():
    """The dense parameters' gradients all-reduced over data x expert, the experts' over data alone (e t apart):
    Mixtral 8x7B on data 4 x expert 8 (one node per data shard)."""
    run, c = run_on(MIXTRAL), DGX_H100
    lay = scaling_layout.layout(run, 1)
    experts = 4 * 32 * lay.expert_layer // 8
    dense = 4 * scaling_layout.parameters_per_gpu(run, 1, 1, 8)[1] - experts
    hand = scaling.ring_allreduce_s(dense, 8, c.intra_bandwidth, c.intra_latency)
    hand += scaling.ring_allreduce_s(dense / 8, 4, c.inter_bandwidth, c.inter_latency)
    hand += scaling.ring_allreduce_s(experts, 4, c.inter_bandwidth, c.inter_latency)  # one member per node
    assert scaling.data_comm_s(run, (4, 1), c, 4, 1, 8) == pytest.approx(hand, rel=1e-12)


def test_expert_shards_split_the_batch_and_cost_their_exchange():
    """data x expert shards split the batch (the same FLOPs per GPU as data alone); the exchange is the difference
    in communication, and the padded dispatch more compute."""
    run = with_choices(run_on(MIXTRAL), remat="full")
    data_only = predict(run, MeshShape(64, 1), 1024, DGX_H100, micro_batch=1, memory=False)
    experts = predict(run, MeshShape(8, 1, expert=8), 1024, DGX_H100, micro_batch=1, memory=False)
    assert experts.gpus == data_only.gpus == 64 and experts.num_micro == data_only.num_micro == 16
    assert experts.expert_comm_s > 0 and experts.tensor_comm_s == data_only.tensor_comm_s == 0
    assert experts.compute_s > data_only.compute_s  # e n rows of dispatch buffers per GPU
    assert experts.data_comm_s < data_only.data_comm_s  # the experts' gradients over 8 GPUs, not 64
    with pytest.raises(ValueError, match="batch shards"):
        predict(run, MeshShape(8, 1, expert=8), 1000, DGX_H100, micro_batch=1, memory=False)


def test_candidates_take_the_models_mesh_rules():
    """Expert degrees that divide the experts; a mixture of experts in stages only without expert shards; a dense
    model has no expert shards."""
    run = run_on(MIXTRAL)
    meshes = scaling_plan.candidate_meshes(run, 64, DGX_H100, 1024, 1)
    assert {m.expert for m in meshes} == {1, 2, 4, 8} and {m.pipe for m in meshes} == {1, 2, 4, 8, 16, 32}
    assert all(m.expert == 1 for m in meshes if m.pipe > 1)
    assert all(m.pipe * m.data * m.expert * m.model == 64 for m in meshes)
    dense = scaling_plan.candidate_meshes(run_on(load_config("llama3_8b")), 64, DGX_H100, 1024, 1)
    assert {m.expert for m in dense} == {1} and {m.pipe for m in dense} > {1}


def test_cli_plans_mixtral_8x7b_on_64_h100s(capsys):
    """The issue's plan: every (data, expert, model) mesh of 64 H100s with its all-to-all time, a recommendation
    that fits, and flags train.py takes for 64 GPUs, at the config's micro-batch of 1 (the micro-batch search:
    ``test_scaling_model.test_cli_json_plans_one_mesh_and_searches_the_micro_batch``); dropless, a note names
    ``model.expert_room``, the bound on the receive buffer's worst case (none with a capacity)."""
    scaling_plan.main(["--config=mixtral_8x7b", "--gpus=64", "--cluster=dgx_h100", "--micro_batch=1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mixtral_8x7b: 46,702,792,704 parameters (12,879,925,248 active per token), 64 GPUs")
    assert "expert" in out[1] and "EP comm" in out[1]
    assert out[-3].startswith("recommendation: pipe=1 x data=") and " x expert=" in out[-3]
    assert sum(line.split()[2] == "8" for line in out[2:-3]) >= 1  # expert 8 meshes are listed
    assert out[-1].startswith("note: dropless") and "--config.model.expert_room=1.25" in out[-1]
    scaling_plan.main(["--config=mixtral_8x7b", "--gpus=64", "--cluster=dgx_h100", "--micro_batch=1",
                       "--config.model.capacity_factor=1.0"])
    assert "note:" not in capsys.readouterr().out
    flags = out[-2].split()
    assert flags[2].startswith("--config.mesh.expert=")
    check_config_overrides(["--config=mixtral_8x7b", *flags], "mixtral_8x7b")
    config = load_config("mixtral_8x7b")
    for flag in flags:
        path, value = flag[len("--config."):].split("=", 1)
        section, leaf = path.split(".")
        kind = type(config[section][leaf])
        config[section][leaf] = (value == "True") if kind is bool else kind(value)
    assert validate(config, 64).devices == 64


def test_deepseek_v3_on_deepseeks_cluster_states_its_gpu_hours(capsys):
    """DeepSeek-V3 on 2,048 H800s (``h800``: the report's NVLink 160 GB/s and InfiniBand 50 GB/s per GPU, the H100's
    compute and memory) at one mesh: the JSON's GPU-hours per trillion tokens are its step times the GPUs over the
    tokens of a step (15,360 sequences of 4,096), the figure DeepSeek reports as 180K (a prediction, not fitted)."""
    from megajax.tools.scaling_clusters import CLUSTERS, DGX_H100

    h800 = CLUSTERS["h800"]
    assert (h800.intra_bandwidth, h800.inter_bandwidth) == (160e9, 50e9)
    assert (h800.peak_flops, h800.fp8_peak_flops, h800.hbm_bytes) == (DGX_H100.peak_flops, DGX_H100.fp8_peak_flops,
                                                                     DGX_H100.hbm_bytes)
    scaling_plan.main(["--config=deepseek_v3", "--gpus=2048", "--cluster=h800", "--mesh=64x2,expert=16",
                       "--micro_batch=1", "--json"])
    plan = json.loads(capsys.readouterr().out.splitlines()[-1])
    tokens = 15360 * 4096
    assert plan["gpu_hours_per_trillion_tokens"] == pytest.approx(plan["step_s"] * 2048 / 3600 * 1e12 / tokens,
                                                                  rel=1e-4)


def test_routed_layer_by_hand():
    """Mixtral 8x7B on 8 expert shards, t = 2, save_dots (the grouped GEMMs are not dots it keeps): each GPU's one
    expert's three GEMMs over the 8 shards' n / 8 rows each, 4 times, and the dispatch's passes (7 of R x h, 9 of
    n x h, 2.5 of R x 2F/t forward; backward twice; recomputed once) at HBM bandwidth, R = e n / 2 the ragged
    exchange's receive room (a token sends one expert's shard one row at most); with ``expert_room`` 1.25, R =
    1.25 n. In fp8 the kernel's GEMMs at the FP8 peak plus their scaling passes; ``expert_gemm=xla`` as bf16."""
    run, c = with_choices(run_on(MIXTRAL), remat="save_dots"), DGX_H100
    n, h, f, e = 2 * 4096 * 2, 4096, 14336 // 2, 8
    gemms = [(1, n, h, f), (1, n, h, f), (1, n, f, h)]  # one expert: 8 shards' n k / E rows each
    for room, rows in ((0.0, e * n // 2), (1.25, 1.25 * n)):
        passes = 7 * rows * h + 9 * n * h + 2.5 * rows * 2 * f
        hand = 4 * sum(scaling.gemm_s(*g, c) for g in gemms) + 4 * 2 * passes / c.hbm_bandwidth
        bounded = dataclasses.replace(run, model=dataclasses.replace(run.model, expert_room=room))
        assert scaling_experts.routed_layer_s(bounded, 2, 2, e, c) == pytest.approx(hand, rel=1e-12)
        # fp8: the kernel's GEMMs at the FP8 peak with their operands' amax and cast passes (twice: recomputed);
        # XLA's ragged_dot (expert_gemm=xla) stays bf16
        fp8 = dataclasses.replace(bounded, model=dataclasses.replace(bounded.model, fp8=True))
        hand8 = (4 * sum(scaling.gemm_s(*g, c, fp8=True) for g in gemms) + 4 * 2 * passes / c.hbm_bandwidth
                 + sum(scaling.fp8_scaling_s(*g[1:], c, forwards=2) for g in gemms))
        assert scaling_experts.routed_layer_s(fp8, 2, 2, e, c) == pytest.approx(hand8, rel=1e-12)
        assert hand8 < hand
        xla = dataclasses.replace(fp8, model=dataclasses.replace(fp8.model, expert_gemm="xla"))
        assert scaling_experts.routed_layer_s(xla, 2, 2, e, c) == pytest.approx(hand, rel=1e-12)
    assert scaling_experts.routed_layer_s(run_on(load_config("llama3_8b")), 2, 2, 1, c) == 0.0


def test_cli_plans_a_mixture_in_stages_without_expert_shards(capsys):
    """A mixture of experts in pipeline stages: every schedule (1F1B too, its balancing loss each microbatch's)
    with the experts split over model, not over expert shards (``MoEConfig.check_mesh``)."""
    scaling_plan.main(["--config=mixtral_8x7b", "--gpus=64", "--cluster=dgx_h100", "--pipe=2", "--micro_batch=0"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["2"]]
    assert rows and all(r[2] == "1" for r in rows), out
    # interleaved 1F1B is fastest but needs 99 GiB a GPU: plain 1F1B is the recommendation within JAX's 60 GiB
    assert [(r[3], r[-1]) for r in rows[-2:]] == [("intl2", "NO"), ("1f1b", "yes")], out
    assert "pipeline_schedule=1f1b" in out and "pipeline_repeats=1" in out, out
    assert "recommendation: pipe=2 x data=" in out and "x expert=1 x" in out


def test_cli_refusals_say_what_to_change(capsys):
    """A GPU count no (data, expert, model) mesh divides: one error line, naming the cause."""
    with pytest.raises(SystemExit, match=r"no \(data, expert, model\) mesh of 12 GPUs divides the model \(its "
                                         r"layers, heads, experts\) and the global batch of 1024"):
        scaling_plan.main(["--config=mixtral_8x7b", "--gpus=12", "--cluster=dgx_h100"])


def test_dense_layers_among_the_routed_ones_are_timed_as_their_own_stack():
    """A mixture with every other layer dense (Qwen3-MoE's ``decoder_sparse_step=2``): the scaling model reads its two
    stacks apart (the routed layers with their router and experts, the dense ones with Llama's SwiGLU), and their
    GEMMs add up to the spec's FLOPs (it refused such a model while it timed one stack of alike layers); the plan
    is finite and its memory the planner's state plus activations."""
    config = load_config("mixtral_tiny")
    config.model.decoder_sparse_step = 2
    run = run_on(config)
    m, stacks = run.model, scaling_layout.layout(run, 1).stacks
    assert [(st.count, st.routed) for st in stacks] == [(m.num_layers // 2, True), (m.num_layers // 2, False)]
    per_gpu = 0.0
    for i, st in enumerate(stacks):
        dense, attention, logits = scaling.gemms(run, 1, 8, i)
        routed = scaling_experts.routed_gemms(run, 1, 8, 1) if st.routed else []
        per_gpu += 3 * st.count * sum(2 * math.prod(g) for g in dense + attention + routed)
    per_gpu += 3 * 2 * math.prod(logits)
    assert per_gpu == pytest.approx(run.model_spec.flops(m, 8, m.max_seq_len), rel=1e-12)
    prediction = scaling.predict(run, MeshShape(2, 1, expert=2), 16, DGX_H100, micro_batch=2)
    assert 0 < prediction.step_s < math.inf and 0 < prediction.memory_bytes
