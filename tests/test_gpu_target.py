"""The training step compiled for H100s on this CPU host (megajax.tools.gpu_target): cuDNN's flash attention in
bf16, the tensor-parallel all-reduces at Megatron's count in the compute dtype, every gradient element reduced over
`data` once, the collectives asynchronous under megajax's XLA options, and `megajax.info --target` as a user runs it.
Skipped where JAX's CUDA plugin (the gpu-compile extra, part of the test extra) or ptxas is missing."""

import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from conftest import SCALAR_STATE_BYTES, child_env, run_on

from megajax.cli import load_config
from megajax.config import model_config
from megajax.models.transformer import attention_reason
from megajax.outputs import HLO_HEADER
from megajax.parallel import hlo_audit
from megajax.tools import gpu_target
from megajax.tools.comm_budget import step_shape

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda12") is None or shutil.which("ptxas") is None,
    reason="compiling for GPUs needs JAX's CUDA plugin (pip install 'megajax[gpu-compile]') and ptxas on the PATH")
# 2x4: data and model shards (a 1x8 step checks nothing 2x4's does not)
MODELS, MESHES, ROWS = ("gpt_tiny", "bert_tiny", "llama_tiny"), ((2, 4),), 2


def _config(name: str, mesh: tuple[int, int]):
    """The tiny config in bf16 without dropout (cuDNN's attention has none), 8 heads so that 8 model shards hold
    whole ones."""
    config = load_config(name)
    config.mesh.data, config.mesh.model = mesh
    config.model.update(dropout=0.0, num_heads=8)
    config.train.precision = "bf16"
    return config


@pytest.fixture(scope="module")
def steps():
    return {(name, mesh): gpu_target.compile_step(run_on(_config(name, mesh), *mesh), "h100", micro_batch=ROWS)
            for name in MODELS for mesh in MESHES}


def test_cudnn_flash_attention_in_bf16_where_the_model_allows(steps):
    for key, step in steps.items():
        assert step.attention == "cudnn", key
        kernels = set(re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', step.hlo))
        assert any(k.endswith("Backward") for k in kernels) and any(not k.endswith("Backward") for k in kernels), key
    gpt = load_config("gpt_tiny")  # Megatron's attention dropout keeps GPT-2 and BERT on XLA's attention
    gpt.train.precision = "bf16"
    assert "attention dropout" in attention_reason(model_config(gpt))
    assert attention_reason(model_config(_config("gpt_tiny", (1, 8)))) == ""


def test_compiled_memory_is_the_planners_within_10_percent(steps):
    """The planner as the step compiles for a GPU (``memory_report(..., gpu=True)``: cuDNN's attention keeps its
    log-sum-exp, not the probabilities; the head its logits and their gradient; cuBLAS's workspace) against XLA's
    memory plan of the compiled H100 step: the same state to the byte, the peak within 10%."""
    for key, step in steps.items():
        compiled, planned = step.compiled, step.planned
        assert compiled.state - planned.state_bytes == SCALAR_STATE_BYTES, key
        assert abs(compiled.peak / planned.peak_bytes - 1) <= 0.10, (key, compiled.peak, planned.peak_bytes)
        assert abs(compiled.temp / planned.temp_bytes - 1) <= 0.10, (key, compiled.temp, planned.temp_bytes)


def test_tensor_parallel_all_reduces_are_megatrons_in_the_compute_dtype(steps):
    """2L + 1 all-reduces of b x s x h each way over `model` (each block's f and g, the embedding lookup; the tied
    output layer's input gradient), every one in bf16: the lookup's partial rows are summed in the compute dtype."""
    for (name, mesh), step in steps.items():
        spec = step.run.spec
        bsh = ROWS * spec.model.max_seq_len * spec.model.hidden_size
        found = {}
        for c in step.collectives:
            if c.op == "all-reduce" and c.axes == {"model"} and c.elements == bsh:
                found[c.phase, c.dtype] = found.get((c.phase, c.dtype), 0) + c.executions
        want = 2 * spec.model.num_layers + 1
        assert found == {("forward", "bf16"): want, ("backward", "bf16"): want}, (name, mesh, found)


def test_every_gradient_element_is_reduced_over_data_once(steps):
    for (name, mesh), step in steps.items():
        reduced = sum(c.elements * c.executions for c in step.collectives
                      if c.axes == {"data"} and c.op == "all-reduce" and c.elements > 1)
        # every local gradient element once; XLA concatenates the step's scalars (GPT: the loss; BERT: its two
        # losses, two accuracies and the masked tokens' count, which losses.Means divides by) into the buffers
        assert 0 <= reduced - step_shape(step.run).local_grad_elements <= 5, name


def test_collectives_overlap_compute_under_megajaxs_options(steps):
    """Under the latency-hiding scheduler every collective of the step is asynchronous, the data-parallel
    gradient reduction has compute scheduled between its start and its done, and so do most tensor-parallel
    all-reduces (10-12 of the 13-15 in these steps; the rest have their consumer next)."""
    for (name, mesh), step in steps.items():
        overlap = gpu_target.overlap(step.hlo)
        assert step.options["xla_gpu_enable_latency_hiding_scheduler"]
        assert all(c.instruction in overlap for c in step.collectives), name
        data = [overlap[c.instruction][1] for c in step.collectives if c.axes == {"data"}]
        assert data and max(data) > 0, name
        tensor = [overlap[c.instruction][1] for c in step.collectives if c.axes == {"model"} and c.op == "all-reduce"]
        assert sum(n > 0 for n in tensor) >= 2 / 3 * len(tensor), (name, mesh, tensor)


def test_gradients_are_reduced_over_data_in_fp32(steps):
    """Without accumulation (each model on 2x4, H100): every matrix's gradient is summed over `data` in fp32, as
    Megatron-LM reduces, the blocks' GEMMs giving their weight gradients as fp32 outputs (``layers.half_product``;
    with the plain product's transpose XLA reduced the bf16 partial sums). What stays bf16 is summed over rows
    element-wise, not by a GEMM: GPT's position table and the vectors (7.0% of gpt_tiny's elements, BERT 0.8%,
    Llama 0.3%; before, Llama's blocks' kernels too, 41%). The tensor-parallel all-reduces of the activations'
    gradients stay bf16."""
    for key, step in steps.items():
        summed = {}
        for c in step.collectives:
            if c.axes == {"data"} and c.op in ("all-reduce", "reduce-scatter"):
                summed[c.dtype] = summed.get(c.dtype, 0) + c.elements * c.executions
        assert set(summed) <= {"f32", "bf16"} and summed.get("bf16", 0) < 0.08 * sum(summed.values()), (key, summed)
        assert "bf16" in {c.dtype for c in step.collectives if c.axes == {"model"} and c.op == "all-reduce"}, key


def test_accumulation_reduces_the_gradients_once():
    """With 3 accumulation steps (each data replica's gradients kept apart through the loop, training.replicas)
    the compiled H100 step reduces its gradients over `data` once, in fp32, after the loop, as Megatron-LM does:
    every local gradient element once (4 key/value heads, so 4 model shards hold whole ones and reduce only their
    own), where the step without the replicas apart reduced them in every accumulation step (3 x). The loop stays
    one loop of 3 micro-batches, the layers' forward and backward loops inside it once each: XLA neither
    double-buffers it nor peels a micro-batch off it (with its bound in sight it did both: 6 layer loops, 2 of
    them outside it, each copy with its own saved activations)."""
    config = _config("llama_tiny", (2, 4))
    config.model.num_kv_heads = 4
    step = gpu_target.compile_step(run_on(config, 2, 4), "h100", micro_batch=ROWS, num_micro=3)
    loops = hlo_audit.loops(step.hlo)
    (accumulation,) = [loop for loop in loops if loop.top]
    assert accumulation.trips == 3 and len(loops) == 3, loops
    assert all(loop.computation == accumulation.body for loop in loops if not loop.top), loops
    local = step_shape(step.run).local_grad_elements
    reduced = [c for c in step.collectives if c.axes == {"data"} and c.elements > 1]
    assert {(c.op, c.dtype, c.executions) for c in reduced} == {("all-reduce", "f32", 1)}, reduced
    assert 0 <= sum(c.elements for c in reduced) - local <= 5, (reduced, local)


def test_fsdp_gathers_the_kernels_in_the_compute_dtype():
    """FSDP compiled for H100s (llama_tiny on 8x1, bf16): each layer's kernels are all-gathered over `data` in bf16,
    cast on their shards (half the bytes of the fp32 masters, as Megatron-LM's distributed optimizer and PyTorch
    FSDP's mixed precision gather), forward and again backward; the tied embedding, whose lookup's gradient is
    summed in fp32, is gathered in fp32, once for both of its uses. The kernels' gradients are reduce-scattered in
    fp32 (the GEMMs' weight gradients are their fp32 outputs, ``layers.half_product``), as Megatron-LM reduces."""
    config = _config("llama_tiny", (8, 1))
    config.parallel.fsdp = True
    step = gpu_target.compile_step(run_on(config, 8, 1), "h100", micro_batch=ROWS)
    gathers = [c for c in step.collectives if c.op == "all-gather" and c.axes == {"data"}]
    vocab = step.run.spec.model.vocab_size
    kernels = [c for c in gathers if len(c.shape) >= 2 and c.shape[0] != vocab]
    assert {(c.dtype, c.phase) for c in kernels} == {("bf16", "forward"), ("bf16", "backward")}, kernels
    assert [c.dtype for c in gathers if c.shape[0] == vocab] == ["f32"], gathers
    scattered = {c.dtype for c in step.collectives if c.op == "reduce-scatter" and len(c.shape) >= 2}
    assert scattered == {"f32"}, scattered


def test_fp8_gemms_are_cublaslt_fp8_calls(steps):
    """``train.precision=fp8`` compiled for H100s: every GEMM of the blocks (forward, and both gradients') is one
    cuBLASLt FP8 call (``__cublas$lt$matmul$f8``, the scales its operands, the result bf16), not an upcast; the
    untied output layer's three stay bf16 GEMMs, as every bf16 GEMM of the same step is one call."""
    config = _config("llama_tiny", (2, 4))
    config.train.precision = "fp8"
    fp8 = gpu_target.compile_step(run_on(config, 2, 4), "h100", micro_batch=ROWS)
    bf16 = steps[("llama_tiny", (2, 4))]
    assert bf16.fp8_gemms == 0 and fp8.gemms == bf16.gemms and fp8.gemms - fp8.fp8_gemms == 3, (fp8.gemms, bf16.gemms)
    outputs = re.findall(r"= \((\w+)\[[^]]*\]\{[^}]*\}, s8\[\d+\]\{0\}\) custom-call\([^)]*\), "
                         r'custom_call_target="__cublas\$lt\$matmul\$f8"', fp8.hlo)
    assert sorted(set(outputs)) == ["bf16", "f32"], outputs  # the kernels' gradients accumulate in fp32


def test_info_compiles_for_an_h100_as_a_user_runs_it(tmp_path):
    """With an empty JAX_PLATFORMS (unset, to jax) megajax picks the CPU itself where there is no GPU; --overwrite
    replaces the HLO an earlier run wrote, which a run without it refuses."""
    hlo = tmp_path / "step.hlo"
    hlo.write_text(f"{HLO_HEADER}an earlier run\nHloModule old\n")
    env = {**child_env(), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": ""}
    command = [sys.executable, "-m", "megajax.info", "--config=llama_tiny", "--target=h100", "--compiled",
               "--mesh=2x4", f"--hlo={hlo}"]
    run = subprocess.run([*command, "--overwrite"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the step compiled for NVIDIA H100 80GB HBM3 (mesh 2x4" in run.stdout
    assert "attention            cudnn" in run.stdout and "fits one NVIDIA H100 80GB HBM3" in run.stdout
    assert re.search(r"GEMMs                0 FP8 cuBLASLt calls, [1-9]\d* others", run.stdout)
    assert "all-reduce" in run.stdout and "overlap" in run.stdout
    written = hlo.read_bytes()
    assert written.startswith(HLO_HEADER.encode()) and b"__cudnn$fmha" in written
    assert "Traceback" not in run.stderr and "cudart_stub" not in run.stderr  # quiet on a host without a GPU
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode != 0 and again.stdout == "" and "Traceback" not in again.stderr
    assert again.stderr.strip().splitlines() == [f"error: --hlo={hlo} already exists (a compiled step's HLO text): "
                                                 "pass --overwrite to replace it (the old one is removed only once "
                                                 "the new one is complete), or write the output elsewhere"]
    assert hlo.read_bytes() == written and sorted(p.name for p in tmp_path.iterdir()) == ["step.hlo"]


def test_bad_targets_are_one_error_line(tmp_path, monkeypatch):
    """Each refused before compiling, the processes side by side: no traceback, no new file, a file megajax did not
    write left as it was."""
    env = {**child_env(), "PYTHONPATH": str(ROOT)}
    (tmp_path / "notes.hlo").write_text("my notes\n")
    compiled = ("--target=h100", "--compiled")
    cases = {("--target=h900",): ({}, "argument --target: invalid choice: 'h900'"),
             (*compiled, "--mesh=4x4"): ({}, "mesh 4x4 needs 16 GPUs; --hosts=1 x 8 has 8"),
             ("--target=a100", "--compiled", "--precision=fp8"): ({}, "the NVIDIA A100-SXM4-80GB (compute "
                                                                      "capability 8.0) has no FP8 tensor cores"),
             ("--hlo=x.hlo",): ({}, "--hlo writes the step compiled for a GPU: give it with --target=... --compiled"),
             (*compiled, "--hlo=notes.hlo", "--overwrite"): ({}, "--hlo=notes.hlo already holds a file megajax did "
                                                                 "not write, not a compiled step's HLO text"),
             compiled: ({"JAX_PLATFORMS": "cpu,cuda"}, "JAX's CUDA plugin did not start (Unable to load CUDA. Is it "
                        "installed?): JAX_PLATFORMS=cpu,cuda makes it check this host's CUDA, which failed; to compile "
                        "for a GPU without one, set JAX_PLATFORMS=cpu")}
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    runs = {flags: subprocess.Popen([sys.executable, "-m", "megajax.info", "--config=gpt_tiny", *flags], cwd=tmp_path,
                                    env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for flags, (extra, _) in cases.items()}
    for flags, run in runs.items():
        out, err = run.communicate(timeout=600)
        last = err.strip().splitlines()[-1]
        assert run.returncode != 0 and last.startswith("error: ") and cases[flags][1] in last, (flags, err[-2000:])
        assert err.strip().splitlines() == [last] and out == "", (flags, err[-2000:])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.setattr(gpu_target.importlib.util, "find_spec", lambda name: None)  # as without the extra
    with pytest.raises(gpu_target.GpuTargetError, match=r"pip install 'megajax\[gpu-compile\]'"):
        gpu_target.gpu_devices("h100")


@pytest.mark.parametrize("packed,context", [(False, 2), (True, 2)])
def test_cudnn_attention_with_packed_rows_and_context_shards(packed, context):
    """llama_tiny (s=256) compiled for H100s with document masking (the per-row mask reaches cuDNN as its bias) and
    on context shards (cuDNN inside the attention's shard_map, the keys and values all-gathered over `context`, their
    gradients reduce-scattered; the parameters' gradients reduced over data x context in one all-reduce each)."""
    config = _config("llama_tiny", (2, 4 // context))
    config.model.max_seq_len = 256
    config.data.document_masking = packed
    run = run_on(config, 2, 4 // context, context=context)
    step = gpu_target.compile_step(run, "h100", micro_batch=ROWS)
    assert step.attention == "cudnn"
    ops = {(c.op, tuple(sorted(c.axes))) for c in step.collectives}
    if context > 1:
        assert ("all-gather", ("context",)) in ops and ("reduce-scatter", ("context",)) in ops
        assert not [c for c in step.collectives if c.op == "all-reduce" and c.axes == {"context"}]


def test_cudnn_attention_inside_the_1f1b_stages():
    """llama_tiny on pipe 2 x data 2 x model 2 under the 1F1B schedule compiled for H100s, over packed rows:
    cuDNN's flash attention, forward and backward, inside the stages' shard_map (on each device's blocks: its
    partitioning rule fails on a partly manual mesh; the per-row mask over every head, split over `model` as the
    heads are: under the stages' vmap jax's cuDNN batching rule fails on a mask broadcast over the heads), and the
    schedule's permutes over `pipe`."""
    config = _config("llama_tiny", (2, 2))
    config.parallel.pipeline_schedule = "1f1b"
    config.data.document_masking = True
    step = gpu_target.compile_step(run_on(config, 2, 2, pipe=2), "h100", micro_batch=4)
    assert step.attention == "cudnn"
    kernels = set(re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', step.hlo))
    assert any(k.endswith("Backward") for k in kernels) and any(not k.endswith("Backward") for k in kernels)
    assert [c for c in step.collectives if c.op == "collective-permute" and c.axes == {"pipe"}]


def test_deepseek_in_1f1b_stages_with_a_prediction_depth_is_planned_within_10_percent():
    """deepseek_tiny with a multi-token prediction depth in 1F1B stages (pipe 2 x data 2 x model 2), compiled for
    H100s: the planner's peak and temp within 10%. Its dense first layer runs whole with the embeddings, its
    residuals kept through the tick loop for the stage's share of the micro-batch, and the depth in the tail, one
    microbatch at a time (counted as the mean layer they made the compiled peak 1.23 of the planner's)."""
    config = load_config("deepseek_tiny")
    config.train.precision = "bf16"
    config.model.mtp_depth = 1
    config.parallel.pipeline_schedule = "1f1b"
    step = gpu_target.compile_step(run_on(config, 2, 2, pipe=2), "h100", micro_batch=8)
    compiled, planned = step.compiled, step.planned
    assert abs(compiled.peak / planned.peak_bytes - 1) <= 0.10, (compiled.peak, planned.peak_bytes)
    assert abs(compiled.temp / planned.temp_bytes - 1) <= 0.10, (compiled.temp, planned.temp_bytes)


@pytest.mark.parametrize("exchange,room,precision", [("auto", 0.0, "bf16"), ("blocks", 0.0, "bf16"),
                                                      ("auto", 1.0, "fp8")])
def test_the_expert_exchange_and_gemms_on_gpus_skip_what_is_not_routed(exchange, room, precision):
    """Compiled for H100s (deepseek_tiny on data 2 x expert 4: its 2 routed layers' 8 experts two to a shard, 2
    sequences of 128 a shard, top-2: n = 512 routed rows a shard per layer): by default (auto) each routed layer's
    hidden states go to their experts in one ragged-all-to-all sending at most the n rows (its operand), two slices
    per destination, the outputs come back in one from the receive buffer of 4 n (room for every source's rows),
    each transposed once backward, and the integers exchanged are counts and offsets (one per expert); ``blocks``
    moves a block of n rows per destination, 4 n each way, in four all-to-alls, and the rows' expert ids. Either
    way the expert GEMMs are the Pallas kernels (``parallel/grouped_gemm``), which skip the rows past the groups.
    With ``model.expert_room`` 1 the receive buffer holds n rows, not 4 n: both ragged all-to-alls move at most n. In
    fp8 (that case) every kernel's two operands are E4M3 (``grouped_gemm._fp8_gemm``). The memory planner (the ragged
    exchange's receive room) within 10% of the compiled ragged step."""
    config = load_config("deepseek_tiny")
    config.train.precision = precision
    config.model.update(expert_exchange=exchange, expert_room=room)
    step = gpu_target.compile_step(run_on(config, data=2, expert=4), "h100", micro_batch=ROWS)
    m = step.run.spec.model
    n, h, layers = ROWS * m.max_seq_len * m.experts_per_token, m.hidden_size, m.num_layers - m.first_k_dense_replace
    assert m.num_experts // 4 == 2
    big, small = {}, []
    for c in step.collectives:
        if c.op in ("all-to-all", "ragged-all-to-all"):
            assert c.axes == {"expert"}, c
            if c.dtype.startswith("s"):  # integers: counts, offsets, ids
                small.append(c)
            else:
                big[c.op, c.elements // h] = big.get((c.op, c.elements // h), 0) + c.executions
    # the expert GEMMs: Pallas's Triton kernels, three forward, three for the rows' gradients and three for the
    # weights' a layer; none left to XLA's ragged_dot (a dense GEMM over every local expert's weights)
    triton = r'custom_call_target="__gpu\$xla\.gpu\.triton".*?op_name="[^"]*/(grouped_gemm\w*)/pallas_call"'
    kernels = re.findall(triton, step.hlo)
    assert sorted(set(kernels)) == ["grouped_gemm", "grouped_gemm_weights"], kernels
    assert (kernels.count("grouped_gemm"), kernels.count("grouped_gemm_weights")) == (6 * layers, 3 * layers)
    constraints = r'operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}'  # the operands' types and layouts
    operands = re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton", ' + constraints, step.hlo)
    assert len(operands) == 9 * layers
    fp8 = [re.findall(r"(f8e4m3fn|f8e5m2|bf16)\[", o) for o in operands]
    assert fp8 == [["f8e4m3fn"] * 2 if precision == "fp8" else ["bf16"] * 2] * len(operands), fp8
    assert "ragged_dot" not in step.hlo
    # no buffer of the exchange's room reduced (a receive buffer cast to the rows' varying axes once was, backward)
    buffer = step.run.spec.receive_rows(ROWS, 4)  # rows
    assert buffer == (n if room else 4 * n)
    assert not [c for c in step.collectives if c.op == "all-reduce" and c.elements == buffer * h]
    if exchange == "auto":
        want = {("ragged-all-to-all", n): 2 * layers}  # the rows there, and backward their gradients'
        received = ("ragged-all-to-all", n if room else 4 * n)  # the outputs back from the receive buffer
        want[received] = want.get(received, 0) + 2 * layers
        assert big == want, big
        assert all(c.elements <= m.num_experts for c in small), small
    else:
        assert big == {("all-to-all", 4 * n): 4 * layers}, big
        assert {c.elements for c in small} == {4 * n}  # each routed row's expert id
        return
    assert abs(step.compiled.peak / step.planned.peak_bytes - 1) <= 0.10, (step.compiled.peak, step.planned.peak_bytes)
