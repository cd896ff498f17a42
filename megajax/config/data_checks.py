"""Whether a model and its data fit each other (``config.data`` or a run's ``DataSource``): ``check_packing`` runs
in ``config.checks.checked``, ``check_data`` (``config.check_data_source``, ``check_run_data``) before the data is
opened, each a ConfigError naming the field to change."""

from __future__ import annotations

import ml_collections

from megajax.data.settings import FILE_SOURCES, DataSource
from megajax.errors import ConfigError
from megajax.models import MODELS, ModelSpec, task_models


def check_packing(spec: ModelSpec, d: DataSource | ml_collections.ConfigDict) -> None:
    """ConfigError where ``data.document_masking`` (or its options) or ``data.source=sft`` asks for packed rows the
    model does not read."""
    if (d.document_masking or d.source in FILE_SOURCES) and (spec.objective.packed_fields is None
                                                             or spec.examples is None):
        if d.source in FILE_SOURCES:
            raise ConfigError(f"data.source={d.source} fine-tunes a decoder on packed rows; model.name={spec.name} "
                              "reads none: fine-tune a decoder (gpt, llama, moe)")
        raise ConfigError(f"data.document_masking packs documents into a decoder's windows; model.name={spec.name} "
                          "reads no packed rows: set data.document_masking=False")
    if d.eod_mask_loss and not d.document_masking:
        raise ConfigError("data.eod_mask_loss drops the targets that cross from one document to the next of a packed "
                          "window: set data.document_masking=True with it (or leave data.eod_mask_loss=False)")


def check_data(spec: ModelSpec, d: DataSource | ml_collections.ConfigDict) -> None:
    """ConfigError where the model and its data (``config.data`` or the run's ``DataSource``) do not fit: a
    tokenizer the source would not read, document masking of a source without documents, a blend or corpus for a
    task model, a task another model trains, a source without the sentences the model's examples need."""
    if d.tokenizer and d.source not in ("tfds", "task", *FILE_SOURCES):  # it would be silently unused
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} is read with data.source=tfds, task, sft or preference; "
                          f"data.source="
                          f"{d.source} brings its own (a preprocessed dataset's PREFIX.tokenizer.json, the default "
                          "corpus's): leave data.tokenizer empty")
    if d.document_masking and d.source in ("random", *FILE_SOURCES):  # it would change nothing
        raise ConfigError("data.document_masking masks attention at a corpus's document ends; " + (
            "data.source=random draws uniform tokens with no documents" if d.source == "random" else
            f"data.source={d.source} packs each example as a document of its row already") + ": set "
            "data.document_masking=False")
    if d.blend:
        if spec.examples is None:
            raise ConfigError(f"data.blend mixes pretraining corpora, but model.name={spec.name} fine-tunes on "
                              "data.source=task; leave data.blend empty")
        return
    if (d.source == "task") != (spec.examples is None):
        fine_tuning = sorted(s.name for s in MODELS.values() if s.examples is None)
        raise ConfigError(f"model.name={spec.name} with data.source={d.source}: the task models "
                          f"({', '.join(fine_tuning)}) train on data.source=task and only they do")
    if d.source == "task":
        tasks = task_models()
        if d.task not in tasks:
            raise ConfigError(f"data.task={d.task!r}; choose one of {sorted(tasks)}")
        if tasks[d.task] is not spec:
            raise ConfigError(f"data.task={d.task} trains model.name={tasks[d.task].name}, got "
                              f"model.name={spec.name!r}")
    elif d.source == "random" and spec.examples.needs_sentences:
        raise ConfigError(f"data.source=random has no sentences for model.name={spec.name} (its examples are "
                          f"{spec.examples.name}); use data.source=default (the embedded prose corpus) or a corpus "
                          "preprocessed with --split_sentences")
