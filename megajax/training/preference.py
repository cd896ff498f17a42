"""Direct preference optimisation's frozen reference model (``data.source=preference``): its log-probability of
every completion of the run's preference file, computed once before the first step and kept in the batches'
``reference_logps`` field (``megajax.models.preference``).

The reference is ``dpo.reference``, else the ``init_from`` checkpoint, checked as ``init_from`` is (the same family,
sizes and vocabulary) before anything is written. Its parameters are read into the policy's shardings on the run's
own mesh and evaluated by the run's validation program (every mesh the step runs on: tensor, sequence, FSDP,
context, pipeline stages), then dropped before the policy's state is made, so training holds one model, as SFT does.
What it costs: a forward pass over the file (about a third of one epoch's compute) at every start, a resumed run's
too (deterministic on the same mesh, so the resumed steps are those of the uninterrupted run), and 8 bytes per pair
on the host; on the device, the reference's parameters (the policy's bytes) and one validation batch's activations,
before the optimizer's state exists.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megajax.checkpoint import CheckpointError
from megajax.config import RunSpec
from megajax.data.preference import PreferenceData
from megajax.evaluation.evaluator import Evaluator
from megajax.models.preference import REFERENCE, completion_logps
from megajax.training.finetune import check_init_from, load_trunk

FIELD = "dpo.reference"


def reference_of(spec: RunSpec) -> tuple[str, str]:
    """(the reference checkpoint, the config field that names it): ``dpo.reference``, else ``init_from``."""
    return (spec.dpo.reference, FIELD) if spec.dpo.reference else (spec.init_from, "init_from")


def check_reference(spec: RunSpec) -> None:
    """FileNotFoundError or CheckpointError where the reference checkpoint is missing or holds another model (family,
    sizes, vocabulary) than the run's (``finetune.check_init_from``)."""
    given, field = reference_of(spec)
    try:
        check_init_from(spec, given, field)
    except (CheckpointError, FileNotFoundError) as e:
        if f"{field}=" in str(e):
            raise
        raise type(e)(f"{field}={given!r}: {e}") from None


def fill_reference(spec: RunSpec, params_target: dict, validation: Evaluator, data: PreferenceData) -> None:
    """Writes the reference model's log-probability sums of every completion into ``data``'s training and validation
    rows (their ``reference_logps``, zeros until now; the loaders read the same arrays). ``params_target``: the
    run's parameters as the step holds them (abstract, sharded); ``validation``: the run's validation program,
    whose model, mesh and shardings the reference runs with."""
    params = load_trunk(spec, params_target, *reference_of(spec))
    pairs = spec.data.pairs_per_row
    evaluate = dataclasses.replace(validation, fn=lambda model, batch: completion_logps(model, batch, pairs)[0])
    for rows in (data.train, data.valid):
        if len(rows):
            sums = evaluate.map_rows(params, rows.fields, spec.global_batch)
            rows.fields[REFERENCE][:] = np.asarray(sums, np.float32).reshape(len(rows), 2 * pairs)
