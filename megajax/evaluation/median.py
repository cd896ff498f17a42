"""The median over fine-tuning seeds of eval.py's results, as the paper reports its downstream numbers (Table 5:
the median of 5 seeds).

    for seed in 1 2 3 4 5; do
      python train.py --config=finetune.py:mnli,336m --config.init_from=runs/bert_336m \\
          --config.train.seed=$seed --config.data.seed=$seed --workdir=runs/mnli_seed$seed
      python eval.py --checkpoint=runs/mnli_seed$seed --task=mnli --output=runs/mnli_seed$seed.eval.json
    done
    python -m megajax.evaluation.median runs/mnli_seed*.eval.json [--output=runs/mnli_median.json]

(Results go beside the workdirs: megajax writes nothing into a training workdir but training itself.)

Every number of every split (``matched.accuracy``, ``dev.f1``, ...) gets its median and its values in file order.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from megajax.cli import ArgumentParser
from megajax.outputs import OutputPathError, claim_file, write_json


class ResultsError(ValueError):
    """Result files that cannot be combined; the message names the file."""


def _numbers(result: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of an eval.py result, keyed by dotted path (booleans and counts of rows included)."""
    out = {}
    for key, value in result.items():
        if isinstance(value, dict):
            out.update(_numbers(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


def median_of(paths: Sequence[str | pathlib.Path]) -> dict:
    """``{"task", "runs", "median": {metric: median}, "values": {metric: [value per file]}}`` over eval.py result
    files of one task; raises ResultsError when a file is unreadable, of another task or lacks a metric."""
    if not paths:
        raise ResultsError("no result files given")
    seen: dict[str, str | pathlib.Path] = {}
    for path in paths:  # a seed counted twice would move the median
        real = os.path.realpath(path)
        if real in seen:
            raise ResultsError(f"{path} is given twice (as {seen[real]} too): give each seed's result file once")
        seen[real] = path
    results = []
    for path in paths:
        try:
            results.append(json.loads(pathlib.Path(path).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ResultsError(f"{path}: not an eval.py result file ({e})") from e
        if not isinstance(results[-1], dict) or "task" not in results[-1]:
            raise ResultsError(f"{path}: not an eval.py result file (no 'task')")
    task = results[0]["task"]
    numbers = [_numbers(r) for r in results]
    for path, result, values in zip(paths, results, numbers):
        if result["task"] != task:
            raise ResultsError(f"{path} holds --task={result['task']} results, {paths[0]} holds {task}")
        if set(values) != set(numbers[0]):
            missing = sorted(set(numbers[0]) ^ set(values))
            raise ResultsError(f"{path} and {paths[0]} do not report the same metrics (differ in: "
                               f"{', '.join(missing[:5])})")
    values = {k: [n[k] for n in numbers] for k in numbers[0]}
    return {"task": task, "runs": len(results), "files": [str(p) for p in paths],
            "median": {k: float(np.median(v)) for k, v in values.items()}, "values": values}


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="eval.py --output files, one per seed")
    p.add_argument("--output", help="also write the medians here as JSON")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier results file at --output")
    args = p.parse_args(argv)
    try:
        claim_file(args.output, inputs=args.results, overwrite=args.overwrite)
        summary = median_of(args.results)
    except (ResultsError, OutputPathError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1))
    if args.output:
        write_json(args.output, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
