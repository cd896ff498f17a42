"""Evaluate a megajax checkpoint the paper's way, or generate text.

    python eval.py --checkpoint=runs/355m --task=wikitext103 --data=wiki.test.tokens [--stride=32]
    python eval.py --checkpoint=runs/355m --task=lambada --data=lambada_test.jsonl
    python eval.py --checkpoint=runs/355m --task=ppl --data=data/valid            # a preprocessed prefix
    python eval.py --checkpoint=runs/355m --task=generate --prompt="def main(" --top_p=0.9
    python eval.py --checkpoint=runs/bert --task=mlm [--data=PREFIX]          # BERT: MLM loss/accuracy, SOP
    python eval.py --checkpoint=runs/mnli --task=mnli [--data=glue/MNLI]     # fine-tuned: mnli qqp squad1 squad2 race
    python eval.py --checkpoint=runs/dpo --task=dpo --reference=runs/sft --data=pairs.jsonl  # preference pairs
    ... --mesh=2x4 --output=results.json --tokenizer=gpt2/

``--cpu_devices=N`` simulates N devices on a CPU host.
"""

import argparse

from megajax.cli import ArgumentParser, fail, inference_mesh, start_backend, use_cpu_devices
from megajax.errors import USER_ERRORS
from megajax.evaluation.generate import Sampling
from megajax.evaluation.inputs import InputError
from megajax.evaluation.runner import TASKS, run


def main(argv=None):

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="workdir, checkpoints/ dir, a step, or an export")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--data", help="wiki.test.tokens, lambada_test.jsonl, or a preprocessed prefix (ppl; mlm: "
                                  "sentence-split, default the validation split of the checkpoint's data); "
                                  "fine-tuning tasks: the task's folder (default the run's data.task_dir) or one "
                                  "dev file")
    p.add_argument("--tokenizer", help="default: the tokenizer the checkpoint was trained with (mlm and ppl read "
                                       "token ids: a tokenizer given there is only checked to be the model's)")
    p.add_argument("--output", help="also write the results here as JSON")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier results or predictions file at --output / --predictions (never a "
                        "dataset's or a checkpoint's file)")
    p.add_argument("--predictions", help="fine-tuning tasks: write each example's prediction here as JSON (SQuAD: "
                                         "the official {id: answer} file; squad2 also NAME.null_odds.json beside it)")
    p.add_argument("--null_score_diff_threshold", type=float, default=None,
                   help="squad2: answer \"\" where the null score minus the best span's score exceeds this "
                        "(BERT's run_squad.py flag; default 0)")
    for flag, what in (("sft_skip_bad_rows", "skip rows that make no example (counted)"),
                       ("sft_truncate", "cut examples longer than the model's rows (counted)")):
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"sft, dpo: {what}; default: as the checkpoint's run trained (its data.{flag})")
    p.add_argument("--reference", help="dpo: the frozen reference checkpoint the policy (--checkpoint) is compared "
                                       "with, the model it was tuned from")
    p.add_argument("--dpo_loss", choices=("sigmoid", "ipo", "hinge"), default=None,
                   help="dpo: TRL's loss (default sigmoid)")
    p.add_argument("--dpo_beta", type=float, default=None, help="dpo: beta (default 0.1)")
    p.add_argument("--dpo_label_smoothing", type=float, default=None, help="dpo: the sigmoid loss's (default 0)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--stride", type=int, default=None,
                   help="wikitext103/ppl: windows start every STRIDE tokens and each one after the first scores "
                        "its last STRIDE targets (Megatron-LM's --overlapping-eval), 1..max_seq_len; default: 32, "
                        "the paper's (wikitext103), max_seq_len, non-overlapping (ppl)")
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (as --temperature=0)")
    p.add_argument("--temperature", type=float, default=1.0, help=">= 0; 0 means greedy")
    p.add_argument("--top_k", type=int, default=0, help="sample among the K most likely ids (0: off)")
    p.add_argument("--top_p", type=float, default=1.0, help="in (0, 1]: nucleus sampling (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 1x2, or DATAxMODEL,expert=E for a mixture of "
                                                "experts (default: the checkpoint's model and expert split over the "
                                                "devices there are)")
    p.set_defaults(mesh_expert=None)
    # the spelling of earlier releases, still accepted
    p.add_argument("--config.mesh.data", dest="mesh_data", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--config.mesh.model", dest="mesh_model", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cpu_devices", type=int, default=0)
    args = p.parse_args(argv)
    try:
        use_cpu_devices(args.cpu_devices)
        start_backend()
    except USER_ERRORS as e:
        fail(e)
    if args.mesh:
        if args.mesh_data or args.mesh_model:
            p.error("give the mesh once: --mesh=DATAxMODEL")
        try:
            args.mesh_data, args.mesh_model, args.mesh_expert = inference_mesh(args.mesh)
        except ValueError as e:
            p.error(str(e))
    try:
        sampling = Sampling(args.greedy, args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        p.error(str(e))
    try:
        run(args.checkpoint, args.task, data=args.data, prompt=args.prompt, tokenizer=args.tokenizer,
            mesh_data=args.mesh_data, mesh_model=args.mesh_model, mesh_expert=args.mesh_expert,
            batch_size=args.batch_size, stride=args.stride,
            max_new_tokens=args.max_new_tokens, seed=args.seed, output=args.output, sampling=sampling,
            predictions=args.predictions, null_score_diff_threshold=args.null_score_diff_threshold,
            overwrite=args.overwrite, sft_skip_bad_rows=args.sft_skip_bad_rows, sft_truncate=args.sft_truncate,
            reference=args.reference, dpo_loss=args.dpo_loss, dpo_beta=args.dpo_beta,
            dpo_label_smoothing=args.dpo_label_smoothing)
    except InputError as e:  # raised before the model is loaded: usage, not a traceback
        p.error(str(e))
    except USER_ERRORS as e:  # a path, a checkpoint, a config: what to change, not a traceback
        fail(e)


if __name__ == "__main__":
    main()
