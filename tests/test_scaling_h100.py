"""The scaling model's H100 constants against the published BF16 H100 runs they were fitted to
(``megajax.tools.scaling_h100``, ``bench/h100_fit.py``): each row's figure in its publisher's FLOP count, every row
within 2.5 points of peak, and the constants a minimum of the fit (pure Python: nothing compiles)."""

import dataclasses

import pytest

from megajax.tools import scaling_h100
from megajax.tools.scaling import DGX_H100

ROWS = {row.name: row for row in scaling_h100.H100_ROWS}


def test_each_publishers_flop_count_gives_its_published_figures():
    """Hand arithmetic on the sources' own numbers: Megatron-LM's 1.7B (h 2048, 24 layers, s 4096, V 131,072)
    counts 11.28 GFLOP per token; MaxText's Llama 2 7B (6.74B parameters, 4 sequences of 4096 per GPU) about 715
    TFLOP per GPU and step, so 1.45 s at 492 TFLOP/s; torchtitan's 6,667 tokens/s per GPU on Llama 3.1 8B at 8192
    are 39.0% of the 989 TFLOP/s peak in its count (its doc's 33% / 39% MFU)."""
    megatron = ROWS["megatron 1.7B"]
    per_token = scaling_h100.megatron_flops(megatron.model(), 1) / 4096
    assert per_token == pytest.approx(72 * 24 * 2048**2 + 12 * 4096 * 24 * 2048 + 6 * 2048 * 131072, rel=1e-12)
    assert per_token == pytest.approx(11.28e9, rel=1e-3)
    assert megatron.published_step_s == pytest.approx(192 * 4096 * per_token / (408.8e12 * 48), rel=1e-12)
    maxtext = ROWS["maxtext llama2 7B"]
    assert scaling_h100.maxtext_flops(maxtext.model(), 4) == pytest.approx(715e12, rel=0.005)
    assert maxtext.published_step_s == pytest.approx(1.45, rel=0.005)
    titan = ROWS["torchtitan llama3.1 8B"]
    published = scaling_h100.row_errors()["torchtitan llama3.1 8B"][0]
    assert published / 989 == pytest.approx(0.390, abs=0.001)
    assert titan.published_step_s == pytest.approx(16 * 8192 / (6667 * 8), rel=1e-12)


def test_every_row_within_2_5_points_and_the_constants_minimize_the_fit():
    errors = scaling_h100.row_errors()
    assert len(errors) == 11 and all(abs(points) <= 2.5 for _, _, points in errors.values()), errors
    fitted = scaling_h100.squared_error()
    for field, step in (("gemm_efficiency", 0.01), ("layer_overhead_s", 0.1e-3), ("dp_overlap", 0.05),
                        ("tp_overlap", 0.05)):
        for sign in (-1, 1):
            moved = dataclasses.replace(DGX_H100, **{field: getattr(DGX_H100, field) + sign * step})
            assert scaling_h100.squared_error(moved) > fitted, (field, sign)
