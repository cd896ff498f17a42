"""Fits DGX_H100's four calibration constants to published BF16 H100 runs and prints every row's error.

    python bench/h100_fit.py

Least squares of the predicted - published TFLOP/s per GPU (each row in its publisher's FLOP count) in points of
the 989 TFLOP/s peak over ``scaling_h100.H100_ROWS`` (Megatron-LM's weak-scaling table, MaxText's Llama 2 7B on one
host, torchtitan's Llama 3.1 8B on 8 GPUs; no FP8 run), by Nelder-Mead over ``gemm_efficiency``,
``layer_overhead_s``, ``dp_overlap`` and ``tp_overlap`` under fused element-wise kernels, from the constants
assumed before the fit (0.75, 0.6 ms, 0.3, 0); each row re-picks its unpublished settings at every point. The
result is written into ``megajax/tools/scaling_clusters.py`` by hand, as literals. Pure Python, about half a
minute.
"""

import dataclasses
import pathlib
import sys

import numpy as np
from scipy import optimize

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from megajax.models.spec import FUSED  # noqa: E402
from megajax.tools import scaling_h100  # noqa: E402
from megajax.tools.scaling import DGX_H100  # noqa: E402


def cluster_at(x: np.ndarray):
    """DGX_H100 under fused element-wise kernels with (gemm_efficiency, layer_overhead in ms, dp_overlap,
    tp_overlap) = ``x``."""
    return dataclasses.replace(DGX_H100, software=FUSED, gemm_efficiency=float(x[0]),
                               layer_overhead_s=float(x[1]) * 1e-3, dp_overlap=float(x[2]), tp_overlap=float(x[3]))


def loss(x: np.ndarray) -> float:
    if not (0.3 <= x[0] <= 1.0 and x[1] >= 0 and 0 <= x[2] <= 1 and 0 <= x[3] <= 1):
        return 1e9
    return scaling_h100.squared_error(cluster_at(x))


def main() -> int:
    start = np.array([0.75, 0.6, 0.3, 0.0])  # the constants assumed before this fit (no TP overlap)
    simplex = [start, start + [0.1, 0, 0, 0], start + [0, 0.5, 0, 0], start + [0, 0, 0.4, 0], start + [0, 0, 0, 0.4]]
    best = optimize.minimize(loss, start, method="Nelder-Mead",
                             options={"xatol": 1e-4, "fatol": 1e-3, "initial_simplex": simplex})
    x = best.x
    print(f"gemm_efficiency={x[0]:.4f}, layer_overhead_s={x[1] * 1e-3:.6f}, dp_overlap={x[2]:.4f}, "
          f"tp_overlap={x[3]:.4f} (rms {np.sqrt(best.fun / len(scaling_h100.H100_ROWS)):.2f} points, "
          f"{best.nfev} evaluations)")
    for label, cluster in (("as scaling_clusters.py has it", DGX_H100), ("fitted", cluster_at(x))):
        print(label)
        for name, (published, predicted, points) in scaling_h100.row_errors(cluster).items():
            print(f"  {name:>24}: published {published:6.1f}, predicted {predicted:6.1f} TFLOP/s per GPU, "
                  f"{points:+5.1f} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
