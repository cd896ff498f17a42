"""Fits DGX_A100's two calibration constants to PTD-P Table 1's odd rows and prints every row's error.

    python bench/ptdp_fit.py

A grid over ``gemm_efficiency`` (0.50-0.95 by 0.005) and ``layer_overhead_s`` (0-10 ms by 0.05 ms), least squares
of the predicted - published TFLOP/s per GPU in points of peak over ``scaling_papers.PTDP_FITTED`` only (each row
with the v the model predicts fastest). The result is written into ``megajax/tools/scaling_clusters.py`` by hand, as
literals. Pure Python, about half a minute.
"""

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from megajax.tools import scaling  # noqa: E402
from megajax.tools import scaling_papers as papers


def loss(cluster: scaling.Cluster, rows) -> float:
    predicted = {r.name: papers.ptdp_tflops(r, papers.ptdp_prediction(r, cluster)) for r in rows}
    return sum(papers.ptdp_errors(predicted)[r.name][0] ** 2 for r in rows)


def main() -> int:
    fitted = [r for r in papers.PTDP_TABLE1 if r.name in papers.PTDP_FITTED]
    best = None
    for e in range(100, 191):
        for o in range(0, 201):
            cluster = dataclasses.replace(scaling.DGX_A100, gemm_efficiency=e / 200, layer_overhead_s=o * 5e-5)
            value = loss(cluster, fitted)
            if best is None or value < best[0]:
                best = (value, e / 200, o * 5e-5)
    _, efficiency, overhead = best
    print(f"fitted on {', '.join(papers.PTDP_FITTED)}: gemm_efficiency={efficiency}, layer_overhead_s={overhead:.5f}")
    cluster = dataclasses.replace(scaling.DGX_A100, gemm_efficiency=efficiency, layer_overhead_s=overhead)
    for label, repeats in (("interleaved (the model's fastest v)", None), ("1F1B (v = 1)", 1)):
        predicted = papers.ptdp_predictions(cluster, repeats)
        errors = papers.ptdp_errors(predicted)
        print(label)
        for row in papers.PTDP_TABLE1:
            points, relative = errors[row.name]
            kind = "fitted" if row.name in papers.PTDP_FITTED else "held out"
            print(f"  {row.name:>8} {kind:>8}: published {row.tflops:5.1f}, predicted {predicted[row.name]:6.1f} "
                  f"TFLOP/s per GPU, {points:+5.1f} points, {relative:+6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
