"""The scaling model's context dimension (``megajax.tools.scaling_context``): with C context shards a GPU does the
work of micro-batch / C sequences (its GEMMs sum to the spec's FLOPs over the group), its key/value traffic is the
communication budget's bytes (the compiled step's: tests/test_context_parallel.py) timed by hand, its memory is the
memory planner's on the mesh with context shards, H100s run flash attention (no s x s scores kept or passed), and
the planner prints a plan for Llama 3 8B at 128K whose flags train.py takes (pure Python: nothing compiles)."""

import math

import pytest
from conftest import run_on

from megajax.cli import check_config_overrides, load_config
from megajax.parallel.mesh import MeshShape
from megajax.tools import scaling, scaling_context, scaling_plan
from megajax.tools.comm_minimum import minimum
from megajax.tools.memory_planner import activations
from megajax.tools.scaling import DGX_A100, DGX_H100, predict
from megajax.tools.scaling_clusters import HALF, group_allreduce_s
from megajax.tools.scaling_layout import comm_shape, with_choices

LONG = 32768


def _llama(seq: int = LONG):
    config = load_config("llama3_8b")
    config.model.max_seq_len = seq
    return run_on(config)


@pytest.mark.parametrize("context,tensor", [(2, 1), (4, 2), (16, 8)])
def test_gemms_over_the_context_group_add_up_to_the_specs_flops(context, tensor):
    """A GPU of C context shards times the GEMMs of micro-batch / C sequences; over the C x t GPUs of a group they
    are the spec's model FLOPs of the micro-batch (queries against every key: s/C x s per GPU)."""
    run = _llama()
    m = run.model
    dense, attention, logits = scaling.gemms(run, tensor, 8 / context)
    per_gpu = 3 * (m.num_layers * sum(2 * math.prod(g) for g in dense + attention) + 2 * math.prod(logits))
    assert per_gpu * tensor * context == pytest.approx(run.model_spec.flops(m, 8, m.max_seq_len), rel=1e-12)


@pytest.mark.parametrize("remat", ["full", "selective"])
def test_key_value_time_is_the_budgets_bytes_over_the_group(remat):
    """Per layer 2 all-gathers of each GPU's chunk of the keys and values (again where remat=full recomputes the
    layer) and 2 reduce-scatters, each half a ring all-reduce of the C chunks over the group (``model`` apart), plus
    the mask's positions once; the bytes are ``comm_budget.minimum``'s."""
    run = with_choices(_llama(), remat=remat)
    m, c, t, b = run.model, 8, 2, 1
    chunk = b * m.max_seq_len // c * (m.kv_heads // t) * m.head_dim * HALF
    collectives = m.num_layers * (2 * (2 if remat == "full" else 1) + 2)
    positions = 4 * b * m.max_seq_len // c
    assert minimum(comm_shape(run, (1, t), b, 1, m.num_layers, context=c))["context key/value"] == \
        collectives * chunk + positions
    want = collectives * group_allreduce_s(c * chunk, c, t, DGX_H100) / 2 + \
        group_allreduce_s(c * positions, c, t, DGX_H100) / 2
    assert scaling_context.context_comm_s(run, (1, t), b, c, DGX_H100) == pytest.approx(want, rel=1e-12)
    p = predict(run, MeshShape(2, t, context=c), 4, DGX_H100, memory=False)
    # 2 sequences a data shard, in one micro-batch: the collectives carry both
    assert p.gpus == 2 * c * t and p.context_comm_s == scaling_context.context_comm_s(run, (2, t), 2, c, DGX_H100)


def test_memory_is_the_planners_on_the_context_mesh_and_h100s_run_flash_attention():
    """The memory of a data 2 x context 4 x model 8 mesh is the state plus the memory planner's activations of the run
    placed there (with cuDNN's attention on an H100: XLA's keeps 4x more, its s/C x s scores)."""
    run = _llama()
    need = scaling.memory_bytes(run, MeshShape(2, 8, context=4), 1, gpu=True)
    assert need - scaling.state_bytes(run, 8, 2) == scaling.activations(
        scaling._on_mesh(run, MeshShape(2, 8, context=4), scaling.Pipeline()), 1, True).total
    assert scaling.flash_attention(run, DGX_H100) and not scaling.flash_attention(run, DGX_A100)
    on_h100 = predict(run, MeshShape(2, 8, context=4), 4, DGX_H100, micro_batch=1)
    # two accumulation steps: the micro-batch's own fp32 gradients beside the accumulator
    second = 4 * scaling.parameters_per_gpu(run, 8)[1] // (2 if run.shard_optimizer else 1)
    assert on_h100.num_micro == 2 and on_h100.memory_bytes == need + second
    xla = activations(scaling._on_mesh(run, MeshShape(2, 8, context=4), scaling.Pipeline()), 1).total
    assert xla > 4 * (need - scaling.state_bytes(run, 8, 2))  # the s/C x s scores XLA's attention keeps


def test_cli_plans_llama3_8b_at_128k(capsys):
    scaling_plan.main(["--config=llama3_8b", "--gpus=128", "--cluster=dgx_h100", "--context=16",
                       "--config.model.max_seq_len=131072", "--global_batch=8"])
    out = capsys.readouterr().out.splitlines()
    assert "ctx" in out[1] and "CP comm" in out[1]
    assert out[-2].startswith("recommendation: pipe=1 x data=") and " x context=16 x " in out[-2]
    flags = out[-1].split()
    assert "--config.mesh.context=16" in flags
    check_config_overrides(["--config=llama3_8b", *flags], "llama3_8b")
    with pytest.raises(SystemExit):
        scaling_plan.main(["--config=llama3_8b", "--gpus=128", "--context=3"])
