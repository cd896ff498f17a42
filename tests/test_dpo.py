"""Direct preference optimisation (``data.source=preference``, ``megajax.models.preference``): the loss and TRL's
metrics of a converted HF Llama pair (policy and reference) on a JSONL file equal an independent float64
computation from transformers' log-probabilities (1e-4) for each ``dpo.loss``; one step on data, tensor, sequence,
FSDP, context and pipeline meshes (GPipe, 1F1B) and with accumulation equals the one-device step (loss 1e-6,
gradients 1e-5); pairs are read, rendered and packed as SFT's examples are, bad rows refused with their line; a
short run moves held-out rewards/accuracies from 0 to near 1 and, stopped halfway, resumes bit-exactly."""

import json
import math

import jax
import numpy as np
import pytest
from conftest import assert_planned_within_10_percent, assert_same_step, choice_config, hf_conversions, run_on

import megajax
from megajax.cli import load_config
from megajax.config import resolve
from megajax.config.load import read_run_config
from megajax.data.preference import NOT_COUNTED, Pair, load_preference, pack_pairs, read_pairs
from megajax.data.tokenizer import load_tokenizer, train_tokenizer
from megajax.data.tokenizer_folder import read_chat_template
from megajax.errors import ConfigError
from megajax.evaluation.inputs import InputError
from megajax.evaluation.runner import run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|end|>"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
ROWS = [
    {"prompt": "Translate to French: cat\n", "chosen": "chat", "rejected": "chien"},
    {"prompt": "Count: one two", "chosen": " three four", "rejected": " five"},
    {"chosen": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}],
     "rejected": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Five."}]},
    {"prompt": [{"role": "user", "content": "Name a colour."}], "chosen": [{"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "assistant", "content": "A stone, of course."}]},
]
WORDS = ["apple", "river", "stone", "cloud", "tiger", "music", "paper", "green", "light", "table", "ocean", "house"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A BPE tokenizer with a chat template, a JSONL file of ``ROWS``, and two random HF Llamas of its vocabulary
    (the policy, seed 0, and the reference, seed 1) converted to megajax."""
    root = tmp_path_factory.mktemp("dpo")
    texts = [json.dumps(r) for r in ROWS] * 30 + ["first of " + " ".join(WORDS) + " is"] * 30
    tok = train_tokenizer(texts, "bpe", 320)
    tok.tokenizer.add_special_tokens(["<|begin|>", "<|start|>", "<|end|>"])
    (root / "tok").mkdir()
    tok.save(root / "tok" / "tokenizer.json")
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<|begin|>", "eos_token": "<|endoftext|>"}))
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    vocab = load_tokenizer(root / "tok" / "tokenizer.json").vocab_size

    def build(name):
        torch.manual_seed({"policy": 0, "reference": 1}[name])
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128,
                                       rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg).eval()

    convert = hf_conversions(tmp_path_factory, build, lambda _: ["--make_vocab_size_divisible_by=64"])
    return root, convert("policy"), convert("reference")


def _hf_logps(model, pair: Pair) -> np.ndarray:
    """transformers' summed log-probabilities (float64) of the chosen and rejected completions' ids given the
    prompt, and their counts."""
    out = []
    for completion in (pair.chosen, pair.rejected):
        ids = [*pair.prompt, *completion]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        targets = range(len(pair.prompt), len(ids))
        out.append((sum(float(logp[t - 1, ids[t]]) for t in targets), len(completion)))
    return np.asarray(out)


def _trl(loss: str, beta: float, smoothing: float, policy: np.ndarray, reference: np.ndarray) -> dict:
    """TRL's DPO loss and metrics, written out in float64 from (pairs, 2, [sum, count]) log-probabilities."""
    pol, ref = policy[..., 0], reference[..., 0]
    if loss == "ipo":
        pol, ref = pol / policy[..., 1], ref / reference[..., 1]
    x = (pol[:, 0] - pol[:, 1]) - (ref[:, 0] - ref[:, 1])
    logsig = lambda z: -np.logaddexp(0, -z)  # noqa: E731
    losses = {"sigmoid": -logsig(beta * x) * (1 - smoothing) - logsig(-beta * x) * smoothing,
              "ipo": (x - 1 / (2 * beta)) ** 2, "hinge": np.maximum(0, 1 - beta * x)}[loss]
    chosen, rejected = beta * (pol[:, 0] - ref[:, 0]), beta * (pol[:, 1] - ref[:, 1])
    return {"loss": losses.mean(), "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
            "rewards/accuracies": (chosen > rejected).mean(), "rewards/margins": (chosen - rejected).mean(),
            "logps/chosen": pol[:, 0].mean(), "logps/rejected": pol[:, 1].mean()}


@pytest.mark.parametrize("loss,beta,smoothing,mesh", [
    ("sigmoid", 0.1, 0.0, (1, 1)), ("sigmoid", 0.5, 0.1, (2, 2)), ("ipo", 0.1, 0.0, (1, 2)),
    ("hinge", 0.3, 0.0, (4, 1)),
])
def test_loss_and_metrics_equal_trl_from_transformers(files, loss, beta, smoothing, mesh):
    """eval.py's dpo task on a converted policy and reference: every metric within 1e-4 of TRL's formulas on
    transformers' log-probabilities (the completion's ids and the end id given the prompt; float64)."""
    root, (_, hf_policy, policy), (_, hf_reference, reference) = files
    tokenizer = str(root / "tok" / "tokenizer.json")
    pairs, _ = read_pairs(root / "pairs.jsonl", load_tokenizer(tokenizer), read_chat_template(tokenizer), False)
    want = _trl(loss, beta, smoothing, np.stack([_hf_logps(hf_policy, p) for p in pairs]),
                np.stack([_hf_logps(hf_reference, p) for p in pairs]))
    got = run(str(policy), "dpo", data=str(root / "pairs.jsonl"), tokenizer=tokenizer, reference=str(reference),
              dpo_loss=loss, dpo_beta=beta, dpo_label_smoothing=smoothing, mesh_data=mesh[0], mesh_model=mesh[1])
    assert got["pairs"] == len(ROWS) and got["dpo_loss"] == loss
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-6, err_msg=k)


def test_pairs_are_read_and_packed_as_sft_reads_examples(files):
    """Chat pairs render as transformers renders the conversation (the shared turns the prompt, each answer the
    rest); a row of 2 pairs holds 4 documents, each completion's targets (its ids and the end id) under its slot
    and nothing else counted; the reference field is zeros until training fills it."""
    root, _, _ = files
    tokenizer = str(root / "tok" / "tokenizer.json")
    tok = load_tokenizer(tokenizer)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer, bos_token="<|begin|>",
                                                  eos_token="<|endoftext|>")
    hf_tok.chat_template = TEMPLATE
    pairs, skipped = read_pairs(root / "pairs.jsonl", tok, read_chat_template(tokenizer), False)
    assert not skipped and len(pairs) == len(ROWS)
    conversation = ROWS[2]["chosen"]
    prompt = hf_tok.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=False)
    whole = hf_tok.apply_chat_template(conversation, tokenize=False)
    assert list(pairs[2].prompt) == hf_tok(prompt, add_special_tokens=False)["input_ids"]
    assert list(pairs[2].chosen) == hf_tok(whole[len(prompt):], add_special_tokens=False)["input_ids"] + [tok.eod_id]
    assert pairs[3].prompt == tuple(tok.encode_batch([hf_tok.apply_chat_template(
        ROWS[3]["prompt"], add_generation_prompt=True, tokenize=False)])[0])
    rows = pack_pairs(pairs, 127, tok.eod_id, 2, False)
    reference = rows.fields["reference_logps"]
    assert len(rows) == 2 and reference.shape == (2, 4) and not reference.any()
    for r, row_pairs in enumerate((pairs[:2], pairs[2:])):
        slots, tokens = rows.fields["completion_slots"][r], rows.fields["tokens"][r]
        start = 0  # each sequence a document: segments 1, 2, ... and positions from 0, padding the last segment
        for j, pair in enumerate(row_pairs):
            for k, completion in enumerate((pair.chosen, pair.rejected)):
                n = len(pair.prompt) + len(completion)
                assert list(tokens[start:start + n]) == [*pair.prompt, *completion]
                assert (rows.fields["segments"][r][start:start + n] == 2 * j + k + 1).all()
                np.testing.assert_array_equal(rows.fields["positions"][r][start:start + n], np.arange(n))
                assert list(tokens[1:][slots == 2 * j + k]) == list(completion)  # its ids and the end id
                start += n
        assert (slots >= 0).sum() == sum(len(p.chosen) + len(p.rejected) for p in row_pairs)
        assert (slots[start - 1:] == NOT_COUNTED).all() and (rows.fields["segments"][r][start:] == 5).all()


def test_two_pairs_a_row_give_each_pairs_own_log_probabilities(files):
    """The converted policy's completion log-probabilities from rows of two pairs equal those from one pair a row
    (1e-5): attention and positions keep each sequence to itself."""
    from megajax.evaluation.dpo_task import _sums
    from megajax.evaluation.registry import Loaded

    root, (_, _, policy), _ = files
    tokenizer = str(root / "tok" / "tokenizer.json")
    pairs, _ = read_pairs(root / "pairs.jsonl", load_tokenizer(tokenizer), read_chat_template(tokenizer), False)
    loaded = megajax.load_model(policy, data=1, model=1)
    on = Loaded(loaded.model, loaded.mesh, loaded.spec.rules, None, 127)
    one = _sums(on, pack_pairs(pairs, 127, 0, 1, False), 4)["sums"].reshape(-1, 2)
    two = _sums(on, pack_pairs(pairs, 127, 0, 2, False), 4, pairs=2)["sums"].reshape(-1, 2)  # 2 rows of 2 pairs
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert np.abs(one).min() > 1


def _config(files, **data):
    root, (_, _, policy), _ = files
    config = read_run_config(policy)
    config.init_from = str(policy)
    config.data.update(source="preference", path=str(root / "pairs.jsonl"),
                       tokenizer=str(root / "tok" / "tokenizer.json"), valid_fraction=0.0)
    config.data.update(data)
    config.model.max_seq_len = 128
    config.train.update(global_batch_size=2, precision="fp32")
    return config


@pytest.mark.parametrize("line,want", [
    ('{"prompt": "a", "chosen": "b"}\n', r'line 2: the row has no "rejected"'),
    ('{"prompt": "a", "chosen": "b", "rejected": "b"}\n', r"line 2: chosen and rejected are the same text"),
    ('{"prompt": "a", "chosen": "", "rejected": "b"}\n', r"line 2: the chosen completion is empty"),
    ('{"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "rejected": '
     '[{"role": "user", "content": "z"}, {"role": "assistant", "content": "w"}]}\n',
     r'line 2: "chosen" and "rejected" do not share the turns before their answers'),
    ('{"prompt": 3, "chosen": "b", "rejected": "c"}\n', r'line 2: .*needs a "prompt" string'),
    ('{"prompt": "", "chosen": "b", "rejected": "c"}\n', r"line 2: the prompt is empty"),
])
def test_bad_rows_are_refused_with_their_line_or_skipped(files, tmp_path, line, want):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + json.dumps(ROWS[1]) + "\n")
    config = _config(files, path=str(path))
    with pytest.raises(ConfigError, match=want + r".*--config.data.sft_skip_bad_rows=True"):
        load_preference(resolve(config, 1).dataset)
    config.data.sft_skip_bad_rows = True
    data = load_preference(resolve(config, 1).dataset)
    assert data.report["pairs"] == 2 and data.report["skipped"] == 1


def test_refusals_before_anything_runs(files, tmp_path):
    """No model to tune (so no reference), a mixture of experts, a bad loss, a pair longer than a row (cut with
    sft_truncate), eval.py without --reference or with it on another task: each one error naming what to change."""
    config = _config(files)
    config.init_from = ""
    with pytest.raises(ConfigError, match=r"data.source=preference tunes a trained model .* set --config.init_from"):
        resolve(config, 1)
    moe = choice_config(None, 1, 1)
    moe.model = megajax.config.base_config("moe").model
    moe.model.update(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=64, num_experts=4,
                     vocab_size=1000, max_seq_len=32)
    moe.data.source, moe.init_from = "preference", "(not read)"
    with pytest.raises(ConfigError, match=r"DPO of a mixture of experts \(model.name=moe\) would train without its "):
        resolve(moe, 1)
    for field, value, want in (("loss", "kto", r"dpo.loss='kto'; choose one of sigmoid, ipo, hinge"),
                               ("beta", 0.0, r"dpo.beta=0.0 must be > 0"),
                               ("label_smoothing", 0.5, r"dpo.label_smoothing=0.5 must be in \[0, 0.5\)")):
        config = _config(files)
        config.dpo[field] = value
        with pytest.raises(ConfigError, match=want):
            resolve(config, 1)
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "Count:", "chosen": " one two three" * 9,
                                                     "rejected": " four"}) + "\n" + json.dumps(ROWS[1]) + "\n")
    config = _config(files, path=str(tmp_path / "long.jsonl"))
    config.model.max_seq_len = 32
    with pytest.raises(ConfigError, match=r"line 1: the pair takes \d+ tokens .* more than a row's 33 .*"
                                          r"--config.data.sft_truncate=True"):
        load_preference(resolve(config, 1).dataset)
    config.data.sft_truncate = True
    data = load_preference(resolve(config, 1).dataset)
    slots = data.train.fields["completion_slots"][0]
    prompt = int(np.argmax(slots >= 0)) + 1  # the targets before the first completion id are the prompt's
    assert data.report["truncated"] == 1 and prompt + (slots == 0).sum() == 33 // 2  # cut to half a row
    root, (_, _, policy), _ = files
    with pytest.raises(InputError, match=r"--task=dpo needs --reference=CHECKPOINT"):
        run(str(policy), "dpo", data=str(root / "pairs.jsonl"))
    with pytest.raises(InputError, match=r"--reference applies to --task=dpo"):
        run(str(policy), "ppl", reference=str(policy))


def _batch(pairs_per_row: int, seq: int, rows: int, seed: int) -> dict:
    """``rows`` packed rows of random pairs (prompts of 2-6 ids, completions of 1-5) with random reference sums, the
    first three rows' second pair left out (its targets not counted)."""
    rng = np.random.default_rng(seed)
    pairs = [Pair(tuple(rng.integers(5, 1000, rng.integers(2, 7))), tuple(rng.integers(5, 1000, rng.integers(1, 6))),
                  tuple(rng.integers(5, 1000, rng.integers(1, 6))), i) for i in range(rows * pairs_per_row)]
    packed = pack_pairs(pairs, seq, 0, pairs_per_row, False)
    assert len(packed) == rows
    packed.fields["reference_logps"][:] = rng.normal(-12, 3, packed.fields["reference_logps"].shape)
    slots = packed.fields["completion_slots"]
    slots[:3][slots[:3] >= 2] = NOT_COUNTED  # rows 0-2 hold one pair: micro-batches of unequal pair counts
    return packed.fields


@pytest.fixture(scope="module")
def steps():
    """mesh and flags -> (loss, parameter change) of one DPO step of the small Llama (gradient_step: the change
    is the gradient) from one initial state, on one batch of 8 rows of up to 2 pairs."""
    from megajax.models.transformer import reorder_layers
    from megajax.training.loop import setup

    cache, initial = {}, {}
    batch = _batch(2, 64, 8, 0)

    def get(data=1, model=1, pipe=1, context=1, flags=None, schedule="gpipe", micro=0):
        key = (data, model, pipe, context, flags, schedule, micro)
        if key not in cache:
            config = choice_config(flags, data, model, name="llama", gradient_step=True)
            config.mesh.update(pipe=pipe, context=context)
            config.model.max_seq_len = 64
            config.parallel.pipeline_schedule = schedule
            config.data.update(source="preference", pairs_per_row=2)
            config.init_from = "(not read: the batch holds the reference's log-probabilities)"
            config.dpo.beta = 0.5
            config.train.micro_batch_size = micro
            r = setup(config)
            if not initial:
                assert key == (1, 1, 1, 1, None, "gpipe", 0), "the reference first"
                initial["state"] = jax.tree.map(np.array, r.init_state())
            laid = reorder_layers(initial["state"], (1, 1), r.spec.layer_layout)
            state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), laid, r.abstract_state)
            new, metrics = r.step_fn(state, {k: jax.device_put(v, r.batch_shardings[k]) for k, v in batch.items()})
            params = reorder_layers(jax.tree.map(np.asarray, new.params), r.spec.layer_layout, (1, 1))
            cache[key] = float(metrics["loss"]), jax.tree.map(lambda a, b: a - b, params, initial["state"].params)
        return cache[key]

    return get


@pytest.mark.parametrize("mesh", [
    dict(data=2, model=2), dict(model=4, flags="sequence"), dict(data=4, flags="fsdp"),
    dict(data=2, context=2, model=2), dict(pipe=2, data=2, model=2), dict(pipe=2, data=2, schedule="1f1b"),
    dict(data=2, micro=2),
], ids=["2x2", "sequence", "fsdp", "context", "gpipe", "1f1b", "accumulation"])
def test_one_step_on_every_mesh_equals_one_device(steps, mesh):
    want = steps()
    assert want[0] > 0
    assert_same_step(*steps(**mesh), *want)


def _task(seed: int, n: int) -> str:
    """The synthetic preference: asked to pick one of two words, prefer the one of the first half of ``WORDS``."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        good, bad = rng.choice(WORDS[:6]), rng.choice(WORDS[6:])
        first, second = (good, bad) if rng.random() < 0.5 else (bad, good)
        rows.append({"prompt": f"pick {first} or {second}:", "chosen": f" {good}", "rejected": f" {bad}"})
    return "".join(json.dumps(r) + "\n" for r in rows)


STEPS = 60


def test_a_short_run_learns_the_preference_and_resumes_exactly(files, tmp_path):
    """configs/dpo.py from the converted policy (itself the reference): the first step's loss is log 2 (the policy
    is the reference); held-out rewards/accuracies (eval.py's dpo task, 60 pairs) from 0 (every reward 0: TRL counts
    chosen > rejected) to >= 0.9; a run stopped halfway and resumed (its reference log-probabilities recomputed)
    logs the uninterrupted run's losses exactly."""
    root, (_, _, policy), _ = files
    (tmp_path / "train.jsonl").write_text(_task(0, 400))
    (tmp_path / "held.jsonl").write_text(_task(1, 60))
    tokenizer = str(root / "tok" / "tokenizer.json")

    def config(steps: int):
        c = load_config("dpo.py")
        c.init_from = str(policy)
        c.data.update(path=str(tmp_path / "train.jsonl"), tokenizer=tokenizer, pairs_per_row=2, valid_fraction=0.0)
        c.model.update(max_seq_len=64, remat="none")
        c.mesh.data = 1
        c.dpo.beta = 0.5
        c.train.update(steps=steps, global_batch_size=8, log_every=1, eval_every=0, eval_batches=0,
                       precision="fp32")
        c.optimizer.update(lr=3e-3, min_lr=3e-4, warmup_steps=5, decay_steps=STEPS)
        c.checkpoint.update(every_steps=1000, async_save=False)
        return c

    records = megajax.train(config(STEPS), tmp_path / "run")
    steps = [r for r in records if "rewards/accuracies" in r]
    assert steps[0]["step"] == 1 and math.isclose(steps[0]["loss"], math.log(2), rel_tol=1e-5)
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["preference_data"]["pairs"] == 400 and start["preference_data"]["skipped"] == 0
    held = dict(data=str(tmp_path / "held.jsonl"), tokenizer=tokenizer, reference=str(policy), dpo_beta=0.5,
                mesh_data=1, mesh_model=1)
    before, after = run(str(policy), "dpo", **held), run(str(tmp_path / "run"), "dpo", **held)
    assert before["rewards/accuracies"] == 0.0 and math.isclose(before["loss"], math.log(2), rel_tol=1e-6)
    assert after["rewards/accuracies"] >= 0.9 and after["loss"] < 0.3 < 0.69 < before["loss"]
    # stopped halfway (as a SIGTERM leaves it: a saved step, tests/test_checkpoint.py) and resumed: the same steps
    megajax.train(config(STEPS // 2), tmp_path / "halves")
    resumed = megajax.train(config(STEPS), tmp_path / "halves")
    assert [r["loss"] for r in resumed if "rewards/accuracies" in r] == [r["loss"] for r in steps[STEPS // 2:]]


def test_a_reference_of_another_model_is_refused_before_anything_is_written(files, tmp_path):
    """A ``dpo.reference`` of another family, or of another vocabulary, is one error naming it, and the workdir is
    never made (stand-in checkpoints: the refusal comes from their stored configs)."""
    from megajax.checkpoint import Checkpointer, CheckpointError
    from megajax.config import base_config
    from megajax.config.settings import checkpoint_settings

    def stand_in(path, config):
        config.checkpoint.async_save = False
        checkpointer = Checkpointer(path, checkpoint_settings(config))
        checkpointer.save(1, {"params": {"w": np.zeros(2, np.float32)}}, {"step": 1}, config.to_json(), force=True)
        checkpointer.close()

    stand_in(tmp_path / "gpt", base_config("gpt"))
    other_vocabulary = _config(files)
    other_vocabulary.data.tokenizer_fingerprint = "0" * 16
    stand_in(tmp_path / "other_vocabulary", other_vocabulary)
    for name, want in (("gpt", r"holds a model.name='gpt' checkpoint"),
                       ("other_vocabulary", r"was pretrained with another vocabulary")):
        config = _config(files)
        config.dpo.reference = str(tmp_path / name)
        config.mesh.data = 1
        with pytest.raises(CheckpointError, match=rf"dpo.reference='{tmp_path / name}' {want}"):
            megajax.train(config, tmp_path / "run")
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mesh", [dict(data=2, model=2), dict(pipe=2, data=2, model=2)], ids=["2x2", "gpipe"])
def test_memory_planned_within_10_percent(mesh):
    """The DPO step holds one model (the reference's log-probabilities are a batch field, computed before the
    policy's state exists): the memory planner's temp and peak within 10% of the compiled step's."""
    config = choice_config(None, 1, 1, name="llama")
    config.model.max_seq_len = 64
    config.data.update(source="preference", pairs_per_row=2)
    config.init_from = "(not read)"
    assert_planned_within_10_percent(run_on(config, **mesh), micro_batch=4)
