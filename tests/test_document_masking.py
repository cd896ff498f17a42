"""Document masking over packed rows (``data.document_masking``, ``megajax.data.documents``): a packed row's
documents each attend only within themselves, at positions restarting at 0, so each document's losses and
gradients equal the document run alone (1e-6); the loader's packed fields equal a loop over the documents; a
training run over packed windows gives the same losses on every mesh (sequence parallelism, pipeline stages,
accumulation) as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import choice_config, step_losses
from flax import nnx
from test_moe import QWEN, moe_config

from megajax.config.build import build_mesh, create_model
from megajax.data.documents import packed_row, window_documents
from megajax.data.gpt_dataset import GPTBatches, Packing
from megajax.data.indexed import IndexedWriter
from megajax.errors import ConfigError
from megajax.parallel.losses import vocab_parallel_cross_entropy
from megajax.training.loop import setup

LENGTHS = (6, 9, 5, 8, 5)  # five documents filling one row of 32 inputs and 32 targets


def _naive_fields(doc_ids: list[int], reset: bool, eod_mask: bool) -> dict[str, list]:
    """The packed fields by a loop over the row's tokens."""
    segments, positions, weights = [], [], []
    segment = position = 0
    for j in range(len(doc_ids) - 1):
        new = j == 0 or doc_ids[j] != doc_ids[j - 1]
        segment += new
        position = 0 if new else position + 1
        segments.append(segment)
        positions.append(position if reset else j)
        weights.append(0.0 if eod_mask and doc_ids[j + 1] != doc_ids[j] else 1.0)
    return {"segments": segments, "positions": positions, "loss_weights": weights}


@pytest.mark.parametrize("reset,eod_mask", [(True, True), (True, False), (False, True)])
def test_packed_fields_equal_a_loop_over_the_documents(reset, eod_mask):
    doc_ids = [3, 3, 4, 5, 5, 5, 5, 6, 6, 7]
    got = packed_row(np.array(doc_ids), reset, eod_mask)
    for name, want in _naive_fields(doc_ids, reset, eod_mask).items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_packed_windows_follow_the_corpus_documents():
    """Every window of a corpus of short documents: its tokens as unpacked, its fields from the offsets."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 12, 60)
    offsets = np.r_[0, np.cumsum(lengths)]
    tokens = rng.integers(0, 500, offsets[-1]).astype(np.int32)
    seq = 16
    packed = GPTBatches(tokens, seq, 4, seed=2, packing=Packing(offsets, True, True))
    plain = GPTBatches(tokens, seq, 4, seed=2)
    for step in range(3):
        got, want = packed.batch(step), plain.batch(step)
        np.testing.assert_array_equal(got["tokens"], want["tokens"])
        for row in got["tokens"]:  # find the window's start in the corpus, then its documents by a loop
            start = next(s for s in range(0, len(tokens) - seq, seq) if np.array_equal(tokens[s:s + seq + 1], row))
            docs = [int(np.searchsorted(offsets, g, side="right") - 1) for g in range(start, start + seq + 1)]
            i = [np.array_equal(r, row) for r in got["tokens"]].index(True)
            for name, want_field in _naive_fields(docs, True, True).items():
                np.testing.assert_array_equal(got[name][i], want_field, err_msg=name)
    np.testing.assert_array_equal(window_documents(offsets, 5, 40),
                                  [sum(g >= o for o in offsets[1:]) for g in range(5, 45)])


def _model(name: str):
    config = moe_config(**{**QWEN, "capacity_factor": 0.0, "max_seq_len": 32}) if name == "moe" else (
        choice_config(None, 1, 1, name=name))
    return create_model(config, build_mesh(config), seed=0)


@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
def test_each_packed_document_equals_the_document_alone(name):
    """A row of five documents with document masking and eod_mask_loss: the summed target losses and every
    gradient equal those of the five documents each run alone (from position 0, attending to nothing else), 1e-6
    relative; without the masking the same row's losses differ."""
    model = _model(name)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, sum(LENGTHS)).astype(np.int32)
    fields = packed_row(np.repeat(np.arange(len(LENGTHS)), LENGTHS), True, True)
    graphdef, state = nnx.split(model)

    def packed(state, documents=True):
        m = nnx.merge(graphdef, state)
        kwargs = dict(segments=fields["segments"][None], positions=fields["positions"][None]) if documents else {}
        nll = vocab_parallel_cross_entropy(m(tokens[None, :-1], **kwargs), tokens[None, 1:])[0]
        return (nll * fields["loss_weights"]).sum()

    def alone(state):
        m = nnx.merge(graphdef, state)
        ends = np.cumsum(LENGTHS)
        return sum(vocab_parallel_cross_entropy(m(doc[None, :-1]), doc[None, 1:]).sum()
                   for doc in np.split(tokens, ends[:-1]))

    got, got_grads = jax.jit(jax.value_and_grad(packed))(state)
    want, want_grads = jax.jit(jax.value_and_grad(alone))(state)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(got_grads),
                          jax.tree.leaves(want_grads)):
        scale = float(jnp.abs(w).max())
        assert scale > 0, jax.tree_util.keystr(path[0])
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path[0]))
    assert abs(float(jax.jit(packed, static_argnums=1)(state, False)) - float(want)) > 1e-3 * float(want)


def _corpus(prefix) -> str:
    """Documents of 3 to 20 tokens, so every window of 33 packs several."""
    rng = np.random.default_rng(3)
    writer = IndexedWriter(prefix, np.uint16)
    for n in rng.integers(3, 21, 400):
        writer.add(rng.integers(0, 1000, n))
    writer.commit({"vocab_size": 1000})
    return str(prefix)


def _losses(corpus: str, name: str, pipe: int = 1, data: int = 1, model: int = 1, accumulate: int = 0,
            sequence: bool = False, steps: int = 3) -> list[float]:
    """The losses of ``steps`` steps over packed windows (document masking, eod_mask_loss) from the 1x1 run's
    initial parameters."""
    config = choice_config("sequence" if sequence else None, data, model, name=name)
    config.model.num_layers = 4
    config.mesh.pipe = pipe
    config.parallel.pipeline_microbatches = 2 if pipe > 1 else 0
    config.train.micro_batch_size = accumulate
    config.data.update(source="indexed", path=corpus, document_masking=True, eod_mask_loss=True)
    return step_losses(config, _INITIAL, name, steps)


_INITIAL = {}


@pytest.mark.parametrize("name,mesh", [
    ("gpt", dict(data=2, model=2, sequence=True, accumulate=2)),  # SP, and 2 accumulation steps of unequal weights
    ("llama", dict(pipe=2, data=2, model=2, accumulate=2)),  # rotary positions per row through the stages
])
def test_packed_training_is_the_same_on_every_mesh(tmp_path_factory, name, mesh):
    corpus = _corpus(tmp_path_factory.mktemp("packed") / "docs")
    want = _losses(corpus, name)
    np.testing.assert_allclose(_losses(corpus, name, **mesh), want, rtol=1e-6)


def test_packing_refused_where_nothing_reads_it():
    config = choice_config(None, 1, 1, name="bert")
    config.data.document_masking = True
    with pytest.raises(ConfigError, match="document_masking.*model.name=bert reads no packed rows"):
        setup(config)
    config = choice_config(None, 1, 1)
    config.data.eod_mask_loss = True
    with pytest.raises(ConfigError, match="set data.document_masking=True"):
        setup(config)
