"""A megajax GPT checkpoint as an lm-evaluation-harness model: ``python -m megajax.lm_eval --model megajax``.

Importing this module registers the class under the name ``megajax`` (lm-eval 0.4.13 discovers no plugin entry
points, so the registration needs this import: ``python -m megajax.lm_eval`` does it before lm-eval's CLI runs).

    python -m megajax.lm_eval --model megajax --model_args pretrained=runs/355m,mesh=1x8 --tasks lambada_openai

Model args: ``pretrained`` (the checkpoint: workdir, step or export; relative paths are fine; ``checkpoint=`` is
accepted too), ``mesh=DxM`` (default: the
checkpoint's model axis, every other device on data), ``expert=E`` (a mixture of experts' expert shards; default:
the checkpoint's, as its devices allow), ``tokenizer`` (default: the one the checkpoint's training
data used), ``max_gen_toks`` (default 256), ``seed`` (sampling). ``--batch_size`` is rows per forward (rounded up
to a multiple of the data axis).

The requests run through megajax's own evaluation code: ``loglikelihood`` scores ``cloze_rows`` with the sharded
``Scorer`` (the context cut from the left to fit max_seq_len), ``loglikelihood_rolling`` scores each document in
lm-eval's own rolling windows (those of its Hugging Face model, so perplexities compare; Megatron-LM's strided
windows are eval.py's ``--task=ppl``), and ``generate_until`` runs the KV-cache ``generate``, stopping when every
row has produced one of its stop strings.

With ``--output_path DIR`` lm-eval writes ``DIR/<model name>/results_<timestamp>.json``, naming the folder after
``pretrained=`` as for a Hugging Face model (``runs/355m`` -> ``runs__355m``); with ``checkpoint=`` lm-eval knows no
name and picks a random id.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megajax import cli
from megajax.config.load import inference_config, read_stored_run, restore_model
from megajax.evaluation.generate import Sampling, generate
from megajax.evaluation.inputs import check_tokenizer, tokenizer_for
from megajax.evaluation.scoring import Scorer, cloze_rows

GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def parse_mesh(mesh: str | None) -> tuple[int | None, int | None]:
    """``"DxM"`` -> (D, M); None -> (None, None): ``load_model``'s default layout."""
    if mesh is None:
        return None, None
    return cli.parse_mesh(mesh)


def cut_at_stop(text: str, until: list[str]) -> str | None:
    """``text`` up to its first stop string, or None when none occurs yet."""
    cuts = [text.index(s) for s in until if s and s in text]
    return text[:min(cuts)] if cuts else None


@register_model("megajax")
class MegajaxLM(TemplateLM):
    """A sharded megajax GPT checkpoint, loaded without conversion, answering lm-eval's three request types.

    ``TemplateLM`` (an ``LM``) supplies lm-eval's standard context/continuation split (trailing context spaces move
    to the continuation; an empty context becomes the end-of-document token), so scores compare with HF models'.
    """

    def __init__(self, pretrained: str | None = None, checkpoint: str | None = None, mesh: str | None = None,
                 expert: int | None = None, tokenizer: str | None = None, batch_size: int | str = 8,
                 stride: int | None = None,
                 max_gen_toks: int = 256, seed: int = 0, max_batch_size: int | None = None, device: str | None = None):
        """``max_batch_size`` and ``device`` come from lm-eval's CLI and are not used: the mesh places the
        model, and ``batch_size`` is fixed (no "auto"). ``stride`` is refused: the rolling windows are lm-eval's.
        ``pretrained`` or ``checkpoint``: the checkpoint (``pretrained=`` also names lm-eval's output folder)."""
        super().__init__()
        if (pretrained is None) == (checkpoint is None):
            raise ValueError("give the checkpoint once: --model_args pretrained=PATH (a workdir, step or export)")
        checkpoint = pretrained or checkpoint
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size!r}: give a whole number >= 1 (megajax has no 'auto')")
        if stride is not None:  # once Megatron's window stride; failing beats silently scoring other windows
            raise ValueError(f"stride={stride}: loglikelihood_rolling uses lm-eval's own rolling windows (as its "
                             "Hugging Face model) and takes no stride; Megatron-LM's strided windows are "
                             "eval.py --task=ppl --stride=N")
        stored = read_stored_run(checkpoint)  # checks before loading anything
        if not stored.model_spec.causal_lm:
            raise ValueError(f"{checkpoint} holds a {stored.model_name} model; lm-eval needs a causal language "
                             "model (a GPT)")
        self.tok = tokenizer_for(stored, tokenizer)
        check_tokenizer(self.tok, stored)
        self.seq_len = stored.model.max_seq_len
        self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)
        data, model = parse_mesh(mesh)
        self.model, spec, self.mesh = restore_model(checkpoint, inference_config(
            checkpoint, data, model, None if expert is None else int(expert)))
        self.rules = spec.rules
        self.scorer = Scorer(self.model, self.mesh, self.rules, int(batch_size), self.seq_len)
        self.batch_size = self.scorer.batch_size  # rounded up to a multiple of the data axis

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod_id

    @property
    def tokenizer_name(self) -> str:
        return self.tok.source

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode_batch([string])[0]

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation is the argmax at every position) per request of
        (request args or None, context ids, continuation ids)."""
        # A context of only spaces encodes to nothing once its spaces move to the continuation.
        rows = [cloze_rows(ctx or [self.eot_token_id], cont, self.seq_len) for _, ctx, cont in requests]
        results = []
        chunk = self.batch_size * 16  # bounds the host memory of the (rows, seq_len) arrays
        for i in range(0, len(rows), chunk):
            inputs, labels, mask = (np.stack(x) for x in zip(*rows[i:i + chunk]))
            nll, hit = self.scorer(inputs, labels)
            for n, h, m in zip(nll, hit, mask):
                results.append((-float(n[m].astype(np.float64).sum()), bool(h[m].all())))
        for (args, _, _), result in zip(requests, results):
            if args is not None:  # rolling windows have no request of their own to cache
                self.cache_hook.add_partial("loglikelihood", args, result)
        return results

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) windows covering ``tokens``, exactly as lm-eval's HF model cuts them: windows of
        max_seq_len predicted tokens, the first after the prefix (end-of-document) token, each later one after the
        token before it; the last, shorter one keeps the tokens before it as context up to max_seq_len."""
        windows = get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                            max_seq_len=self.seq_len, context_len=1)
        return [make_disjoint_window(w) for w in windows]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """log p(document | prefix token) summed over lm-eval's rolling windows (``rolling_windows``): every
        document token scored once; the windows of all documents batched together. An empty document scores 0."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            for context, continuation in self.rolling_windows(self.tok_encode(req.args[0])):
                windows.append((None, context, continuation))
                owner.append(i)
        results = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            results[i] += ll  # in window order, as lm-eval's HF model sums them
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, result)
        return results

    def _generation_args(self, kwargs: dict[str, Any]) -> tuple[list[str], int, Sampling]:
        """(stop strings + the end-of-document text, max new tokens, sampling) from a request's gen_kwargs:
        greedy unless ``do_sample`` (as HF's generate)."""
        unknown = set(kwargs) - set(GEN_KWARGS)
        if unknown:
            raise ValueError(f"generation arguments {sorted(unknown)} are not supported by megajax "
                             f"(supported: {', '.join(GEN_KWARGS)})")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        until.append(self.tok.decode([self.eot_token_id]))
        sampling = Sampling(greedy=not kwargs.get("do_sample", False),
                            temperature=float(kwargs.get("temperature", 1.0)), top_k=int(kwargs.get("top_k", 0)),
                            top_p=float(kwargs.get("top_p", 1.0)))
        max_gen = int(kwargs.get("max_gen_toks", self.max_gen_toks))
        if not 1 <= max_gen < self.seq_len:
            raise ValueError(f"max_gen_toks={max_gen}: must be in 1..{self.seq_len - 1} (the model's "
                             f"max_seq_len={self.seq_len} holds the prompt and the generated tokens)")
        return until, max_gen, sampling

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """The continuation of each context up to its first stop string (the context cut from the left to leave
        room for ``max_gen_toks``). Requests of equal prompt length and settings share batches."""
        groups = collections.defaultdict(list)
        for i, req in enumerate(requests):
            context, kwargs = req.args
            until, max_gen, sampling = self._generation_args(dict(kwargs))
            prompt = (self.tok_encode(context) or [self.eot_token_id])[-(self.seq_len - max_gen):]
            groups[(len(prompt), max_gen, sampling)].append((i, prompt, until))
        results: list[str | None] = [None] * len(requests)
        for (p, max_gen, sampling), items in groups.items():
            for j in range(0, len(items), self.batch_size):
                batch = items[j:j + self.batch_size]
                prompts = np.asarray([prompt for _, prompt, _ in batch], np.int32)  # generate pads to the shards

                def done(out: np.ndarray, batch=batch) -> bool:
                    return all(cut_at_stop(self.tok.decode(out[r, p:].tolist()), until) is not None
                               for r, (_, _, until) in enumerate(batch))

                out = generate(self.model, self.mesh, self.rules, prompts, max_gen, sampling, seed=self.seed,
                               stop=done)
                for r, (i, _, until) in enumerate(batch):
                    text = self.tok.decode(out[r, p:].tolist())
                    cut = cut_at_stop(text, until)
                    results[i] = text if cut is None else cut  # no stop string: all max_gen_toks tokens
                    self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        return results
