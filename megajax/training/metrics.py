"""Throughput and model-FLOPs accounting, and the metrics writers (JSON lines + TensorBoard)."""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys
from collections.abc import Iterator

import jax

from megajax.config import RunSpec
from megajax.errors import UserError
from megajax.outputs import METRICS_NAME

# Dense peak FLOP/s per device from vendor datasheets: (substring of jax's device_kind, precision). The first
# matching kind wins, so the specific ones (H100 PCIe) come before the general (H100, the SXM part). fp32 runs
# use the TF32 tensor-core peak on Ampere and Hopper (XLA's default matmul precision there) and the plain FP32
# peak on Volta. A device or precision not listed gets no MFU rather than a guess (set
# train.peak_flops_per_device).
PEAK_FLOPS = {
    ("H100 PCIe", "bf16"): 756e12, ("H100 PCIe", "fp32"): 378e12, ("H100 NVL", "bf16"): 835e12,
    ("H100 NVL", "fp32"): 418e12,
    ("H100", "bf16"): 989e12, ("H100", "fp32"): 495e12, ("H200", "bf16"): 989e12, ("H200", "fp32"): 495e12,
    ("A100", "bf16"): 312e12, ("A100", "fp32"): 156e12, ("L40S", "bf16"): 362e12, ("L40S", "fp32"): 183e12,
    ("L40", "bf16"): 181e12, ("L40", "fp32"): 90.5e12, ("L4", "bf16"): 121e12, ("L4", "fp32"): 60e12,
    ("V100", "fp16"): 125e12, ("V100", "fp32"): 15.7e12,
    ("TPU v4", "bf16"): 275e12, ("TPU v5 lite", "bf16"): 197e12, ("TPU v5e", "bf16"): 197e12,
    ("TPU v5p", "bf16"): 459e12, ("TPU v6", "bf16"): 918e12,
}


def sequences_per_step(spec: RunSpec) -> int:
    """Sequences of ``max_seq_len`` through the trunk per step: the model's rows per example (multiple choice: one
    per option) for each example of the global batch."""
    return spec.global_batch * spec.model_spec.rows_per_example


def model_flops_per_step(spec: RunSpec, seq: int) -> float:
    """Model FLOPs of one step of a resolved run, as the model's spec counts them (``ModelSpec.flops``)."""
    return spec.model_spec.flops(spec.model, sequences_per_step(spec), seq)


def peak_flops(device: jax.Device, precision: str, override: float | None = None) -> float | None:
    """Peak FLOP/s of ``device`` at ``precision`` (fp32 | bf16 | fp16) from the table, None when it is not
    listed (CPUs, unknown devices), unless ``override``."""
    if override:
        return float(override)
    kind = getattr(device, "device_kind", "").lower()
    listed = ("fp32",) if precision == "fp32" else ("bf16", "fp16")  # half precisions share the tensor cores
    return next((v for (name, p), v in PEAK_FLOPS.items() if p in listed and name.lower() in kind), None)


def check_writable(workdir: str | pathlib.Path) -> None:
    """Raises UserError unless ``workdir/metrics.jsonl`` can be appended to (checked before compiling; a file this
    creates stays empty, and a failed start removes it)."""
    path = pathlib.Path(workdir) / METRICS_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        open(path, "a").close()  # appending nothing changes neither its bytes nor its time
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e}): make it writable, or pass a different "
                        "--workdir") from None


@contextlib.contextmanager
def _torch_unseen() -> Iterator[None]:
    """tensorboardX's writer imports torch where it can (3 s on a 2-core machine, every train.py start where torch is
    installed) only to accept torch tensors; megajax writes Python floats. While this holds, ``import torch`` fails
    as if torch were absent (a torch already imported is left alone); afterwards torch imports as usual."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # the import system's mark of a module that cannot be imported
    try:
        yield
    finally:
        del sys.modules["torch"]


class MetricsWriter:
    """Appends one JSON object per line to ``workdir/metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, workdir: str | pathlib.Path, enabled: bool = True):
        self.enabled = enabled
        self.path = pathlib.Path(workdir) / METRICS_NAME
        self._tb = None
        if enabled:
            with _torch_unseen():
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
