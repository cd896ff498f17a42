"""The default experiment config. Each file in ``configs/`` starts from ``base_config(family)`` (GPT by default;
``bert_base_config()`` adds BERT's training defaults) and sets the model; ``megajax.config.resolve`` checks and
resolves it."""

from __future__ import annotations

import dataclasses

import ml_collections

from megajax.models import model_spec
from megajax.models.bert import NAME as BERT
from megajax.models.gpt import NAME as GPT
from megajax.parallel.sharding import MEGATRON_RULES


def model_section(name: str, **fields) -> ml_collections.ConfigDict:
    """``config.model`` for the family registered as ``name``: every field of its config type (``fields()``: not
    the compute precision's, which ``train.precision`` sets) with the type's defaults, updated by ``fields``."""
    config_type = model_spec(name).config
    named = set(config_type.fields())
    defaults = {f.name: f.default for f in dataclasses.fields(config_type) if f.name in named}
    if unknown := set(fields) - set(defaults):
        raise ValueError(f"model.name={name} has no field {', '.join(sorted(unknown))}")
    return ml_collections.ConfigDict({"name": name, **defaults, **fields})


def with_model_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of ``config`` whose ``config.model`` holds every field of its family, the ones it leaves out at the
    family's defaults (a section switched to a task model by its name alone, one stored before a field existed), so
    the code below reads any field of the family. A field the family does not have stays, for
    ``resolve.model_config`` to name."""
    config = config.copy_and_resolve_references()
    section = model_section(config.model.name)
    section.update(config.model)
    config.model = section
    return config


# the parallel.* fields of a run without a pipeline schedule (what a loader or a planner sets when it drops
# mesh.pipe: microbatches without stages are refused)
NO_SCHEDULE = {"pipeline_microbatches": 0, "pipeline_repeats": 1, "pipeline_schedule": "gpipe",
               "pipeline_stage_recompute": False}


def base_config(model: str = GPT) -> ml_collections.ConfigDict:
    """Defaults shared by every config (the paper's Section 4.2 where it says), with the ``model`` family's
    ``config.model`` section (``model_section``)."""
    c = ml_collections.ConfigDict()
    c.model = model_section(model)
    # Fine-tuning: a megajax checkpoint (workdir or step directory) whose BERT trunk initialises the task model
    # when the workdir has no checkpoint yet ('' = train from scratch; a resume ignores it).
    c.init_from = ""
    # pipe > 1: pipeline parallelism (megajax.parallel.pipeline): the layers split into `pipe` stages, each batch
    # into parallel.pipeline_microbatches microbatches, run by parallel.pipeline_schedule: gpipe (each stage holds
    # contiguous layers; every microbatch's forward, then the backwards), circular (with parallel.pipeline_repeats =
    # v > 1: each stage holds v chunks; with M >= pipe the bubble's time shrinks v-fold) or 1f1b (GPipe's layers,
    # each microbatch's backward as soon as its forward ends: at most 2 pipe - 1 microbatches' residuals held, or
    # with parallel.pipeline_stage_recompute only their stage inputs, each stage's forward run again in its backward)
    # expert > 1: expert parallelism (a mixture-of-experts model's experts split over `expert` shards, which are data
    # shards for every other layer: the batch is split over data x expert)
    # auto: train.py plans the mesh, micro-batch and switches for the devices it finds (megajax.tools.auto_plan)
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1, pipe=1, expert=1, context=1, auto=False))
    c.sharding = ml_collections.ConfigDict(dict(rules=MEGATRON_RULES))
    # beyond the paper: shard_optimizer (ZeRO-1, Megatron's distributed optimizer) splits AdamW's moments over
    # `data` too; the parameters stay replicated over it (the step all-gathers their updated shards). sequence
    # (Korthikanti et al. 2022) splits the residual stream's sequence over `model` (the `seq_sp` rule): each
    # all-reduce of a block becomes a reduce-scatter + all-gather, and LayerNorm / dropout / residual activations
    # take 1/model of the memory. Needs model.max_seq_len divisible by mesh.model. fsdp (ZeRO-3) splits the
    # parameters, gradients and moments over `data`: each layer all-gathers its parameters when it runs (again in
    # the backward pass) and their gradients are reduced onto the shards; implies shard_optimizer.
    c.parallel = ml_collections.ConfigDict(dict(shard_optimizer=False, sequence=False, fsdp=False,
                                                pipeline_microbatches=0,  # 0: mesh.pipe of them
                                                pipeline_schedule="gpipe",  # gpipe | circular | 1f1b
                                                pipeline_stage_recompute=False,  # 1f1b only
                                                pipeline_repeats=1))
    c.train = ml_collections.ConfigDict(dict(
        steps=300_000,
        global_batch_size=512,  # sequences per step
        micro_batch_size=0,  # sequences per data shard per accumulation step; 0 = no accumulation
        seed=0,
        log_every=10,
        eval_every=0,  # validation loss every N steps (0: only at the end)
        eval_batches=8,  # global batches of the validation split per evaluation (0: never)
        precision="auto",  # fp32 | bf16 | fp16 | fp8 (bf16, blocks' GEMMs FP8) | auto (bf16 on accelerators, else fp32)
        max_nonfinite_steps=0,  # stop after this many consecutive non-finite losses (fp16's skipped steps aside)
        allow_batch_size_change=False,  # resume with another global_batch_size (the data order then shifts)
        peak_flops_per_device=0.0,  # override the MFU denominator; 0 = look up by device kind
    ))
    c.checkpoint = ml_collections.ConfigDict(dict(
        enabled=True,
        every_steps=1000,
        # The newest K checkpoints in the workdir (0: all). Earlier runs' steps count too, so a resumed run keeps
        # the same budget; an old step is deleted only after a newer save is complete.
        keep=3,
        keep_period=0,  # also keep every M-th step forever (0: off)
        async_save=True,  # write in the background while training continues
        # Resume from this step (0: the latest). Newer steps are moved to WORKDIR/superseded/<time>/, not deleted.
        restore_step=0,
    ))
    c.loss_scale = ml_collections.ConfigDict(dict(initial=2.0**32, growth_interval=1000, hysteresis=2,
                                                  min_scale=1.0))
    c.optimizer = ml_collections.ConfigDict(dict(
        lr=1.5e-4, min_lr=1e-5, warmup_steps=3000, decay="cosine", decay_steps=0,  # 0: until train.steps
        b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, clip_norm=1.0,
    ))
    c.data = ml_collections.ConfigDict(dict(
        # default (stdlib corpus, offline) | indexed (data.path=PREFIX) | tfds | random | task | sft (data.path=JSONL)
        # | preference (data.path=JSONL: direct preference optimisation, the dpo section)
        source="default",
        path="",  # indexed: the prefix written by python -m megajax.data.preprocess
        tokenizer="",  # tfds, task: tokenizer.json, a GPT-2 BPE directory or a vocab.txt
        # source=task: mnli | qqp | squad1 | squad2 | race (files in task_dir) or synthetic_pair | synthetic_span |
        # synthetic_choice (generated from data.seed; for tests and CPU runs)
        task="",
        task_dir="",  # source=task: the task's downloaded files (GLUE TSVs, SQuAD JSONs, RACE's split folders)
        tfds_name="",
        tfds_split="train",
        tfds_feature="text",
        tfds_data_dir="",
        min_tokens=0,  # tfds: drop shorter documents (the preprocess CLI defaults to the paper's 128)
        seed=1234,
        valid_fraction=1 / 30,  # the paper's 29:1 train/validation split
        # source=indexed: "W1 PREFIX1 W2 PREFIX2 ..." mixes several datasets by weight (Megatron's --data-path);
        # each is split by valid_fraction. Resuming with other weights needs allow_blend_change=True.
        blend="",
        allow_blend_change=False,
        mask_prob=0.15,  # BERT: fraction of tokens masked (whole-word n-grams)
        max_ngram=3,  # BERT: n-gram lengths 1..max_ngram with probability proportional to 1/n
        short_seq_prob=0.1,  # BERT: probability of a shorter target length
        # source=task: the largest fraction of the training file's questions (SQuAD: text not at answer_start, no
        # window holds the answer, empty context) or rows (QQP: malformed) left out before the run is refused. The
        # official files lose none or a handful (QQP's train.tsv: a few of 364k rows), so more than 1% means a
        # wrong or damaged file; 1.0 trains on whatever is left.
        max_dropped_fraction=0.01,
        # Packed windows (a decoder's next-token prediction; megajax.data.documents): each token attends only within
        # its own document (Llama 3's intra-document masking, Megatron's reset_attention_mask), its position
        # restarting at each document (reset_position_ids=False keeps the window's); eod_mask_loss drops the targets
        # that cross from one document to the next (Megatron's option of that name).
        document_masking=False,
        reset_position_ids=True,
        eod_mask_loss=False,
        # source=sft (data.path=FILE.jsonl, data.tokenizer=tokenizer.json; megajax.data.sft): examples packed into
        # rows (False: one per row), an example longer than a row refused (sft_truncate: cut to it), a bad row
        # refused with its line number (sft_skip_bad_rows: skipped and counted)
        sft_packing=True,
        sft_truncate=False,
        sft_skip_bad_rows=False,
        # source=preference (data.path=FILE.jsonl of prompt / chosen / rejected rows, data.tokenizer as sft;
        # megajax.data.preference): up to this many pairs packed in a row, each pair's two completions beside each
        # other; sft_truncate (each completion cut to half a row) and sft_skip_bad_rows as for sft
        pairs_per_row=1,
        # Recorded, not set: training writes here its data's tokenizer's vocabulary fingerprint (a sha256), stored
        # with each checkpoint; resuming, fine-tuning and evaluation refuse a tokenizer or dataset that differs.
        tokenizer_fingerprint="",
    ))
    # data.source=preference (megajax.models.preference): TRL's DPO losses, sigmoid (Rafailov et al. 2023) | ipo |
    # hinge, their beta and the sigmoid loss's label smoothing; the frozen reference model's checkpoint ("": the
    # init_from one), its log-probabilities of every pair computed before the first step
    c.dpo = ml_collections.ConfigDict(dict(beta=0.1, loss="sigmoid", label_smoothing=0.0, reference=""))
    return c


def bert_base_config(model: str = BERT) -> ml_collections.ConfigDict:
    """``base_config(model)`` (BERT or one of its task models) with BERT's training defaults (paper Section 4.2,
    following Lan et al. 2019 and Devlin et al.)."""
    c = base_config(model)
    c.train.update(steps=2_000_000, global_batch_size=1024)
    c.optimizer.update(lr=1e-4, min_lr=1e-5, warmup_steps=10_000, decay="linear")
    return c
