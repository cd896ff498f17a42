"""``python -m megajax.lm_eval ...``: lm-evaluation-harness's own command line with the ``megajax`` model
registered (lm-eval finds models only by import; it reads no plugin entry points). ``--cpu_devices=N`` simulates
N devices on a CPU host. ``--output_path DIR`` writes ``DIR/<checkpoint, sanitised>/results_<timestamp>.json``, as
lm-eval names an HF model's results after ``pretrained=`` (the adapter's import teaches lm-eval the name). That
folder is checked before anything runs (``megajax.outputs.claim_folder``): never the checkpoint or its tokenizer,
inside or above them, nor inside a workdir, checkpoint or model directory.

    python -m megajax.lm_eval --model megajax --model_args pretrained=runs/355m,mesh=1x8 --tasks lambada_openai
"""

import pathlib
import sys

from megajax.cli import BackendError, fail, simulate_cpu_devices, start_backend
from megajax.outputs import OutputPathError, claim_folder


def _output_folder(argv: list[str]) -> pathlib.Path | None:
    """The folder lm-eval writes its results into (``--output_path DIR``, or a ``.json`` path's folder)."""
    value = None
    for i, arg in enumerate(argv):
        for flag in ("--output_path", "-o"):
            if arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            elif arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
    if not value:
        return None
    path = pathlib.Path(value)
    return path.parent if path.suffix == ".json" else path


def _model_paths(argv: list[str]) -> list[str]:
    """The paths ``--model_args`` names (``pretrained=``/``checkpoint=``, ``tokenizer=``): what the run reads."""
    args = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--model_args"), None) or next(
        (a.split("=", 1)[1] for a in argv if a.startswith("--model_args=")), "")
    pairs = (item.split("=", 1) for item in args.split(",") if "=" in item)
    return [v for k, v in pairs if k.strip() in ("pretrained", "checkpoint", "tokenizer")]


def main() -> None:
    if (folder := _output_folder(sys.argv)) is not None:  # lm-eval writes new timestamped files in it
        try:
            claim_folder(folder, flag="output_path", inputs=_model_paths(sys.argv))
        except OutputPathError as e:
            fail(e)
    simulate_cpu_devices(sys.argv)  # before jax starts its backends
    try:
        start_backend()
    except BackendError as e:
        fail(e)
    sys.argv = [a for i, a in enumerate(sys.argv)  # lm-eval's parser does not know the flag
                if not a.startswith("--cpu_devices") and not (i and sys.argv[i - 1] == "--cpu_devices")]
    # Imported here, not at the top: lm-eval is an optional extra, so a missing one gets a message, not a traceback.
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        sys.exit(f"error: python -m megajax.lm_eval needs lm-evaluation-harness ({e}); "
                 "install it with: pip install 'megajax[lmeval]'")

    import megajax.evaluation.lm_eval_adapter  # noqa: F401  (registers "megajax")

    cli_evaluate()


if __name__ == "__main__":
    main()
