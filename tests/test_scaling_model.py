"""The scaling model reproduces the paper's published scaling figures, and its parts are the hand formulas and
megajax's own counts (pure Python: nothing compiles)."""

import dataclasses
import math

import pytest

from megajax.cli import load_config
from megajax.config import model_config
from megajax.models import model_spec
from megajax.models.spec import transformer_flops
from megajax.tools import scaling
from megajax.tools.scaling import DGX2H_V100, PAPER_MODELS, Decoder, predict, recommend_mesh

# Shoeybi et al. 2019 (Megatron-LM), as published.
PUBLISHED = {
    "baseline TFLOP/s": {1: 39.0},  # Section 5.1.1: 1.2B on 1 V100, "30% of the theoretical peak"
    "figure 5 model": {1: 100, 2: 95, 4: 82, 8: 77},  # Figure 5, model parallel weak scaling (%)
    "figure 5 model+data": {64: 96, 128: 83, 256: 79, 512: 74},  # Figure 5, model + 64-way data parallel (%)
    "table 7": {16: 82, 24: 80, 32: 77},  # Table 7: 8.3B, 8-way model parallel, by attention heads (%)
    "table 8": {1: 1.0, 2: 1.64, 4: 2.34, 8: 2.98},  # Table 8: 1.2B strong scaling, batch 8 (speedup)
    "abstract": {512: 76},  # Abstract / Section 1: 15.1 PFLOP/s on 512 GPUs = 76% of the 1-GPU baseline
}
# The three calibration constants of DGX2H_V100 were fitted to three of these figures (gemm_efficiency to the 1-GPU
# baseline, layer_overhead_s to Table 8's strong scaling, dp_overlap to Figure 5's model + data curve); the other
# three were not used to set anything and are held out. Tolerance, for both kinds: 8 percentage points for
# efficiencies, 3% for speedups and TFLOP/s (what the README claims). Figure 5's values are read off a bar chart
# (about +-1 point).
FITTED = ("baseline TFLOP/s", "table 8", "figure 5 model+data")
HELD_OUT = ("figure 5 model", "table 7", "abstract")
POINTS = 8.0
RELATIVE = 0.03


@pytest.fixture(scope="module")
def predicted():
    return scaling.paper_predictions(DGX2H_V100)


@pytest.mark.parametrize("figure", FITTED + HELD_OUT)
def test_paper_figure_within_tolerance(predicted, figure):
    for x, published in PUBLISHED[figure].items():
        got = predicted[figure][x]
        if figure in ("table 8", "baseline TFLOP/s"):
            assert abs(got / published - 1) <= RELATIVE, (figure, x, got, published)
        else:
            assert abs(got - published) <= POINTS, (figure, x, got, published)


def test_trends_have_the_papers_sign(predicted):
    """Beyond the tolerance: efficiency falls with model-parallel size and with heads, speedup rises with GPUs."""
    mp, heads, speed = predicted["figure 5 model"], predicted["table 7"], predicted["table 8"]
    assert mp[1] > mp[2] > mp[4] > mp[8]
    assert heads[16] > heads[24] > heads[32]
    assert speed[1] < speed[2] < speed[4] < speed[8]
    assert all(predicted["figure 5 model+data"][64 * t] < mp[t] for t in (1, 2, 4, 8))  # gradients cost


def test_ring_allreduce_by_hand():
    # 8 GPUs, 100 MB, 150 GB/s, 2 us per step: 2 * 7/8 * 1e8 / 150e9 s + 14 steps * 2 us
    assert scaling.ring_allreduce_s(1e8, 8, 150e9, 2e-6) == pytest.approx(1.75e8 / 150e9 + 28e-6, rel=1e-12)
    assert scaling.ring_allreduce_s(1e8, 1, 150e9, 2e-6) == 0.0


def test_tensor_parallel_time_is_megatrons_all_reduces():
    model = dataclasses.replace(PAPER_MODELS["1.2B"], remat="none")
    b, t, c = 8, 4, DGX2H_V100
    message = b * model.seq * model.hidden * 2
    hand = (4 * model.layers + 2) * scaling.ring_allreduce_s(message, t, c.intra_bandwidth, c.intra_latency)
    hand += 3 * scaling.ring_allreduce_s(b * model.seq * 4, t, c.intra_bandwidth, c.intra_latency)  # the loss
    assert scaling.tensor_comm_s(model, t, b, c) == pytest.approx(hand, rel=1e-12)
    full = dataclasses.replace(model, remat="full")  # + L recomputed all-reduces (comm_budget)
    extra = model.layers * scaling.ring_allreduce_s(message, t, c.intra_bandwidth, c.intra_latency)
    assert scaling.tensor_comm_s(full, t, b, c) == pytest.approx(hand + extra, rel=1e-12)


def test_data_parallel_time_by_hand():
    model, c = PAPER_MODELS["8.3B"], DGX2H_V100
    grads = model.params(8)[1] * 2  # fp16; 64 x 8 on 16-GPU nodes: 2 of each data group per node, 32 nodes
    hand = scaling.ring_allreduce_s(grads, 2, c.intra_bandwidth, c.intra_latency)
    hand += scaling.ring_allreduce_s(grads / 2, 32, c.inter_bandwidth, c.inter_latency)
    assert scaling.data_comm_s(model, (64, 8), c, grad_bytes=2) == pytest.approx(hand, rel=1e-12)


@pytest.mark.parametrize("name,tensor", [("1.2B", 1), ("2.5B", 2), ("8.3B", 8)])
def test_flops_are_transformer_flops(name, tensor):
    model = PAPER_MODELS[name]
    want = transformer_flops(8, model.seq, model.layers, model.hidden, model.vocab)
    dense, attention, logits = scaling.gemms(model, tensor, 8)  # one GPU's forward GEMMs, (batch, m, k, n) each
    gemm_flops = 3 * (sum(2 * math.prod(g) for g in dense + attention) * model.layers + 2 * math.prod(logits))
    assert gemm_flops * tensor == pytest.approx(want, rel=1e-12)  # the GEMM shapes
    p = predict(model, (2, tensor), 16, DGX2H_V100, memory=False)
    assert p.tflops_per_gpu * 1e12 * p.step_s * 2 * tensor == pytest.approx(2 * want, rel=1e-12)
    assert p.mfu == pytest.approx(p.tflops_per_gpu * 1e12 / DGX2H_V100.peak_flops)


@pytest.mark.parametrize("name,tensor", [("llama3_8b", 8), ("llama3p2_1b", 4)])
def test_llama_flops_are_its_specs(name, tensor):
    """Llama's GEMMs (query and key/value with 8 key/value heads, SwiGLU's gate, up and down, the untied or tied
    output layer) add up to the spec's model FLOPs, the metrics' MFU numerator."""
    config = load_config(name)
    model = Decoder.from_config(config)
    want = model_spec(config.model.name).flops(model_config(config), 8, model.seq)
    assert model.flops(8) == pytest.approx(want, rel=1e-12)
    dense, attention, logits = scaling.gemms(model, tensor, 8)
    gemm_flops = 3 * (sum(2 * math.prod(g) for g in dense + attention) * model.layers + 2 * math.prod(logits))
    assert gemm_flops * tensor == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name,tensor", [("gpt_tiny", 2), ("gpt_8p3b", 8), ("llama3_8b", 8), ("llama3p2_1b", 4),
                                         ("llama_tiny", 4)])
def test_parameters_and_memory_match_info(name, tensor):
    """GPT-2's shape, and Llama's (untied, tied, and llama_tiny's 2 key/value heads whole on each of 4 shards)."""
    from megajax.tools.memory_planner import memory_report, params_per_device

    config = load_config(name)
    model = Decoder.from_config(config)
    assert model.params(tensor) == params_per_device(config, {"data": 1, "model": tensor})
    # The state from scaling's own parameter formula against the planner's, which counts the abstract model's
    # parameters through the sharding rules (the activations are the planner's own formula in both, held against
    # XLA's compiled plan by tests/test_memory_planner.py).
    report = memory_report(config, 2, tensor, micro_batch=2)
    assert scaling.state_bytes(model, tensor, data=2) == report.param_bytes + report.grad_bytes + report.optimizer_bytes
    config.parallel.update(sequence=True, shard_optimizer=True)  # the planner's choices, counted as info does
    chosen = Decoder.from_config(config)
    assert chosen.sequence and chosen.shard_optimizer
    report = memory_report(config, 2, tensor, micro_batch=2)
    assert scaling.state_bytes(chosen, tensor, data=2) == report.param_bytes + report.grad_bytes + \
        report.optimizer_bytes


def test_one_gpu_has_no_communication():
    p = predict(PAPER_MODELS["1.2B"], (1, 1), 8, DGX2H_V100, memory=False)
    assert p.tensor_comm_s == 0 and p.data_comm_s == 0
    assert p.step_s == pytest.approx(p.compute_s) and p.efficiency == pytest.approx(1.0)


def test_recommend_mesh_skips_indivisible_meshes():
    model = PAPER_MODELS["2.5B"]  # 20 heads: 8- and 16-way cannot hold whole heads
    best, table = recommend_mesh(model, 16, DGX2H_V100, global_batch=16)
    assert sorted(p.mesh for p in table) == [(4, 4), (8, 2), (16, 1)]
    assert best in table and best.fits
    assert [p.step_s for p in table] == sorted(p.step_s for p in table)


def test_recommend_mesh_never_picks_a_mesh_that_does_not_fit():
    model = PAPER_MODELS["8.3B"]
    best, table = recommend_mesh(model, 512, DGX2H_V100, global_batch=512)
    assert best.mesh == (64, 8)  # the paper's choice; 128 x 4 is predicted faster but needs > 32 GiB
    assert any(not p.fits and p.step_s < best.step_s for p in table)
    assert all(p.memory_bytes > DGX2H_V100.hbm_bytes for p in table if not p.fits)
    small = dataclasses.replace(DGX2H_V100, hbm_bytes=4 * scaling.GiB)
    best, table = recommend_mesh(model, 512, small, global_batch=512)
    assert best is None and table and not any(p.fits for p in table)


def test_cli_prints_the_table_and_recommendation(capsys):
    scaling.main(["--config=gpt_8p3b", "--gpus=512", "--cluster=dgx2h", "--global_batch=512", "--keep_choices"])
    out = capsys.readouterr().out
    assert "recommendation: data=64 x model=8, remat=full, sequence parallelism off, state split over data: none" \
        in out
    assert "  64x8 " in out and "fits" in out and out.count("NO") >= 1
    scaling.main(["--config=gpt_8p3b", "--gpus=512", "--cluster=dgx2h", "--global_batch=512"])
    out = capsys.readouterr().out.splitlines()
    flags = out[-1].split()
    assert flags[:2] == ["--config.mesh.data=64", "--config.mesh.model=8"]
    assert "--config.parallel.sequence=True" in flags  # printed as train.py takes them


def test_planner_turns_on_what_makes_a_model_fit_and_nothing_slower():
    """gpt_8p3b on 512 V100s: with the config's full recomputation 64 x 8 fits at 2.3 s; choosing, the planner
    keeps less (save_dots) and splits the LayerNorm / dropout activations (sequence parallelism) to fit in 32 GiB
    and run faster. With HBM to spare nothing is recomputed or sharded; with too little for any plain mesh ZeRO-1
    is what fits."""
    model = PAPER_MODELS["8.3B"]
    kept, _ = recommend_mesh(model, 512, DGX2H_V100, global_batch=512)
    best, table = recommend_mesh(model, 512, DGX2H_V100, global_batch=512, choose=True)
    assert best.fits and best.step_s < kept.step_s and best.model.remat != "full" and best.model.sequence
    for p in table:  # each row: the fastest of its mesh's choices that fits, else the one that needs least memory
        options = [predict(m, p.mesh, 512, DGX2H_V100) for m in scaling.variants(model, p.mesh, True)]
        assert len(options) == 4 * (1 + (p.mesh[1] > 1)) * 3
        fitting = [o for o in options if o.fits]
        if fitting:
            assert p.fits and p.step_s == min(o.step_s for o in fitting)
        else:
            assert not p.fits and p.memory_bytes == min(o.memory_bytes for o in options)
    roomy = dataclasses.replace(DGX2H_V100, hbm_bytes=1024 * scaling.GiB)
    best, _ = recommend_mesh(model, 512, roomy, global_batch=512, choose=True)
    assert (best.model.remat, best.model.shard_optimizer, best.model.fsdp) == ("none", False, False)
    small = PAPER_MODELS["1.2B"]
    tight = dataclasses.replace(DGX2H_V100, hbm_bytes=4 * scaling.GiB)
    assert recommend_mesh(small, 16, tight, global_batch=16)[0] is None  # no plain mesh fits in 4 GiB
    best, _ = recommend_mesh(small, 16, tight, global_batch=16, choose=True)
    assert best is not None and best.model.shard_optimizer
    # In 2.5 GiB only 16-way model parallelism fits without FSDP (2.59 GiB at best on 2 x 8); FSDP fits every
    # data-parallel mesh in ~2 GiB and is faster than 1 x 16.
    tighter = dataclasses.replace(DGX2H_V100, hbm_bytes=int(2.5 * scaling.GiB))
    best, table = recommend_mesh(small, 16, tighter, global_batch=16, choose=True)
    assert best.model.fsdp and best.mesh[0] > 1
    assert [p.mesh for p in table if p.fits and not p.model.fsdp] == [(1, 16)]


def test_zero1_and_sequence_parallel_costs_by_hand():
    """ZeRO-1 adds half a ring all-reduce of the fp32 parameters over `data` and saves 8 (d-1)/d bytes per local
    parameter; sequence parallelism takes the replicated element-wise passes down by t and changes nothing at t=1."""
    model = PAPER_MODELS["1.2B"]
    zero = dataclasses.replace(model, shard_optimizer=True)
    local = model.params(2)[1]
    gather = scaling.gather_params_s(zero, (4, 2), DGX2H_V100)  # 4 x 2 fits in one 16-GPU node
    assert gather == pytest.approx(scaling.ring_allreduce_s(4 * local, 4, DGX2H_V100.intra_bandwidth,
                                                            DGX2H_V100.intra_latency) / 2)
    assert scaling.gather_params_s(model, (4, 2), DGX2H_V100) == 0
    assert predict(zero, (4, 2), 8, DGX2H_V100).step_s == pytest.approx(
        predict(model, (4, 2), 8, DGX2H_V100).step_s + gather)
    saved = scaling.memory_bytes(model, 2, 1, data=4) - scaling.memory_bytes(zero, 2, 1, data=4)
    assert saved == 8 * local - 8 * local // 4
    sp = dataclasses.replace(model, sequence=True)
    tokens, h = 8 * model.seq, model.hidden
    fwd, bwd = scaling.REPLICATED_PASSES
    passes = tokens * h * (1 - 1 / 2) * (2 * fwd + bwd)  # remat=full reruns the forward's element-wise work
    assert scaling.compute_s(model, 2, 8, DGX2H_V100) - scaling.compute_s(sp, 2, 8, DGX2H_V100) == pytest.approx(
        model.layers * scaling.HALF * passes / DGX2H_V100.hbm_bandwidth)
    assert scaling.compute_s(sp, 1, 8, DGX2H_V100) == scaling.compute_s(model, 1, 8, DGX2H_V100)
    assert scaling.memory_bytes(sp, 2, 8) < scaling.memory_bytes(model, 2, 8)


def test_fsdp_costs_by_hand():
    """FSDP halves the gradients' exposed reduction (a reduce-scatter), adds two all-gathers of the fp32 parameters
    (forward and backward, not overlapped) and keeps 16/d bytes per local parameter."""
    model = PAPER_MODELS["1.2B"]
    fsdp = dataclasses.replace(model, shard_optimizer=True, fsdp=True)
    local, mesh = model.params(2)[1], (4, 2)
    ring = scaling.ring_allreduce_s(4 * local, 4, DGX2H_V100.intra_bandwidth, DGX2H_V100.intra_latency)
    assert scaling.gather_params_s(fsdp, mesh, DGX2H_V100) == pytest.approx(ring)  # two halves
    grads = (1 - DGX2H_V100.dp_overlap) * scaling.data_comm_s(model, mesh, DGX2H_V100)
    assert predict(fsdp, mesh, 8, DGX2H_V100).data_comm_s == pytest.approx(grads / 2 + ring)
    assert scaling.memory_bytes(model, 2, 1, data=4) - scaling.memory_bytes(fsdp, 2, 1, data=4) == \
        16 * local - 16 * (local // 4)
    assert "--config.parallel.fsdp=True" in fsdp.flags()


def test_larger_model_parallel_means_less_memory():
    model = PAPER_MODELS["8.3B"]
    mem = [scaling.memory_bytes(model, t, 8) for t in (1, 2, 4, 8)]
    assert mem == sorted(mem, reverse=True)
    assert math.isclose(model.params(8)[0], 8.3e9, rel_tol=0.01)
