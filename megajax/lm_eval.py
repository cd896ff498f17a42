"""``python -m megajax.lm_eval ...``: lm-evaluation-harness's own command line with the ``megajax`` model
registered (lm-eval finds models only by import; it reads no plugin entry points). ``--cpu_devices=N`` simulates
N devices on a CPU host. ``--output_path DIR`` writes ``DIR/<checkpoint, sanitised>/results_<timestamp>.json``, as
lm-eval names an HF model's results after ``pretrained=`` (the adapter's import teaches lm-eval the name).

    python -m megajax.lm_eval --model megajax --model_args pretrained=runs/355m,mesh=1x8 --tasks lambada_openai
"""

import sys

from megajax.cli import simulate_cpu_devices


def main() -> None:
    simulate_cpu_devices(sys.argv)  # before jax starts its backends
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
