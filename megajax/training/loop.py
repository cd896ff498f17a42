"""The training loop: config -> mesh -> sharded state -> compiled step -> logged steps."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.builder import abstract_model, build_mesh
from megajax.checkpoint import Checkpointer
from megajax.config import ConfigError, gpt_config, resolve_precision, rules_of
from megajax.data.gpt_dataset import GPTLoader, unigram_entropy
from megajax.data.sources import make_loader
from megajax.info import memory_report
from megajax.models.gpt import GPT
from megajax.partition import shardings
from megajax.sharding import activate, logical_to_spec
from megajax.training import distributed
from megajax.training.loss_scale import LossScale
from megajax.training.metrics import MetricsWriter, model_flops_per_step, peak_flops
from megajax.training.optimizer import learning_rate_schedule, make_optimizer
from megajax.training.preemption import StopRequest
from megajax.training.step import TrainState, make_eval_step, make_train_step
from megajax.training.workdir_lock import hold_workdir


ENTROPY_SAMPLE_TOKENS = 1 << 24  # tokens read for the logged unigram entropy


def num_micro_batches(config: ml_collections.ConfigDict, data_parallel: int) -> int:
    """Accumulation steps per optimizer step: global batch / (micro batch x data-parallel size)."""
    b, micro = config.train.global_batch_size, config.train.micro_batch_size or 0
    if b % data_parallel:
        raise ConfigError(f"train.global_batch_size={b} is not divisible by the data-parallel size {data_parallel}")
    micro = micro or b // data_parallel
    if b % (micro * data_parallel):
        raise ConfigError(f"train.global_batch_size={b} is not a multiple of train.micro_batch_size={micro} x "
                          f"data={data_parallel}")
    return b // (micro * data_parallel)


@dataclasses.dataclass
class Run:
    """Everything a training run holds besides its state."""

    config: ml_collections.ConfigDict
    mesh: Mesh
    graphdef: nnx.GraphDef
    abstract_state: TrainState  # ShapeDtypeStructs carrying the target shardings
    batch_sharding: NamedSharding
    step_fn: jax.stages.Compiled
    num_params: int
    init_state: Callable[[], TrainState]  # fresh sharded state (jitted, each device makes its own shards)
    eval_step: Callable  # jitted (params, batch) -> mean loss, for the validation split


def _init_fn(config: ml_collections.ConfigDict, optimizer: optax.GradientTransformation):
    model_cfg, seed = gpt_config(config), config.train.seed
    dynamic = resolve_precision(config.train.precision) == "fp16"

    def init() -> TrainState:
        params = nnx.to_pure_dict(nnx.state(GPT(model_cfg, rngs=nnx.Rngs(seed))))
        return TrainState(step=jax.numpy.int32(0), params=params, opt_state=optimizer.init(params),
                          loss_scale=LossScale.create(config.loss_scale, dynamic),
                          rng=jax.random.key_data(jax.random.key(seed + 1)))
    return init


def setup(config: ml_collections.ConfigDict) -> Run:
    """Validates the config, builds the mesh, derives every sharding and compiles the step (nothing allocated)."""
    mesh = build_mesh(config)
    rules = rules_of(config)
    graphdef, abstract_params = nnx.split(abstract_model(config))
    param_shardings = nnx.to_pure_dict(shardings(abstract_params, mesh, rules))
    schedule = learning_rate_schedule(config.optimizer, config.train.steps)
    optimizer = make_optimizer(config.optimizer, config.train.steps)
    init = _init_fn(config, optimizer)
    abstract_state = jax.eval_shape(init)
    replicated = NamedSharding(mesh, P())
    state_shardings = TrainState(
        step=replicated, params=param_shardings,
        opt_state=optax.tree_map_params(optimizer, lambda _, s: s, abstract_state.opt_state, param_shardings,
                                        transform_non_params=lambda _: replicated),
        loss_scale=jax.tree.map(lambda _: replicated, abstract_state.loss_scale), rng=replicated)
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state,
                                  state_shardings)
    batch_sharding = NamedSharding(mesh, logical_to_spec(("batch", None), rules))
    num_micro = num_micro_batches(config, mesh.shape["data"])
    step = make_train_step(graphdef, optimizer, schedule, num_micro=num_micro, dropout=config.model.dropout > 0)
    batch_shape = jax.ShapeDtypeStruct((config.train.global_batch_size, config.model.max_seq_len + 1), np.int32,
                                       sharding=batch_sharding)
    with activate(mesh, rules):
        init_state = jax.jit(init, out_shardings=state_shardings)
        compiled = jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                           out_shardings=(state_shardings, replicated), donate_argnums=0
                           ).lower(abstract_state, batch_shape).compile()
        eval_step = jax.jit(make_eval_step(graphdef), in_shardings=(state_shardings.params, batch_sharding),
                            out_shardings=replicated)  # compiled on first use
    num_params = sum(x.size for x in jax.tree.leaves(abstract_params))
    return Run(config, mesh, graphdef, abstract_state, batch_sharding, compiled, num_params, init_state, eval_step)


def _start_record(run: Run, config: ml_collections.ConfigDict, loader: GPTLoader,
                  resumed_from: int | None) -> dict:
    dp, tp = run.mesh.shape["data"], run.mesh.shape["model"]
    report = memory_report(config, dp, tp, config.train.global_batch_size // dp // num_micro_batches(config, dp))
    dev = jax.local_devices()[0]
    try:
        stats = dev.memory_stats()  # None or unsupported on CPU
    except Exception:  # noqa: BLE001 - purely informational
        stats = None
    source = loader.batches.source
    # A bounded prefix: reading a whole multi-GB corpus at every start would stall it for minutes.
    end = source.start + min(len(source) * source.seq_len, ENTROPY_SAMPLE_TOKENS)
    train_tokens = source.tokens[source.start:end]
    return {"step": resumed_from or 0, "event": "resume" if resumed_from is not None else "start",
            "mesh": f"{dp}x{tp}", "devices": jax.device_count(), "processes": jax.process_count(),
            "device_kind": dev.device_kind, "num_params": run.num_params,
            "precision": resolve_precision(config.train.precision),
            "param_bytes_per_device": report.param_bytes,
            "train_state_bytes_per_device": report.param_bytes + report.grad_bytes + report.optimizer_bytes,
            "device_bytes_in_use": (stats or {}).get("bytes_in_use"),
            "unigram_entropy": unigram_entropy(train_tokens)}


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> list[dict]:
    """Trains to ``config.train.steps``, resuming from the latest checkpoint in ``workdir`` if there is one
    (or from ``config.checkpoint.restore_step``). A workdir another live run holds is refused (WorkdirInUseError).

    Returns the records logged by this call (also appended to workdir/metrics.jsonl). On SIGTERM/SIGINT it
    finishes the current step, saves a checkpoint and returns.
    """
    distributed.maybe_initialize()
    with hold_workdir(workdir):  # one run per workdir, taken before anything is written; freed on return or error
        return _train(config, workdir)


def _train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> list[dict]:
    run = setup(config)
    loader = make_loader(config)
    checkpointer = Checkpointer(workdir, config.checkpoint) if config.checkpoint.enabled else None
    restored = checkpointer.resume(run.abstract_state, config.checkpoint.get("restore_step", 0)) \
        if checkpointer else None
    if restored:
        state, loader_state = restored
        loader.set_state(loader_state)
    else:
        state = run.init_state()
    is_main = jax.process_index() == 0
    writer = MetricsWriter(workdir, enabled=is_main)
    start = _start_record(run, config, loader, resumed_from=int(state.step) if restored else None)
    writer.write(start)
    if is_main:
        print(" ".join(f"{k}={v}" for k, v in start.items() if k not in ("step", "event")), file=sys.stderr)
    stop = StopRequest()
    valid = make_loader(config, "valid") if config.train.eval_batches else None
    try:
        state, records = _loop(run, state, loader, valid, checkpointer, writer, stop, is_main)
    finally:
        stop.restore_handlers()
        if checkpointer:
            checkpointer.wait()
            checkpointer.close()
        writer.close()
    return records


def validation_loss(run: Run, params, valid: GPTLoader, num_batches: int) -> float:
    """Mean loss over the first ``num_batches`` batches of the validation split (the same ones every time)."""
    valid.step = 0
    with activate(run.mesh, rules_of(run.config)):
        losses = [run.eval_step(params, valid.next_global(run.batch_sharding)) for _ in range(num_batches)]
    return float(np.mean(jax.device_get(losses)))


def _loop(run: Run, state: TrainState, loader: GPTLoader, valid: GPTLoader | None,
          checkpointer: Checkpointer | None, writer: MetricsWriter, stop: StopRequest,
          is_main: bool) -> tuple[TrainState, list[dict]]:
    config, seq, m = run.config, run.config.model.max_seq_len, run.config.model
    flops = model_flops_per_step(config.train.global_batch_size, seq, m.num_layers, m.hidden_size,
                                 gpt_config(config).padded_vocab_size)
    peak = peak_flops(jax.devices()[0], config.train.peak_flops_per_device)
    records, first_step = [], int(state.step)
    progress = _progress(first_step, config.train.steps, is_main)
    last_time, last_step = time.perf_counter(), first_step
    for step in range(first_step, config.train.steps):
        state, metrics = run.step_fn(state, loader.next_global(run.batch_sharding))
        done = step + 1
        stopping = stop.should_stop(done)
        if checkpointer:
            checkpointer.save(done, state, loader.get_state(), config,
                              force=stopping or done == config.train.steps)
        if done % config.train.log_every == 0 or done == config.train.steps or stopping:
            metrics = {k: v.item() for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            step_time = (now - last_time) / (done - last_step)
            last_time, last_step = now, done
            tflops = flops / step_time / jax.device_count() / 1e12
            record = {"step": done, "loss": metrics["loss"], "lr": metrics["lr"],
                      "grad_norm": metrics["grad_norm"],
                      "tokens_per_sec": config.train.global_batch_size * seq / step_time, "step_time_s": step_time,
                      "tflops_per_device": tflops, "mfu": tflops * 1e12 / peak if peak else None}
            if state.loss_scale.dynamic:
                record.update(loss_scale=metrics["loss_scale"], skipped=metrics["skipped"])
            writer.write(record)
            records.append(record)
            progress.update(done - progress.n)
            progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        every = config.train.eval_every
        if valid and (done == config.train.steps or (every and done % every == 0)):
            v = validation_loss(run, state.params, valid, config.train.eval_batches)
            record = {"step": done, "valid_loss": v, "valid_ppl": float(np.exp(v))}
            writer.write(record)
            records.append(record)
            last_time = time.perf_counter()  # keep evaluation out of the training step time
        if stopping:
            if is_main:
                print(f"stop signal: saved a checkpoint at step {done}; exiting", file=sys.stderr)
            break
    progress.close()
    return state, records


def _progress(initial: int, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", dynamic_ncols=True)
