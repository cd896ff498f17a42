"""Training checkpoints (orbax) with exact resume and resharding on restore; params-only exports.

A training checkpoint is ``WORKDIR/checkpoints/<step>/`` with four items: ``state`` (parameters, optimizer
state, step, loss-scale state, dropout key), ``data`` (the loader's position), ``config`` (the config that made
it) and ``digests`` (a 64-bit content digest of every array, see ``megajax.checkpoint.digest``). Restoring reads every
array straight into the target mesh's shardings, so a checkpoint written on 1x8 loads on 2x4 or 1x1 without
gathering the model on one host, then checks each array against its digest: orbax's zarr/zstd files carry no
checksum of their data, so changed bytes would otherwise restore silently. Checkpoints written before digests
existed load unverified. Saves are asynchronous; orbax writes into a temporary directory and renames it when
complete, so a process killed mid-save leaves the previous checkpoint intact.

Paths may be relative (orbax needs absolute ones): every public function resolves its path first.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import os
import pathlib
import re
import shutil
import socket
import sys
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import serialization

from megajax.checkpoint import digest as array_digest
from megajax.errors import UserError
from megajax.outputs import CHECKPOINTS_NAME, STEP_CONFIG, STEP_PARAMS, STEP_STATE

SUPERSEDED = "superseded"  # WORKDIR/superseded/<time>/<step>: steps set aside by a resume from an earlier step


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be restored into this config; the message names the parameter."""


def _resolve(path: str | pathlib.Path) -> pathlib.Path:
    return pathlib.Path(path).expanduser().resolve()


def _to_tree(state: Any) -> Any:
    return serialization.to_state_dict(state)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def _path(keys) -> str:
    return jax.tree_util.keystr(keys, simple=True, separator="/")


def _params_first(name: str) -> tuple[bool, str]:
    return not name.startswith("params"), name


def _arrays(tree: Any) -> dict[str, Any]:
    """``{"params/wte/embedding": array, ...}`` for the array leaves of a state tree."""
    return {_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree) if hasattr(v, "dtype")}


def check_shapes(saved: Any, target: Any, where: str) -> None:
    """Raises CheckpointError naming the first parameter whose saved shape or presence differs from the target."""
    saved_flat = {_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(saved)}
    leaves = [(_path(p), v) for p, v in jax.tree_util.tree_leaves_with_path(target)]
    for name, want in sorted(leaves, key=lambda kv: _params_first(kv[0])):
        got = saved_flat.get(name)
        if got is None:
            raise CheckpointError(f"{where}: parameter {name} is missing from the checkpoint")
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{where}: parameter {name} has shape {tuple(got.shape)} in the checkpoint but "
                                  f"{tuple(want.shape)} in this config; use the config the checkpoint was made with")


def _steps_in(directory: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) \
        if directory.is_dir() else []


def _train_hint(directory: pathlib.Path, bad_step: int) -> str:
    others = [s for s in _steps_in(directory) if s != bad_step]
    if not others:
        return f"No other step is saved in {directory}: train from scratch in a new --workdir."
    return (f"To resume from an earlier step pass --config.checkpoint.restore_step=N (steps available in "
            f"{directory}: {', '.join(map(str, others))}).")


def _load_hint(step_dir: pathlib.Path) -> str:
    others = [s for s in _steps_in(step_dir.parent) if str(s) != step_dir.name]
    if not others:
        return "No other step is saved beside it: re-convert or re-train."
    return (f"Load an earlier step by passing its directory, e.g. {step_dir.parent / str(others[-1])} "
            f"(steps available: {', '.join(map(str, others))}).")


# orbax names an array by its keys joined with '.'; tensorstore's errors quote it as `reading "NAME/chunk"` and
# the array's spec as `'path': 'NAME/'` (the spec's file paths start with '/', so they do not match).
_ORBAX_ARRAY = re.compile(r"""(?:reading "|'path': ')([^"'/]+)/""")


def _unreadable_array(error: BaseException) -> str | None:
    """The array a tensorstore failure was reading (as "params/wte/embedding"), from the exception's chain."""
    seen = error
    while seen is not None:
        found = _ORBAX_ARRAY.search(str(seen))
        if found:
            return found.group(1).replace(".", "/")
        seen = seen.__cause__ or seen.__context__
    return None


def _closed_loop_reports_quieted() -> None:
    """After a failed read, tensorstore's other reads still in flight finish into orbax's asyncio loop, which has
    closed by then; each reports ``RuntimeError: Event loop is closed`` through ``sys.unraisablehook`` (tracebacks
    beside the command's one ``error:`` line, before or after it). Those reports, and only those, are dropped from
    the first read on (installed before it: the loop closes before the failure reaches ``_read``)."""
    hook = sys.unraisablehook
    if getattr(hook, "quiets_closed_loops", False):
        return

    def quieted(report) -> None:
        if not (isinstance(report.exc_value, RuntimeError) and str(report.exc_value) == "Event loop is closed"):
            hook(report)

    quieted.quiets_closed_loops = True
    sys.unraisablehook = quieted


def _read(fn, where: str, hint: str) -> Any:
    """Runs an orbax read; any failure becomes a CheckpointError naming the array tensorstore could not read."""
    _closed_loop_reports_quieted()
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for damaged files
        root = e
        while root.__cause__ is not None:
            root = root.__cause__  # orbax's own message is a spec dump; the cause says what went wrong
        array = _unreadable_array(e)
        # arrays share files (OCDBT): the one named is the first read that failed, not necessarily the only one
        what = f"array {array} (the first that failed) cannot be read" if array else "it cannot be read"
        cause = str(root)
        cause = cause if len(cause) <= 600 else cause[:600].rsplit(" ", 1)[0] + " ..."  # whole words, whole paths
        raise CheckpointError(f"{where} is damaged or incomplete: {what} ({type(root).__name__}: "
                              f"{cause}). Nothing was changed. {hint}") from e


def _digest_record(tree: Any) -> dict:
    arrays = _arrays(tree)
    sums = array_digest.digests(arrays)
    return {"algorithm": array_digest.ALGORITHM,
            "arrays": {n: {"digest": sums[n], "dtype": str(arrays[n].dtype)} for n in arrays}}


def verify(tree: Any, record: dict | None, where: str, hint: str) -> None:
    """Raises CheckpointError naming the arrays of ``tree`` that differ from the digests saved with them.

    Arrays restored into a wider dtype (a bfloat16 export read as float32) are cast back, which is exact; arrays
    read into a narrower dtype, unknown names and checkpoints without digests (``record`` None) are not checked.
    """
    if not record or record.get("algorithm") != array_digest.ALGORITHM:
        return
    saved, comparable = record["arrays"], {}
    for name, x in _arrays(tree).items():
        if name not in saved:
            continue
        dtype = jnp.dtype(saved[name]["dtype"])
        if x.dtype != dtype and jnp.promote_types(dtype, x.dtype) == x.dtype:
            x = x.astype(dtype)
        if x.dtype == dtype:
            comparable[name] = x
    got = array_digest.digests(comparable)
    bad = sorted((n for n in got if got[n] != saved[n]["digest"]), key=_params_first)
    if bad:
        more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})" \
            if len(bad) > 1 else ""
        raise CheckpointError(f"{where} is damaged: array {bad[0]}{more} does not match the digest written with "
                              f"it, so its bytes changed after the save. Nothing was changed. {hint}")


def _array_tree_handler() -> ocp.PyTreeCheckpointHandler:
    """orbax's pytree handler; with one process, replica-parallel writing is off.

    Replica-parallel writing splits each replicated shard among the processes that hold a replica. One process
    writes every replica anyway, and the split only adds a device slice per shard, each compiled once per shape
    (about 100 small compilations for a 2x4 BERT). orbax already turns it off on GPUs; with several processes its
    default stays.
    """
    if jax.process_count() > 1:
        return ocp.PyTreeCheckpointHandler()
    from orbax.checkpoint._src.metadata.array_metadata_store import Store  # the store orbax's default handler uses

    th = ocp.type_handlers
    array = th.ArrayHandler(use_replica_parallel=False, array_metadata_store=Store())
    registry = th.create_type_handler_registry(*((ty, array if ty is jax.Array else th.get_type_handler(ty))
                                                 for ty in th.supported_types()))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _handlers() -> dict:
    return {STEP_STATE: _array_tree_handler(), "data": ocp.JsonCheckpointHandler(),
            STEP_CONFIG: ocp.JsonCheckpointHandler(), "digests": ocp.JsonCheckpointHandler()}


def _check_writable(directory: pathlib.Path) -> None:
    """Creates ``directory`` and writes and removes a probe file in it: orbax meets a read-only directory only at
    the first save, then retries for minutes before a TimeoutError."""
    probe = directory / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints to {directory} ({e.strerror or e}): make it writable or "
                              "pass a different --workdir; nothing in it was changed") from None


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """When a run saves and which step it resumes (``config.checkpoint``, resolved by ``megajax.config.resolve``)."""

    enabled: bool
    every_steps: int
    keep: int  # the newest K checkpoints (0: all)
    keep_period: int  # also keep every M-th step forever (0: off)
    async_save: bool  # write in the background while training continues
    restore_step: int  # resume from this step (0: the latest)


class Checkpointer:
    """Periodic asynchronous saves of the training state, the loader position, the config and the digests."""

    def __init__(self, workdir: str | pathlib.Path, cfg: CheckpointSettings):
        self.directory = _resolve(workdir) / CHECKPOINTS_NAME
        _check_writable(self.directory)
        self._remove_partial_saves()
        # orbax's own clean-up of partial saves runs in a thread that outlives close(); a command that fails right
        # after this then prints that thread's traceback at exit. It is done above instead, synchronously.
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=cfg.every_steps, max_to_keep=cfg.keep or None,  # keep=0: no limit
            keep_period=cfg.keep_period or None, enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

    def _remove_partial_saves(self) -> None:
        """Removes what a save that did not finish left behind (a killed run's, or a failed one's)."""
        if jax.process_index() == 0:
            for partial in self.directory.glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, loader_state: dict, config: str, force: bool = False) -> bool:
        """Starts a save if ``step`` is due (or ``force``); returns whether one started. ``config``: the run's
        config as JSON text (``RunSpec.config_json``), stored beside the state."""
        if not (force or self.manager.should_save(step)):
            return False  # the common case: no host work on the step's hot path
        tree = _to_tree(state)
        self.check_space(tree)
        try:
            return self.manager.save(step, force=force, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(tree), data=ocp.args.JsonSave(loader_state),
                config=ocp.args.JsonSave(json.loads(config)), digests=ocp.args.JsonSave(_digest_record(tree))))
        except Exception as e:  # this save, or the previous asynchronous one, failed
            raise self._failed_save(e) from e

    def restore(self, state_template: Any, step: int | None = None) -> tuple[Any, dict] | None:
        """(state, loader state) from ``step`` (default: the latest) laid out like ``state_template``'s arrays.

        Every array is checked against its digest; damage raises CheckpointError naming the array.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        where, hint = f"checkpoint {self.directory / str(step)}", _train_hint(self.directory, step)
        target = _to_tree(state_template)
        saved = _read(lambda: self.manager.item_metadata(step)["state"], where, hint)
        check_shapes(saved, target, where)
        items = {"state": ocp.args.PyTreeRestore(_abstract(target),
                                                 ocp.checkpoint_utils.construct_restore_args(target)),
                 "data": ocp.args.JsonRestore()}
        if (self.directory / str(step) / "digests").is_dir():  # absent in checkpoints from before digests
            items["digests"] = ocp.args.JsonRestore()
        restored = _read(lambda: self.manager.restore(step, args=ocp.args.Composite(**items)), where, hint)
        verify(restored["state"], restored.get("digests"), where, hint)
        return serialization.from_state_dict(state_template, restored["state"]), restored["data"]

    def stored(self, step: int) -> tuple[dict, dict]:
        """(the config as stored, ``read_config``; the loader position) saved with ``step``: what a resume can check
        before compiling."""
        step_dir = self.directory / str(step)
        where, hint = f"checkpoint {step_dir}", _train_hint(self.directory, step)
        return read_config(step_dir), _read(lambda: _read_json_item(step_dir / "data"), where, hint)

    def resume(self, state_template: Any, restore_step: int = 0) -> tuple[Any, dict] | None:
        """What training continues from: step ``restore_step`` (0: the latest), or None with no checkpoint.

        Steps newer than ``restore_step`` belong to the abandoned continuation; they are moved to
        ``WORKDIR/superseded/<time>/`` (never deleted) so this run's own saves do not collide with them.
        """
        steps = list(self.manager.all_steps())
        if restore_step and restore_step not in steps:
            available = ", ".join(map(str, sorted(steps))) or "none"
            raise CheckpointError(f"checkpoint.restore_step={restore_step}, but {self.directory} holds no step "
                                  f"{restore_step} (steps available: {available}); pass one of them, or 0 for "
                                  "the latest")
        restored = self.restore(state_template, restore_step or None)
        newer = sorted(s for s in steps if restore_step and s > restore_step)
        if newer:
            self._set_aside(newer)
        return restored

    def _set_aside(self, steps: list[int]) -> None:
        destination = self.directory.parent / SUPERSEDED / \
            datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
        if jax.process_index() == 0:
            destination.mkdir(parents=True, exist_ok=True)
            for s in steps:
                (self.directory / str(s)).rename(destination / str(s))
            print(f"resuming from an earlier step: moved the newer checkpoints {', '.join(map(str, steps))} to "
                  f"{destination} (kept; delete them when you no longer need them)", file=sys.stderr)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("megajax_checkpoint_set_aside")
        self.manager.reload()

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # the asynchronous save failed
            raise self._failed_save(e) from e

    def check_space(self, state: Any) -> None:
        """Raises CheckpointError when the checkpoint disk has less room than this process's share of ``state``
        (arrays or ShapeDtypeStructs): refused before orbax starts writing, whose failure mid-write is noisy."""
        need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) // jax.process_count()
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise CheckpointError(
                f"the disk of {self.directory} has {free / 2**20:.1f} MiB free but a checkpoint of this run takes "
                f"~{need / 2**20:.1f} MiB: free space, or pass a --workdir on a larger disk, and run the same command "
                "again (the checkpoints saved before are intact)")

    def _failed_save(self, error: Exception) -> Exception:
        """Removes the failed save's temporary directory (orbax leaves it until the next start) and returns the
        error to raise: a CheckpointError saying what happened when the cause is the file system."""
        self._remove_partial_saves()
        code, cause = None, error
        while cause is not None and code is None:  # an OSError, or tensorstore's text with the OS error code
            found = re.search(r"os_error_code='(\d+)'", str(cause))
            code = cause.errno if isinstance(cause, OSError) else int(found.group(1)) if found else None
            cause = cause.__cause__ or cause.__context__
        if code is None:
            return error  # not the file system: a bug, raised as it is
        full = code in (errno.ENOSPC, errno.EDQUOT)
        return CheckpointError(
            f"saving a checkpoint to {self.directory} failed: {'the disk is full' if full else os.strerror(code)}. "
            "The checkpoints saved before are intact and the partial one was removed; "
            f"{'free space' if full else 'fix the directory'} and run the same command again to resume")

    def close(self) -> None:
        self.manager.close()


def saved_steps(workdir: str | pathlib.Path) -> list[int]:
    """The training checkpoints a workdir holds (complete ones: a save in progress has a temporary name), read
    without creating anything."""
    return _steps_in(_resolve(workdir) / CHECKPOINTS_NAME)


def _step_dir(path: pathlib.Path) -> pathlib.Path:
    """A workdir, a checkpoints/ directory or a step directory -> the step directory to read."""
    if (path / CHECKPOINTS_NAME).is_dir():
        path = path / CHECKPOINTS_NAME
    if (path / STEP_CONFIG).is_dir():
        return path
    steps = _steps_in(path)
    if not steps:
        raise FileNotFoundError(f"no megajax checkpoint at {path} (expected a workdir, its checkpoints/ "
                                "directory, or a step directory holding config/ and state/ or params/)")
    return path / str(steps[-1])


def _read_json_item(item: pathlib.Path) -> Any:
    handler = ocp.JsonCheckpointHandler()
    try:
        return handler.restore(item)
    finally:
        handler.close()


def read_config(path: str | pathlib.Path) -> dict:
    """The config stored with a checkpoint (training checkpoint or export), as written: its JSON. Reading it as
    today's config (the fields added since, the family's own) is the config layer's: ``config.load.run_config``."""
    return _read_json_item(_step_dir(_resolve(path)) / STEP_CONFIG)


def restore_params(path: str | pathlib.Path, target: Any) -> Any:
    """The parameter tree of a checkpoint, read straight into ``target``'s shardings and dtypes, then verified."""
    step_dir = _step_dir(_resolve(path))
    where, hint = f"checkpoint {step_dir}", _load_hint(step_dir)
    handler = _array_tree_handler()
    if (step_dir / STEP_STATE).is_dir():  # a training checkpoint: only its params subtree
        item, wrap = step_dir / STEP_STATE, lambda t: {"params": t}
    elif (step_dir / STEP_PARAMS).is_dir():
        item, wrap = step_dir / STEP_PARAMS, lambda t: t
    else:
        raise FileNotFoundError(f"{step_dir} holds neither state/ nor params/")
    try:
        saved = _read(lambda: handler.metadata(item).tree, where, hint)
        check_shapes(saved, wrap(target), where)
        args = ocp.args.PyTreeRestore(wrap(_abstract(target)),
                                      ocp.checkpoint_utils.construct_restore_args(wrap(target)), partial_restore=True)
        restored = _read(lambda: handler.restore(item, args=args), where, hint)
    finally:
        handler.close()
    record = _read(lambda: _read_json_item(step_dir / "digests"), where, hint) \
        if (step_dir / "digests").is_dir() else None
    verify(restored, record, where, hint)
    return restored["params"] if (step_dir / STEP_STATE).is_dir() else restored


def save_params(path: str | pathlib.Path, params: Any, config: str, step: int = 0,
                dtype: str | None = None) -> pathlib.Path:
    """Writes a params-only checkpoint (``path/<step>/{params,config,digests}``), optionally cast (e.g. bfloat16).
    ``config``: the model's config as JSON text (``config.to_json()``, ``RunSpec.config_json``), as
    ``Checkpointer.save`` takes it. ``params`` hold the stacked layers in the model's order (converters and exports
    make them so), and the config written says so: ``parallel.pipeline_repeats`` 1, whatever the given config's
    pipeline schedule (readers reorder by the layout a config records: ``megajax.config.layer_layout``)."""
    path = _resolve(path)
    config = json.loads(config)
    if "parallel" in config:
        config["parallel"]["pipeline_repeats"] = 1
    if dtype:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    manager = ocp.CheckpointManager(path, item_handlers={
        STEP_PARAMS: _array_tree_handler(), STEP_CONFIG: ocp.JsonCheckpointHandler(),
        "digests": ocp.JsonCheckpointHandler()})
    manager.save(step, force=True, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params),
                                                           config=ocp.args.JsonSave(config),
                                                           digests=ocp.args.JsonSave(_digest_record(params))))
    manager.wait_until_finished()
    manager.close()
    return path / str(step)
