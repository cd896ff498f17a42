"""The default experiment config, the checks that run before anything is allocated, and the resolved run.

Each file in ``configs/`` starts from ``base_config()`` and sets the model. Layers never see this object:
``resolve`` turns it, once, into a frozen ``RunSpec`` (the model's ``TransformerConfig``, the rules, the mesh
shape, the precision, the micro-batching) that everything downstream reads.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from megajax.models import MODELS, TransformerConfig
from megajax.sharding import (MEGATRON_RULES, MESH_AXES, SEQUENCE_PARALLEL_NAME, ConfigError, Rules,
                              ShardingConfigError, resolve_mesh_shape)


def base_config() -> ml_collections.ConfigDict:
    """Defaults shared by every GPT config (the paper's Section 4.2 where it says)."""
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
        name="gpt",
        vocab_size=50257,
        make_vocab_size_divisible_by=1024,  # 128 x 8 (paper Section 5.1): 50257 -> 51200
        num_layers=12,
        hidden_size=768,
        num_heads=12,
        max_seq_len=1024,
        mlp_ratio=4,
        dropout=0.1,
        init_std=0.02,
        layernorm_eps=1e-5,
        remat="full",  # activation checkpointing after every layer (paper Section 4.2)
        post_layernorm=False,  # False: pre-LN blocks + final LN (paper Fig. 7b); True: original BERT (Fig. 7a)
        activation="gelu_tanh",  # gelu_tanh (GPT-2) | gelu (exact erf, BERT)
        num_token_types=0,  # BERT: 2 (sentence A / B)
        num_classes=2,  # bert_classifier's outputs (MNLI 3, QQP 2)
    ))
    # Fine-tuning: a megajax checkpoint (workdir or step directory) whose BERT trunk initialises the task model
    # when the workdir has no checkpoint yet ('' = train from scratch; a resume ignores it).
    c.init_from = ""
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))
    c.sharding = ml_collections.ConfigDict(dict(rules=MEGATRON_RULES))
    # beyond the paper: shard_optimizer (ZeRO-1, Megatron's distributed optimizer) splits AdamW's moments over
    # `data` too; the parameters stay replicated over it (the step all-gathers their updated shards). sequence
    # (Korthikanti et al. 2022) splits the residual stream's sequence over `model` (the `seq_sp` rule): each
    # all-reduce of a block becomes a reduce-scatter + all-gather, and LayerNorm / dropout / residual activations
    # take 1/model of the memory. Needs model.max_seq_len divisible by mesh.model. fsdp (ZeRO-3) splits the
    # parameters, gradients and moments over `data`: each layer all-gathers its parameters when it runs (again in
    # the backward pass) and their gradients are reduced onto the shards; implies shard_optimizer.
    c.parallel = ml_collections.ConfigDict(dict(shard_optimizer=False, sequence=False, fsdp=False))
    c.train = ml_collections.ConfigDict(dict(
        steps=300_000,
        global_batch_size=512,  # sequences per step
        micro_batch_size=0,  # sequences per data shard per accumulation step; 0 = no accumulation
        seed=0,
        log_every=10,
        eval_every=0,  # validation loss every N steps (0: only at the end)
        eval_batches=8,  # global batches of the validation split per evaluation (0: never)
        precision="auto",  # fp32 | bf16 | fp16 | auto (bf16 on accelerators, fp32 on CPU)
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
        source="default",  # default (stdlib corpus, offline) | indexed (data.path=PREFIX) | tfds | random | task
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
    ))
    return c


def bert_base_config() -> ml_collections.ConfigDict:
    """``base_config()`` with BERT's defaults (paper Section 4.2, following Lan et al. 2019 and Devlin et al.)."""
    c = base_config()
    c.model.update(name="bert", vocab_size=30522, num_token_types=2, max_seq_len=512, activation="gelu",
                   layernorm_eps=1e-12, post_layernorm=False)  # the paper's rearranged pre-LN (Figure 7b)
    c.train.update(steps=2_000_000, global_batch_size=1024)
    c.optimizer.update(lr=1e-4, min_lr=1e-5, warmup_steps=10_000, decay="linear")
    return c


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Rounds the vocabulary up to a multiple of ``divisible_by``; fixed by the config, not by the mesh."""
    if divisible_by < 1:
        raise ConfigError(f"model.make_vocab_size_divisible_by must be >= 1, got {divisible_by}")
    return -(-vocab_size // divisible_by) * divisible_by


_PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def resolve_precision(precision: str) -> str:
    """'auto' is bf16 on GPU/TPU and fp32 on CPU."""
    if precision != "auto":
        return precision
    import jax

    return "fp32" if jax.default_backend() == "cpu" else "bf16"


def model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
    """The model's own frozen config, from ``config.model`` (and the compute dtype from ``train.precision``)."""
    m = config.model
    if m.name not in MODELS:
        raise ConfigError(f"model.name={m.name!r}; choose one of {sorted(MODELS)}")
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    precision = resolve_precision(config.train.get("precision", "auto"))
    if precision not in _PRECISION_DTYPES:
        raise ConfigError(f"train.precision={precision!r}; choose one of {sorted(_PRECISION_DTYPES)}")
    try:
        return TransformerConfig(
            vocab_size=m.vocab_size,
            padded_vocab_size=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by),
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads, max_seq_len=m.max_seq_len,
            mlp_ratio=m.mlp_ratio, dropout=m.dropout, init_std=m.init_std, layernorm_eps=m.layernorm_eps,
            dtype=_PRECISION_DTYPES[precision], remat=m.remat, post_layernorm=m.post_layernorm,
            activation=m.activation, num_token_types=m.num_token_types,
            num_classes=m.get("num_classes", 2))  # .get: configs stored by older checkpoints lack it
    except ValueError as e:
        raise ConfigError(str(e)) from e


def rules_of(config: ml_collections.ConfigDict) -> Rules:
    """The logical-axis rules as a hashable tuple of pairs, with targets checked against the mesh axes.

    ``parallel.sequence`` maps the residual stream's sequence (``seq_sp``) to ``model``; rules stored before that
    name existed get it (replicated), so their checkpoints still load.
    """
    rules = tuple((str(k), None if v is None else str(v)) for k, v in config.sharding.rules)
    if SEQUENCE_PARALLEL_NAME not in dict(rules):
        rules += ((SEQUENCE_PARALLEL_NAME, None),)
    if config.get("parallel", {}).get("sequence", False):  # .get: configs stored before the field existed
        rules = tuple((k, "model" if k == SEQUENCE_PARALLEL_NAME else v) for k, v in rules)
    for name, axis in rules:
        if axis is not None and axis not in MESH_AXES:
            raise ShardingConfigError(f"sharding rule ({name!r}, {axis!r}) names no mesh axis; use one of "
                                      f"{MESH_AXES} or None")
    return rules


def sequence_parallel(config: ml_collections.ConfigDict) -> bool:
    """Whether the rules split the residual stream's sequence (``parallel.sequence``, or a ``seq_sp`` rule)."""
    return dict(rules_of(config))[SEQUENCE_PARALLEL_NAME] is not None


def state_split(config: ml_collections.ConfigDict) -> tuple[bool, bool]:
    """(moments split over data, parameters split over data): ``parallel.shard_optimizer`` (ZeRO-1) gives
    (True, False), ``parallel.fsdp`` (ZeRO-3) (True, True). ``.get``: configs stored before the fields existed."""
    parallel = config.get("parallel", {})
    fsdp = bool(parallel.get("fsdp", False))
    return bool(parallel.get("shard_optimizer", False)) or fsdp, fsdp


def validate(config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int]:
    """Checks a config against the device count; returns the resolved (data, model) mesh shape.

    Runs before any allocation, so a bad config fails in milliseconds with a message that says what to change.
    """
    m, tp, dp = config.model, config.mesh.model, config.mesh.data
    if tp < 1:
        raise ConfigError(f"mesh.model must be >= 1, got {tp}")  # before the divisibility checks below
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    if m.num_heads % tp:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by mesh.model={tp}: each model shard "
                          f"must hold whole heads; pick mesh.model from the divisors of {m.num_heads}")
    if m.hidden_size % tp:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by mesh.model={tp}")
    if (m.mlp_ratio * m.hidden_size) % tp:
        raise ConfigError(f"the MLP width {m.mlp_ratio * m.hidden_size} is not divisible by mesh.model={tp}")
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    if padded % tp:
        raise ConfigError(f"the padded vocabulary {padded} (model.make_vocab_size_divisible_by="
                          f"{m.make_vocab_size_divisible_by}) is not divisible by mesh.model={tp}; make "
                          f"make_vocab_size_divisible_by a multiple of {tp}")
    if m.max_seq_len < 1 or not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.max_seq_len must be >= 1 and model.dropout in [0, 1); got {m.max_seq_len} and "
                          f"{m.dropout}")
    if sequence_parallel(config) and m.max_seq_len % tp:
        raise ConfigError(f"parallel.sequence splits the sequence over mesh.model={tp}, but model.max_seq_len="
                          f"{m.max_seq_len} is not divisible by it: make max_seq_len a multiple of {tp}, pick "
                          f"mesh.model from its divisors, or set parallel.sequence=False")
    model_config(config)  # name, precision, remat, activation
    dp, tp = resolve_mesh_shape(dp, tp, num_devices)
    rules_of(config)
    if config.checkpoint.keep < 0:
        raise ConfigError(f"checkpoint.keep={config.checkpoint.keep}; use 0 to keep every checkpoint or K > 0 "
                          "to keep the newest K")
    if config.checkpoint.get("restore_step", 0) < 0:  # .get: configs stored by older checkpoints lack it
        raise ConfigError(f"checkpoint.restore_step={config.checkpoint.restore_step}; use 0 for the latest step "
                          "or a step number listed in WORKDIR/checkpoints")
    return dp, tp


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_training(config: ml_collections.ConfigDict, data_parallel: int) -> int:
    """Checks the fields only training reads; returns the number of micro-batches per step."""
    t, c, d = config.train, config.checkpoint, config.data
    _require(t.steps >= 1, f"train.steps must be >= 1 (optimizer steps to train to), got {t.steps}")
    _require(t.log_every >= 1, f"train.log_every must be >= 1 (log every N steps), got {t.log_every}")
    _require(t.eval_every >= 0 and t.eval_batches >= 0,
             f"train.eval_every and train.eval_batches must be >= 0 (0: off), got {t.eval_every}, {t.eval_batches}")
    _require(t.max_nonfinite_steps >= 0, f"train.max_nonfinite_steps must be >= 0, got {t.max_nonfinite_steps}")
    _require(not c.enabled or c.every_steps >= 1,
             f"checkpoint.every_steps must be >= 1, got {c.every_steps}; to save no checkpoints set "
             "checkpoint.enabled=False")
    _require(0.0 <= d.valid_fraction < 1.0, f"data.valid_fraction must be in [0, 1), got {d.valid_fraction}")
    _require(0.0 < d.mask_prob < 1.0 and d.max_ngram >= 1 and 0.0 <= d.short_seq_prob <= 1.0,
             f"data.mask_prob must be in (0, 1), data.max_ngram >= 1 and data.short_seq_prob in [0, 1]; got "
             f"{d.mask_prob}, {d.max_ngram}, {d.short_seq_prob}")
    b, micro = t.global_batch_size, t.micro_batch_size or 0
    _require(b >= 1 and micro >= 0, f"train.global_batch_size must be >= 1 and train.micro_batch_size >= 0 "
                                    f"(0: no accumulation); got {b} and {micro}")
    _require(b % data_parallel == 0,
             f"train.global_batch_size={b} is not divisible by the data-parallel size {data_parallel}")
    micro = micro or b // data_parallel
    _require(b % (micro * data_parallel) == 0, f"train.global_batch_size={b} is not a multiple of "
                                               f"train.micro_batch_size={micro} x data={data_parallel}")
    return b // (micro * data_parallel)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A config resolved once: what the model, the mesh and the step are; read everywhere downstream."""

    model_name: str
    model: TransformerConfig
    rules: Rules
    data: int  # mesh shape
    tensor: int
    precision: str  # fp32 | bf16 | fp16 (``auto`` resolved)
    global_batch: int
    num_micro: int  # accumulation steps per optimizer step
    shard_optimizer: bool = False  # ZeRO-1: AdamW's moments also split over `data`
    sequence: bool = False  # sequence parallelism: the residual stream's sequence split over `model` (in ``rules``)
    fsdp: bool = False  # ZeRO-3: parameters (and so gradients and moments) also split over `data`

    @property
    def micro_batch(self) -> int:
        """Sequences per data shard per accumulation step."""
        return self.global_batch // (self.data * self.num_micro)


def resolve(config: ml_collections.ConfigDict, num_devices: int) -> RunSpec:
    """Validates a training config against ``num_devices`` and resolves every derived fact once."""
    dp, tp = validate(config, num_devices)
    num_micro = validate_training(config, dp)
    shard_optimizer, fsdp = state_split(config)
    return RunSpec(model_name=config.model.name, model=model_config(config), rules=rules_of(config), data=dp,
                   tensor=tp, precision=resolve_precision(config.train.precision),
                   global_batch=config.train.global_batch_size, num_micro=num_micro,
                   shard_optimizer=shard_optimizer, sequence=sequence_parallel(config), fsdp=fsdp)
