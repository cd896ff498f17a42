"""Train a GPT, BERT, Llama or mixture of experts with Megatron-style tensor + data parallelism (and pipeline,
sequence, expert and context parallelism), or fine-tune one (BERT's tasks; a decoder's prompt / completion rows).

    python train.py --config=configs/gpt_tiny.py --workdir=/tmp/tiny
    python train.py --config=gpt_2p5b.py --config.train.steps=1000 --mesh=1x2
    python train.py --config=bert_tiny --workdir=/tmp/bert
    python train.py --config=finetune.py:mnli,336m --config.init_from=runs/bert_336m ...
    python train.py --config=sft.py --config.init_from=CONVERTED --config.data.path=train.jsonl \
        --config.data.tokenizer=CONVERTED_HF/

``--mesh=DATAxMODEL`` sets ``config.mesh`` (the spelling every megajax command takes; ``PIPExDATAxMODEL`` adds
pipeline stages, a trailing ``,expert=E`` expert shards, ``,context=C`` context shards); ``--cpu_devices=N``
simulates N devices on a CPU host.
"""

import signal
import sys

# First, before any import: from here a stop signal (Ctrl-C during start-up or compilation) is recorded and ends the
# run with its exit status and one line, not a KeyboardInterrupt traceback (megajax.training.preemption).
_EARLY_SIGNALS: list[int] = []
if __name__ == "__main__":
    for _sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_sig, lambda signum, _: _EARLY_SIGNALS.append(signum))

# isort: split
from megajax.training.preemption import StopRequest, TrainingStopped  # noqa: E402

if __name__ == "__main__":
    StopRequest.watch(_EARLY_SIGNALS)

# isort: split
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from megajax.cli import (  # noqa: E402
    absolute_paths,
    apply_mesh,
    check_config_overrides,
    cpu_devices_flag,
    fail,
    resolve_config_path,
    rewrite_config_flag,
    start_backend,
    use_cpu_devices,
)
from megajax.errors import USER_ERRORS, ConfigError  # noqa: E402

DEFAULT_CONFIG = "gpt_tiny"


def define_flags() -> None:
    """The flags; defined after the config flags were checked, since ml_collections applies ``--config.a.b=V`` as
    soon as ``--config`` is defined."""
    # the default resolved here is found from any directory (./configs/, else the shipped configs)
    config_flags.DEFINE_config_file("config", resolve_config_path(DEFAULT_CONFIG),
                                    "config file (path or bare name in configs/)")
    flags.DEFINE_string("workdir", "workdir", "where metrics, TensorBoard events and checkpoints go")
    flags.DEFINE_string("mesh", None, "DATAxMODEL, e.g. 4x2 (or PIPExDATAxMODEL, e.g. 2x2x2), optionally ,expert=E "
                        "(e.g. 4x1,expert=2: a mixture of experts' experts over E shards) and / or ,context=C (e.g. "
                        "2x2,context=2: every sequence over C shards): sets config.mesh")
    flags.DEFINE_integer("cpu_devices", 0, "simulate this many devices on a CPU host (0: the real devices)")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax and jax log every step at INFO
    use_cpu_devices(flags.FLAGS.cpu_devices)
    # after the flags: importing the trainer takes a few seconds
    from megajax.training import distributed
    from megajax.training.loop import train

    config = flags.FLAGS.config
    try:
        distributed.maybe_initialize()  # a multi-host job joins before jax's backends start
        start_backend()
        if flags.FLAGS.mesh:
            apply_mesh(config, flags.FLAGS.mesh)
        config = absolute_paths(config)
        if config.mesh.auto:
            given = [a for a in sys.argv if a.startswith("--config.mesh.") and not a.startswith("--config.mesh.auto")]
            if flags.FLAGS.mesh or given:
                raise ConfigError(f"mesh.auto plans the mesh: drop {flags.FLAGS.mesh and '--mesh' or given[0]}, or "
                                  "mesh.auto to use it")
            import jax

            from megajax.tools.auto_plan import plan_for_devices

            print(plan_for_devices(config, jax.devices()).describe(), flush=True)
        train(config, flags.FLAGS.workdir)
    except TrainingStopped as e:  # saved, not finished: the signal's exit status, as schedulers expect
        print(e, file=sys.stderr)
        sys.exit(e.exit_status)
    except USER_ERRORS as e:  # a message that says what to change; no traceback
        fail(e)


if __name__ == "__main__":
    try:
        sys.argv = rewrite_config_flag(sys.argv)  # bare config names, before absl reads the flag
        check_config_overrides(sys.argv, DEFAULT_CONFIG)
        cpu_devices_flag(sys.argv)  # absl would answer a bad value with its FATAL
    except USER_ERRORS as e:  # a misspelled config name, :ARG or field
        fail(e)
    define_flags()
    app.run(main)
