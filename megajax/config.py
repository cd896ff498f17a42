"""The default experiment config and the checks that run before anything is allocated.

Each file in ``configs/`` starts from ``base_config()`` and sets the model size. Layers never see this object:
``gpt_config`` turns ``config.model`` into a frozen ``GPTConfig``.
"""

from __future__ import annotations

import ml_collections

from megajax.models.gpt import GPTConfig
from megajax.sharding import MEGATRON_RULES, MESH_AXES, ConfigError, Rules, ShardingConfigError, resolve_mesh_shape


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
    ))
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))
    c.sharding = ml_collections.ConfigDict(dict(rules=MEGATRON_RULES))
    c.train = ml_collections.ConfigDict(dict(
        steps=300_000,
        global_batch_size=512,  # sequences per step
        micro_batch_size=0,  # sequences per data shard per accumulation step; 0 = no accumulation
        seed=0,
        log_every=10,
        eval_every=0,  # validation loss every N steps (0: only at the end)
        eval_batches=8,  # global batches of the validation split per evaluation (0: never)
        precision="auto",  # fp32 | bf16 | fp16 | auto (bf16 on accelerators, fp32 on CPU)
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
        source="default",  # default (stdlib corpus, offline) | indexed (data.path=PREFIX) | tfds | random
        path="",  # indexed: the prefix written by python -m megajax.data.preprocess
        tokenizer="",  # tfds: tokenizer.json, a GPT-2 BPE directory or a vocab.txt
        tfds_name="",
        tfds_split="train",
        tfds_feature="text",
        tfds_data_dir="",
        min_tokens=0,  # tfds: drop shorter documents (the preprocess CLI defaults to the paper's 128)
        seed=1234,
        valid_fraction=1 / 30,  # the paper's 29:1 train/validation split
    ))
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


def gpt_config(config: ml_collections.ConfigDict) -> GPTConfig:
    """The model's own frozen config, from ``config.model`` (and the compute dtype from ``train.precision``)."""
    m = config.model
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
    precision = resolve_precision(config.train.get("precision", "auto"))
    if precision not in _PRECISION_DTYPES:
        raise ConfigError(f"train.precision={precision!r}; choose one of {sorted(_PRECISION_DTYPES)}")
    return GPTConfig(
        vocab_size=m.vocab_size,
        padded_vocab_size=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by),
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads, max_seq_len=m.max_seq_len,
        mlp_ratio=m.mlp_ratio, dropout=m.dropout, init_std=m.init_std, layernorm_eps=m.layernorm_eps,
        dtype=_PRECISION_DTYPES[precision], remat=m.remat,
    )


def rules_of(config: ml_collections.ConfigDict) -> Rules:
    """The logical-axis rules as a hashable tuple of pairs, with targets checked against the mesh axes."""
    rules = tuple((str(k), None if v is None else str(v)) for k, v in config.sharding.rules)
    for name, axis in rules:
        if axis is not None and axis not in MESH_AXES:
            raise ShardingConfigError(f"sharding rule ({name!r}, {axis!r}) names no mesh axis; use one of "
                                      f"{MESH_AXES} or None")
    return rules


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
    dp, tp = resolve_mesh_shape(dp, tp, num_devices)
    rules_of(config)
    if config.checkpoint.keep < 0:
        raise ConfigError(f"checkpoint.keep={config.checkpoint.keep}; use 0 to keep every checkpoint or K > 0 "
                          "to keep the newest K")
    if config.checkpoint.get("restore_step", 0) < 0:  # .get: configs stored by older checkpoints lack it
        raise ConfigError(f"checkpoint.restore_step={config.checkpoint.restore_step}; use 0 for the latest step "
                          "or a step number listed in WORKDIR/checkpoints")
    return dp, tp
