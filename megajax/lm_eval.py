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

from megajax.cli import fail, simulate_cpu_devices, start_backend
from megajax.errors import USER_ERRORS
from megajax.outputs import OutputPathError, claim_folder


def _flag(argv: list[str], *names: str) -> str | None:
    """The value of the last ``--name=V`` / ``--name V`` in ``argv`` for any of ``names`` (None: not given)."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
            elif arg == name and i + 1 < len(argv):
                value = argv[i + 1]
    return value


def _model_args(argv: list[str]) -> dict[str, str]:
    """``--model_args`` as lm-eval splits it (``k=v`` pairs separated by commas)."""
    pairs = (item.split("=", 1) for item in (_flag(argv, "--model_args") or "").split(",") if "=" in item)
    return {k.strip(): v.strip() for k, v in pairs}


def _output_folders(argv: list[str], sanitize) -> list[pathlib.Path]:
    """The folders lm-eval writes its results into: ``--output_path DIR`` (a ``.json`` path: its folder) and, for a
    directory, the subfolder it names after ``pretrained=`` (``sanitize``: lm-eval's own naming)."""
    value = _flag(argv, "--output_path", "-o")
    if value is None:
        return []
    if not value.strip():
        raise OutputPathError("--output_path is empty; give a folder for lm-eval's results, e.g. --output_path=results")
    path = pathlib.Path(value)
    if path.suffix == ".json":
        return [path.parent]
    named = _model_args(argv).get("pretrained")
    return [path] + ([path / sanitize(named)] if named else [])


def main() -> None:
    # Imported first, not at the top: lm-eval is an optional extra, so a missing one gets a message, not a traceback.
    try:
        from lm_eval.__main__ import cli_evaluate
        from lm_eval.utils import sanitize_model_name
    except ImportError as e:
        sys.exit(f"error: python -m megajax.lm_eval needs lm-evaluation-harness ({e}); "
                 "install it with: pip install 'megajax[lmeval]'")
    args = _model_args(sys.argv)
    try:  # lm-eval writes new timestamped files there: never on, in or above what the run reads, or a checkpoint
        for folder in _output_folders(sys.argv, sanitize_model_name):
            claim_folder(folder, flag="output_path",
                         inputs=[args.get(k) for k in ("pretrained", "checkpoint", "tokenizer")])
        simulate_cpu_devices(sys.argv)  # before jax starts its backends
        start_backend()
    except USER_ERRORS as e:
        fail(e)
    sys.argv = [a for i, a in enumerate(sys.argv)  # lm-eval's parser does not know the flag
                if not a.startswith("--cpu_devices") and not (i and sys.argv[i - 1] == "--cpu_devices")]

    import megajax.evaluation.lm_eval_adapter  # noqa: F401  (registers "megajax")

    try:
        cli_evaluate()
    except (*USER_ERRORS, ValueError) as e:  # the adapter's checks of its model_args, lm-eval's of its tasks
        fail(e)


if __name__ == "__main__":
    main()
