"""The scaling model (megajax/tools/scaling.py) beside Megatron-LM's published scaling figures
(megajax/tools/scaling_papers.py).

    python bench/scaling_plot.py [--output=bench/scaling_vs_paper.png] [--no_plot]

Prints every published figure of the 2019 paper (Figure 5's two curves, Table 7, Table 8, the 1-GPU baseline and
the abstract's 512-GPU number) beside its prediction on ``DGX2H_V100``, and PTD-P's Table 1 (2021) beside its
predictions on ``DGX_A100`` (interleaved with the model's fastest v, and plain 1F1B), then draws the 2019 figures
with each Figure 5 configuration's predicted step split into compute, tensor-parallel and exposed data-parallel
time. Plotting needs matplotlib (not a megajax dependency): ``pip install matplotlib``; ``--no_plot`` prints the
tables only. Pure Python, a few seconds.
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from megajax.parallel.mesh import MeshShape  # noqa: E402
from megajax.tools import scaling, scaling_papers  # noqa: E402

UNITS = {"baseline TFLOP/s": "TFLOP/s", "table 8": "x"}  # the rest are weak-scaling efficiencies in %
AXIS = {"baseline TFLOP/s": "GPUs", "figure 5 model": "GPUs", "figure 5 model+data": "GPUs", "table 7": "heads",
        "table 8": "GPUs", "abstract": "GPUs"}


def text_table(predicted: dict) -> str:
    lines = [f"{'figure':<22}{'':>10}{'published':>11}{'predicted':>11}{'error':>10}"]
    for figure, published in scaling_papers.PAPER_PUBLISHED.items():
        unit = UNITS.get(figure, "%")
        for x, want in published.items():
            got = predicted[figure][x]
            error = f"{(got / want - 1):+.1%}" if unit != "%" else f"{got - want:+.1f} pt"
            lines.append(f"{figure:<22}{f'{x} {AXIS[figure]}':>10}{want:>9g} {unit:<2}{got:>8.2f} {unit:<2}"
                         f"{error:>9}")
    c = scaling.DGX2H_V100
    lines.append(f"constants: gemm_efficiency={c.gemm_efficiency}, layer_overhead_s={c.layer_overhead_s}, "
                 f"dp_overlap={c.dp_overlap}")
    return "\n".join(lines)


def ptdp_table() -> str:
    """PTD-P Table 1: published and predicted TFLOP/s per GPU (eq. 3's FLOPs), fitted or held out, the errors."""
    interleaved, plain = scaling_papers.ptdp_predictions(), scaling_papers.ptdp_predictions(repeats=1)
    errors, plain_errors = scaling_papers.ptdp_errors(interleaved), scaling_papers.ptdp_errors(plain)
    lines = [f"{'PTD-P row':<10}{'t':>3}{'p':>4}{'GPUs':>6}{'b':>4}{'m':>5}{'v':>3}{'published':>11}{'predicted':>11}"
             f"{'points':>8}{'rel':>8}{'1F1B':>8}{'points':>8}  rows"]
    for row in scaling_papers.PTDP_TABLE1:
        v = scaling_papers.ptdp_prediction(row).pipeline.repeats if row.pipe > 1 else 1
        points, relative = errors[row.name]
        kind = "fitted" if row.name in scaling_papers.PTDP_FITTED else "held out"
        lines.append(f"{row.name:<10}{row.tensor:>3}{row.pipe:>4}{row.gpus:>6}{row.micro_batch:>4}"
                     f"{row.microbatches if row.pipe > 1 else '-':>5}{v:>3}{row.tflops:>11.0f}"
                     f"{interleaved[row.name]:>11.1f}{points:>+8.1f}{relative:>+8.1%}{plain[row.name]:>8.1f}"
                     f"{plain_errors[row.name][0]:>+8.1f}  {kind}")
    c = scaling.DGX_A100
    lines.append(f"constants: gemm_efficiency={c.gemm_efficiency}, layer_overhead_s={c.layer_overhead_s}, "
                 f"dp_overlap={c.dp_overlap} (fitted on {', '.join(scaling_papers.PTDP_FITTED)})")
    return "\n".join(lines)


def ptdp_megajax_table() -> str:
    """PTD-P Table 1's rows with megajax's own pipeline schedules (GPipe / 1F1B holding residuals or recomputing the
    stages / circular), the fastest that fits 80 GB, without sequence parallelism (the paper's setting) and with it."""
    lines = [f"{'PTD-P row':<10}{'SP':>4}{'schedule':>10}{'v':>3}{'remat':>10}{'stage again':>12}{'published':>11}"
             f"{'megajax':>9}{'rel':>8}{'GiB':>8}  fits"]
    for sequence in (False, True):
        for row in [r for r in scaling_papers.PTDP_TABLE1 if r.pipe > 1 or not sequence]:  # (pipelined rows only)
            p = scaling_papers.ptdp_megajax_prediction(row, sequence=(sequence,))
            tflops = scaling_papers.ptdp_tflops(row, p)
            lines.append(f"{row.name:<10}{'yes' if p.run.sequence else 'no':>4}{p.pipeline.schedule:>10}"
                         f"{p.pipeline.repeats:>3}{p.run.model.remat:>10}{str(p.pipeline.stage_recompute):>12}"
                         f"{row.tflops:>11.0f}{tflops:>9.1f}{tflops / row.tflops - 1:>+8.1%}"
                         f"{p.memory_bytes / 2**30:>8.1f}  {p.fits}")
    return "\n".join(lines)


def breakdown() -> list[tuple[str, scaling.Prediction]]:
    """Figure 5's configurations' predicted steps (the paper's fp16 gradients)."""
    out = []
    for t, (name, model) in zip((1, 2, 4, 8), scaling_papers.PAPER_MODELS.items()):
        for data, batch in ((1, 8), (64, 512)):
            p = scaling.predict(model, MeshShape(data, t), batch, scaling.DGX2H_V100, grad_bytes=2, memory=False,
                                reduce_once=True)
            out.append((f"{name}\n{data}x{t}", p))
    return out


def plot(predicted: dict, output: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pub = scaling_papers.PAPER_PUBLISHED
    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    a = ax[0, 0]
    for key, color, label in (("figure 5 model", "tab:blue", "model parallel (1-8 GPUs)"),
                              ("figure 5 model+data", "tab:green", "model + 64-way data (64-512 GPUs)")):
        xs = list(pub[key])
        a.plot(xs, [pub[key][x] for x in xs], "o", color=color, ms=8, label=f"paper: {label}")
        a.plot(xs, [predicted[key][x] for x in xs], "-x", color=color, label=f"model: {label}")
    a.plot([512], [pub["abstract"][512]], "s", color="tab:red", label="paper: 8.3B (24 heads), 512 GPUs")
    a.plot([512], [predicted["abstract"][512]], "x", color="tab:red", ms=10, label="model: same")
    a.set(xscale="log", xlabel="GPUs", ylabel="weak-scaling efficiency (%)", ylim=(50, 105),
          title="Figure 5: Table 1 models, 1.2B on 1 GPU = 100%")
    a.set_xticks([1, 2, 4, 8, 64, 128, 256, 512], labels=["1", "2", "4", "8", "64", "128", "256", "512"])
    a.legend(fontsize=7)
    a = ax[0, 1]
    heads = list(pub["table 7"])
    a.bar([h - 1.5 for h in heads], [pub["table 7"][h] for h in heads], 3, label="paper")
    a.bar([h + 1.5 for h in heads], [predicted["table 7"][h] for h in heads], 3, label="model")
    a.set(xticks=heads, xlabel="attention heads", ylabel="weak-scaling efficiency (%)", ylim=(50, 100),
          title="Table 7: 8.3B, 8-way model parallel")
    a.legend()
    a = ax[1, 0]
    gpus = list(pub["table 8"])
    a.plot(gpus, gpus, ":", color="gray", label="linear")
    a.plot(gpus, [pub["table 8"][g] for g in gpus], "o", ms=8, label="paper")
    a.plot(gpus, [predicted["table 8"][g] for g in gpus], "-x", label="model")
    a.set(xlabel="model-parallel GPUs", ylabel="speedup", title="Table 8: 1.2B strong scaling, batch 8")
    a.legend()
    a = ax[1, 1]
    rows = breakdown()
    names = [n for n, _ in rows]
    bottom = [0.0] * len(rows)
    for part, label in (("compute_s", "compute"), ("tensor_comm_s", "tensor-parallel all-reduce"),
                        ("data_comm_s", "exposed data-parallel all-reduce")):
        values = [getattr(p, part) for _, p in rows]
        a.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    a.set(ylabel="predicted seconds per step", title="Figure 5's runs, predicted step (DGX-2H)",
          ylim=(0, 1.35 * max(bottom)))
    a.tick_params(axis="x", labelsize=7)
    a.legend(fontsize=8)
    fig.suptitle("megajax.scaling vs Shoeybi et al. 2019 (published points: markers / left bars)")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default=str(pathlib.Path(__file__).resolve().parent / "scaling_vs_paper.png"))
    p.add_argument("--no_plot", action="store_true", help="print the table only")
    args = p.parse_args()
    predicted = scaling_papers.paper_predictions()
    print(text_table(predicted))
    print()
    print(ptdp_table())
    print()
    print(ptdp_megajax_table())
    if args.no_plot:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib, which is not installed: pip install matplotlib "
              "(or pass --no_plot for the table only)", file=sys.stderr)
        return 1
    plot(predicted, pathlib.Path(args.output))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
