"""Multi-host start-up: ``jax.distributed.initialize`` when launched under SLURM or Open MPI, or with
``JAX_COORDINATOR_ADDRESS`` (plus ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``) in the environment."""

from __future__ import annotations

import os

import jax


def launched_multi_process() -> bool:
    env = os.environ
    return ("JAX_COORDINATOR_ADDRESS" in env or int(env.get("SLURM_NTASKS", "1")) > 1
            or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)


def maybe_initialize() -> None:
    """Joins the job's other processes if there are any; a no-op for a single process."""
    if not launched_multi_process() or jax.distributed.is_initialized():
        return
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts talk over TCP
    if "JAX_COORDINATOR_ADDRESS" in os.environ and "JAX_NUM_PROCESSES" in os.environ:
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                                   int(os.environ["JAX_PROCESS_ID"]))
    else:
        jax.distributed.initialize()  # SLURM / Open MPI auto-detection
