"""Throughput and model-FLOPs accounting, and the metrics writers (JSON lines + TensorBoard)."""

from __future__ import annotations

import json
import pathlib

import jax

# Dense bf16/fp16 peak per device (vendor datasheets), by substring of jax's device_kind.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L4": 121e12, "V100": 125e12,
    "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12, "TPU v6": 918e12,
}


def transformer_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron's model FLOPs of one forward+backward step (Narayanan et al. 2021, without recomputation):
    72 B s L h^2 (1 + s / (6 h) + V / (12 L h)); the last term is the output layer over every position."""
    return 72.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def sequences_per_step(spec) -> int:
    """Sequences of ``max_seq_len`` through the trunk per step: one per example, four for multiple choice (each
    RACE option is its own row)."""
    from megajax.training.objectives import NUM_CHOICES

    return spec.global_batch * (NUM_CHOICES if spec.model_name == "bert_multiple_choice" else 1)


def model_flops_per_step(spec, seq: int) -> float:
    """Model FLOPs of one step of a resolved run (``config.RunSpec``): GPT's formula; BERT adds its MLM
    transform (an h x h dense at every position, 6 B s h^2 forward + backward; the pooler is negligible). Task
    models have no output layer over the vocabulary (their heads are negligible) and count every sequence."""
    m = spec.model
    vocab = m.padded_vocab_size if spec.model_name in ("gpt", "bert") else 0
    rows = sequences_per_step(spec)
    flops = transformer_flops(rows, seq, m.num_layers, m.hidden_size, vocab)
    if spec.model_name == "bert":
        flops += 6.0 * rows * seq * m.hidden_size**2
    return flops


def peak_flops(device: jax.Device, override: float | None = None) -> float | None:
    """Peak FLOP/s of ``device`` from the table (None when unknown, e.g. CPU), unless overridden."""
    if override:
        return float(override)
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if k.lower() in kind.lower()), None)


class MetricsWriter:
    """Appends one JSON object per line to ``workdir/metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, workdir: str | pathlib.Path, enabled: bool = True):
        self.enabled = enabled
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self._tb = None
        if enabled:
            from tensorboardX import SummaryWriter  # a core dependency

            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(str(workdir))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None and "step" in record:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, record["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
