"""Evaluate a megajax checkpoint the paper's way, or generate text.

    python eval.py --checkpoint=runs/355m --task=wikitext103 --data=wiki.test.tokens [--stride=32]
    python eval.py --checkpoint=runs/355m --task=lambada --data=lambada_test.jsonl
    python eval.py --checkpoint=runs/355m --task=ppl --data=data/valid            # a preprocessed prefix
    python eval.py --checkpoint=runs/355m --task=generate --prompt="def main(" --top_p=0.9
    ... --config.mesh.model=4 --config.mesh.data=2 --output=results.json --tokenizer=gpt2/

``--cpu_devices=N`` simulates N devices on a CPU host.
"""

import argparse
import sys

from megajax.cli import simulate_cpu_devices

simulate_cpu_devices(sys.argv)  # before jax is imported


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="workdir, checkpoints/ dir, a step, or an export")
    p.add_argument("--task", required=True, choices=["wikitext103", "lambada", "ppl", "generate"])
    p.add_argument("--data", help="wiki.test.tokens, lambada_test.jsonl, or a preprocessed prefix (ppl)")
    p.add_argument("--tokenizer", help="default: the tokenizer the checkpoint was trained with")
    p.add_argument("--output", help="also write the results here as JSON")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--stride", type=int, default=32, help="sliding-window overlap (paper: 32)")
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config.mesh.data", dest="mesh_data", type=int, default=None)
    p.add_argument("--config.mesh.model", dest="mesh_model", type=int, default=None)
    p.add_argument("--cpu_devices", type=int, default=0)
    args = p.parse_args(argv)

    from megajax.evaluation.generate import Sampling
    from megajax.evaluation.runner import run

    run(args.checkpoint, args.task, data=args.data, prompt=args.prompt, tokenizer=args.tokenizer,
        mesh_data=args.mesh_data, mesh_model=args.mesh_model, batch_size=args.batch_size, stride=args.stride,
        max_new_tokens=args.max_new_tokens, seed=args.seed, output=args.output,
        sampling=Sampling(args.greedy, args.temperature, args.top_k, args.top_p))


if __name__ == "__main__":
    main()
