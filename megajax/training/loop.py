"""The training loop: config -> run description (``RunSpec``, resolved once at the top) -> mesh -> sharded state ->
compiled step -> logged steps. ``train`` and ``setup`` are the library's way in from a config (train.py, the
tools and ``megajax.api`` call them): each resolves it once, then every function below reads the RunSpec or its
parts, and a checkpoint's stored config as its ``StoredRun``."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.checkpoint import Checkpointer, CheckpointError, saved_steps
from megajax.cli import input_paths
from megajax.config import (
    RunSpec,
    StoredRun,
    abstract_model_of,
    describe_differences,
    model_differences,
    resolve,
    run_model_factory,
    stored_run,
)
from megajax.config.load import in_layout, run_config
from megajax.data.blend import BlendedBatches
from megajax.data.gpt_dataset import split_by_documents, unigram_entropy
from megajax.data.loader import Loader
from megajax.data.preference import PreferenceData
from megajax.data.sft import SFTData
from megajax.data.sources import BlendedData, tokenizer_fingerprint
from megajax.data.tasks.task_data import TaskData
from megajax.evaluation.evaluator import Evaluator, objective_metrics
from megajax.models.objectives import Field
from megajax.models.transformer import reorder_layers
from megajax.outputs import CHECKPOINTS_NAME, METRICS_NAME, claim_workdir
from megajax.parallel import pipeline
from megajax.parallel.fp8 import check_fp8_devices
from megajax.parallel.partition import over_data, shardings
from megajax.parallel.sharding import activate, logical_to_spec
from megajax.parallel.xla_options import compiler_options
from megajax.training import distributed
from megajax.training.data import load_dataset, make_loader
from megajax.training.finetune import check_init_from, load_trunk
from megajax.training.health import NonFiniteGuard
from megajax.training.loss_scale import LossScale
from megajax.training.metrics import (
    MetricsWriter,
    check_writable,
    model_flops_per_step,
    peak_flops,
    sequences_per_step,
)
from megajax.training.optimizer import learning_rate_schedule, make_optimizer
from megajax.training.preemption import StopRequest, TrainingStopped
from megajax.training.preference import check_reference, fill_reference
from megajax.training.step import TrainState, make_train_step
from megajax.training.workdir_lock import hold_workdir

ENTROPY_SAMPLE_TOKENS = 1 << 24  # tokens read for the logged unigram entropy


@dataclasses.dataclass
class Run:
    """Everything a training run holds besides its state."""

    spec: RunSpec
    mesh: Mesh
    abstract_state: TrainState  # ShapeDtypeStructs carrying the target shardings
    batch_shardings: dict[str, NamedSharding]  # one per batch field, from its logical names
    step_fn: jax.stages.Compiled
    num_params: int
    init_state: Callable[[], TrainState]  # fresh sharded state (jitted, each device makes its own shards)
    evaluate: Evaluator  # (params, batch) -> {'loss', ...} on the validation split, compiled on first use


def _init_fn(spec: RunSpec, optimizer: optax.GradientTransformation, param_shardings: dict):
    make, seed = run_model_factory(spec), spec.train.seed
    circular = not pipeline.same_order((1, 1), spec.layer_layout, spec.model.num_layers)

    def init() -> TrainState:  # the stacked layers in the run's order (the model's, but for a circular pipeline)
        params = nnx.to_pure_dict(nnx.state(make(seed)))
        if circular:  # each device makes its own layers, then the stages swap them (else each would make all)
            params = reorder_layers(jax.lax.with_sharding_constraint(params, param_shardings), (1, 1),
                                    spec.layer_layout)
        return TrainState(step=jax.numpy.int32(0), params=params, opt_state=optimizer.init(params),
                          loss_scale=LossScale.create(spec.loss_scale, spec.precision == "fp16"),
                          rng=jax.random.key_data(jax.random.key(seed + 1)))
    return init


def batch_layout(spec: RunSpec, mesh: Mesh) -> tuple[dict[str, Field], dict[str, NamedSharding]]:
    """The objective's batch fields and the sharding of each (from its logical names)."""
    fields = spec.batch_fields
    return fields, {k: NamedSharding(mesh, logical_to_spec(f.names, spec.rules)) for k, f in fields.items()}


def setup(config: ml_collections.ConfigDict, devices: list[jax.Device] | None = None,
          options: dict | None = None) -> Run:
    """Validates the config, builds the mesh, derives every sharding and compiles the step (nothing allocated).
    ``devices``: the mesh's (default: this host's); compile-only devices of another platform compile its step for
    that platform (``megajax.tools.gpu_target``). ``options``: XLA's compiler options (default: megajax's for the
    devices' platform, ``parallel.xla_options``)."""
    devices = list(jax.devices() if devices is None else devices)
    return setup_run(resolve(config, len(devices)), devices, options)


def step_options(spec: RunSpec, devices: list[jax.Device]) -> dict:
    """The XLA options ``spec``'s training step compiles with on ``devices`` (``xla_options.compiler_options``)."""
    return compiler_options(devices, pipelined_all_gather=not (spec.num_micro > 1 and spec.sequence))


def setup_run(spec: RunSpec, devices: list[jax.Device] | None = None, options: dict | None = None,
              model: nnx.Module | None = None) -> Run:
    """``setup`` of a resolved run; ``model``: its abstract model (``abstract_model_of(spec)``) if already built."""
    devices = list(jax.devices() if devices is None else devices)
    if spec.model.fp8:
        check_fp8_devices(devices)
    mesh = spec.mesh.make(devices)
    graphdef, abstract_params = nnx.split(abstract_model_of(spec) if model is None else model)
    # FSDP (ZeRO-3): stored split over data; each layer gathers its parameters at use (sharding.param_at_use)
    param_shardings = nnx.to_pure_dict(shardings(abstract_params, mesh, spec.rules, split_over_data=spec.fsdp))
    schedule = learning_rate_schedule(spec.optimizer, spec.train.steps)
    optimizer = make_optimizer(spec.optimizer, spec.train.steps)
    init = _init_fn(spec, optimizer, param_shardings)
    abstract_state = jax.eval_shape(init)
    replicated = NamedSharding(mesh, P())
    moment_shardings = param_shardings
    if spec.shard_optimizer:  # ZeRO-1: each data shard keeps (and updates) its slice of the moments
        moment_shardings = jax.tree.map(lambda s, a: over_data(s, a.shape), param_shardings,
                                        nnx.to_pure_dict(abstract_params))
    state_shardings = TrainState(
        step=replicated, params=param_shardings,
        opt_state=optax.tree_map_params(optimizer, lambda _, s: s, abstract_state.opt_state, moment_shardings,
                                        transform_non_params=lambda _: replicated),
        loss_scale=jax.tree.map(lambda _: replicated, abstract_state.loss_scale), rng=replicated)
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state,
                                  state_shardings)
    objective = spec.objective
    fields, batch_shardings = batch_layout(spec, mesh)
    step = make_train_step(graphdef, optimizer, schedule, objective, fields, num_micro=spec.num_micro,
                           dropout=spec.model.dropout > 0, pipeline_schedule=spec.pipeline.schedule)
    abstract_batch = {k: jax.ShapeDtypeStruct((spec.global_batch, *f.row_shape), f.dtype,
                                              sharding=batch_shardings[k]) for k, f in fields.items()}
    context = spec.parallel_context  # one set of settings: the step and validation trace alike
    with activate(mesh, context):
        init_state = jax.jit(init, out_shardings=state_shardings, compiler_options=compiler_options(devices))
        compiled = jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                           out_shardings=(state_shardings, replicated), donate_argnums=0
                           ).lower(abstract_state, abstract_batch).compile(
                               compiler_options=step_options(spec, devices) if options is None else options)
    evaluate = Evaluator(objective_metrics(objective), graphdef, mesh, context,
                         in_shardings=(state_shardings.params, batch_shardings), out_shardings=replicated)
    num_params = sum(x.size for x in jax.tree.leaves(abstract_params))
    return Run(spec, mesh, abstract_state, batch_shardings, compiled, num_params, init_state, evaluate)


def _bytes_per_device(tree) -> int:
    """Bytes one device holds of the arrays (scalars aside: AdamW's step count) of a tree of sharded
    ShapeDtypeStructs."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree) if a.ndim)


def _start_record(run: Run, data, resumed_from: int | None) -> dict:
    spec = run.spec
    param_bytes = _bytes_per_device(run.abstract_state.params)
    dev = jax.local_devices()[0]
    try:
        stats = dev.memory_stats()  # None or unsupported on CPU
    except Exception:  # noqa: BLE001 - purely informational
        stats = None
    blend = None
    if isinstance(data, TaskData | SFTData | PreferenceData):  # fine-tuning rows: no corpus entropy
        entropy = None
    elif isinstance(data, BlendedData):  # no single corpus; each dataset's weight and samples per epoch instead
        entropy = None
        blend = [{"path": p, "weight": w, "tokens": int(len(d.tokens))}
                 for p, w, d in zip(data.spec.paths, data.spec.weights, data.datasets)]
    else:  # a bounded prefix of the training split: reading a whole multi-GB corpus at every start would stall it
        train_end = split_by_documents(data.offsets, spec.dataset.valid_fraction)[0][1]
        entropy = unigram_entropy(data.tokens[:min(train_end, ENTROPY_SAMPLE_TOKENS)])
    return {"step": resumed_from or 0, "event": "resume" if resumed_from is not None else "start",
            "model": spec.model_name, "mesh": f"{spec.mesh.data}x{spec.mesh.model}",
            **({"expert": spec.mesh.expert} if spec.mesh.expert > 1 else {}),
            **({"context": spec.mesh.context} if spec.mesh.context > 1 else {}),
            **({"pipe": spec.mesh.pipe, "pipeline_schedule": spec.pipeline.schedule,
                **({"pipeline_stage_recompute": True} if spec.pipeline.stage_recompute else {}),
                "pipeline_repeats": spec.pipeline.repeats,  # the microbatch count used:
                "pipeline_microbatches": pipeline.microbatches_for(spec.micro_batch, spec.pipeline.microbatches,
                                                                    spec.mesh.pipe)}
               if spec.mesh.pipe > 1 else {}),
            "devices": jax.device_count(),
            "processes": jax.process_count(), "device_kind": dev.device_kind, "num_params": run.num_params,
            "precision": spec.precision, "param_bytes_per_device": param_bytes,
            # parameters, one fp32 gradient per parameter held (the paper's accounting) and AdamW's moments
            "train_state_bytes_per_device": 2 * param_bytes + _bytes_per_device(run.abstract_state.opt_state),
            "device_bytes_in_use": (stats or {}).get("bytes_in_use"),
            **({"task_data": data.report} if isinstance(data, TaskData) and data.report else {}),  # rows left out
            **({"sft_data": data.report} if isinstance(data, SFTData) else {}),  # examples, rows, cut, skipped
            **({"preference_data": data.report} if isinstance(data, PreferenceData) else {}),
            "unigram_entropy": entropy, **({"blend": blend} if blend else {})}


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> list[dict]:
    """Trains to ``config.train.steps``, resuming from the latest checkpoint in ``workdir`` if there is one
    (or from ``config.checkpoint.restore_step``). A workdir another live run holds is refused (WorkdirInUseError).

    Every check that needs no workdir runs first (the config, the model, where the workdir lies, the data and its
    tokenizer, ``init_from``); a run that then fails before its first step removes what it created. Returns the
    records logged by this call (also appended to workdir/metrics.jsonl) and prints a one-line summary. On
    SIGTERM/SIGINT it finishes the current step, saves a checkpoint and raises ``TrainingStopped``. A non-finite
    loss raises ``TrainingDiverged`` before anything is saved from that state.
    """
    stop = StopRequest.watch()  # train.py started watching already: a signal during start-up is caught too
    try:
        distributed.maybe_initialize()
        spec = resolve(config, jax.device_count())  # config errors first, in milliseconds; the one resolve of the run
        return _checked_train(spec, input_paths(config), workdir, stop)
    finally:
        stop.restore_handlers()


def _checked_train(spec: RunSpec, inputs: list[str], workdir: str | pathlib.Path, stop: StopRequest) -> list[dict]:
    """``train`` of a resolved run; ``inputs``: the files and folders it reads (``cli.input_paths``)."""
    model = abstract_model_of(spec)  # the module's own checks (options its family does not have), before the workdir
    workdir = claim_workdir(workdir, inputs=inputs)  # never on, in or above its data, or a checkpoint
    data = load_dataset(spec)  # data errors next, still before the workdir is touched
    spec = spec.with_tokenizer_fingerprint(tokenizer_fingerprint(data))  # stored with every checkpoint
    if spec.init_from and not saved_steps(workdir):
        check_init_from(spec)  # a wrong path or model (a resume ignores init_from)
    if isinstance(data, PreferenceData):
        check_reference(spec)  # read at every start, a resume's too
    stop.check("before the run started")
    with hold_workdir(workdir) as created, _undone_on_failure(workdir, created) as started:  # one run per workdir
        return _train(spec, model, workdir, data, started, stop)


@contextlib.contextmanager
def _undone_on_failure(workdir: pathlib.Path, created: list[pathlib.Path]) -> Iterator[Callable[[], None]]:
    """Yields ``started()``, to call once the run's first record is written; an error before that removes what
    this run created in ``workdir`` (``created``: the workdir itself if taking it made it, or its lock file), so a
    failed start leaves nothing behind. Entered with the workdir held, so what is new here is this run's."""
    if jax.process_index():  # process 0 owns the files
        created = []
    elif workdir not in created:
        created = created + [workdir / name for name in (METRICS_NAME, CHECKPOINTS_NAME)
                             if not (workdir / name).exists()]
    started = []
    try:
        yield lambda: started.append(True)
    except BaseException:
        if not started:
            for path in created:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        raise


def _check_same_model(saved: StoredRun, spec: RunSpec, step_dir: pathlib.Path) -> None:
    """Refuses to resume a checkpoint of another model (another family, other sizes) before anything is built."""
    if differences := model_differences(saved, spec):
        raise CheckpointError(
            f"{step_dir} holds another model than this config's ({describe_differences(differences)}): resume it with "
            "the config it was trained with (its config is stored beside it), or pass a different --workdir to start "
            "a new run; nothing was changed")


def _check_same_tokenizer(saved: StoredRun, fingerprint: str, step_dir: pathlib.Path) -> None:
    """Refuses to resume on data made with another vocabulary (the model would read every id as another token)."""
    recorded = saved.dataset.tokenizer_fingerprint
    if recorded and fingerprint and recorded != fingerprint:
        raise CheckpointError(
            f"{step_dir} was trained on data tokenized with another vocabulary than this run's data (tokenizer "
            f"fingerprints {recorded} there, {fingerprint} here): resume it on data made with its tokenizer, or "
            "pass a different --workdir; nothing was changed")


def _train(spec: RunSpec, model: nnx.Module, workdir: pathlib.Path, data, started: Callable[[], None],
           stop: StopRequest) -> list[dict]:
    # a checkpoint directory that cannot be written fails here, not minutes into the first save
    checkpointer = Checkpointer(workdir, spec.checkpoint) if spec.checkpoint.enabled else None
    try:
        return _train_with(spec, model, workdir, data, checkpointer, started, stop)
    finally:  # also on a bad input found below: an unclosed manager's thread fails noisily at exit
        if checkpointer:
            checkpointer.close()


def _train_with(spec: RunSpec, model: nnx.Module, workdir: pathlib.Path, data, checkpointer: Checkpointer | None,
                started: Callable[[], None], stop: StopRequest) -> list[dict]:
    restore_step, steps = spec.checkpoint.restore_step, spec.train.steps
    latest = checkpointer.latest_step() if checkpointer else None
    # the step a resume reads (a restore_step that is not there is refused by resume, naming the steps there are)
    resume_dir = checkpointer.directory / str(restore_step or latest) if latest is not None else None
    saved = saved_position = None
    if resume_dir is not None and resume_dir.is_dir():
        stored, saved_position = checkpointer.stored(int(resume_dir.name))
        saved = stored_run(run_config(stored))
        _check_same_model(saved, spec, resume_dir)
        _check_same_tokenizer(saved, spec.dataset.tokenizer_fingerprint, resume_dir)
    loader = make_loader(spec, "train", data)
    valid = make_loader(spec, "valid", data) if spec.train.eval_batches else None
    if latest is not None and (restore_step or latest) >= steps:
        if jax.process_index() == 0:
            print(f"done: nothing to train, {workdir} already holds step {restore_step or latest} >= train.steps="
                  f"{steps}; checkpoint {resume_dir}. Raise --config.train.steps to train it further.",
                  file=sys.stderr)
        return []
    if saved_position is not None:  # the same data and batch, checked before compiling
        loader.set_state(saved_position, spec.train.allow_batch_size_change, spec.dataset.allow_blend_change)
    is_main = jax.process_index() == 0
    if is_main:
        check_writable(workdir)  # metrics.jsonl: before compiling, not after
    run = setup_run(spec, model=model)
    stop.check("while the step compiled")  # a run that never started leaves nothing (_undone_on_failure)
    if checkpointer:
        checkpointer.check_space(run.abstract_state)  # a disk too small for one checkpoint: before the first step
    if isinstance(data, PreferenceData):  # before the policy's state exists: one model on the devices at a time
        fill_reference(spec, run.abstract_state.params, run.evaluate, data)
    restored = checkpointer.resume(run.abstract_state, restore_step) if checkpointer else None
    init_from = spec.init_from
    if restored:
        state, _ = restored  # the loader already stands at the position saved with it
        state = in_layout(state, saved, run.spec.layer_layout)
        if init_from and is_main:
            reference = " (still the reference model)" if isinstance(data, PreferenceData) and \
                not spec.dpo.reference else ""
            print(f"resuming from {checkpointer.directory}: the weights of init_from={init_from!r} are not read "
                  f"(resume wins){reference}", file=sys.stderr)
    else:
        state = run.init_state()
        if init_from:  # fine-tuning: the pretrained trunk replaces the fresh one, the heads stay fresh
            state = state.replace(params={**state.params, **load_trunk(spec, run.abstract_state.params)})
    writer = MetricsWriter(workdir, enabled=is_main)
    start = _start_record(run, data, resumed_from=int(state.step) if restored else None)
    writer.write(start)
    started()
    if is_main:
        print(" ".join(f"{k}={v}" for k, v in start.items() if k not in ("step", "event")), file=sys.stderr)
        if (used := run.mesh.devices.size) < jax.device_count():
            print(f"note: mesh {run.spec.mesh.spelling} uses {used} of the {jax.device_count()} devices present; the "
                  f"other {jax.device_count() - used} stay idle (mesh.data=-1 takes every device left)",
                  file=sys.stderr)
    try:
        state, records, seconds = _loop(run, state, loader, valid, checkpointer, writer, stop, is_main)
    finally:
        if checkpointer:
            checkpointer.wait()
        writer.close()
    done = int(state.step)
    saved = checkpointer.directory / str(checkpointer.latest_step()) if checkpointer and checkpointer.latest_step() \
        else None
    summary = _summary(start, records, done, steps, int(start["step"]), seconds, run.spec, saved)
    if done < steps:  # a stop signal ended the run early
        signal_name = signal.Signals(stop.signum).name
        raise TrainingStopped(f"stopped by {signal_name}: {summary}; run the same command to resume", stop.signum)
    if is_main:
        print(f"done: {summary}", file=sys.stderr)
    return records


def _summary(start: dict, records: list[dict], done: int, steps: int, first: int, seconds: float, spec: RunSpec,
             checkpoint: pathlib.Path | None) -> str:
    """One line: the steps, the last train and validation loss beside the unigram entropy, the mean tokens/s of
    this run's steps and the checkpoint to read."""
    last = next((r for r in reversed(records) if "loss" in r), {})
    valid = next((r for r in reversed(records) if "valid_loss" in r), {})
    parts = [f"step {done}/{steps}"]
    if done > first and seconds > 0:
        tokens = (done - first) * sequences_per_step(spec) * spec.model.max_seq_len
        parts.append(f"{tokens / seconds:,.0f} tokens/s over {done - first} steps")
    losses = [f"{k}={r[k]:.4f}" for k, r in (("loss", last), ("valid_loss", valid)) if k in r]
    if start.get("unigram_entropy") is not None:
        losses.append(f"unigram entropy {start['unigram_entropy']:.4f}")
    parts += [", ".join(losses)] if losses else []
    parts.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpoint.enabled=False)")
    return "; ".join(parts)


def validation_metrics(run: Run, params, valid: Loader, num_batches: int) -> dict[str, float]:
    """Mean loss (and the objective's metrics) over the first ``num_batches`` validation batches (the same ones
    every time)."""
    valid.step = 0
    out = [run.evaluate(params, valid.next_global(run.batch_shardings)) for _ in range(num_batches)]
    return {k: float(np.mean([o[k] for o in jax.device_get(out)])) for k in out[0]}


def _save_due(checkpointer: Checkpointer | None, step: int, force: bool) -> bool:
    return checkpointer is not None and (force or checkpointer.manager.should_save(step))


def _loop(run: Run, state: TrainState, loader: Loader, valid: Loader | None,
          checkpointer: Checkpointer | None, writer: MetricsWriter, stop: StopRequest,
          is_main: bool) -> tuple[TrainState, list[dict], float]:
    """Runs the steps; returns the state, the records and the seconds spent in training steps (evaluation out)."""
    spec, train = run.spec, run.spec.train
    seq = spec.model.max_seq_len
    flops = model_flops_per_step(spec, seq)
    peak = peak_flops(jax.devices()[0], spec.precision, train.peak_flops_per_device)
    records, first_step = [], int(state.step)
    guard = NonFiniteGuard(train.max_nonfinite_steps, checkpointer)
    progress = _progress(first_step, train.steps, is_main)
    last_time, last_step = time.perf_counter(), first_step
    began, evaluating = last_time, 0.0
    stored = spec.config_json  # what each checkpoint stores: built once, not on each step
    for step in range(first_step, train.steps):
        state, metrics = run.step_fn(state, loader.next_global(run.batch_shardings))
        done = step + 1
        guard.add(done, metrics)
        stopping = stop.should_stop(done)
        last = done == train.steps
        log_due = done % train.log_every == 0 or last or stopping
        if _save_due(checkpointer, done, stopping or last) or log_due:
            guard.check()  # raises before a non-finite state is saved or logged as progress
        if checkpointer:
            checkpointer.save(done, state, loader.get_state(), stored, force=stopping or last)
        if log_due:
            metrics = {k: v.item() for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            step_time = (now - last_time) / (done - last_step)
            last_time, last_step = now, done
            tflops = flops / step_time / jax.device_count() / 1e12
            record = {"step": done, "loss": metrics["loss"], "lr": metrics["lr"], "grad_norm": metrics["grad_norm"],
                      **{k: v for k, v in metrics.items() if k not in ("loss_scale", "skipped", "nonfinite")},
                      "tokens_per_sec": sequences_per_step(spec) * seq / step_time, "step_time_s": step_time,
                      "tflops_per_device": tflops, "mfu": tflops * 1e12 / peak if peak else None}
            if state.loss_scale.dynamic:
                record.update(loss_scale=metrics["loss_scale"], skipped=metrics["skipped"])
            if isinstance(loader.batches, BlendedBatches):  # samples drawn so far from each data.blend dataset
                record.update({f"blend_samples_{i}": n for i, n in enumerate(loader.batches.drawn(done))})
            writer.write(record)
            records.append(record)
            progress.update(done - progress.n)
            progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        every = train.eval_every
        if valid and (last or (every and done % every == 0)):
            jax.block_until_ready(state.step)  # the step's time is not evaluation's
            eval_start = time.perf_counter()
            v = validation_metrics(run, state.params, valid, train.eval_batches)
            record = {"step": done, **{f"valid_{k}": x for k, x in v.items()}}
            if spec.perplexity_of:  # a language model's perplexity (BERT's: of the MLM loss alone)
                record["valid_ppl"] = float(np.exp(v[spec.perplexity_of]))
            writer.write(record)
            records.append(record)
            last_time = time.perf_counter()  # keep evaluation out of the training step time
            evaluating += last_time - eval_start
        if stopping:  # the checkpoint of this step is saved above; the caller says so
            break
    progress.close()
    jax.block_until_ready(state.step)
    return state, records, time.perf_counter() - began - evaluating


def _progress(initial: int, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", dynamic_ncols=True)
