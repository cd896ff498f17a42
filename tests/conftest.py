"""Test setup: 8 simulated CPU devices (set before jax is imported) and shared small models."""

import contextlib
import faulthandler
import functools
import gc
import os
import pathlib
import subprocess
import sys
import threading
import time

# Compiling dominates the suite; the test programs mostly run in milliseconds. So the tests compile with
# jax_disable_most_optimizations: LLVM at -O0 without its expensive passes. XLA's HLO passes (SPMD partitioning,
# buffer assignment) all run as usual, so the collectives the tests read are those of the production program (what
# this saves: bench/README.md); so are the memory plans, read in tests that compile with XLA:CPU's fusion emitters
# (FAST_CODEGEN below). Numerics are unchanged up to rounding (no fast-math flag moves). Tests that run many steps
# are marked `many_steps` and compile at COMPILE_FLAG's -O1 instead (at -O0 their steps run ~2x slower).
COMPILE_FLAG = "--xla_backend_optimization_level=1"
# XLA:CPU ends the process (SIGABRT) when a device waits 40 s at a collective for the other devices' threads: on a
# loaded 2-core CI machine a pipelined step's stages (uneven work between permutes, 8 device threads, a second test
# process) once did, and took its pytest worker down. A wait that long is a stall, not a deadlock, up to 10 minutes;
# the warning at 60 s names the collective in the log.
COLLECTIVE_FLAGS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=60 "
                    "--xla_cpu_collective_call_terminate_timeout_seconds=600")
# a compiled step's state beyond parameters and moments: the step, the optimizer's two counts, the loss scale's
# three fields, the dropout key (u32[2])
SCALAR_STATE_BYTES = 32
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " " + COMPILE_FLAG
if "collective_call_terminate" not in _flags:
    _flags += " " + COLLECTIVE_FLAGS
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()


# XLA:CPU's fusion emitters (its default) take about a third of the suite's compile time; without them the same
# HLO compiles to the same results (the suite passes either way) but its fusions, and so XLA's memory plan, differ
# (temp 6-19% lower on four pipelined steps). So the tests compile without them but where they read a memory plan
# (marked ``memory_plan``: the plan of the program train.py compiles), and so do the processes they start.
FAST_CODEGEN = {"xla_cpu_use_fusion_emitters": False}


def child_env() -> dict[str, str]:
    """The environment for a process a test starts: this one's (so its compile settings), without the 8 devices
    (the child's ``--cpu_devices`` sets its own)."""
    fast = " ".join(f"--{k}={str(v).lower()}" for k, v in FAST_CODEGEN.items())
    return {**os.environ, "XLA_FLAGS": f"{COMPILE_FLAG} {COLLECTIVE_FLAGS} {fast}"}


os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the train.py processes the tests start (a resume test's processes compile one step).
# The test processes themselves do not use it (``jax_enable_compilation_cache`` off below): serializing an
# executable into it aborted or crashed jaxlib in a pytest worker twice, after other modules' steps (docs/results.md),
# and it saved them ~3% (test_communication_audit + test_sharded_optimizer, serial: 198 s with it, 204 s without).
# The process that makes it (pytest's controller; its workers inherit the variable) removes it at the end.
OWN_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    OWN_CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="megajax-test-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import megajax  # noqa: E402, F401, I001 - first: it imports jax without the CUDA plugin's notices (megajax.platform)

# isort: split
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from megajax.platform import quiet_cuda_notices  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)  # this process only: its children inherit the variable

# FAST_CODEGEN on this process's CPU compiles, but in tests marked ``memory_plan`` (``_compile_level``). XLA reads it
# per compile, from the options jax builds there (jax has no public default for them; without this hook the suite
# only runs slower).
_fast_codegen = [True]


def _with_fast_codegen(build):
    @functools.wraps(build)
    def options(*args, **kwargs):
        backend = kwargs.get("backend")
        if _fast_codegen[0] and backend is not None and backend.platform == "cpu":
            kwargs["env_options_overrides"] = {**FAST_CODEGEN, **(kwargs.get("env_options_overrides") or {})}
        return build(*args, **kwargs)

    return options


try:
    from jax._src import compiler as _jax_compiler

    _jax_compiler.get_compile_options = _with_fast_codegen(_jax_compiler.get_compile_options)
except (ImportError, AttributeError):
    pass


def memory_plans() -> bool:
    """Whether this test compiles as train.py does (marked ``memory_plan``): a key for cached compiled runs, so
    that a test reading a memory plan never gets a run another test compiled without the fusion emitters."""
    return not _fast_codegen[0]


@contextlib.contextmanager
def compiled_as_train_py():
    """Compiles with XLA:CPU's fusion emitters (as train.py and the tests marked ``memory_plan`` do) whatever the
    test's marks: a module's cached run that a memory-plan test reads and other tests run is compiled once, for
    both (the fusion emitters change the program's fusions and memory plan, not its results or collectives)."""
    before = _fast_codegen[0]
    _fast_codegen[0] = False
    try:
        yield
    finally:
        _fast_codegen[0] = before


with quiet_cuda_notices():  # the backends start here, once per test process
    jax.devices()

from megajax.config import (  # noqa: E402
    RunSpec,
    base_config,
    bert_base_config,
    build_mesh,
    create_model,
    resolve,
    rules_of,
)
from megajax.convert.__main__ import main as convert_main  # noqa: E402
from megajax.models import llama  # noqa: E402
from megajax.parallel.partition import shardings  # noqa: E402

MESHES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (4, 2)]

# xdist hands whole modules to the two workers (--dist loadscope), in collection order. Longest first keeps both
# busy to the end. The numbers are each module's worker seconds, roughly (docs/results.md has the suite's measured
# times); they only decide how modules are shared out, so stale ones cost balance, never correctness.
SLOWEST_FIRST = {"test_pipeline_1f1b.py": 324, "test_pipeline.py": 269, "test_moe.py": 217, "test_checkpoint.py": 192,
                 "test_deepseek.py": 160,
                 "test_context_parallel.py": 149, "test_train_end_to_end.py": 132, "test_gpu_target.py": 125,
                 "test_user_faults.py": 124, "test_finetune.py": 109, "test_memory_planner.py": 101,
                 "test_sharded_optimizer.py": 95, "test_training_step.py": 87, "test_two_layer_kinds.py": 77,
                 "test_sequence_parallel.py": 76, "test_sft_commands.py": 68, "test_document_masking.py": 67,
                 "test_bert_training.py": 63, "test_llama.py": 58, "test_faults.py": 57,
                 "test_communication_audit.py": 57, "test_bert_model.py": 51, "test_evaluation.py": 50,
                 "test_bad_input.py": 49, "test_scaling_model.py": 48, "test_convert_moe.py": 48,
                 "test_dropout_rows.py": 43, "test_fourth_family.py": 41, "test_config_migration.py": 39,
                 "test_run_guards.py": 34, "test_convert_llama.py": 33, "test_sft.py": 31,
                 "test_downstream_eval.py": 24, "test_tensor_parallel_equivalence.py": 23, "test_bert_data.py": 19,
                 "test_convert_inputs.py": 16, "test_data_pipeline.py": 16, "test_convert.py": 16,
                 "test_lm_eval_adapter.py": 14, "test_official_squad_scores.py": 12, "test_convert_bert.py": 12}


@pytest.fixture(autouse=True)
def _compile_level(request: pytest.FixtureRequest):
    """Tests marked ``many_steps`` compile at -O1 (COMPILE_FLAG), the rest with most optimizations off (above); tests
    marked ``memory_plan`` with XLA:CPU's fusion emitters (FAST_CODEGEN). Both are read when a program compiles and
    are not part of jit's in-memory cache key: a program compiled before the test (a module fixture's,
    ``one_step_run``'s) runs as it was compiled (``memory_plans`` keys the cached runs memory tests read)."""
    many, plan = (request.node.get_closest_marker(m) is not None for m in ("many_steps", "memory_plan"))
    before, fast = jax.config.read("jax_disable_most_optimizations"), _fast_codegen[0]
    if many:
        jax.config.update("jax_disable_most_optimizations", False)
    _fast_codegen[0] = not plan
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
        _fast_codegen[0] = fast


@pytest.fixture(autouse=True, scope="module")
def _module_codegen(request: pytest.FixtureRequest):
    """A module marked ``memory_plan`` (``pytestmark``) compiles its module fixtures with the fusion emitters too
    (they are built before any of its tests' fixtures)."""
    _fast_codegen[0] = request.node.get_closest_marker("memory_plan") is None
    yield
    _fast_codegen[0] = True


@pytest.fixture(autouse=True, scope="module")
def _clear_jit_caches_after_each_module():
    """Drops jax's caches of compiled programs when a module ends (its own cached fixtures keep theirs). A pytest
    worker compiles hundreds of programs; XLA:CPU crashed inside one after many others three times (twice writing the
    persistent cache, once compiling test_convert_moe's generation step: docs/results.md), and freeing test_pipeline's
    steps at its end had stopped one such crash."""
    yield
    jax.clear_caches()
    gc.collect()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Removes the session's compilation cache where this process made it."""
    if OWN_CACHE_DIR is not None:
        import shutil

        shutil.rmtree(OWN_CACHE_DIR, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules longest first (a stable sort: the tests of a module keep their order)."""
    items.sort(key=lambda item: -SLOWEST_FIRST.get(item.path.name, 0))


# A test that runs longer than this has stalled: twice in CI a worker waited forever inside XLA:CPU's executor (every
# runtime thread parked, no collective running) and the run sat until CI's 90-minute limit with no name on it; a third
# time (2026-11-28, a fresh-clone run) this named it: tests/test_sft.py's training loop, waiting in a compiled step's
# call. The slowest test takes ~2 minutes on CI's contended 2 cores, module fixtures included.
STALL_SECONDS = float(os.environ.get("MEGAJAX_TEST_STALL_SECONDS", 600))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Ends this test process when a test (setup, call and teardown) runs past STALL_SECONDS, after writing the test's
    name, the end of its stderr and every thread's Python stack to the terminal: pytest-xdist reports the test as
    crashed and ends the run (``--max-worker-restart=0``, pyproject.toml) instead of hanging. A stalled native wait
    cannot be interrupted."""
    capture = item.config.pluginmanager.getplugin("capturemanager")

    def stalled():
        err = ""
        if capture is not None:  # what the test wrote (XLA warns of a collective stuck past 60 s on stderr)
            err = capture.read_global_capture()[1]
            capture.suspend_global_capture(in_=True)
        os.write(2, f"\n{item.nodeid} ran past {STALL_SECONDS:.0f} s (MEGAJAX_TEST_STALL_SECONDS): a stall; this "
                    f"test process ends. The end of its stderr:\n{err[-4000:]}\nIts threads' stacks:\n".encode())
        faulthandler.dump_traceback(all_threads=True)
        os._exit(70)

    watchdog = threading.Timer(STALL_SECONDS, stalled)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def host_batch(loader) -> dict:
    """The loader's next global batch on the host (what ``Loader.next_global`` lays out on the devices), and one
    step on."""
    rows = loader.batches.rows(loader.step, 0, loader.batches.global_batch)
    loader.step += 1
    return rows


def small_config(num_layers: int = 2, data: int = 1, model: int = 1):
    """2 layers, hidden 64, 8 heads, vocab 1000 (not a multiple of 128; padded to 1024)."""
    c = base_config()
    c.model.update(vocab_size=1000, make_vocab_size_divisible_by=128, num_layers=num_layers, hidden_size=64,
                   num_heads=8, max_seq_len=32, dropout=0.0, remat="none")
    c.mesh.data, c.mesh.model = data, model
    return c


@pytest.fixture(scope="session")
def reference_model():
    """The small model, initialised on a 1x1 mesh (``place`` lays its parameters out on other meshes)."""
    config = small_config()
    model = create_model(config, build_mesh(config), seed=0)
    return config, model


def place(model: nnx.Module, config, data: int, model_axis: int):
    """The same parameters laid out on a data x model mesh; returns (mesh, graphdef, state)."""
    config = config.copy_and_resolve_references()
    config.mesh.data, config.mesh.model = data, model_axis
    mesh = build_mesh(config)
    graphdef, state = nnx.split(model)
    state = jax.device_put(jax.tree.map(np.asarray, state), shardings(state, mesh, rules_of(config)))
    return mesh, graphdef, state


@pytest.fixture(scope="session")
def batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=(8, 17), dtype=np.int32)
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def train_config(data: int = 1, model: int = 1, steps: int = 5, dropout: float = 0.0, **train):
    """The small model with a short run on random tokens (no corpus build needed)."""
    c = small_config(data=data, model=model)
    c.model.dropout = dropout
    c.train.update({"steps": steps, "global_batch_size": 8, "log_every": 1, "precision": "fp32", "eval_batches": 1,
                    **train})
    c.optimizer.update(lr=1e-3, min_lr=1e-4, warmup_steps=2)
    c.data.source = "random"
    return c


def choice_config(choice: str | None, data: int, model: int, steps: int = 3, name: str = "gpt",
                  remat: str = "none", gradient_step: bool = False):
    """The small model (``name``: gpt, or a BERT or Llama of the same sizes) on random data with
    ``parallel.<flag>`` on for each flag of ``choice`` ('+'-joined, e.g. 'fsdp+sequence'). ``gradient_step``: AdamW
    with eps >> |g|, so one step changes each parameter by lr / eps x its gradient (runs on different meshes then
    compare at 1e-5)."""
    c = small_config(data=data, model=model)
    if name == "bert":
        b = bert_base_config()
        b.model.update(vocab_size=1000, make_vocab_size_divisible_by=128, num_layers=2, hidden_size=64, num_heads=8,
                       max_seq_len=32, dropout=0.0, remat="none")
        b.mesh = c.mesh
        c = b
    elif name == "llama":  # 2 key/value heads: split on mesh.model=2, replicated on 4 and 8; untied; Llama 3 rope
        b = base_config(llama.NAME)
        b.model.update(
            vocab_size=1000, make_vocab_size_divisible_by=128, num_layers=2, hidden_size=64, num_heads=8,
            num_kv_heads=2, ffn_hidden_size=96, max_seq_len=32, remat="none", rope_scaling="llama3",
            rope_original_max_len=8)
        b.mesh = c.mesh
        c = b
    for flag in choice.split("+") if choice else ():
        c.parallel[flag] = True
    c.model.remat = remat
    c.data.source = "random"
    c.train.update(global_batch_size=8, precision="fp32", steps=steps, log_every=1, eval_batches=0)
    c.optimizer.update(lr=1e-3, warmup_steps=0, decay_steps=10)
    if gradient_step:
        c.optimizer.update(lr=1e6, eps=1e3, weight_decay=0.0, clip_norm=1e9)
    c.checkpoint.enabled = False
    return c


@functools.cache
def one_step_run(choice: str | None, data: int, model: int, name: str = "gpt", remat: str = "none"):
    """``setup`` of ``choice_config(..., gradient_step=True)``: its step compiled once per test process, for all
    the modules there that use it."""
    from megajax.training.loop import setup

    return setup(choice_config(choice, data, model, name=name, remat=remat, gradient_step=True))


def run_on(config, data: int = 1, model: int = 1, pipe: int = 1, expert: int = 1, context: int = 1) -> RunSpec:
    """``config`` resolved on a ``pipe x data x expert x context x model`` mesh, as the tools take a run
    (``megajax.info``'s way: without the training checks, the planners reading the model, its mesh and its
    choices)."""
    config = config.copy_and_resolve_references()
    config.mesh.update(data=data, model=model, pipe=pipe, expert=expert, context=context)
    return resolve(config, pipe * data * expert * context * model, training=False)


def step_losses(config, initial: dict, key: str, steps: int) -> list[float]:
    """The losses of ``steps`` training steps of ``config`` on its data's first batches, from the initial state
    ``initial[key]`` (the first run of ``key``, which must be on one device, sets it), its layers reordered to the
    run's pipeline layout: runs on different meshes then compare from the same parameters."""
    from megajax.models.transformer import reorder_layers
    from megajax.training.data import make_loader
    from megajax.training.loop import setup

    run = setup(config)
    if key not in initial:
        assert run.spec.mesh.devices == 1, "the reference: one device"
        initial[key] = jax.tree.map(np.array, run.init_state())
    state = reorder_layers(initial[key], (1, 1), run.spec.layer_layout)
    state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), state, run.abstract_state)
    loader = make_loader(resolve(config, jax.device_count()))
    losses = []
    for _ in range(steps):
        state, metrics = run.step_fn(state, loader.next_global(run.batch_shardings))
        losses.append(float(metrics["loss"]))
    return losses


def assert_planned_within_10_percent(run: RunSpec, micro_batch: int) -> None:
    """The memory planner's temp and peak of ``run`` at ``micro_batch`` within 10% of its compiled step's (a new
    family's check that the planner counts its layers)."""
    from megajax.tools.memory_planner import compiled_memory, memory_report

    report, compiled = memory_report(run, micro_batch=micro_batch), compiled_memory(run, micro_batch=micro_batch)
    assert compiled.temp == pytest.approx(report.temp_bytes, rel=0.10)
    assert compiled.peak == pytest.approx(report.peak_bytes, rel=0.10)


def assert_same_step(loss: float, change, want_loss: float, want_change, initial=None) -> None:
    """One step's loss within 1e-6 (relative) and its parameter changes within 1e-5 of a reference's (with AdamW at
    eps >> |g| the changes are the gradients, x lr / eps); every reference leaf must have moved. Given the
    ``initial`` parameters, each leaf's absolute tolerance is at least two float32 spacings at its largest value: a
    parameter near 1 (a norm's scale) holds its new value rounded to 2^-23, so a change below 1e-2 can differ by that
    rounding alone."""
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    flat, ref = jax.tree_util.tree_leaves_with_path(change), jax.tree.leaves(want_change)
    starts = jax.tree.leaves(initial) if initial is not None else [None] * len(ref)
    assert len(flat) == len(ref) == len(starts)
    for (path, got), want, start in zip(flat, ref, starts):
        scale = np.abs(want).max()
        assert scale > 0, jax.tree_util.keystr(path)
        rounding = 0.0 if start is None else 2 * float(np.spacing(np.float32(np.abs(start).max())))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=max(1e-5 * scale, rounding),
                                   err_msg=jax.tree_util.keystr(path))


def hf_conversions(tmp_path_factory, build, flags):
    """name -> (HF directory saved in 100 KB shards, the HF model ``build(name)``, its megajax conversion with the
    converter's ``flags(name)``), each built once: the HF conversion tests' fixtures."""
    built = {}

    def get(name: str):
        if name not in built:
            model = build(name)
            root = tmp_path_factory.mktemp(name)
            model.save_pretrained(root / "hf", max_shard_size="100KB")
            assert (root / "hf" / "model.safetensors.index.json").is_file()
            convert_main(["hf-to-megajax", f"--hf={root / 'hf'}", f"--output={root / 'mj'}", *flags(name)])
            built[name] = root / "hf", model, root / "mj"
        return built[name]

    return get


def assert_greedy_matches_hf(model, checkpoint, prompt: np.ndarray, meshes: list[dict]) -> None:
    """Greedy generation of 8 tokens with the key/value cache: the megajax ``checkpoint`` loaded on each of ``meshes``
    (``load_model`` keyword arguments) equals the HF ``model``'s ``generate`` on ``prompt``, which must have no
    near-tie (top-2 logit margin above 1e-3) that rounding could flip. The HF conversion tests' check."""
    import torch
    import transformers

    from megajax.evaluation.generate import Sampling, generate

    with torch.no_grad():
        out = model.generate(torch.from_numpy(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                             generation_config=transformers.GenerationConfig(
                                 max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True))
    margins = [float(np.diff(np.sort(s.numpy(), axis=-1)[:, -2:], axis=-1).min()) for s in out.scores]
    assert min(margins) > 1e-3, margins
    for mesh in meshes:
        loaded = megajax.load_model(checkpoint, **mesh)
        got = generate(loaded.model, loaded.mesh, loaded.spec.rules, prompt, 8, Sampling(greedy=True))
        np.testing.assert_array_equal(got, out.sequences.numpy(), err_msg=str(mesh))


# The commands users type, run as processes (the fault tests): every refusal is one ``error:`` line.
ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMANDS_AT_ONCE = 4  # processes at a time: CI's two cores, and memory for each interpreter's jax


def tree_of(root: pathlib.Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (directories as None, files as their bytes)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def run_commands(cases: dict, cwd: pathlib.Path) -> dict[str, tuple[int, str]]:
    """Runs ``{name: (argv after python, env overrides)}`` at most COMMANDS_AT_ONCE at a time; (exit status,
    stderr) each."""
    base = {**child_env(), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    pending, running, results = list(cases.items()), {}, {}
    while pending or running:
        while pending and len(running) < COMMANDS_AT_ONCE:
            name, (argv, env) = pending.pop(0)
            running[name] = subprocess.Popen([sys.executable, *argv], cwd=cwd, env={**base, **env},
                                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                results[name] = (proc.returncode, proc.stderr.read())
                del running[name]
        time.sleep(0.05)
    return results


def assert_one_error_line(results: dict, wanted: dict[str, str]) -> None:
    """Each command failed with a last stderr line ``error: ...`` holding ``wanted[name]``, and no traceback."""
    for name, (rc, stderr) in results.items():
        lines = stderr.strip().splitlines()
        assert rc != 0 and lines and lines[-1].startswith("error: "), (name, rc, stderr[-3000:])
        assert wanted[name] in lines[-1], (name, wanted[name], lines[-1])
        assert "Traceback" not in stderr and "cannot schedule new futures" not in stderr, (name, stderr[-3000:])
