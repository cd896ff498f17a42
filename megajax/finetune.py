"""``config.init_from``: a fine-tuning run's BERT trunk read from a pretrained megajax checkpoint.

The task models subclass ``BERTEncoder``, so the trunk (embeddings, blocks, final / embedding LN, pooler) has the
same parameter paths in a pretraining checkpoint and in the task model. Only those paths are read, straight into
the task run's shardings (any mesh); the heads keep their fresh initialisation. Everything that can be checked
from the checkpoint's stored config is checked before compiling.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import ml_collections
from flax import nnx

from megajax.checkpoint import CheckpointError, read_config, restore_params
from megajax.config import model_config
from megajax.models import MODELS
from megajax.models.bert import BERTEncoder

# config.model fields that fix the trunk's parameter shapes (and its architecture); max_seq_len may be smaller
TRUNK_FIELDS = ("vocab_size", "make_vocab_size_divisible_by", "num_layers", "hidden_size", "num_heads", "mlp_ratio",
                "num_token_types", "post_layernorm", "activation")


def trunk_keys(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The top-level parameter names the task model shares with ``BERTEncoder`` (wte, wpe, tte, blocks, ...)."""
    encoder = nnx.eval_shape(lambda: BERTEncoder(model_config(config), rngs=nnx.Rngs(0)))
    return tuple(nnx.to_pure_dict(nnx.state(encoder)))


def check_init_from(config: ml_collections.ConfigDict) -> pathlib.Path:
    """The resolved ``config.init_from`` after checking that it holds a BERT checkpoint of this config's trunk
    sizes; raises FileNotFoundError or CheckpointError naming what differs."""
    path = pathlib.Path(config.init_from).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"init_from={config.init_from!r}: {path} does not exist; pass a pretraining run's "
                                "workdir or one of its step directories")
    saved = read_config(path).model
    cls = MODELS.get(saved.name)
    if cls is None or not issubclass(cls, BERTEncoder):
        raise CheckpointError(f"init_from={config.init_from!r} holds a model.name={saved.name!r} checkpoint: "
                              f"fine-tuning {config.model.name} needs a BERT one")
    for field in TRUNK_FIELDS:
        if saved.get(field) != config.model.get(field):
            raise CheckpointError(f"init_from={config.init_from!r} was trained with model.{field}={saved.get(field)}"
                                  f" but this config has {config.model.get(field)}; set "
                                  f"--config.model.{field}={saved.get(field)}")
    if config.model.max_seq_len > saved.max_seq_len:
        raise CheckpointError(f"init_from={config.init_from!r} has position embeddings for model.max_seq_len="
                              f"{saved.max_seq_len}, fewer than this config's {config.model.max_seq_len}; set "
                              f"--config.model.max_seq_len to at most {saved.max_seq_len}")
    return path


def load_trunk(config: ml_collections.ConfigDict, params_target: dict[str, Any]) -> dict[str, Any]:
    """The trunk parameters of ``config.init_from``, read into the shardings and dtypes of ``params_target``'s
    matching entries (a pure dict of ShapeDtypeStructs or arrays); the shapes are checked by name. A shorter
    ``model.max_seq_len`` than pretraining's keeps the first rows of the position embeddings (fine-tuning at 128
    tokens from a 512-token BERT, as BERT's GLUE runs)."""
    path = check_init_from(config)
    target = {k: params_target[k] for k in trunk_keys(config)}
    wpe, positions = target["wpe"], read_config(path).model.max_seq_len
    if positions != wpe.shape[0]:
        target["wpe"] = jax.ShapeDtypeStruct((positions, *wpe.shape[1:]), wpe.dtype, sharding=wpe.sharding)
    trunk = restore_params(path, target)
    if positions != wpe.shape[0]:
        trunk["wpe"] = jax.device_put(trunk["wpe"][:wpe.shape[0]], wpe.sharding)
    return trunk


# Paper Table 6 (fine-tuning hyperparameters), as read from its garbled layout in the reference copy: per task and
# size (batch, learning rate, epochs). MNLI's lr and epochs span all three rows; QQP's epochs (12) span its rows;
# SQuAD's and RACE's epochs are not legible there and are the 2 and 3 of BERT's and Megatron-LM's scripts.
TABLE6 = {
    "mnli": {"336m": (128, 1e-5, 10), "1p3b": (128, 1e-5, 10), "3p9b": (128, 1e-5, 10)},
    "qqp": {"336m": (128, 5e-5, 12), "1p3b": (128, 3e-5, 12), "3p9b": (128, 4e-5, 12)},
    "squad1": {"336m": (64, 3e-5, 2), "1p3b": (48, 3e-5, 2), "3p9b": (48, 1e-5, 2)},
    "squad2": {"336m": (64, 3e-5, 2), "1p3b": (64, 3e-5, 2), "3p9b": (48, 1e-5, 2)},
    "race": {"336m": (32, 2e-5, 3), "1p3b": (16, 1e-5, 3), "3p9b": (32, 2e-5, 3)},
}
TRAIN_EXAMPLES = {"mnli": 392_702, "qqp": 363_846, "squad1": 87_599, "squad2": 130_319, "race": 87_866}  # questions
# paper Table 4's BERT sizes: (layers, hidden, heads, mesh.model as in configs/bert_*.py)
BERT_SIZES = {"336m": (24, 1024, 16, 1), "1p3b": (24, 2048, 32, 2), "3p9b": (48, 2560, 40, 8)}
WARMUP_FRACTION = 0.065  # Megatron-LM's fine-tuning scripts; Table 6 does not give it


def table6_config(task: str, size: str) -> ml_collections.ConfigDict:
    """The fine-tuning config of ``task`` (mnli, qqp, squad1, squad2, race) at ``size`` (336m, 1p3b, 3p9b):
    the pretraining model of ``configs/bert_<size>.py`` with the task's head and Table 6's batch, lr and epochs
    (steps = epochs x training questions / batch; SQuAD counts questions, not its document-stride windows)."""
    from megajax.config import bert_base_config
    from megajax.data.task_source import TASKS

    batch, lr, epochs = TABLE6[task][size]
    layers, hidden, heads, tensor = BERT_SIZES[size]
    model, classes = TASKS[task]
    steps = -(-epochs * TRAIN_EXAMPLES[task] // batch)
    c = bert_base_config()
    c.model.update(name=model, num_layers=layers, hidden_size=hidden, num_heads=heads, num_classes=classes or 2)
    c.mesh.model = tensor
    c.data.update(source="task", task=task)
    c.train.update(steps=steps, global_batch_size=batch, log_every=50, eval_every=1000, eval_batches=32)
    c.optimizer.update(lr=lr, min_lr=0.0, warmup_steps=int(WARMUP_FRACTION * steps), decay="linear")
    c.checkpoint.update(every_steps=1000, keep=2)
    return c
