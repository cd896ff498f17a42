"""Starting jax quietly on a host without a GPU that has JAX's CUDA plugin installed (the ``gpu-compile`` extra,
to compile for GPUs on a CPU host). Imports no jax at module level, so ``megajax/__init__.py`` can run it first."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterator

# What the plugin's C++ start-up writes to stderr (past Python) when jax loads it on a host without an NVIDIA
# driver, each time jax is imported and again when its backends start: known, and no problem there.
CUDA_NOTICES = re.compile(r"cudart_stub\.cc.*Could not find cuda drivers|All log messages before absl::InitializeLog")


def cuda_plugin_installed() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except (ImportError, ValueError):
        return False


def has_nvidia_driver() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


@contextlib.contextmanager
def quiet_cuda_notices() -> Iterator[None]:
    """Runs the block with file descriptor 2 captured, then writes back all it wrote but ``CUDA_NOTICES``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            sys.stderr.write("".join(line for line in captured.read().decode(errors="replace").splitlines(True)
                                     if not CUDA_NOTICES.search(line)))


def cpu_without_a_gpu() -> None:
    """With the CUDA plugin installed and no NVIDIA driver, jax would print an "Unable to load CUDA" traceback when
    it starts, and the plugin its notices: megajax asks for the CPU (unless ``JAX_PLATFORMS`` names platforms) and
    imports jax with the notices left out. Nothing happens where jax started before megajax was imported."""
    if "jax" in sys.modules or has_nvidia_driver() or not cuda_plugin_installed():
        return
    if not os.environ.get("JAX_PLATFORMS"):  # empty is unset to jax too: every platform, CUDA's check failing
        os.environ["JAX_PLATFORMS"] = "cpu"
    with quiet_cuda_notices():
        import jax  # noqa: F401 - the import that loads the plugin
