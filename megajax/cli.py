"""Shared command-line plumbing: config files by path or bare name, simulated CPU devices, the parallelism
switches of the tools."""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import logging
import os
import pathlib
import shlex
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import jax
import ml_collections
from absl import flags

from megajax.errors import USER_ERRORS, ConfigError, UserError
from megajax.platform import quiet_cuda_notices

_PACKAGE = pathlib.Path(__file__).resolve().parent
# The shipped configs: megajax/configs/ in an installed package (pyproject.toml maps the repository's configs/ there),
# else the checkout's configs/ beside the package (an editable install, or running from the repository).
CONFIGS_DIR = next((d for d in (_PACKAGE / "configs", _PACKAGE.parent / "configs") if d.is_dir()), _PACKAGE / "configs")


def resolve_config_path(name: str) -> str:
    """``configs/gpt_2p5b.py`` as given, or a bare ``gpt_2p5b.py`` / ``gpt_2p5b`` found in ``./configs/`` or the
    shipped configs (``CONFIGS_DIR``); a ``:ARG`` suffix (``finetune.py:mnli,336m``) is kept for ``get_config``."""
    path, _, override = name.partition(":")  # ml_collections allows 'file.py:arg'
    candidates = [pathlib.Path(path)]
    if not pathlib.Path(path).is_absolute():
        bare = path if path.endswith(".py") else path + ".py"
        candidates += [pathlib.Path("configs") / bare, CONFIGS_DIR / pathlib.Path(bare).name]
    for c in candidates:
        if c.is_file():
            return str(c) + (":" + override if override else "")
    raise FileNotFoundError(f"config {name!r} not found (looked at {', '.join(map(str, candidates))}); "
                            f"available: {', '.join(sorted(p.stem for p in CONFIGS_DIR.glob('*.py')))}")


def rewrite_config_flag(argv: list[str]) -> list[str]:
    """Resolves the value of ``--config=`` in argv so users can type a bare config name, and puts ``--config``
    before its ``--config.FIELD=V`` overrides (ml_collections refuses an override it meets first)."""
    out, config = [], []
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            config = ["--config=" + resolve_config_path(arg.split("=", 1)[1])]
        elif arg == "--config" and i + 1 < len(argv):
            continue  # its value follows
        elif i > 0 and argv[i - 1] == "--config":
            config = ["--config=" + resolve_config_path(arg)]
        else:
            out.append(arg)
    return out[:1] + config + out[1:]


# how ml_collections reads an override of a field holding a bool, an int or a float (absl's parsers)
_VALUE_PARSERS = {bool: flags.BooleanParser(), int: flags.IntegerParser(), float: flags.FloatParser()}


def check_config_overrides(argv: list[str], default: str) -> None:
    """Loads the ``--config`` file (``default`` when argv has none) and raises ConfigError for a ``--config.a.b=V``
    in ``argv`` that names none of its fields (with the closest field's spelling) or whose value does not parse as
    the field's type: absl and ml_collections would raise a traceback or a FATAL while parsing flags."""
    config = load_config(_flag_value(argv, "config") or default)
    for i, arg in enumerate(argv):
        if not arg.startswith("--config."):
            continue
        field, given, value = arg[len("--config."):].partition("=")
        if not given and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value, given = argv[i + 1], "="
        _check_override(config, field, value if given else None)


def _check_override(config: ml_collections.ConfigDict, field: str, value: str | None) -> None:
    """Raises ConfigError unless ``field`` (``a.b``) names a field of ``config`` and ``value`` parses as its type."""
    node, parts = config, field.split(".")
    for i, part in enumerate(parts):
        fields = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        if part not in fields:
            where = "config" + "".join(f".{p}" for p in parts[:i])
            close = difflib.get_close_matches(part, fields, n=1)
            hint = (f"did you mean --{where}.{close[0]}?" if close else
                    f"its fields: {', '.join(sorted(fields))}" if fields else f"{where} is a value, not a section")
            raise ConfigError(f"--config.{field}: {where} has no field {part!r}; {hint}")
        node = node[part]
    parser = _VALUE_PARSERS.get(type(node))
    if parser is not None and value is not None:
        try:
            parser.parse(value)
        except ValueError:
            what = {bool: "true or false", int: "a whole number", float: "a number"}[type(node)]
            raise ConfigError(f"--config.{field}={value}: config.{field} takes {what} (now {node!r}), e.g. "
                              f"--config.{field}={node}") from None


def apply_config_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> None:
    """Sets each ``--config.a.b=V`` of ``overrides`` on ``config`` as train.py's flags would (V parsed as the
    field's type: bool, int, float, else the text); ConfigError for anything else given, a field the config lacks
    or a value of the wrong type (``_check_override``). For the tools that take a config without absl's flags."""
    for arg in overrides:
        field, given, value = arg[len("--config."):].partition("=") if arg.startswith("--config.") else ("", "", "")
        if not given:
            raise ConfigError(f"unrecognized argument {arg!r}: give --config.FIELD=VALUE (e.g. "
                              "--config.model.max_seq_len=8192) or one of the command's flags")
        _check_override(config, field, value)
        *sections, name = field.split(".")
        node = config
        for part in sections:
            node = node[part]
        parser = _VALUE_PARSERS.get(type(node[name]))
        node[name] = parser.parse(value) if parser is not None else value


def parse_mesh(text: str) -> tuple[int, int]:
    """``"DATAxMODEL"`` (e.g. ``"4x2"``) -> (data, model)."""
    try:
        data, model = (int(x) for x in str(text).lower().split("x"))
    except ValueError:
        raise ConfigError(f"--mesh={text}: give DATAxMODEL, e.g. --mesh=4x2") from None
    return data, model


MESH_SUFFIXES = ("expert", "context")  # ",expert=E" and ",context=C" after the shape


def _mesh_suffixes(text: str) -> tuple[str, dict[str, int]]:
    """(the shape, {'expert': E, 'context': C} as given) of ``"SHAPE,expert=E,context=C"`` (either, both or
    neither suffix)."""
    shape, *rest = str(text).lower().split(",")
    given = {}
    for item in rest:
        key, _, value = item.partition("=")
        if key.strip() not in MESH_SUFFIXES or not value.strip().isdigit() or key.strip() in given:
            raise ConfigError(f"--mesh={text}: after the shape give ',expert=E' and/or ',context=C', e.g. "
                              "--mesh=4x1,expert=2 or --mesh=2x2,context=2")
        given[key.strip()] = int(value)
    return shape, given


def inference_mesh(text: str) -> tuple[int, int, int | None]:
    """``"DATAxMODEL"``, optionally ``",expert=E"`` -> (data, model, E or None): the mesh a checkpoint is loaded
    on (``config.load.inference_config``; no context parallelism: it splits training's long sequences)."""
    shape, given = _mesh_suffixes(text)
    if "context" in given:
        raise ConfigError(f"--mesh={text}: context parallelism splits training's sequences; evaluation and "
                          "generation run without it: drop ',context=C'")
    return (*parse_mesh(shape), given.get("expert"))


def apply_mesh(config: ml_collections.ConfigDict, text: str) -> None:
    """Sets ``config.mesh`` from ``"DATAxMODEL"`` or ``"PIPExDATAxMODEL"`` (pipeline stages outermost), either
    followed by ``",expert=E"`` (a mixture of experts' experts split over E expert shards, e.g. ``4x1,expert=2``)
    and / or ``",context=C"`` (every sequence split over C devices, e.g. ``2x2,context=2``)."""
    shape, given = _mesh_suffixes(text)
    for key, value in given.items():
        config.mesh[key] = value
    parts = shape.split("x")
    if len(parts) == 3:
        try:
            config.mesh.pipe = int(parts[0])
        except ValueError:
            raise ConfigError(f"--mesh={text}: give DATAxMODEL or PIPExDATAxMODEL, e.g. --mesh=2x4x1") from None
        parts = parts[1:]
    config.mesh.data, config.mesh.model = parse_mesh("x".join(parts))


PARALLEL_FLAGS = {"sequence": "sequence parallelism", "shard_optimizer": "ZeRO-1", "fsdp": "FSDP / ZeRO-3"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with megajax's error format: one ``error:`` line naming the flag and what to do (argparse prints
    its usage first and begins the line with the program's name)."""

    def __init__(self, *args, **kwargs):
        script = pathlib.Path(sys.argv[0]).resolve()
        if "prog" not in kwargs and script.is_relative_to(_PACKAGE):  # ``python -m megajax.X``, named so
            module = ".".join(script.relative_to(_PACKAGE.parent).with_suffix("").parts)
            kwargs["prog"] = f"python -m {module.removesuffix('.__main__')}"
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """``--sequence``, ``--shard_optimizer``, ``--fsdp``: each turns on ``parallel.<name>``."""
    for name, what in PARALLEL_FLAGS.items():
        parser.add_argument(f"--{name}", action="store_true", help=f"{what} (parallel.{name}=True)")


def apply_parallel_flags(args: argparse.Namespace, config: ml_collections.ConfigDict) -> None:
    """Sets ``parallel.<name>`` for each of ``add_parallel_flags``'s switches given."""
    for name in PARALLEL_FLAGS:
        if getattr(args, name):
            config.parallel[name] = True


def load_config(name: str) -> ml_collections.ConfigDict:
    """Imports a config file (path or bare name, with an optional ``:ARG``) and returns its ``get_config([ARG])``."""
    path, _, arg = resolve_config_path(name).partition(":")
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"config file {e.filename}, line {e.lineno}: {e.msg}; fix the file") from None
    except Exception as e:  # noqa: BLE001 - any error of the user's file: where it is, not a traceback
        raise ConfigError(f"config file {path} fails when loaded: {_where_in(e, path)}") from None
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"config file {path} defines no get_config(); a config file's get_config() returns an "
                          "ml_collections.ConfigDict (see configs/gpt_tiny.py)")
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except ValueError as e:  # a config file's own check of its :ARG
        raise ConfigError(str(e)) from None
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config file {path}: get_config() fails: {_where_in(e, path)}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"config file {path}: get_config() returned a {type(config).__name__}, not an "
                          "ml_collections.ConfigDict; start from megajax.config.base_config(), as configs/gpt_tiny.py")
    return config


def _where_in(error: Exception, path: str) -> str:
    """``line N: ErrorType: message`` of the innermost frame of ``error`` in the file ``path``."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
    line = f"line {frames[-1].lineno}: " if frames else ""
    return f"{line}{type(error).__name__}: {error}"


PATH_FIELDS = (("data", "path"), ("data", "tokenizer"), ("data", "task_dir"), ("data", "tfds_data_dir"),
               (None, "init_from"))


def _blend_items(blend: str) -> list[str] | None:
    """``data.blend``'s "W1 PREFIX1 W2 PREFIX2 ..." split (quoted prefixes may hold spaces); None when malformed
    (left to the blend's own check and message)."""
    try:
        items = shlex.split(blend)
    except ValueError:  # an unclosed quote
        return None
    return items if items and len(items) % 2 == 0 else None


def absolute_paths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config`` with its file and directory fields made absolute (from the current directory): the config is
    stored with every checkpoint, and eval.py or a resumed run may start elsewhere."""
    for section, field in PATH_FIELDS:
        parent = config if section is None else config[section]
        if value := parent[field]:
            parent[field] = str(pathlib.Path(value).expanduser().resolve())
    if items := _blend_items(config.data.blend):
        items[1::2] = [str(pathlib.Path(p).expanduser().resolve()) for p in items[1::2]]
        config.data.blend = shlex.join(items)
    return config


def input_paths(config: ml_collections.ConfigDict) -> list[str]:
    """What a training config reads from disk: its data prefix or blend, tokenizer, task files and ``init_from``
    (a training run writes nowhere on, in or above them: ``megajax.outputs.claim_workdir``)."""
    paths = [(config if section is None else config[section])[field] for section, field in PATH_FIELDS]
    return [p for p in paths if p] + ((_blend_items(config.data.blend) or [])[1::2])


def _flag_value(argv: list[str], name: str) -> str | None:
    """The value of ``--name=V`` or ``--name V`` (the last one wins, as absl's), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}":
            if i + 1 >= len(argv):
                raise ConfigError(f"--{name} needs a value, e.g. --{name}=8")
            value = argv[i + 1]
    return value


def use_cpu_devices(n: int) -> None:
    """Simulates ``n`` CPU devices (0: the devices there are). Must run before jax starts its backends (any
    computation, ``jax.devices()``); importing jax first is fine."""
    if n < 0:
        raise ConfigError(f"--cpu_devices={n}: give 0 (the real devices) or more")
    if not n:
        return
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # jax refuses once a backend is up
        raise RuntimeError(f"--cpu_devices must be applied before jax starts its backends: {e}") from e


def cpu_devices_flag(argv: list[str]) -> int | None:
    """``--cpu_devices=N`` (or ``--cpu_devices N``) in ``argv``, checked (ConfigError for anything but N >= 0)."""
    value = _flag_value(argv, "cpu_devices")
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"--cpu_devices={value!r}: give a whole number of devices, e.g. --cpu_devices=8") from None
    if n < 0:
        raise ConfigError(f"--cpu_devices={n}: give 0 (the real devices) or more")
    return n


def simulate_cpu_devices(argv: list[str]) -> None:
    """Honours ``--cpu_devices=N`` (or ``--cpu_devices N``) in ``argv`` (``use_cpu_devices``)."""
    if (n := cpu_devices_flag(argv)) is not None:
        use_cpu_devices(n)


class BackendError(UserError):
    """The platform asked for (``JAX_PLATFORMS``) cannot start here: its plugin is missing or it has no device."""


def backend_error(error: BaseException, cause: str | None = None) -> BackendError | None:
    """The BackendError to report for ``error`` if jax raised it while starting its backends (a bare
    AssertionError for ``JAX_PLATFORMS=cuda`` without the CUDA plugin, a RuntimeError without a device), else None;
    ``cause``: what a plugin said when it failed to start (its logged exception), if it did."""
    frames = traceback.extract_tb(error.__traceback__)
    if not isinstance(error, (AssertionError, RuntimeError)) or not frames or \
            not frames[-1].filename.endswith(os.path.join("jax", "_src", "xla_bridge.py")):
        return None
    asked = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    cause = cause or str(error).split(" (set JAX_PLATFORMS")[0] or "no backend for it is installed"
    return BackendError(f"JAX_PLATFORMS={asked} cannot start here ({cause}). For NVIDIA GPUs install the gpu extra "
                        "(pip install 'megajax[gpu]') on a machine with a GPU and its driver; to run on the CPU, "
                        "unset JAX_PLATFORMS or set it to cpu")


def start_backend(compiles_for_gpu: bool = False) -> None:
    """Starts jax's backends now (after ``--cpu_devices`` and a multi-host start), quietly (``quiet_cuda_notices``),
    so that a platform which cannot start is one ``error:`` line naming the fix (``backend_error``).
    ``compiles_for_gpu``: the command needs JAX's CUDA plugin though the CPU runs it (``info --target
    --compiled``), so the plugin failing to start is an error line too, not its logged traceback."""
    logger = logging.getLogger("jax._src.xla_bridge")  # a plugin that fails logs its traceback here
    held: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = held.append
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        with quiet_cuda_notices():
            jax.devices()
    except (AssertionError, RuntimeError) as e:
        causes = [str(r.exc_info[1]) for r in held if r.exc_info and r.exc_info[1] is not None]
        if (failure := backend_error(e, causes[0] if causes else None)) is None:
            raise
        raise failure from None
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    cuda = [r for r in held if "jax_plugins.xla_cuda" in r.getMessage()]
    if compiles_for_gpu and cuda:
        cause = cuda[0].exc_info[1] if cuda[0].exc_info else cuda[0].getMessage()
        asked = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
        raise BackendError(f"JAX's CUDA plugin did not start ({cause}): "
                           f"{f'JAX_PLATFORMS={asked}' if asked else 'JAX_PLATFORMS unset'} makes it check this "
                           "host's CUDA, which failed; to compile for a GPU without one, set JAX_PLATFORMS=cpu")
    for record in held:  # the backend started: whatever the plugins said, as they said it
        logger.handle(record)


DEBUG_VARIABLE = "MEGAJAX_DEBUG"  # set to 1: a user error shows its traceback instead of the one error: line


def fail(error: BaseException, message: str | None = None) -> NoReturn:
    """Exits 1 with ``error: MESSAGE`` (default: the error's own text), the way every megajax command reports an
    error the user can fix; with ``MEGAJAX_DEBUG=1`` in the environment the error is raised with its traceback."""
    if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        raise error
    sys.exit(f"error: {error if message is None else message}")


def exit_on_user_error(main: Callable[[], object]) -> object:
    """Runs a tool's ``main``; an error the user can fix (``megajax.errors.USER_ERRORS``) exits 1 with its message,
    not a traceback (``fail``)."""
    try:
        return main()
    except USER_ERRORS as e:
        fail(e)
    except (AssertionError, RuntimeError) as e:  # jax's backends failing to start: the fix, not a traceback
        if (failure := backend_error(e)) is None:
            raise
        fail(failure)
