"""Hardening round 5, through the commands users type: supervised fine-tuning of a converted GPT-2 whose tokenizer
transformers 5 saved (its chat template in chat_template.jinja), evaluated on its own training file as it was
trained, exported with its tokenizer; and the faults found in the new features, each refused with one ``error:``
line, no traceback, nothing new on disk and every byte already there unchanged."""

import gzip
import json

import numpy as np
import pytest
from conftest import ROOT, assert_one_error_line, run_commands, tree_of

import megajax
from megajax.cli import load_config
from megajax.config import resolve
from megajax.convert.__main__ import main as convert_main
from megajax.data.sft import load_sft
from megajax.data.tokenizer import GPT_EOD, train_tokenizer
from megajax.evaluation.inputs import InputError
from megajax.evaluation.runner import run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# "role: content" lines after an end-of-text separator; the generation prompt is the answer's role
TEMPLATE = ("{% for m in messages %}" + GPT_EOD + "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}" + GPT_EOD + "assistant:{% endif %}")
WORDS = ["apple", "river", "stone", "cloud", "tiger", "music", "paper", "green", "light", "table", "ocean", "house"]


def _rows(seed: int, n: int) -> list[dict]:
    """The first of three words, asked as a chat (half the rows) or as a prompt and completion."""
    rng, rows = np.random.default_rng(seed), []
    for i in range(n):
        w = rng.choice(WORDS, 3, replace=False)
        question = f"first of {w[0]} {w[1]} {w[2]} is"
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": w[0]}]}
                    if i % 2 else {"prompt": question, "completion": f" {w[0]}"})
    return rows


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A random HF GPT-2 (256 positions) saved with its tokenizer by transformers (tokenizer.json,
    tokenizer_config.json, chat_template.jinja), converted to megajax; the fine-tuning rows."""
    root = tmp_path_factory.mktemp("gpt2")
    texts = [r.get("prompt", "") + r.get("completion", "") for r in _rows(0, 60)] + ["user assistant :"] * 20
    tok = train_tokenizer(texts, "bpe", 300)
    tok.save(root / "trained.json")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "trained.json"), bos_token=GPT_EOD,
                                                  eos_token=GPT_EOD)
    hf_tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=tok.eod_id,
        eos_token_id=tok.eod_id))
    model.save_pretrained(root / "hf")
    hf_tok.save_pretrained(root / "hf")
    assert (root / "hf" / "chat_template.jinja").is_file()
    convert_main(["hf-to-megajax", f"--hf={root / 'hf'}", f"--output={root / 'mj'}",
                  "--make_vocab_size_divisible_by=64"])
    (root / "train.jsonl").write_text(_jsonl(_rows(1, 400)) + json.dumps(
        {"prompt": " ".join(WORDS * 2), "completion": " apple"}) + "\n")  # one example longer than 65 tokens
    return root, hf_tok


def test_gpt2_fine_tunes_evaluates_as_trained_and_exports_its_tokenizer(gpt2, tmp_path, capsys):
    """configs/sft.py on the converted GPT-2: with max_seq_len left at 0 a row is the longest example rounded up to
    128 tokens (not the model's 256); trained at 64 with over-long examples cut, the loss falls; eval.py's sft task
    reads the run's own training file as the run did (cut) and refuses it when told not to cut; the HF export holds
    the tokenizer (AutoTokenizer encodes and renders chats as the original) and its end-of-text id, and --overwrite
    replaces it whole."""
    root, hf_tok = gpt2
    config = load_config("sft.py")
    config.init_from = str(root / "mj")
    config.data.update(path=str(root / "train.jsonl"), tokenizer=str(root / "hf"), valid_fraction=0.0)
    assert resolve(config, 1).model.max_seq_len == 128
    plain = load_sft(resolve(config, 1).dataset)
    (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress((root / "train.jsonl").read_bytes()))
    config.data.path = str(tmp_path / "train.jsonl.gz")
    zipped = load_sft(resolve(config, 1).dataset)
    for k, v in plain.train.fields.items():  # a gzip file reads as the plain one
        np.testing.assert_array_equal(zipped.train.fields[k], v)
    config.data.update(path=str(root / "train.jsonl"), sft_truncate=True)
    config.model.update(max_seq_len=64, remat="none")
    config.mesh.data = 1  # one device: the loop's steps never wait on 8 devices' threads (docs/results.md's stall)
    config.train.update(steps=30, global_batch_size=8, log_every=1, eval_every=0, eval_batches=0, precision="fp32")
    config.optimizer.update(lr=3e-3, min_lr=3e-4, warmup_steps=3)
    config.checkpoint.async_save = False
    records = megajax.train(config, tmp_path / "run")
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["sft_data"]
    assert start["chat_template"] == str(root / "hf" / "chat_template.jinja") and start["truncated"] == 1
    assert (start["max_seq_len"], start["examples"]) == (64, 401) and start["longest_example"] > 65
    losses = [r["loss"] for r in records if "loss" in r]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses

    result = run(str(tmp_path / "run"), "sft", data=str(root / "train.jsonl"), batch_size=16)
    assert result["truncated"] == 1 and result["examples"] == 401
    with pytest.raises(InputError, match=r"line 401: the example has \d+ tokens, more than a row's 65 .*: shorten "
                                         r"the row, or pass --sft_truncate to cut"):
        run(str(tmp_path / "run"), "sft", data=str(root / "train.jsonl"), sft_truncate=False)

    convert_main(["megajax-to-hf", f"--checkpoint={tmp_path / 'run'}", f"--output={tmp_path / 'hf'}"])
    convert_main(["megajax-to-hf", f"--checkpoint={tmp_path / 'run'}", f"--output={tmp_path / 'hf'}",
                  "--overwrite"])  # its own tokenizer files are megajax's to replace
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text, chat = "first of tiger river ocean is apple", _rows(2, 2)[1]["messages"]
    assert exported(text)["input_ids"] == hf_tok(text)["input_ids"]
    assert exported.apply_chat_template(chat, tokenize=False) == hf_tok.apply_chat_template(chat, tokenize=False)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["eos_token_id"] == hf_config["bos_token_id"] == hf_tok.convert_tokens_to_ids(GPT_EOD)


def test_faults_in_the_new_features_are_one_line(gpt2, tmp_path):
    """Mesh degrees of zero (train.py and eval.py), a chat template that does not compile, a Latin-1 byte (train.py
    and eval.py), a damaged gzip file, a directory as --data, an over-long row in eval.py (the advice is eval.py's
    flag), a row with both shapes, and options that would do nothing (document masking of random tokens, pipeline
    microbatches without stages)."""
    root, _ = gpt2
    (tmp_path / "badtpl").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "badtpl" / name).write_bytes((root / "hf" / name).read_bytes())
    (tmp_path / "badtpl" / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n")
    rows = _jsonl(_rows(3, 4))
    (tmp_path / "latin1.jsonl").write_bytes(rows.encode() + b'{"prompt": "caf\xe9", "completion": "x"}\n')
    (tmp_path / "both.jsonl").write_text(rows + json.dumps({"prompt": "a", "completion": "b", "messages": []}) + "\n")
    (tmp_path / "damaged.jsonl.gz").write_bytes(gzip.compress(rows.encode())[:40])
    (tmp_path / "long.jsonl").write_text(rows + json.dumps({"prompt": " ".join(WORDS * 30), "completion": "x"})
                                         + "\n")
    (tmp_path / "folder").mkdir()
    train_py = [str(ROOT / "train.py"), "--workdir=run"]
    random = [*train_py, "--config=gpt_tiny", "--config.data.source=random"]
    sft = [*train_py, "--config=sft.py", f"--config.init_from={root / 'mj'}",
           f"--config.data.tokenizer={root / 'hf'}"]
    evaluate = [str(ROOT / "eval.py"), f"--checkpoint={root / 'mj'}", "--task=sft"]
    cases = {  # name: (argv, what the error line says)
        "expert of zero, train": ([*random, "--mesh=1x1,expert=0"], "mesh.expert must be a whole number >= 1"),
        "expert of zero, eval": ([*evaluate, "--data=long.jsonl", "--mesh=1x1,expert=0"],
                                 "mesh.expert must be a whole number >= 1"),
        "model of zero, eval": ([*evaluate, "--data=long.jsonl", "--mesh=1x0"], "mesh.model must be a whole number"),
        "a template that does not compile": ([*sft, "--config.data.path=long.jsonl",
                                              f"--config.data.tokenizer={tmp_path / 'badtpl'}"],
                                             f"the chat template in {tmp_path / 'badtpl' / 'chat_template.jinja'} "
                                             "does not compile: line 2: "),
        "latin-1, train": ([*sft, "--config.data.path=latin1.jsonl"],
                           "latin1.jsonl, line 5: byte 0xe9 at column 16 is not UTF-8"),
        "latin-1, eval": ([*evaluate, "--data=latin1.jsonl"], "--data=latin1.jsonl, line 5: byte 0xe9"),
        "damaged gzip": ([*sft, "--config.data.path=damaged.jsonl.gz"], "the gzip data is damaged"),
        "a directory as --data": ([*evaluate, "--data=folder"], "--data=folder is a directory"),
        "over-long row, eval": ([*evaluate, "--data=long.jsonl"], "or pass --sft_truncate to cut such examples"),
        "both shapes in a row": ([*sft, "--config.data.path=both.jsonl"], 'holds both "messages" and "prompt"'),
        "document masking of random tokens": ([*random, "--config.data.document_masking=True"],
                                              "data.source=random draws uniform tokens with no documents"),
        "pipeline microbatches without stages": ([*random, "--config.parallel.pipeline_microbatches=4"],
                                                 "parallel.pipeline_microbatches=4 cuts the batch for pipeline "
                                                 "stages: set mesh.pipe > 1"),
    }
    before, inputs = tree_of(tmp_path), tree_of(root)
    results = run_commands({name: (argv, {}) for name, (argv, _) in cases.items()}, cwd=tmp_path)
    assert_one_error_line(results, {name: message for name, (_, message) in cases.items()})
    assert tree_of(tmp_path) == before and tree_of(root) == inputs  # no workdir, every byte the same
