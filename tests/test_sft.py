"""Supervised fine-tuning of decoders (``data.source=sft``, ``megajax.data.sft``): JSONL prompt / completion and
chat rows read, rendered with a tokenizer's chat template as transformers renders it, encoded, packed with
document masking, the loss on the completions only. The loss of a converted HF Llama on a file equals
transformers' with the prompt's labels at -100 (1e-4); the targets of prompt tokens get exactly zero gradient;
packed rows give the unpacked rows' loss; bad rows are refused with their line number or skipped and counted."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_conversions
from flax import nnx

import megajax
from megajax.cli import load_config
from megajax.config import resolve
from megajax.config.load import read_run_config
from megajax.data.sft import default_seq_len, load_sft, read_examples
from megajax.data.sources import make_loader
from megajax.data.tokenizer import load_tokenizer, train_tokenizer
from megajax.data.tokenizer_folder import DEFAULT_SOURCE, DEFAULT_TEMPLATE, ChatTemplate, read_chat_template
from megajax.errors import ConfigError
from megajax.evaluation.runner import run
from megajax.models.objectives import LM
from megajax.parallel.sharding import ParallelContext, activate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# A Llama-3-like chat template: the BOS text, a header per message, roles that must alternate.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
            "<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|begin|>", "<|start|>", "<|end|>"]
# The synthetic instruction task: answer the first of three words (of 12; chance 1/12)
WORDS = ["apple", "river", "stone", "cloud", "tiger", "music", "paper", "green", "light", "table", "ocean", "house"]
ROWS = [
    {"prompt": "Translate to French: cat\n", "completion": "chat"},
    {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]},
    {"prompt": "", "completion": "An empty prompt is allowed."},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green, of course."}]},
    {"prompt": "Count: one two", "completion": " three four five six"},
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A byte-level BPE tokenizer.json with the chat template in its tokenizer_config.json, a JSONL file of
    ``ROWS``, and a random HF Llama of the tokenizer's vocabulary converted to megajax."""
    root = tmp_path_factory.mktemp("sft")
    texts = [r.get("prompt", "") + r.get("completion", "") for r in ROWS] * 30 + ["user assistant colour"] * 30 + [
        "first of " + " ".join(WORDS) + " is"] * 30
    tok = train_tokenizer(texts, "bpe", 320)
    tok.tokenizer.add_special_tokens(SPECIALS[1:])
    (root / "tok").mkdir()
    tok.save(root / "tok" / "tokenizer.json")
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<|begin|>", "eos_token": "<|endoftext|>"}))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    vocab = load_tokenizer(root / "tok" / "tokenizer.json").vocab_size

    def build(_):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                       rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg).eval()

    hf_dir, hf, mj = hf_conversions(tmp_path_factory, build, lambda _: ["--make_vocab_size_divisible_by=64"])("sft")
    return root, hf, mj


def _config(files, **data):
    root, _, mj = files
    config = read_run_config(mj)
    config.init_from = str(mj)
    config.data.update(source="sft", path=str(root / "train.jsonl"), tokenizer=str(root / "tok" / "tokenizer.json"),
                       valid_fraction=0.0)
    config.data.update(data)
    config.model.max_seq_len = 64
    config.train.update(global_batch_size=2, precision="fp32")
    return config


def _sft_loss(files, rows, delta=None):
    """The objective's loss over ``rows`` (all in one batch) with the converted model, and its gradient with
    respect to an additive shift of the logits (``delta``)."""
    _, _, mj = files
    loaded = megajax.load_model(mj, data=1, model=1)
    graphdef, state = nnx.split(loaded.model)
    batch = {k: jnp.asarray(v) for k, v in rows.fields.items()}

    class Shifted:  # the model's logits plus ``delta``: d loss / d delta is d loss / d logits
        def __init__(self, model, delta):
            self.model, self.delta = model, delta

        def __call__(self, tokens, **kw):
            return self.model(tokens, **kw) + self.delta

    def loss(state, delta):
        return LM.loss(Shifted(nnx.merge(graphdef, state), delta), batch, None)[0]

    shape = (*batch["segments"].shape, loaded.spec.model.padded_vocab_size)
    delta = jnp.zeros(shape) if delta is None else delta
    with activate(loaded.mesh, ParallelContext(loaded.spec.rules)):  # (the model's state a traced argument too)
        value, (_, grad) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, delta)
    return value, grad


def _hf_loss(files, examples):
    """transformers' loss on the examples (right-padded, one per row), the prompt's labels at -100: the mean over
    the completion's targets."""
    _, hf, _ = files
    width = max(len(e.prompt) + len(e.completion) for e in examples)
    ids = np.zeros((len(examples), width), np.int64)
    labels = np.full((len(examples), width), -100, np.int64)
    mask = np.zeros((len(examples), width), np.int64)
    for i, e in enumerate(examples):
        row = [*e.prompt, *e.completion]
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
        labels[i, len(e.prompt):len(row)] = e.completion
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                 labels=torch.from_numpy(labels))
    return float(out.loss)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "saved by transformers"])
def test_chat_rows_render_as_transformers_renders_them(files, tmp_path, where):
    """The prompt and completion ids of each chat row equal transformers' apply_chat_template of the conversation
    without its answer (with the generation prompt) and the rest of the whole conversation's ids, whether the
    template is in tokenizer_config.json or in the chat_template.jinja transformers 5's save_pretrained writes; the
    two give the same packed rows (so the same loss), and the start record names the file."""
    root, _, _ = files
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tok" / "tokenizer.json"),
                                                  bos_token="<|begin|>", eos_token="<|endoftext|>")
    hf_tok.chat_template = TEMPLATE
    folder = root / "tok"
    if where != "tokenizer_config.json":
        folder = tmp_path / "saved"
        hf_tok.save_pretrained(folder)
        assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    tok = load_tokenizer(folder / "tokenizer.json")
    template = read_chat_template(folder / "tokenizer.json")
    assert template.text == TEMPLATE and template.specials["bos_token"] == "<|begin|>"
    assert template.source.startswith(str(folder / ("tokenizer_config.json" if folder == root / "tok"
                                                    else "chat_template.jinja")))
    examples, skipped = read_examples(root / "train.jsonl", tok, template, False)
    assert not skipped and len(examples) == len(ROWS)
    for row, ex in zip(ROWS, examples):
        if "messages" not in row:
            assert list(ex.prompt) == tok.encode_batch([row["prompt"]])[0]
            continue
        prompt = hf_tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=False)
        whole = hf_tok.apply_chat_template(row["messages"], tokenize=False)
        assert list(ex.prompt) == hf_tok(prompt, add_special_tokens=False)["input_ids"]
        assert list(ex.completion) == hf_tok(whole[len(prompt):], add_special_tokens=False)["input_ids"] + [
            tok.eod_id]
        assert tok.decode(ex.prompt).startswith("<|begin|><|start|>user\n")
    data = load_sft(resolve(_config(files, tokenizer=str(folder / "tokenizer.json")), 1).dataset)
    reference = load_sft(resolve(_config(files), 1).dataset)
    for k, v in reference.train.fields.items():
        np.testing.assert_array_equal(data.train.fields[k], v)
    assert data.report["chat_template"] == template.source


def test_sft_loss_equals_transformers_with_prompt_labels_ignored(files):
    """Packed rows (several examples in a row of 65 tokens, attention within each) and one example per row both
    give transformers' loss (1e-4 relative); the targets inside prompts and padding get exactly zero gradient,
    the completions' targets not."""
    config = _config(files)
    data = load_sft(resolve(config, 1).dataset)
    assert len(data.train) < len(ROWS) and data.report["examples"] == len(ROWS)  # some rows hold several
    root, _, _ = files
    tok = load_tokenizer(root / "tok" / "tokenizer.json")
    examples, _ = read_examples(root / "train.jsonl", tok, read_chat_template(root / "tok"), False)
    want = _hf_loss(files, examples)
    packed, grad = _sft_loss(files, data.train)
    np.testing.assert_allclose(float(packed), want, rtol=1e-4)
    config.data.sft_packing = False
    unpacked = load_sft(resolve(config, 1).dataset)
    assert len(unpacked.train) == len(ROWS)
    np.testing.assert_allclose(float(_sft_loss(files, unpacked.train)[0]), float(packed), rtol=1e-6)
    weights = data.train.fields["loss_weights"]
    per_target = np.abs(np.asarray(grad)).max(-1)  # (R, S)
    assert (per_target[weights == 0] == 0).all() and (per_target[weights > 0] > 0).all()
    counted = int(weights.sum())
    assert counted == sum(len(e.completion) for e in examples) - 1  # the empty prompt's first token: no context


@pytest.mark.parametrize("line,want", [
    ("not json\n", r"line 2: not JSON"),
    ('{"prompt": "a"}\n', r"line 2: a row holds \"prompt\" and \"completion\" strings"),
    ('{"prompt": "a", "completion": ""}\n', r"line 2: the completion is empty"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}, '
     '{"role": "assistant", "content": "z"}]}\n', r"line 2: the chat template \(.*tokenizer_config.json "
                                                  r"\('chat_template'\)\) refuses the conversation \(roles must "
                                                  r"alternate"),
    ('{"messages": [{"role": "user", "content": "x"}]}\n', r"line 2: the last message is the 'user' one"),
    ('{"prompt": "a", "completion": "b", "messages": []}\n', r'line 2: the row holds both "messages" and "prompt"'),
])
def test_bad_rows_are_refused_with_their_line_or_skipped(files, tmp_path, line, want):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + json.dumps(ROWS[4]) + "\n")
    config = _config(files)
    config.data.path = str(path)
    with pytest.raises(ConfigError, match=want + r".*--config.data.sft_skip_bad_rows=True"):
        load_sft(resolve(config, 1).dataset)
    config.data.sft_skip_bad_rows = True
    data = load_sft(resolve(config, 1).dataset)
    assert data.report["examples"] == 2 and data.report["skipped"] == 1


def test_long_examples_are_refused_or_cut(files, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "one two three " * 30, "completion": "four"}) + "\n"
                    + json.dumps(ROWS[0]) + "\n")
    config = _config(files)
    config.data.path = str(path)
    with pytest.raises(ConfigError, match=r"line 1: the example has \d+ tokens, more than a row's 65 .*raise "
                                          r"model.max_seq_len, or pass --config.data.sft_truncate=True"):
        load_sft(resolve(config, 1).dataset)
    config.data.sft_truncate = True
    data = load_sft(resolve(config, 1).dataset)
    assert data.report["truncated"] == 1 and data.train.fields["tokens"].shape[1] == 65


def test_default_template_and_refusals(files, tmp_path):
    """Without a chat template beside the tokenizer the documented default renders a chat, and says so; sft needs a
    decoder, a file and a tokenizer; max_seq_len=0 means the longest example rounded up, at most the model's."""
    root, _, _ = files
    (tmp_path / "tokenizer.json").write_bytes((root / "tok" / "tokenizer.json").read_bytes())
    template = read_chat_template(tmp_path / "tokenizer.json")
    assert (template.text, template.source) == (DEFAULT_TEMPLATE, DEFAULT_SOURCE)
    assert template.compiled().render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True) == (
        "user: hi\nassistant: ")
    with pytest.raises(ConfigError, match=r"the chat template in x.jinja does not compile: line 2: "):
        ChatTemplate("{% for m in messages %}\n{{ m['content'] }\n", "x.jinja", {}).compiled()
    config = _config(files)  # no example held out (valid_fraction 0), yet validation reads a split
    with pytest.raises(ConfigError, match=r"validation split \(the file's last data.valid_fraction=0 of its "
                                          r"examples\) holds no examples: raise --config.data.valid_fraction"):
        make_loader(resolve(config, 1).dataset, None, "valid")
    config.data.tokenizer = ""
    with pytest.raises(ConfigError, match="data.source=sft needs --config.data.tokenizer"):
        load_sft(resolve(config, 1).dataset)
    config = megajax.config.base_config("bert")
    config.data.source = "sft"
    with pytest.raises(ConfigError, match="model.name=bert reads none: fine-tune a decoder"):
        resolve(config, 1)
    path, tokenizer = str(root / "train.jsonl"), str(root / "tok" / "tokenizer.json")
    longest = max(len(e.prompt) + len(e.completion) for e in read_examples(
        path, load_tokenizer(tokenizer), read_chat_template(tokenizer), False)[0])
    assert 1 < longest <= 129 and default_seq_len(path, tokenizer, False, 131072) == (128, longest)
    assert default_seq_len(path, tokenizer, False, 64) == (64, longest)  # capped at the model's positions


def _task_rows(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        w = rng.choice(WORDS, 3, replace=False)
        rows.append({"prompt": f"first of {w[0]} {w[1]} {w[2]} is", "completion": f" {w[0]}"})
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_short_fine_tune_learns_the_task(files, tmp_path):
    """configs/sft.py from the converted random Llama (its model fields read from the checkpoint, none restated):
    200 steps on 600 rows of "first of A B C is" -> " A"; eval.py's sft task on 60 held-out rows reports the loss
    over the completions and an exact-match rate far above chance (1/12)."""
    root, _, mj = files
    (tmp_path / "train.jsonl").write_text(_task_rows(0, 600))
    (tmp_path / "held.jsonl").write_text(_task_rows(1, 60))
    config = load_config("sft.py")
    tokenizer = str(root / "tok" / "tokenizer.json")
    config.init_from = str(mj)
    config.data.update(path=str(tmp_path / "train.jsonl"), tokenizer=tokenizer)
    config.model.update(max_seq_len=32, remat="none")
    # one device: the XLA:CPU stall that struck this loop three times (docs/results.md) waited on 8 devices' threads
    config.mesh.data = 1
    config.train.update(steps=200, global_batch_size=8, log_every=50, eval_every=0, precision="fp32")
    config.optimizer.update(lr=3e-3, min_lr=3e-4, warmup_steps=10)
    megajax.train(config, tmp_path / "run")
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["sft_data"]["examples"] == 600 and start["sft_data"]["skipped"] == 0
    before = run(str(mj), "sft", data=str(tmp_path / "held.jsonl"), tokenizer=tokenizer, mesh_data=1, mesh_model=1)
    after = run(str(tmp_path / "run"), "sft", data=str(tmp_path / "held.jsonl"), mesh_data=2, mesh_model=2)
    assert after["tokens"] == before["tokens"] == sum(
        len(load_tokenizer(tokenizer).encode_batch([" " + w])[0]) + 1 for w in [
            json.loads(r)["completion"][1:] for r in (tmp_path / "held.jsonl").read_text().splitlines()])
    assert after["loss"] < before["loss"] / 4 and after["exact_match"] >= 0.8 > 0.2 > before["exact_match"]
