"""The scaling model reproduces Megatron-LM's published scaling figures (2019) and PTD-P's Table 1 (2021), and its
parts are the hand formulas and megajax's own counts: the pipeline's ticks against a simulated schedule, its stages'
parameters and memory against the memory planner (pure Python: nothing compiles)."""

import dataclasses
import inspect
import json
import math

import pytest
from conftest import run_on

from megajax.cli import check_config_overrides, load_config
from megajax.config import validate
from megajax.models.spec import BLOCK_PASSES, EAGER, transformer_flops
from megajax.parallel import pipeline as megajax_pipeline
from megajax.parallel.mesh import MeshShape
from megajax.tools import scaling, scaling_layout, scaling_papers, scaling_pipeline, scaling_plan
from megajax.tools.scaling import DGX2H_V100, DGX_A100, predict
from megajax.tools.scaling_layout import with_choices
from megajax.tools.scaling_papers import PAPER_MODELS, PTDP_FITTED, PTDP_TABLE1, gpt_model
from megajax.tools.scaling_pipeline import Pipeline
from megajax.tools.scaling_plan import recommend_mesh

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
    return scaling_papers.paper_predictions(DGX2H_V100)


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
    model = with_choices(PAPER_MODELS["1.2B"], remat="none")
    m, b, t, c = model.model, 8, 4, DGX2H_V100
    message = b * m.max_seq_len * m.hidden_size * 2
    hand = (4 * m.num_layers + 2) * scaling.ring_allreduce_s(message, t, c.intra_bandwidth, c.intra_latency)
    hand += 3 * scaling.ring_allreduce_s(b * m.max_seq_len * 4, t, c.intra_bandwidth, c.intra_latency)  # the loss
    assert scaling.tensor_comm_s(model, t, b, c) == pytest.approx(hand, rel=1e-12)
    full = with_choices(model, remat="full")  # + L recomputed all-reduces (comm_budget)
    extra = m.num_layers * scaling.ring_allreduce_s(message, t, c.intra_bandwidth, c.intra_latency)
    assert scaling.tensor_comm_s(full, t, b, c) == pytest.approx(hand + extra, rel=1e-12)


def test_data_parallel_time_by_hand():
    model, c = PAPER_MODELS["8.3B"], DGX2H_V100
    # fp16; 64 x 8 on 16-GPU nodes: 2 of each data group per node, 32 nodes
    grads = scaling_layout.parameters_per_gpu(model, 8)[1] * 2
    hand = scaling.ring_allreduce_s(grads, 2, c.intra_bandwidth, c.intra_latency)
    hand += scaling.ring_allreduce_s(grads / 2, 32, c.inter_bandwidth, c.inter_latency)
    assert scaling.data_comm_s(model, (64, 8), c, grad_bytes=2) == pytest.approx(hand, rel=1e-12)


@pytest.mark.parametrize("name,tensor", [("1.2B", 1), ("2.5B", 2), ("8.3B", 8)])
def test_flops_are_transformer_flops(name, tensor):
    model = PAPER_MODELS[name]
    m = model.model
    want = transformer_flops(8, m.max_seq_len, m.num_layers, m.hidden_size, m.padded_vocab_size)
    dense, attention, logits = scaling.gemms(model, tensor, 8)  # one GPU's forward GEMMs, (batch, m, k, n) each
    gemm_flops = 3 * (sum(2 * math.prod(g) for g in dense + attention) * m.num_layers + 2 * math.prod(logits))
    assert gemm_flops * tensor == pytest.approx(want, rel=1e-12)  # the GEMM shapes
    p = predict(model, MeshShape(2, tensor), 16, DGX2H_V100, memory=False)
    assert p.tflops_per_gpu * 1e12 * p.step_s * 2 * tensor == pytest.approx(2 * want, rel=1e-12)
    assert p.mfu == pytest.approx(p.tflops_per_gpu * 1e12 / DGX2H_V100.peak_flops)


@pytest.mark.parametrize("name,tensor", [("llama3_8b", 8), ("llama3p2_1b", 4)])
def test_llama_flops_are_its_specs(name, tensor):
    """Llama's GEMMs (query and key/value with 8 key/value heads, SwiGLU's gate, up and down, the untied or tied
    output layer) add up to the spec's model FLOPs, the metrics' MFU numerator."""
    model = run_on(load_config(name))
    want = model.model_spec.flops(model.model, 8, model.model.max_seq_len)
    assert scaling.flops(model, 8) == pytest.approx(want, rel=1e-12)
    dense, attention, logits = scaling.gemms(model, tensor, 8)
    gemm_flops = 3 * (sum(2 * math.prod(g) for g in dense + attention) * model.model.num_layers +
                      2 * math.prod(logits))
    assert gemm_flops * tensor == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name,tensor", [("gpt_tiny", 2), ("gpt_8p3b", 8), ("llama3_8b", 8), ("llama3p2_1b", 4),
                                         ("llama_tiny", 4)])
def test_parameters_and_memory_match_info(name, tensor):
    """GPT-2's shape, and Llama's (untied, tied, and llama_tiny's 2 key/value heads whole on each of 4 shards)."""
    from megajax.tools.memory_planner import memory_report
    from megajax.tools.memory_terms import params_per_device

    config = load_config(name)
    assert scaling_layout.parameters_per_gpu(run_on(config), tensor) == params_per_device(run_on(config, 1, tensor))
    # The state from the scaling model's parameters (the abstract model's, cached per tensor degree) against the
    # planner's report, which counts them through the sharding rules (the activations are the planner's own
    # formula in both, held against XLA's compiled plan by tests/test_memory_planner.py).
    report = memory_report(run_on(config, 2, tensor), micro_batch=2)
    assert scaling.state_bytes(run_on(config), tensor, data=2) == report.param_bytes + report.grad_bytes + \
        report.optimizer_bytes
    config.parallel.update(sequence=True, shard_optimizer=True)  # the planner's choices, counted as info does
    assert scaling_layout.choices(run_on(config))[1:3] == (True, True)
    report = memory_report(run_on(config, 2, tensor), micro_batch=2)
    assert scaling.state_bytes(run_on(config), tensor, data=2) == report.param_bytes + report.grad_bytes + \
        report.optimizer_bytes


def test_one_gpu_has_no_communication():
    p = predict(PAPER_MODELS["1.2B"], MeshShape(), 8, DGX2H_V100, memory=False)
    assert p.tensor_comm_s == 0 and p.data_comm_s == 0
    assert p.step_s == pytest.approx(p.compute_s) and p.efficiency == pytest.approx(1.0)


def test_recommend_mesh_skips_indivisible_meshes():
    model = PAPER_MODELS["2.5B"]  # 20 heads: 8- and 16-way cannot hold whole heads; 54 layers: 2 stages, not 4
    best, table = recommend_mesh(model, 16, DGX2H_V100, global_batch=16)
    assert sorted((p.mesh.pipe, p.mesh.data, p.mesh.model) for p in table) == [(1, 4, 4), (1, 8, 2), (1, 16, 1),
                                                                               (2, 2, 4), (2, 4, 2), (2, 8, 1)]
    assert best in table and best.fits
    assert [p.step_s for p in table] == sorted(p.step_s for p in table)


def test_recommend_mesh_never_picks_a_mesh_that_does_not_fit():
    """Among the paper's (data, model) meshes (pipe=1) it picks the paper's; with stages it predicts 4 x 64 x 2
    (circular) faster still, at the config's choices (megajax's pipeline; the paper had none); at 4 GiB per GPU only
    1F1B (plain or interleaved) fits, at 1/4 GiB nothing."""
    model = PAPER_MODELS["8.3B"]
    best, table = recommend_mesh(model, 512, DGX2H_V100, global_batch=512, pipe=1)
    assert best.mesh == MeshShape(64, 8)  # the paper's choice; 128 x 4 is faster, > 32 GiB
    assert any(not p.fits and p.step_s < best.step_s for p in table)
    assert all(p.memory_bytes > DGX2H_V100.hbm_bytes for p in table if not p.fits)
    best, table = recommend_mesh(model, 512, DGX2H_V100, global_batch=512)
    assert best.mesh == MeshShape(64, 2, pipe=4) and best.pipeline.schedule == "circular"
    assert all(not p.fits for p in table if p.step_s < best.step_s)
    small = dataclasses.replace(DGX2H_V100, hbm_bytes=4 * scaling.GiB)  # only 1F1B's flat activations fit
    best, table = recommend_mesh(model, 512, small, global_batch=512)
    assert best.fits and best.pipeline.one_f_one_b  # (interleaved: v chunks of fewer layers held)
    assert not any(p.fits for p in table if not p.pipeline.one_f_one_b)
    tiny = dataclasses.replace(DGX2H_V100, hbm_bytes=scaling.GiB // 4)
    best, table = recommend_mesh(model, 512, tiny, global_batch=512)
    assert best is None and table and not any(p.fits for p in table)


def test_cli_prints_the_table_and_recommendation(capsys):
    scaling_plan.main(["--config=gpt_8p3b", "--gpus=512", "--cluster=dgx2h", "--global_batch=512", "--keep_choices",
                       "--pipe=1"])
    out = capsys.readouterr().out
    assert "recommendation: pipe=1 x data=64 x model=8, remat=full, sequence parallelism off, state split over " \
        "data: none" in out
    assert "  64x8 " in out and "fits" in out and out.count("NO") >= 1
    scaling_plan.main(["--config=gpt_8p3b", "--gpus=512", "--cluster=dgx2h", "--global_batch=512"])
    out = capsys.readouterr().out.splitlines()
    flags = out[-1].split()
    # the circular schedule on 4 stages, 0.1% ahead of 64 x 8 with sequence parallelism since every schedule's
    # stage boundary is scattered (1.841 s against 1.843 s)
    assert flags[:3] == ["--config.mesh.pipe=4", "--config.mesh.data=64", "--config.mesh.model=2"]
    assert "--config.parallel.pipeline_schedule=circular" in flags  # printed as train.py takes them
    config = load_config("gpt_8p3b")
    check_config_overrides(["--config=gpt_8p3b", *flags], "gpt_8p3b")
    _apply(config, flags)
    assert validate(config, 512) == MeshShape(64, 2, pipe=4)


def test_cli_json_plans_one_mesh_and_searches_the_micro_batch(capsys):
    """``--mesh`` plans that one mesh and ``--json``'s last line is the plan: the numbers ``predict`` gives for the
    choices it names (Llama 3.2 1B, global batch 64, on 4 x 2 H100s). Without ``--micro_batch`` the search takes the
    fastest micro-batch that fits: each one planned alone is no faster. A mesh that cannot run is one error line."""
    base = ["--config=llama3p2_1b", "--cluster=dgx_h100", "--global_batch=64", "--mesh=4x2", "--json"]

    def plan(*extra: str) -> tuple[dict, list[str]]:
        scaling_plan.main([*base, *extra])
        out = capsys.readouterr().out.splitlines()
        return json.loads(out[-1]), out

    searched, out = plan()
    rows = [line for line in out if line.split()[:2] == ["1", "4x2"]]
    assert len(rows) == 1 and searched["mesh"] == "4x2" and searched["fits"]
    run = with_choices(run_on(load_config("llama3p2_1b")), remat=searched["remat"],
                       sequence=searched["sequence_parallel"], shard_optimizer=searched["state_split"] != "none",
                       fsdp=searched["state_split"] == "FSDP")
    want = predict(run, MeshShape(4, 2), 64, scaling.DGX_H100, searched["micro_batch"])
    assert searched["accumulation_steps"] == want.num_micro == 16 // searched["micro_batch"]
    assert searched["step_s"] == pytest.approx(want.step_s, abs=1e-5)
    assert searched["mfu"] == pytest.approx(want.mfu, abs=1e-4)
    assert searched["model_tflops_per_gpu"] == pytest.approx(want.tflops_per_gpu, abs=0.01)
    assert searched["peak_gib"] == pytest.approx(want.memory_bytes / scaling.GiB, abs=1e-3)
    assert searched["flags"].split()[:3] == ["--config.mesh.pipe=1", "--config.mesh.data=4", "--config.mesh.model=2"]
    fixed = {m: plan(f"--micro_batch={m}")[0] for m in scaling_plan.micro_batches(16)}  # 16 rows per data shard
    assert sorted(fixed) == [1, 2, 4, 8, 16] and fixed[searched["micro_batch"]] == searched
    assert all(searched["step_s"] <= p["step_s"] for p in fixed.values() if p["fits"])
    for flags, message in ((["--gpus=16"], "--mesh=4x2 spans 8 GPUs, not --gpus=16"),
                           (["--pipe=2"], "--mesh=4x2 gives the stages and context shards: drop --pipe"),
                           (["--global_batch=6"], "--mesh=4x2 does not place llama3p2_1b with a global batch of 6"),
                           (["--global_batch=0"], "--global_batch=0: give the sequences per step (>= 1)"),
                           (["--micro_batch=-1"], "--micro_batch=-1: give the sequences per accumulation step")):
        with pytest.raises(SystemExit) as exit_:
            scaling_plan.main([*base, *flags])
        said = f"{exit_.value.code} {capsys.readouterr().err}"
        assert message in said, said


def test_planner_turns_on_what_makes_a_model_fit_and_nothing_slower():
    """gpt_8p3b on 512 V100s: with the config's full recomputation 64 x 8 fits at 2.3 s; choosing, the planner
    keeps less (save_dots) and splits the LayerNorm / dropout activations (sequence parallelism) to fit in 32 GiB
    and run faster. With HBM to spare nothing is recomputed or sharded; with too little for any plain mesh ZeRO-1
    is what fits."""
    model = PAPER_MODELS["8.3B"]
    kept, _ = recommend_mesh(model, 512, DGX2H_V100, global_batch=512)
    best, table = recommend_mesh(model, 512, DGX2H_V100, global_batch=512, choose=True)
    assert best.fits and best.step_s < kept.step_s and best.run.model.remat != "full" and \
        best.run.sequence
    for p in table:  # each row: the fastest of its mesh's choices that fits, else the one that needs least memory
        stages = p.pipeline.stages
        options = [predict(m, p.mesh, 512, DGX2H_V100, pipeline=pl)
                   for pl in scaling_plan.pipelines(model, stages, 512 // p.mesh.data)
                   for m in scaling_plan.variants(model, p.mesh, True)]
        choices = len(scaling_plan.pipelines(model, stages, 512 // p.mesh.data))
        # with stages: remat none / selective / full (save_dots is full's there), no SP or FSDP
        assert len(options) == choices * (4 * (1 + (p.mesh.model > 1)) * 3 if stages == 1 else
                                          3 * (1 + (p.mesh.data > 1)))
        fitting = [o for o in options if o.fits]
        if fitting:
            assert p.fits and p.step_s == min(o.step_s for o in fitting)
        else:
            assert not p.fits and p.memory_bytes == min(o.memory_bytes for o in options)
    roomy = dataclasses.replace(DGX2H_V100, hbm_bytes=1024 * scaling.GiB)
    best, _ = recommend_mesh(model, 512, roomy, global_batch=512, choose=True)
    assert (best.run.model.remat, best.run.shard_optimizer, best.run.fsdp) == ("none", False, False)
    small = PAPER_MODELS["1.2B"]
    tight = dataclasses.replace(DGX2H_V100, hbm_bytes=4 * scaling.GiB)
    assert recommend_mesh(small, 16, tight, global_batch=16, pipe=1)[0] is None  # no plain (data, model) mesh fits
    best, _ = recommend_mesh(small, 16, tight, global_batch=16, choose=True, pipe=1)
    assert best is not None and best.run.shard_optimizer
    staged, _ = recommend_mesh(small, 16, tight, global_batch=16)  # with stages, a plain one fits: each holds 1/p
    assert staged.pipeline.stages > 1 and not staged.run.shard_optimizer
    # In 2.5 GiB only 16-way model parallelism fits without FSDP (2.59 GiB at best on 2 x 8); FSDP fits every
    # data-parallel mesh in ~2 GiB and is faster than 1 x 16.
    tighter = dataclasses.replace(DGX2H_V100, hbm_bytes=int(2.5 * scaling.GiB))
    best, table = recommend_mesh(small, 16, tighter, global_batch=16, choose=True, pipe=1)
    assert best.run.fsdp and best.mesh.data > 1
    assert [p.mesh for p in table if p.fits and not p.run.fsdp] == [MeshShape(1, 16)]


def test_zero1_and_sequence_parallel_costs_by_hand():
    """ZeRO-1 adds half a ring all-reduce of the fp32 parameters over `data` and saves 8 (d-1)/d bytes per local
    parameter; sequence parallelism takes the replicated element-wise passes down by t and changes nothing at t=1."""
    model = PAPER_MODELS["1.2B"]
    zero = with_choices(model, shard_optimizer=True)
    local = scaling_layout.parameters_per_gpu(model, 2)[1]
    gather = scaling.gather_params_s(zero, (4, 2), DGX2H_V100)  # 4 x 2 fits in one 16-GPU node
    assert gather == pytest.approx(scaling.ring_allreduce_s(4 * local, 4, DGX2H_V100.intra_bandwidth,
                                                            DGX2H_V100.intra_latency) / 2)
    assert scaling.gather_params_s(model, (4, 2), DGX2H_V100) == 0
    assert predict(zero, MeshShape(4, 2), 8, DGX2H_V100).step_s == pytest.approx(
        predict(model, MeshShape(4, 2), 8, DGX2H_V100).step_s + gather)
    saved = scaling.memory_bytes(model, MeshShape(4, 2), 1) - scaling.memory_bytes(zero, MeshShape(4, 2), 1)
    assert saved == 8 * local - 8 * local // 4
    sp = with_choices(model, sequence=True)
    tokens, h = 8 * model.model.max_seq_len, model.model.hidden_size
    fwd, bwd = BLOCK_PASSES.eager[0]
    passes = tokens * h * (1 - 1 / 2) * (2 * fwd + bwd)  # remat=full reruns the forward's element-wise work
    assert scaling.compute_s(model, 2, 8, DGX2H_V100) - scaling.compute_s(sp, 2, 8, DGX2H_V100) == pytest.approx(
        model.model.num_layers * scaling.HALF * passes / DGX2H_V100.hbm_bandwidth)
    assert scaling.compute_s(sp, 1, 8, DGX2H_V100) == scaling.compute_s(model, 1, 8, DGX2H_V100)
    assert scaling.memory_bytes(sp, MeshShape(1, 2), 8) < scaling.memory_bytes(model, MeshShape(1, 2), 8)


def test_fsdp_costs_by_hand():
    """FSDP halves the gradients' exposed reduction (a reduce-scatter), adds two all-gathers of the fp32 parameters
    (forward and backward, not overlapped) and keeps 16/d bytes per local parameter."""
    model = PAPER_MODELS["1.2B"]
    fsdp = with_choices(model, shard_optimizer=True, fsdp=True)
    local, mesh = scaling_layout.parameters_per_gpu(model, 2)[1], (4, 2)
    ring = scaling.ring_allreduce_s(4 * local, 4, DGX2H_V100.intra_bandwidth, DGX2H_V100.intra_latency)
    assert scaling.gather_params_s(fsdp, mesh, DGX2H_V100) == pytest.approx(ring)  # two halves
    grads = (1 - DGX2H_V100.dp_overlap) * scaling.data_comm_s(model, mesh, DGX2H_V100)
    assert predict(fsdp, MeshShape(*mesh), 8, DGX2H_V100).data_comm_s == pytest.approx(grads / 2 + ring)
    assert scaling.memory_bytes(model, MeshShape(4, 2), 1) - scaling.memory_bytes(fsdp, MeshShape(4, 2), 1) == \
        16 * local - 16 * (local // 4)
    assert "--config.parallel.fsdp=True" in scaling_layout.choice_flags(fsdp)


def test_larger_model_parallel_means_less_memory():
    model = PAPER_MODELS["8.3B"]
    mem = [scaling.memory_bytes(model, MeshShape(1, t), 8) for t in (1, 2, 4, 8)]
    assert mem == sorted(mem, reverse=True)
    assert math.isclose(scaling_layout.parameters_per_gpu(model, 8)[0], 8.3e9, rel_tol=0.01)


# --- pipeline parallelism -------------------------------------------------------------------------------------------


def simulated_ticks(stages: int, microbatches: int, repeats: int) -> tuple[int, int]:
    """(stage-ticks, idle stage-ticks) of the circular schedule (v = 1: GPipe), simulated: each tick every stage runs
    the oldest (round, microbatch) chunk that has reached it; a chunk moves one stage on per tick, the last stage's
    output back to stage 0 for the microbatch's next round. Counted independently of ``Pipeline.ticks``."""
    ready = {0: [(0, i) for i in range(microbatches)]}  # stage -> chunks waiting there
    arriving: list[tuple[int, int, tuple[int, int]]] = []  # (tick, stage, chunk)
    tick = busy = finished = 0
    while finished < microbatches:  # each microbatch leaves after its last round
        for when, stage, chunk in [a for a in arriving if a[0] == tick]:
            ready.setdefault(stage, []).append(chunk)
        arriving = [a for a in arriving if a[0] > tick]
        for stage in range(stages):
            if not ready.get(stage):
                continue
            ready[stage].sort()
            round_, micro = ready[stage].pop(0)
            busy += 1
            if stage + 1 < stages:
                arriving.append((tick + 1, stage + 1, (round_, micro)))
            elif round_ + 1 < repeats:
                arriving.append((tick + 1, 0, (round_ + 1, micro)))
            else:
                finished += 1
        tick += 1
    return stages * tick, stages * tick - busy


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
def test_bubble_is_the_simulated_schedules_idle_share(stages):
    """M v + p - 1 ticks (M >= p; (v - 1) p + M + p - 1 below), the idle share (p - 1) / (M v + p - 1); at M a
    multiple of p (what megajax's stages take) it is megajax.parallel.pipeline's own count."""
    for microbatches in range(1, 13):
        for repeats in (1, 2, 3):
            total, idle = simulated_ticks(stages, microbatches, repeats)
            schedule = Pipeline(stages, microbatches, repeats)
            assert schedule.ticks() * stages == total, (stages, microbatches, repeats)
            assert schedule.bubble() == pytest.approx(idle / total, abs=1e-12)
            if microbatches >= stages:
                assert schedule.bubble() == pytest.approx((stages - 1) / (microbatches * repeats + stages - 1))
        if microbatches % stages:  # megajax's stages each hold whole microbatches of their share: M = k p
            continue
        assert Pipeline(stages, microbatches).ticks() == megajax_pipeline.ticks(microbatches, stages)
        assert Pipeline(stages, microbatches).bubble() == pytest.approx(
            megajax_pipeline.bubble_fraction(microbatches, stages))
        if "num_repeats" in inspect.signature(megajax_pipeline.ticks).parameters:  # the circular schedule's count
            assert Pipeline(stages, microbatches, 3).ticks() == megajax_pipeline.ticks(microbatches, stages, 3)
    # Megatron-LM's interleaved bubble, (1/v)(p - 1)/m of the ideal time, is the same idle time
    schedule = Pipeline(stages, 4 * stages, 2, megatron=True)
    ideal = 4 * stages * 2
    assert (schedule.ticks() - ideal) / ideal == pytest.approx((stages - 1) / (4 * stages) / 2)


# DGX_H100 as it was before its constants were fitted (scaling_h100): the values below were taken with it
ASSUMED_H100 = dataclasses.replace(scaling.DGX_H100, software=EAGER, gemm_efficiency=0.75, layer_overhead_s=0.6e-3,
                                   dp_overlap=0.3, tp_overlap=0.0)


def test_pipe_one_predicts_what_it_did_before_stages():
    """With one stage every term is the step's without the pipe dimension (values from before it existed)."""
    before = [  # (model, mesh, batch, cluster, micro, choices) -> step, compute, TP, DP, TFLOP/s, memory
        (("8.3B", (64, 8), DGX2H_V100, None, dict(remat="full")),
         # memory 21859975168 until a dropout mask's random bits were counted (2026-11-28)
         (2.379230791419276, 1.683842587195276, 0.2227884736, 0.47259973062400007, 22.63168633499039, 22186500096)),
        # memory 1996811264 until the second gradient buffer of its 128 accumulation steps was counted (2026-11-30);
        # since 2026-12-01 megajax's step keeps each data replica's gradients apart through them: reduced once (the
        # parameters' all-gather once too), after the loop, not hidden (before: data 128 x 0.022123655423999994 s,
        # step 7.3311 s), both gradient buffers whole (before: 2150197760)
        (("1.2B", (4, 8), ASSUMED_H100, 1, dict(remat="save_dots", sequence=True, shard_optimizer=True)),
         (4.526959958737942, 3.6542677668446086, 0.8450376226133334, 0.027654569279999996, 29.031844870622592,
          3070516736)),
        # FSDP's traffic in each of its 128 accumulation steps since 2026-11-30 (before: data 0.04487941728 s, step
        # 77.56511060112138 s, 27.369476026199187 TFLOP/s), and their second gradient buffer (before: 33474829312)
        (("2.5B", (2, 2), DGX2H_V100, 2, dict(remat="none", shard_optimizer=True, fsdp=True)),
         (83.26479659568137, 75.94408497712138, 1.57614620672, 128 * 0.04487941728, 25.49596614491685, 35967830272)),
    ]
    for (name, mesh, cluster, micro, choices), want in before:
        model = with_choices(PAPER_MODELS[name], **choices)
        for pipeline in (None, Pipeline()):
            p = predict(model, MeshShape(*mesh), 512, cluster, micro, pipeline=pipeline)
            got = (p.step_s, p.compute_s, p.tensor_comm_s, p.data_comm_s, p.tflops_per_gpu, p.memory_bytes)
            assert got == pytest.approx(want, rel=1e-12) and p.pipe_comm_s == 0 and p.bubble == 0


def test_point_to_point_by_hand():
    """Megatron-LM, and megajax's every schedule, send 1/t over InfiniBand, then an NVLink all-gather; without model
    shards (or with sequence parallelism: already 1/t) the message itself. A stage boundary crosses nodes once pipe x
    data x model exceeds a node."""
    c, nbytes = DGX_A100, 2 * 2048 * 8192 * 2
    assert scaling.crosses_nodes(2, 1, 8, 8) and scaling.crosses_nodes(4, 2, 2, 8)  # 4 stages of 4: two per node
    assert not scaling.crosses_nodes(2, 1, 4, 8) and not scaling.crosses_nodes(2, 2, 2, 8)
    assert scaling.p2p_s(nbytes, 1, Pipeline(2, 4), True, c) == pytest.approx(nbytes / 25e9 + 5e-6)
    megatron = scaling.p2p_s(nbytes, 8, Pipeline(2, 4, megatron=True), True, c)
    assert megatron == pytest.approx(nbytes / 8 / 25e9 + 5e-6 + 7 / 8 * nbytes / 300e9 + 7 * 2e-6)
    for schedule in (Pipeline(2, 4), Pipeline(2, 4, 2), Pipeline(2, 4, one_f_one_b=True)):
        assert scaling.p2p_s(nbytes, 8, schedule, True, c) == megatron
    # in a step: two transfers (forward, backward) per tick, M v + p - 1 ticks
    model = gpt_model(8192, 48, 64, seq=2048, remat="full")
    pipeline = Pipeline(2, 8, 3, megatron=True)
    p = predict(model, MeshShape(4, 8, pipe=2), 4 * 16, c, None, 2, memory=False, pipeline=pipeline)
    embedding = scaling.ring_allreduce_s(2 * model.model.vocab_size * model.model.hidden_size / 8, 2, 25e9, 5e-6)
    assert p.pipe_comm_s == pytest.approx(pipeline.ticks() * 2 * megatron + embedding)


@pytest.mark.parametrize("name,pipe,tensor", [("gpt_tiny", 2, 2), ("llama_tiny", 2, 4), ("gpt_8p3b", 8, 8)])
def test_stage_parameters_are_the_planners(name, pipe, tensor):
    """A stage holds L/p layers and the ends (replicated over pipe), as the memory planner counts through the
    sharding rules."""
    from megajax.tools.memory_terms import params_per_device

    config = load_config(name)
    part = scaling_layout.parameters_per_gpu(run_on(config), tensor, Pipeline(pipe, pipe).stages)
    assert part[1] == params_per_device(run_on(config, 1, tensor, pipe))[1]


@pytest.mark.parametrize("pipe,micro,repeats,remat", [
    (2, 2, 1, "full"), (2, 4, 1, "none"), (4, 4, 1, "selective"), (4, 2, 1, "save_dots"), (2, 4, 2, "full"),
    (4, 2, 2, "selective")])
def test_stage_memory_is_the_planners(pipe, micro, repeats, remat):
    """A megajax stage's memory (state, the tick loop's activations and gradient sums) is the memory planner's report
    of the same config, GPipe and circular; Megatron-LM's 1F1B keeps at most p microbatches, its interleaved
    schedule its warm-up."""
    from megajax.tools.memory_planner import memory_report

    config = load_config("gpt_tiny")
    config.model.update(num_layers=8, remat=remat)
    config.train.precision = "bf16"
    config.parallel.update(pipeline_microbatches=micro, pipeline_repeats=repeats,
                           pipeline_schedule="circular" if repeats > 1 else "gpipe")
    config.mesh.pipe = pipe
    run = run_on(config, 2, 2, pipe)
    report = memory_report(run, micro_batch=4, num_micro=1)
    want = report.total_bytes + report.stage_grad_bytes
    assert scaling.memory_bytes(run, MeshShape(2, 2, pipe=pipe), 4, Pipeline(pipe, micro, repeats)) == want
    assert Pipeline(4, 16, megatron=True).in_flight() == 4 and Pipeline(4, 2, megatron=True).in_flight() == 2
    assert Pipeline(4, 16, 2, megatron=True).in_flight() == 2 * 3 + 4 + 1


def test_pipeline_step_counts_ticks_and_stage_terms():
    """A pipelined step: ticks x (L/(p v) layers + their all-reduces + four transfers), the ends on the stage's
    share of the batch, AdamW and the data-parallel all-reduce of one stage's parameters (the ends' over data x
    pipe)."""
    c, model = DGX_A100, gpt_model(4096, 32, 32, seq=2048, remat="full")
    pipeline = Pipeline(4, 8, 2)
    # 2 accumulation steps of 16 rows
    p = predict(model, MeshShape(2, 4, pipe=4), 2 * 32, c, 16, pipeline=pipeline, memory=False)
    micro, chunk, ticks = 2, 4, pipeline.ticks()
    layer = scaling.layer_s(model, 4, micro, c)
    compute = 2 * (ticks * chunk * layer + scaling.head_s(model, 4, 16 // 4, c))  # the ends on the stage's share
    part = scaling_layout.parameters_per_gpu(model, 4, pipeline.stages)
    compute += scaling.OPTIMIZER_BYTES_PER_PARAM * part[1] / c.hbm_bandwidth
    assert p.compute_s == pytest.approx(compute, rel=1e-12)
    # the stage's parameters over data; the ends' (every stage computes part of their gradient) over data x pipe
    ends = 4 * (part[1] - 32 // 4 * scaling_layout.layout(model, 4).layer)
    ends_over_pipe = scaling.group_allreduce_s(ends, 2 * 4, 4, c) - scaling.group_allreduce_s(ends, 2, 4, c)
    # 2 accumulation steps (32 rows per data shard, 16 at a time), each reducing the gradients as megajax's does
    assert c.dp_overlap == 0 and p.data_comm_s == pytest.approx(
        2 * (scaling.data_comm_s(model, (2, 4), c, stages=pipeline.stages) + ends_over_pipe), rel=1e-12)
    assert part[1] < scaling_layout.parameters_per_gpu(model, 4)[1] / 3  # a quarter of the layers, the ends whole
    assert p.step_s == pytest.approx(p.compute_s + p.tensor_comm_s + p.data_comm_s + p.pipe_comm_s)
    assert p.bubble == pytest.approx(3 / (16 + 3)) and p.gpus == 32
    # per accumulation step, each tick: two transfers round the ring (forward, backward) and two along the io column
    # (the budget's pipeline inputs/outputs); 32 GPUs of 8 per node: the boundaries cross nodes
    hop = scaling_pipeline.p2p_s(micro * 2048 * 4096 * 2, 4, pipeline, True, c)
    assert p.pipe_comm_s == pytest.approx(2 * ticks * 4 * hop, rel=1e-12)
    with pytest.raises(ValueError, match="do not divide the 32 layers"):
        predict(model, MeshShape(2, 4, pipe=4), 64, c, 16, pipeline=Pipeline(4, 8, 3), memory=False)
    with pytest.raises(ValueError, match="microbatches do not divide"):
        predict(model, MeshShape(2, 4, pipe=4), 64, c, 16, pipeline=Pipeline(4, 5), memory=False)
    with pytest.raises(ValueError, match="not a multiple of the 4 stages"):
        predict(model, MeshShape(2, 4, pipe=4), 64, c, 16, pipeline=Pipeline(4, 2), memory=False)


# PTD-P Table 1 (Narayanan et al. 2021). DGX_A100's gemm_efficiency and layer_overhead_s were fitted to PTDP_FITTED
# (the odd rows) only; the even rows are held out. Measured: held-out rows within 1.05 points of peak (mean 0.46,
# at most 2.4% relative), fitted rows within 1.47 (mean 0.72, at most 2.9%). Tolerance, for both: 2 points, 4%.
PTDP_POINTS, PTDP_RELATIVE, PTDP_HELD_OUT_MEAN = 2.0, 0.04, 0.75


@pytest.fixture(scope="module")
def ptdp():
    return scaling_papers.ptdp_errors(scaling_papers.ptdp_predictions())


def test_ptdp_table1_rows_the_fit_never_saw(ptdp):
    held_out = [r.name for r in PTDP_TABLE1 if r.name not in PTDP_FITTED]
    assert len(held_out) == 5
    for name in held_out:
        points, relative = ptdp[name]
        assert abs(points) <= PTDP_POINTS and abs(relative) <= PTDP_RELATIVE, (name, points, relative)
    assert sum(abs(ptdp[n][0]) for n in held_out) / len(held_out) <= PTDP_HELD_OUT_MEAN


def test_ptdp_table1_fitted_rows(ptdp):
    for name in PTDP_FITTED:
        points, relative = ptdp[name]
        assert abs(points) <= PTDP_POINTS and abs(relative) <= PTDP_RELATIVE, (name, points, relative)


def test_ptdp_constants_are_the_fit():
    """No grid neighbour of DGX_A100's literals fits the odd rows better (bench/ptdp_fit.py's grid), and the
    pipelined rows' predictions rise with the model, as published (138 -> 163)."""
    fitted = [r for r in PTDP_TABLE1 if r.name in PTDP_FITTED]

    def loss(cluster):
        predicted = {r.name: scaling_papers.ptdp_tflops(r, scaling_papers.ptdp_prediction(r, cluster)) for r in fitted}
        return sum(e[0] ** 2 for e in scaling_papers.ptdp_errors(predicted).values())

    best = loss(DGX_A100)
    for de, do in ((0.005, 0), (-0.005, 0), (0, 5e-5), (0, -5e-5)):
        neighbour = dataclasses.replace(DGX_A100, gemm_efficiency=DGX_A100.gemm_efficiency + de,
                                        layer_overhead_s=DGX_A100.layer_overhead_s + do)
        assert loss(neighbour) >= best
    predicted = scaling_papers.ptdp_predictions()
    pipelined = [predicted[r.name] for r in PTDP_TABLE1 if r.pipe > 1]
    assert pipelined == sorted(pipelined)


def test_ptdp_flops_and_rows():
    """Eq. (3) counts the recomputed forward: 4/3 of megajax's layer FLOPs plus the head's; the table's aggregate
    petaFLOP/s follow from its rows; each row's microbatches fill whole flushes (m a multiple of p) and fit 80 GB."""
    one_t = PTDP_TABLE1[-1]
    model = scaling_papers.ptdp_model(one_t)
    head = 6 * 8 * model.model.max_seq_len * model.model.hidden_size * model.model.vocab_size
    assert scaling_papers.ptdp_flops(model.model, 8) == pytest.approx(4 / 3 * (scaling.flops(model, 8) - head) + head,
                                                                rel=2e-3)
    assert one_t.gpus * one_t.tflops / 1e3 == pytest.approx(500.7, abs=0.1)  # published: 502.0 (rounded TFLOP/s)
    assert [r.data for r in PTDP_TABLE1] == [32, 32, 32, 32, 32, 32, 24, 15, 9, 6]
    for row in PTDP_TABLE1:
        assert row.microbatches % row.pipe == 0 and row.layers % row.pipe == 0
        p = scaling_papers.ptdp_prediction(row)
        assert p.pipeline.megatron == (row.pipe > 1) and p.gpus == row.gpus
        need = scaling.memory_bytes(p.run, row.mesh, p.micro_batch, p.pipeline)
        assert need <= DGX_A100.hbm_bytes, (row.name, need / scaling.GiB)


def _apply(config, flags: list[str]) -> None:
    """Sets ``--config.a.b=V`` flags on ``config`` as ml_collections' flag parser would (V cast to the field's type)."""
    for flag in flags:
        path, value = flag[len("--config."):].split("=", 1)
        *parents, leaf = path.split(".")
        node = config
        for part in parents:
            node = node[part]
        kind = type(node[leaf])
        node[leaf] = (value == "True") if kind is bool else kind(value)


def test_recommend_mesh_picks_stages_where_only_they_fit(tmp_path, capsys, monkeypatch):
    """PTD-P's 76.1B on 64 A100s with the config's choices (no ZeRO), JAX's allocator given the whole 80 GB (its
    default share, 60 GB, holds no mesh of it): no pipe=1 mesh fits, stages do; the CLI prints the flags, and they
    parse and validate as a megajax config (pipeline_repeats once the config has it)."""
    monkeypatch.setenv(scaling.MEMORY_FRACTION_VARIABLE, "1.0")
    assert scaling.jax_memory(DGX_A100) == DGX_A100
    row = next(r for r in PTDP_TABLE1 if r.name == "76.1B")
    model = scaling_papers.ptdp_model(row)
    best, table = recommend_mesh(model, 64, scaling.jax_memory(DGX_A100), global_batch=512, micro_batch=8)
    assert best.pipeline.stages > 1 and not any(p.fits for p in table if p.pipeline.stages == 1)
    path = tmp_path / "gpt_76b.py"
    path.write_text("from megajax.config import base_config\n\n\ndef get_config():\n    c = base_config()\n"
                    "    c.model.update(num_layers=60, hidden_size=10240, num_heads=80, max_seq_len=2048, "
                    "vocab_size=51200, remat='full')\n"
                    "    c.train.update(global_batch_size=512, micro_batch_size=8)\n    return c\n")
    scaling_plan.main([f"--config={path}", "--gpus=64", "--cluster=dgx_a100", "--keep_choices"])
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith(f"recommendation: pipe={best.pipeline.stages} x data={best.mesh.data} x "
                              f"model={best.mesh.model} (")
    flags = out[-1].split()
    assert flags[:3] == [f"--config.mesh.pipe={best.pipeline.stages}", f"--config.mesh.data={best.mesh.data}",
                         f"--config.mesh.model={best.mesh.model}"]
    assert f"--config.parallel.pipeline_microbatches={best.pipeline.microbatches}" in flags
    config = load_config(str(path))
    check_config_overrides([f"--config={path}", *flags], str(path))
    _apply(config, flags)
    assert validate(config, 64) == best.mesh


def test_cli_on_a_config_with_stages(tmp_path, capsys):
    """A config that sets mesh.pipe runs (its mesh is planned anew, as data and model are); --pipe keeps to one
    count of stages."""
    path = tmp_path / "tiny_pipe.py"
    path.write_text("from megajax.cli import load_config\n\n\ndef get_config():\n    c = load_config('gpt_tiny')\n"
                    "    c.mesh.pipe = 2\n    c.parallel.pipeline_microbatches = 4\n    return c\n")
    scaling_plan.main([f"--config={path}", "--gpus=8", "--cluster=dgx_a100", "--global_batch=16", "--pipe=2"])
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[2:-2]]
    assert rows and all(r[0] == "2" for r in rows) and "--config.mesh.pipe=2" in out[-1].split()
    scaling_plan.main([f"--config={path}", "--gpus=8", "--cluster=dgx_a100", "--global_batch=16"])
    out = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in out[2:-2]} == {"1", "2"}  # gpt_tiny's 2 layers: 1 or 2 stages


def test_megajax_own_schedules_on_ptdp_rows():
    """megajax's own pipeline (GPipe, circular, or 1F1B plain or interleaved with full, selective or no
    recomputation, holding residuals or recomputing the chunks; the ends on each stage's share; 1F1B's stage
    boundary scattered over the model shards) on PTD-P Table 1's pipelined rows, the fastest that fits 80 GB.
    Without sequence parallelism (the paper's setting) every row fits, five within 5% of the published TFLOP/s
    (-4.6% to +1.5%; interleaved 1F1B or, at 76.1B, circular; before interleaving, 5.5-21% below) and the 1T row
    5.4% below: interleaved 1F1B no longer fits it once the planner counts two copies of the stage's gradient sums
    and a dropout mask's bits, as the compiled CPU steps hold them (it fitted at -2.9% before, 2026-11-28), so plain
    1F1B runs. With sequence parallelism (the stage boundary's message and the held activations 1/t, beyond the
    paper) every row fits and is predicted 4-9% above the published figures."""
    rows = {row.name: row for row in scaling_papers.PTDP_TABLE1}
    names = ("39.1B", "76.1B", "145.6B", "310.1B", "529.6B", "1008.0B")
    got = {name: scaling_papers.ptdp_megajax_prediction(rows[name], sequence=(False,)) for name in names}
    relative = {n: scaling_papers.ptdp_tflops(rows[n], p) / rows[n].tflops - 1 for n, p in got.items()}
    assert all(got[n].fits for n in names)
    assert {got[n].pipeline.schedule for n in names[:-1]} <= {"interleaved", "circular"}
    assert all(abs(relative[n]) < 0.05 for n in names[:-1]), relative
    assert got["1008.0B"].pipeline.schedule == "1f1b" and -0.06 < relative["1008.0B"] < -0.05
    with_sp = {name: scaling_papers.ptdp_megajax_prediction(rows[name]) for name in names}
    assert all(p.fits for p in with_sp.values())
    assert all(0.03 < scaling_papers.ptdp_tflops(rows[n], p) / rows[n].tflops - 1 < 0.09 for n, p in with_sp.items())


def test_fp8_runs_the_block_gemms_at_the_fp8_peak(capsys):
    """``train.precision=fp8`` on dgx_h100 (Llama 3 8B on 8 GPUs, FSDP, save_dots, micro-batch 2, the same
    choices): a large GEMM's operands in FP8 take half the bf16 time (1,979 vs 989 TFLOP/s), the step is faster
    (1.2x) but not twice (the attention core, the head, the element-wise work, communication and the amax / cast
    passes stay), MFU is still read against the bf16 peak; on a cluster without FP8 the CLI says so in one line."""
    big = (1, 8192, 8192, 8192)
    h100 = scaling.DGX_H100
    assert scaling.gemm_s(*big, h100, fp8=True) == pytest.approx(scaling.gemm_s(*big, h100) * 989 / 1979)
    assert scaling.fp8_scaling_s(*big[1:], h100) > 0
    config = load_config("llama3_8b")
    plans = {}
    for precision in ("bf16", "fp8"):
        config.train.precision = precision
        run = with_choices(run_on(config), remat="save_dots", sequence=False, shard_optimizer=True, fsdp=True)
        plans[precision] = predict(run, MeshShape(8, 1), 64, h100, 2)
    bf16, fp8 = plans["bf16"], plans["fp8"]
    assert 1.1 < bf16.step_s / fp8.step_s < 2 and bf16.data_comm_s == fp8.data_comm_s
    assert fp8.mfu == pytest.approx(fp8.tflops_per_gpu * 1e12 / h100.peak_flops) and fp8.mfu > bf16.mfu
    with pytest.raises(SystemExit) as exit_:
        scaling_plan.main(["--config=llama3p2_1b", "--cluster=dgx_a100", "--gpus=8", "--config.train.precision=fp8"])
    assert "train.precision=fp8: --cluster=dgx_a100's GPUs have no FP8 tensor cores" in str(exit_.value.code)
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        predict(fp8.run, MeshShape(8, 1), 64, DGX_A100, 2)
