"""Training checkpoints (orbax) with exact resume and resharding on restore, and loading a model for inference.

A training checkpoint is ``WORKDIR/checkpoints/<step>/`` with three items: ``state`` (parameters, optimizer
state, step, loss-scale state, dropout key), ``data`` (the loader's position) and ``config`` (the config that made
it). Restoring reads every array straight into the target mesh's shardings, so a checkpoint written on 1x8 loads
on 2x4 or 1x1 without gathering the model on one host. Saves are asynchronous; orbax writes into a temporary
directory and renames it when complete, so a process killed mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import serialization

ITEMS = ("state", "data", "config")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored into this config; the message names the parameter."""


def _to_tree(state: Any) -> Any:
    return serialization.to_state_dict(state)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in keys)


def check_shapes(saved: Any, target: Any, where: str) -> None:
    """Raises CheckpointError naming the first parameter whose saved shape or presence differs from the target."""
    saved_flat = {_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(saved)}
    leaves = [(_path(p), v) for p, v in jax.tree_util.tree_leaves_with_path(target)]
    for name, want in sorted(leaves, key=lambda kv: (not kv[0].startswith("params"), kv[0])):  # params first
        got = saved_flat.get(name)
        if got is None:
            raise CheckpointError(f"{where}: parameter {name} is missing from the checkpoint")
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{where}: parameter {name} has shape {tuple(got.shape)} in the checkpoint but "
                                  f"{tuple(want.shape)} in this config; use the config the checkpoint was made with")


def _read(fn, where: str) -> Any:
    """Runs an orbax read; any failure becomes a CheckpointError naming the array tensorstore could not read."""
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for damaged files
        array = re.search(r'reading "([^"/]+)/', str(e))
        name = f" (parameter {array.group(1).replace('.', '/')})" if array else ""
        raise CheckpointError(f"{where} is damaged or incomplete{name} and cannot be read: {type(e).__name__}: "
                              f"{str(e)[:300]}. Restore an earlier step or re-convert; nothing was changed.") from e


def _handlers() -> dict:
    return {"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler()}


class Checkpointer:
    """Periodic asynchronous saves of the training state, the loader position and the config."""

    def __init__(self, workdir: str | pathlib.Path, cfg: ml_collections.ConfigDict):
        self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=cfg.every_steps, max_to_keep=cfg.keep, keep_period=cfg.keep_period or None,
            enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, loader_state: dict, config: ml_collections.ConfigDict,
             force: bool = False) -> bool:
        """Starts a save if ``step`` is due (or ``force``); returns whether one started."""
        if not (force or self.manager.should_save(step)):
            return False  # the common case: no host work on the step's hot path
        return self.manager.save(step, force=force, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(_to_tree(state)), data=ocp.args.JsonSave(loader_state),
            config=ocp.args.JsonSave(json.loads(config.to_json()))))

    def restore(self, state_template: Any, step: int | None = None) -> tuple[Any, dict] | None:
        """(state, loader state) from ``step`` (default: the latest) laid out like ``state_template``'s arrays."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        where = f"checkpoint {self.directory / str(step)}"
        target = _to_tree(state_template)
        saved = _read(lambda: self.manager.item_metadata(step)["state"], where)
        check_shapes(saved, target, where)
        restored = _read(lambda: self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(_abstract(target), ocp.checkpoint_utils.construct_restore_args(target)),
            data=ocp.args.JsonRestore())), where)
        return serialization.from_state_dict(state_template, restored["state"]), restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _step_dir(path: pathlib.Path) -> pathlib.Path:
    """A workdir, a checkpoints/ directory or a step directory -> the step directory to read."""
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if (path / "config").is_dir():
        return path
    steps = sorted((int(p.name), p) for p in path.iterdir() if p.is_dir() and p.name.isdigit()) \
        if path.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"no megajax checkpoint at {path} (expected a workdir, its checkpoints/ "
                                "directory, or a step directory holding config/ and state/ or params/)")
    return steps[-1][1]


def read_config(path: str | pathlib.Path) -> ml_collections.ConfigDict:
    """The config stored with a checkpoint (training checkpoint or export)."""
    step_dir = _step_dir(pathlib.Path(path))
    handler = ocp.JsonCheckpointHandler()
    try:
        return ml_collections.ConfigDict(handler.restore(step_dir / "config"))
    finally:
        handler.close()


def restore_params(path: str | pathlib.Path, target: Any) -> Any:
    """The parameter tree of a checkpoint, read straight into ``target``'s shardings and dtypes."""
    step_dir = _step_dir(pathlib.Path(path))
    where = f"checkpoint {step_dir}"
    handler = ocp.PyTreeCheckpointHandler()
    if (step_dir / "state").is_dir():  # a training checkpoint: only its params subtree
        item, wrap = step_dir / "state", lambda t: {"params": t}
    elif (step_dir / "params").is_dir():
        item, wrap = step_dir / "params", lambda t: t
    else:
        raise FileNotFoundError(f"{step_dir} holds neither state/ nor params/")
    try:
        saved = _read(lambda: handler.metadata(item).tree, where)
        check_shapes(saved, wrap(target), where)
        args = ocp.args.PyTreeRestore(wrap(_abstract(target)),
                                      ocp.checkpoint_utils.construct_restore_args(wrap(target)), partial_restore=True)
        restored = _read(lambda: handler.restore(item, args=args), where)
    finally:
        handler.close()
    return restored["params"] if (step_dir / "state").is_dir() else restored


def save_params(path: str | pathlib.Path, params: Any, config: ml_collections.ConfigDict, step: int = 0,
                dtype: str | None = None) -> pathlib.Path:
    """Writes a params-only checkpoint (``path/<step>/{params,config}``), optionally cast (e.g. to bfloat16)."""
    if dtype:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    manager = ocp.CheckpointManager(pathlib.Path(path).absolute(), item_handlers={
        "params": ocp.PyTreeCheckpointHandler(), "config": ocp.JsonCheckpointHandler()})
    manager.save(step, force=True, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params),
                                                           config=ocp.args.JsonSave(json.loads(config.to_json()))))
    manager.wait_until_finished()
    manager.close()
    return pathlib.Path(path) / str(step)


def load_model(path: str | pathlib.Path, *, data: int | None = None, model: int | None = None):
    """Loads any megajax checkpoint onto the current devices: ``(model, config)``, ready for ``model(tokens)``.

    ``path`` is a training workdir, its ``checkpoints/`` directory, one step of it, or a params-only export.
    The mesh defaults to the checkpoint's ``mesh.model`` and all remaining devices on ``data``; parameters are
    read straight into that layout (resharding on restore).
    """
    from flax import nnx

    from megajax.builder import abstract_model, build_mesh
    from megajax.config import rules_of
    from megajax.partition import shardings

    config = read_config(path)
    config.mesh.data = -1 if data is None else data
    if model is not None:
        config.mesh.model = model
    mesh = build_mesh(config)
    graphdef, abstract = nnx.split(abstract_model(config))
    target_shardings = nnx.to_pure_dict(shardings(abstract, mesh, rules_of(config)))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(abstract), target_shardings)
    params = restore_params(path, target)
    return nnx.merge(graphdef, params), config
