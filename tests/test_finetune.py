"""Fine-tuning through the trainer: task heads are tensor-parallel exact, learn the synthetic tasks, and start from
a pretrained BERT trunk (``init_from``) loaded bitwise on another mesh."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import place
from flax import nnx

from megajax.checkpoint import CheckpointError, read_config, restore_params, save_params
from megajax.config import bert_base_config, build_mesh, create_model, resolve, rules_of
from megajax.data.tokenizer import BERT_SPECIALS, load_tokenizer
from megajax.models import model_spec
from megajax.parallel.sharding import ParallelContext, activate
from megajax.training.data import load_dataset
from megajax.training.finetune import check_init_from, trunk_keys
from megajax.training.loop import train

TASK_OF = {"bert_classifier": "synthetic_pair", "bert_span": "synthetic_span",
           "bert_multiple_choice": "synthetic_choice"}


def task_config(name: str, data: int = 1, model: int = 1, hidden: int = 64, heads: int = 8):
    """A 2-layer BERT task model on its synthetic task (vocab 64, sequences of 24), no dropout, fp32."""
    c = bert_base_config(name)
    c.model.update(vocab_size=64, make_vocab_size_divisible_by=64, num_layers=2, hidden_size=hidden,
                   num_heads=heads, max_seq_len=24, dropout=0.0, remat="none")
    c.mesh.data, c.mesh.model = data, model
    c.data.update(source="task", task=TASK_OF[name])
    c.train.update(global_batch_size=8, precision="fp32", log_every=1000, eval_batches=0)
    c.checkpoint.enabled = False
    return c


@pytest.fixture(scope="module")
def reference():
    """Per head kind: the 1x1 model, a batch of its task and the 1x1 loss and gradients."""
    out = {}
    for name in TASK_OF:
        config = task_config(name)
        config.model.num_layers = 1  # the heads are under test; one block keeps the compiles short
        model = create_model(config, build_mesh(config), seed=0)
        rows = load_dataset(resolve(config, jax.device_count())).train.rows(np.arange(8))
        batch = {k: jnp.asarray(v) for k, v in rows.items()}
        out[name] = (config, model, batch, loss_and_grads(name, model, batch, config, 1, 1))
    return out


def loss_and_grads(name: str, model: nnx.Module, batch: dict, config, data: int, tensor: int):
    """The objective's loss and parameter gradients with the model's parameters laid out on a data x tensor mesh."""
    mesh, graphdef, state = place(model, config, data, tensor)
    loss = model_spec(name).objective.loss

    @jax.jit
    def fn(state, batch):
        return jax.value_and_grad(lambda s: loss(nnx.merge(graphdef, s), batch, None)[0])(state)

    with activate(mesh, ParallelContext(rules_of(config))):
        value, grads = fn(state, batch)
    return float(value), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


@pytest.mark.parametrize("name", list(TASK_OF))
@pytest.mark.parametrize("mesh", [(2, 4)])
def test_task_heads_are_tensor_parallel_exact(reference, name, mesh):
    config, model, batch, (want_loss, want_grads) = reference[name]
    loss, grads = loss_and_grads(name, model, batch, config, *mesh)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    flat = jax.tree_util.tree_leaves_with_path(want_grads)
    assert len(flat) == len(jax.tree.leaves(grads))
    for path, want in flat:
        got = grads
        for key in path:
            got = got[key.key]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert np.abs(np.concatenate([g.ravel() for g in jax.tree.leaves(want_grads)])).max() > 0


# steps, lr, accuracy a tiny BERT must reach on 256 held-out rows (chance: 0.5, ~0.05 for both span ends, 0.25)
LEARN = {"bert_classifier": (60, 2e-3, 0.8), "bert_span": (30, 2e-3, 0.8), "bert_multiple_choice": (120, 3e-3, 0.6)}


@pytest.mark.many_steps
@pytest.mark.parametrize("name", [n for n in TASK_OF if n != "bert_classifier"])  # the classifier learns its task
def test_tiny_bert_learns_synthetic_task(tmp_path, name):  # from a converted BERT below
    steps, lr, threshold = LEARN[name]
    c = task_config(name, heads=4)
    c.train.update(steps=steps, global_batch_size=32, eval_every=0, eval_batches=8)
    c.optimizer.update(lr=lr, min_lr=lr / 10, warmup_steps=20)
    records = train(c, tmp_path)
    valid = [r for r in records if "valid_accuracy" in r][-1]
    print(name, valid)
    assert valid["valid_accuracy"] > threshold, valid


def _bert_config(**model):
    c = task_config("bert_classifier")
    del c.model["num_classes"]  # the pretraining model's section: BERT's fields
    c.model.update({"name": "bert", **model})
    c.data.update(source="default", task="")
    return c


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A BERT checkpoint (params-only export, seed 7, 32 positions: the task runs use 24) and its parameters as
    numpy."""
    config = _bert_config(max_seq_len=32)
    params = nnx.to_pure_dict(nnx.state(create_model(config, build_mesh(config), seed=7)))
    root = tmp_path_factory.mktemp("pretrained")
    save_params(root / "bert", params, config.to_json())
    return root, jax.tree.map(np.asarray, params)


def _params_of(workdir: pathlib.Path, config) -> dict:
    """The task model's parameters saved in ``workdir``, read onto a 1x1 mesh."""
    c = config.copy_and_resolve_references()
    c.mesh.data, c.mesh.model = 1, 1
    target = nnx.to_pure_dict(nnx.state(create_model(c, build_mesh(c), seed=0)))
    return jax.tree.map(np.asarray, restore_params(workdir, target))


def test_init_from_loads_the_trunk_bitwise_on_another_mesh_and_resume_ignores_it(pretrained, tmp_path, monkeypatch,
                                                                                 capsys):
    root, bert = pretrained
    monkeypatch.chdir(root)  # a relative init_from
    c = task_config("bert_classifier", data=2, model=4)
    c.init_from = "bert"
    c.train.update(steps=1, seed=3)
    c.optimizer.update(lr=0.0, min_lr=0.0, warmup_steps=0, decay_steps=1)  # parameters stay as loaded
    c.checkpoint.update(enabled=True, every_steps=1)
    train(c, tmp_path / "ft")
    got = _params_of(tmp_path / "ft", c)
    trunk = trunk_keys(resolve(c, jax.device_count()))
    assert set(trunk) == {"wte", "wpe", "tte", "blocks", "ln_f", "pooler"}
    want_trunk = {**{k: bert[k] for k in trunk}, "wpe": bert["wpe"][:c.model.max_seq_len]}  # the first positions
    for path, want in jax.tree_util.tree_leaves_with_path(want_trunk):
        x = got
        for key in path:
            x = x[key.key]
        np.testing.assert_array_equal(x, want, err_msg=jax.tree_util.keystr(path))
    fresh = nnx.to_pure_dict(nnx.state(create_model(c, build_mesh(c), seed=3)))["classifier"]
    for k in ("kernel", "bias"):
        np.testing.assert_array_equal(got["classifier"][k], np.asarray(fresh[k]))
    assert not np.array_equal(got["wte"]["embedding"], np.asarray(
        nnx.to_pure_dict(nnx.state(create_model(c, build_mesh(c), seed=3)))["wte"]["embedding"]))

    c.train.steps, c.init_from = 2, "no/such/checkpoint"  # a resume never reads init_from
    records = train(c, tmp_path / "ft")
    assert [r["step"] for r in records] == [2] and "init_from='no/such/checkpoint' are not read (resume wins)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("make, message", [
    (None, "does not exist"),
    (lambda: _bert_config(hidden_size=32, num_heads=4), r"model.hidden_size: 32 saved, 64 here; model.num_heads: 4 "
                                                        r"saved, 8 here\); set --config.model.hidden_size=32 "
                                                        r"--config.model.num_heads=4"),
    (lambda: _bert_config(name="gpt"), "model.name='gpt' checkpoint"),
    (lambda: _bert_config(max_seq_len=16), "model.max_seq_len=16, fewer than this config's 24; set "
                                           "--config.model.max_seq_len to at most 16"),
])
def test_init_from_errors_before_compiling(tmp_path, make, message):
    c = task_config("bert_classifier")
    c.train.steps = 1
    c.init_from = str(tmp_path / "source")
    if make is not None:
        config = make()
        save_params(tmp_path / "source", {"w": np.zeros(2, np.float32)}, config.to_json())  # only its config is read
    with pytest.raises((FileNotFoundError, CheckpointError), match=message):
        train(c, tmp_path / "ft")


def test_init_from_pretrained_with_another_vocabulary_is_refused(tmp_path):
    """A vocab.txt of the same size with other words passes every shape check; the vocabulary fingerprint the
    pretraining run recorded (and the fine-tuning run records from its task data's tokenizer) tells them apart."""
    source = _bert_config()
    source.data.tokenizer_fingerprint = "0" * 16
    save_params(tmp_path / "source", {"w": np.zeros(2, np.float32)}, source.to_json())  # only its config is read
    c = task_config("bert_classifier")
    c.init_from = str(tmp_path / "source")
    c.data.update(tokenizer="other/vocab.txt", tokenizer_fingerprint="1" * 16)
    with pytest.raises(CheckpointError, match=r"pretrained with another vocabulary than data.tokenizer='other/vocab"
                                              r".txt' \(tokenizer fingerprints 0{16} there, 1{16} here\)"):
        check_init_from(resolve(c, jax.device_count()))
    c.data.tokenizer_fingerprint = "0" * 16
    assert check_init_from(resolve(c, jax.device_count())) == tmp_path / "source"


def test_finetune_from_a_converted_hugging_face_bert(tmp_path):
    """A random local transformers BertForPreTraining, converted with hf-to-megajax, is the trunk of a fine-tuning
    run: read by ``load_trunk`` (as train.py does) onto 1x4, its pooled output equals transformers' within 1e-4;
    fine-tuned from it on 1x1, the classifier learns."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from megajax.convert.__main__ import main as convert_main
    from megajax.training.finetune import load_trunk

    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=24, type_vocab_size=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).eval()
    hf.save_pretrained(tmp_path / "hf")
    words = [*BERT_SPECIALS, *(f"w{i}" for i in range(59))]  # 64 entries, as the model's vocabulary
    (tmp_path / "hf" / "vocab.txt").write_text("\n".join(words) + "\n")
    (tmp_path / "other.txt").write_text("\n".join(words[:5] + words[5:][::-1]) + "\n")  # same size, ids moved
    convert_main(["hf-to-megajax", f"--hf={tmp_path / 'hf'}", f"--output={tmp_path / 'mj'}",
                  "--make_vocab_size_divisible_by=64"])
    recorded = read_config(tmp_path / "mj")["data"]["tokenizer_fingerprint"]
    assert recorded == load_tokenizer(tmp_path / "hf" / "vocab.txt").fingerprint
    c = task_config("bert_classifier", data=1, model=4, heads=4)
    c.model.post_layernorm = True  # BertForPreTraining is post-LN; a mismatch is refused by init_from's checks
    c.init_from = str(tmp_path / "mj")
    # the converted directory's vocabulary is compared with the fine-tuning data's, as a pretraining run's is
    c.data.update(tokenizer=str(tmp_path / "other.txt"),
                  tokenizer_fingerprint=load_tokenizer(tmp_path / "other.txt").fingerprint)
    with pytest.raises(CheckpointError, match="pretrained with another vocabulary than data.tokenizer="):
        check_init_from(resolve(c, jax.device_count()))
    c.data.update(tokenizer="", tokenizer_fingerprint=recorded)
    assert check_init_from(resolve(c, jax.device_count())) == tmp_path / "mj"

    mesh = build_mesh(c)
    graphdef, state = nnx.split(create_model(c, mesh, seed=0))
    params = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, {**params, **load_trunk(resolve(c, jax.device_count()), params)})
    batch = load_dataset(resolve(c, jax.device_count())).train.rows(np.arange(8))
    with activate(mesh, ParallelContext(rules_of(c))):
        pooled = jax.jit(lambda s, *x: (m := nnx.merge(graphdef, s)).pool(m.encode(*x)))(
            state, *(jnp.asarray(batch[k]) for k in ("tokens", "token_types", "padding_mask")))
    with torch.no_grad():
        want = hf.bert(input_ids=torch.from_numpy(batch["tokens"]).long(),
                       token_type_ids=torch.from_numpy(batch["token_types"]).long(),
                       attention_mask=torch.from_numpy(batch["padding_mask"]).long()).pooler_output.numpy()
    np.testing.assert_allclose(np.asarray(pooled), want, atol=1e-4)

    steps, lr, threshold = LEARN["bert_classifier"]
    c.train.update(steps=steps, global_batch_size=32, eval_every=0, eval_batches=8)
    c.optimizer.update(lr=lr, min_lr=lr / 10, warmup_steps=20)
    c.mesh.model = 1
    valid = [r for r in train(c, tmp_path / "ft") if "valid_accuracy" in r][-1]
    assert valid["valid_accuracy"] > threshold, valid
