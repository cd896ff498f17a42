"""``eval.py --task=dpo``: a policy checkpoint against its frozen reference (``--reference``) on held-out preference
pairs, read, rendered and packed as training reads them (``megajax.data.preference``): the loss and TRL's metrics,
means over the pairs (``megajax.models.preference``), with ``--dpo_loss`` / ``--dpo_beta`` /
``--dpo_label_smoothing`` (default TRL's: sigmoid, 0.1, 0). The reference is loaded on a mesh of the policy's
shape once the policy's log-probabilities are taken. Bad rows and over-long pairs as the policy's run trained
(its ``data.sft_skip_bad_rows`` / ``data.sft_truncate``) unless ``--sft_skip_bad_rows`` / ``--sft_truncate`` say
otherwise."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from megajax.config import StoredRun, describe_differences, model_differences
from megajax.config.load import inference_config, read_stored_run, restore_model
from megajax.data.preference import Pair, pack_pairs, read_pairs
from megajax.data.tokenizer import TextTokenizer
from megajax.evaluation import inputs
from megajax.evaluation.evaluator import Evaluator
from megajax.evaluation.registry import EvalTask, Loaded, Request, register
from megajax.evaluation.sft_task import flag, row_reading
from megajax.models.preference import PreferenceLoss, completion_logps, preference_loss


@dataclasses.dataclass(frozen=True)
class DPOInput:
    """The held-out file's pairs, its path, the tokenizer, whether over-long pairs are cut, the rows skipped, the
    chat template's file and the loss to report."""

    pairs: list[Pair]
    path: str
    tokenizer: TextTokenizer
    truncate: bool
    skipped: int
    chat_template: str
    loss: PreferenceLoss


def _check_reference(stored: StoredRun, reference: str) -> None:
    """InputError where ``--reference`` holds no checkpoint or another model (family, sizes, vocabulary)."""
    try:
        ref = read_stored_run(reference)
    except (OSError, ValueError) as e:
        raise inputs.InputError(f"--reference={reference}: no megajax checkpoint there ({e}); pass the model the "
                                "policy was tuned from (a workdir, a step or an export)") from None
    if differences := model_differences(ref, stored, ignore=("max_seq_len",)):
        raise inputs.InputError(f"--reference={reference} holds another model than the policy's "
                                f"({describe_differences(differences)}): pass the model the policy was tuned from")
    if ref.model.max_seq_len < stored.model.max_seq_len:
        raise inputs.InputError(f"--reference={reference} reads {ref.model.max_seq_len} positions, fewer than the "
                                f"policy's rows of {stored.model.max_seq_len}: pass the model the policy was tuned "
                                "from")
    theirs, ours = ref.dataset.tokenizer_fingerprint, stored.dataset.tokenizer_fingerprint
    if theirs and ours and theirs != ours:
        raise inputs.InputError(f"--reference={reference} was trained with another vocabulary than the policy "
                                f"(tokenizer fingerprints {theirs} and {ours}): pass the model the policy was tuned "
                                "from")


def _read(stored: StoredRun, request: Request) -> DPOInput:
    if not request.reference:
        raise inputs.InputError("--task=dpo needs --reference=CHECKPOINT: the frozen model the policy is compared "
                                "with (the one it was tuned from)")
    reading = row_reading(stored, request, "dpo", "prompt / chosen / rejected rows")
    loss = PreferenceLoss(*(v if v is not None else d for v, d in zip(
        (request.dpo_beta, request.dpo_loss, request.dpo_label_smoothing), dataclasses.astuple(PreferenceLoss()))))
    try:
        loss.check()
    except ValueError as e:
        raise inputs.InputError(str(e).replace("dpo.", "--dpo_")) from None
    _check_reference(stored, request.reference)
    tok, what = reading.tokenizer, reading.what
    pairs, skipped = read_pairs(request.data, tok, reading.template, reading.skip, what, flag)
    if not pairs:
        raise inputs.InputError(f"{what} holds no pair ({len(skipped)} rows skipped)")
    pack_pairs(pairs, stored.model.max_seq_len, tok.eod_id, 1, reading.truncate, what, flag)  # refuses what won't fit
    return DPOInput(pairs, request.data, tok, reading.truncate, len(skipped), reading.template.source, loss)


def _sums(loaded: Loaded, rows, batch_size: int, pairs: int = 1) -> dict[str, np.ndarray]:
    """Each completion's summed log-probability and target count, (R, pairs, 2) each, under ``loaded``'s model, of
    rows of ``pairs`` pairs."""
    def fn(model, batch):
        sums, counts = completion_logps(model, batch, pairs)
        return {"sums": sums, "counts": counts}

    evaluate, state = Evaluator.of(loaded.model, fn, loaded.mesh, loaded.rules)
    return evaluate.map_rows(state, {k: jnp.asarray(v) for k, v in rows.fields.items()}, batch_size)


def _run(loaded: Loaded, task_input: DPOInput, request: Request) -> dict:
    rows = pack_pairs(task_input.pairs, loaded.seq_len, task_input.tokenizer.eod_id, 1, task_input.truncate)
    policy = _sums(loaded, rows, request.batch_size)
    mesh = dict(loaded.mesh.shape)
    reference = restore_model(request.reference, inference_config(
        request.reference, mesh.get("data", 1), mesh.get("model", 1), mesh.get("expert", 1)))
    ref = _sums(Loaded(reference.model, reference.mesh, reference.spec.rules, None, loaded.seq_len), rows,
                request.batch_size)
    loss, metrics = preference_loss(task_input.loss, jnp.asarray(policy["sums"]), jnp.asarray(ref["sums"]),
                                    jnp.asarray(policy["counts"]))
    return {"task": "dpo", "data": task_input.path, "reference": request.reference, "pairs": len(task_input.pairs),
            "dpo_loss": task_input.loss.loss, "beta": task_input.loss.beta,
            "label_smoothing": task_input.loss.label_smoothing, "loss": float(loss),
            **{k: float(v) for k, v in metrics.items()}, "truncated": rows.truncated,
            "skipped": task_input.skipped, "chat_template": task_input.chat_template}


register(EvalTask("dpo", _read, _run, sft_rows=True, reference=True))
