"""Persistence: orbax checkpoints with exact resume and resharding on restore (``manager.py``) and the per-array
digests verified on every restore (``digest.py``). The config travels as JSON: stored as given, returned as stored
(``config.load`` reads it as today's config). Nothing here builds a mesh or a model: callers pass the target
layout."""

from megajax.checkpoint.manager import (
    Checkpointer,
    CheckpointError,
    CheckpointSettings,
    check_shapes,
    read_config,
    restore_params,
    save_params,
    saved_steps,
    verify,
)

__all__ = ["CheckpointError", "CheckpointSettings", "Checkpointer", "check_shapes", "read_config", "restore_params",
           "save_params", "saved_steps", "verify"]


def __getattr__(name: str):
    """``megajax.checkpoint.load_model``: the old entry point, kept for scripts; it still returns ``(model, config)``.
    New code calls ``megajax.load_model`` (``(model, spec, mesh)``)."""
    if name == "load_model":
        # The one import of this package that points up a layer, kept for the deprecated alias: loading a model
        # builds a mesh and a model, which persistence does not.
        from megajax.config.load import load_model_and_config

        return load_model_and_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
