"""eval.py's input checks: bad flags, files and checkpoint/data mismatches fail with a message that names what to
change, before the model is loaded (loading is replaced by a failure here, so every check is seen to run first)."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
from conftest import small_config
from tokenizers import Tokenizer

from megajax.checkpoint import save_params
from megajax.config import bert_base_config, stored_run
from megajax.data.indexed import IndexedWriter
from megajax.data.preprocess import write_documents
from megajax.data.tokenizer import TextTokenizer, load_tokenizer, train_tokenizer
from megajax.evaluation.generate import Sampling
from megajax.evaluation.inputs import InputError, tokenizer_for
from megajax.evaluation.runner import resolve_stride, run
from megajax.evaluation.tasks import perplexity

VOCAB, SEQ_LEN = 1000, 32  # small_config's model


class ModelLoaded(Exception):
    pass


@pytest.fixture(autouse=True)
def model_loading_is_refused(monkeypatch):
    def refuse(*args, **kwargs):
        raise ModelLoaded("inputs passed their checks")
    monkeypatch.setattr("megajax.evaluation.runner.restore_model", refuse)


def _token_file(prefix, ids, vocab_size):
    writer = IndexedWriter(prefix, np.uint16)
    writer.add(ids)
    writer.commit({"tokenizer": "unused", "vocab_size": vocab_size})
    return str(prefix)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalinputs")
    # Only a checkpoint's config is read before loading, and loading is refused here: no real parameters needed.
    save_params(root / "ck", {"unused": np.zeros(1, np.float32)}, small_config().to_json())
    moved = small_config()
    moved.data.source, moved.data.path = "indexed", str(root / "moved" / "corpus")
    save_params(root / "ck_moved", {"unused": np.zeros(1, np.float32)}, moved.to_json())
    text = " ".join(f"w{i % 37} x{i % 11}" for i in range(200))
    tok = train_tokenizer([text], "bpe", 300)
    tok.save(root / "tok.json")
    tok.tokenizer.add_tokens([f"<extra{i}>" for i in range(VOCAB)])  # a bigger tokenizer than the model's
    assert tok.vocab_size > VOCAB
    tok.save(root / "big_tok.json")
    (root / "wiki.tokens").write_text(" = Title = \n " + text + " \n")
    (root / "lambada.jsonl").write_text(json.dumps({"text": "w1 x1 w2 x2"}) + "\n")
    _token_file(root / "ppl", list(range(999, 0, -1)), 300)
    return root


def _run(root, task, data=None, **kw):
    kw.setdefault("max_new_tokens", 8)
    return run(str(root / kw.pop("ck", "ck")), task, data=data and str(root / data),
               tokenizer=kw.pop("tokenizer", str(root / "tok.json")), **kw)


@pytest.mark.parametrize("task,data", [("wikitext103", "wiki.tokens"), ("lambada", "lambada.jsonl"),
                                       ("ppl", "ppl"), ("generate", None)])
def test_good_inputs_reach_model_loading(root, task, data):
    with pytest.raises(ModelLoaded):
        _run(root, task, data)


@pytest.mark.parametrize("task,data", [("wikitext103", "wiki.tokens"), ("lambada", "lambada.jsonl"),
                                       ("generate", None)])
def test_tokenizer_bigger_than_the_model_vocab_is_refused(root, task, data):
    with pytest.raises(InputError, match=r"big_tok.json has \d+ ids .*model.vocab_size=1000.*--tokenizer"):
        _run(root, task, data, tokenizer=str(root / "big_tok.json"))


def test_token_file_with_ids_past_the_model_vocab_is_refused(root, tmp_path):
    damaged = _token_file(tmp_path / "damaged", [5, 7, VOCAB, 3], 300)  # e.g. a damaged .bin
    with pytest.raises(InputError, match=f"damaged holds token id {VOCAB}.*model.vocab_size={VOCAB}"):
        run(str(root / "ck"), "ppl", data=damaged)
    foreign = _token_file(tmp_path / "foreign", [5, 7, 3], 50257)  # preprocessed with a bigger tokenizer
    with pytest.raises(InputError, match="tokenizer of 50257 ids .*foreign.json.*model.vocab_size=1000"):
        run(str(root / "ck"), "ppl", data=foreign)
    with pytest.raises(ModelLoaded):  # the largest id the model embeds is fine
        run(str(root / "ck"), "ppl", data=_token_file(tmp_path / "edge", [0, VOCAB - 1], 300))


@pytest.mark.parametrize("name,content", [("empty.tokens", ""), ("blank.tokens", " \n\n \t\n")])
@pytest.mark.parametrize("task", ["wikitext103", "lambada"])
def test_empty_text_files_are_refused(root, tmp_path, task, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(InputError, match=f"{name} is empty"):
        run(str(root / "ck"), task, data=str(tmp_path / name), tokenizer=str(root / "tok.json"))


@pytest.mark.parametrize("row,why", [("just text", "'text' field"), ('{"title": "x"}', "'text' field"),
                                     ('{"text": 5}', "context and a last word"),
                                     ('{"text": "   "}', "context and a last word"),
                                     ('{"text": "oneword"}', "context and a last word"),
                                     (json.dumps({"text": "w1 " + "x1" * 40}), "more than the model's max_seq_len")])
def test_unusable_lambada_rows_are_refused_with_file_and_line(root, tmp_path, row, why):
    path = tmp_path / "lambada.jsonl"
    path.write_text("\n" + row + "\n")
    with pytest.raises(InputError, match=f"lambada.jsonl:2: .*{why}"):
        run(str(root / "ck"), "lambada", data=str(path), tokenizer=str(root / "tok.json"))


@pytest.mark.parametrize("task", ["wikitext103", "lambada", "ppl"])
def test_missing_data_is_refused(root, tmp_path, task):
    with pytest.raises(InputError, match=f"--data={tmp_path / 'absent'}"):
        run(str(root / "ck"), task, data=str(tmp_path / "absent"), tokenizer=str(root / "tok.json"))
    with pytest.raises(InputError, match=f"--task={task} needs --data"):
        run(str(root / "ck"), task, tokenizer=str(root / "tok.json"))


def test_too_few_tokens_to_score_is_refused(root, tmp_path):
    (tmp_path / "one.tokens").write_text("w")
    with pytest.raises(InputError, match="encodes to 1 token"):
        run(str(root / "ck"), "wikitext103", data=str(tmp_path / "one.tokens"), tokenizer=str(root / "tok.json"))
    with pytest.raises(InputError, match="holds 1 token"):
        run(str(root / "ck"), "ppl", data=_token_file(tmp_path / "one", [4], 300))


def test_tasks_refuse_streams_without_targets():
    for tokens in [np.zeros(0, np.int32), np.array([3], np.int32)]:  # stream_log_likelihood gives (0.0, 0) here
        with pytest.raises(ValueError, match=f"ppl: {len(tokens)} token.*at least 2"):
            perplexity(None, tokens, 4, "x")


def test_every_models_eval_task_is_registered_once():
    """eval.py's --task choices come from the model specs; each names a registered task (evaluation/registry.py),
    and a second registration of a name is refused."""
    from megajax.evaluation.registry import EVAL_TASKS, register
    from megajax.evaluation.runner import TASKS

    assert TASKS and set(TASKS) <= set(EVAL_TASKS), sorted(set(TASKS) - set(EVAL_TASKS))
    with pytest.raises(ValueError, match="'ppl' is registered twice"):
        register(EVAL_TASKS["ppl"])


def test_stride_is_explicit():
    assert resolve_stride("ppl", 32, 1024) == 32  # the paper's value is not mistaken for "unset"
    assert resolve_stride("ppl", None, 1024) == 1024  # ppl default: non-overlapping windows
    assert resolve_stride("wikitext103", None, 1024) == 32  # the paper's
    assert resolve_stride("wikitext103", None, 16) == 16  # at most max_seq_len
    assert resolve_stride("wikitext103", 1, 16) == 1 and resolve_stride("wikitext103", 16, 16) == 16
    assert resolve_stride("lambada", None, 16) is None
    with pytest.raises(InputError, match="--stride applies to --task=wikitext103 or ppl, not --task=lambada"):
        resolve_stride("lambada", 8, 16)


@pytest.mark.parametrize("stride", [0, -3, SEQ_LEN + 1])
def test_stride_outside_one_to_seq_len_is_refused(root, stride):
    with pytest.raises(InputError, match=rf"--stride={stride}: .* in 1\.\.{SEQ_LEN}"):
        _run(root, "ppl", "ppl", stride=stride)


@pytest.mark.parametrize("kw,flag", [(dict(temperature=-0.5), "--temperature=-0.5"),
                                     (dict(temperature=float("nan")), "--temperature=nan"),
                                     (dict(temperature=float("inf")), "--temperature=inf"),
                                     (dict(top_p=0.0), "--top_p=0.0"), (dict(top_p=1.5), "--top_p=1.5"),
                                     (dict(top_k=-1), "--top_k=-1")])
def test_bad_sampling_settings_are_refused(kw, flag):
    with pytest.raises(ValueError, match=flag):
        Sampling(**kw)


def test_generation_request_checked_against_the_model(root):
    with pytest.raises(InputError, match=f"--top_k={VOCAB + 1}: more than the model's vocab_size={VOCAB}"):
        _run(root, "generate", sampling=Sampling(top_k=VOCAB + 1))
    with pytest.raises(InputError, match=f"--max_new_tokens={SEQ_LEN}.*max_seq_len={SEQ_LEN}"):
        _run(root, "generate", prompt="w1 x1", max_new_tokens=SEQ_LEN)
    with pytest.raises(InputError, match="--max_new_tokens=-1"):
        _run(root, "generate", max_new_tokens=-1)


def test_moved_training_data_asks_for_tokenizer(root, tmp_path):
    with pytest.raises(InputError, match=r"moved/corpus\.json.*pass --tokenizer=PATH"):
        _run(root, "wikitext103", "wiki.tokens", ck="ck_moved", tokenizer=None)
    config = small_config()
    config.data.source, config.data.path = "indexed", _token_file(tmp_path / "corpus", [1, 2], 300)
    with pytest.raises(InputError, match="tokenizer path unused does not exist.*pass --tokenizer=PATH"):
        tokenizer_for(stored_run(config), None)  # the sidecar is there, the tokenizer it names is not
    config.data.source = "random"
    with pytest.raises(InputError, match="pass --tokenizer=PATH"):
        tokenizer_for(stored_run(config), None)


def test_output_paths_are_checked_before_any_work(root, tmp_path):
    with pytest.raises(InputError, match=r"--output=.*: the directory .*/no does not exist; create it first"):
        _run(root, "ppl", "ppl", output=str(tmp_path / "no" / "r.json"))
    with pytest.raises(InputError, match=r"--output=.* is a directory; give a file name, e.g. --output=.*results"):
        _run(root, "ppl", "ppl", output=str(tmp_path))
    with pytest.raises(InputError, match=r"--predictions=.* is a directory"):
        _run(root, "mnli", "ppl", predictions=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_eval_cli_reports_input_errors_as_usage(root, capsys):
    repo = pathlib.Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("eval_cli", repo / "eval.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    for flags, message in [(["--task=generate", "--temperature=-1"], "--temperature=-1.0: must be >= 0"),
                           (["--task=ppl", f"--data={root / 'ppl'}", "--stride=0"], "--stride=0: "),
                           (["--task=ppl", f"--data={root / 'ppl'}", f"--output={root}"], "is a directory")]:
        with pytest.raises(SystemExit) as exit_:
            cli.main([f"--checkpoint={root / 'ck'}", f"--tokenizer={root / 'tok.json'}", *flags])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def _swapped(tok: TextTokenizer) -> TextTokenizer:
    """The same tokenizer with two words' ids exchanged: the same size, another vocabulary."""
    spec = json.loads(tok.tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]  # the two last-learned merges
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return TextTokenizer(Tokenizer.from_str(json.dumps(spec)), tok.eod_id, "swapped.json")


def test_a_tokenizer_or_dataset_of_another_vocabulary_is_refused(root, tmp_path):
    """A checkpoint records its training data's vocabulary fingerprint; a tokenizer or dataset of the same size with
    other ids is refused before loading (without a record, as in older checkpoints, nothing is compared)."""
    tok = load_tokenizer(root / "tok.json")
    other = _swapped(tok)
    other.save(tmp_path / "swapped.json")
    assert other.vocab_size == tok.vocab_size and other.fingerprint != tok.fingerprint
    recorded = small_config()
    recorded.data.tokenizer_fingerprint = tok.fingerprint
    save_params(tmp_path / "ck", {"unused": np.zeros(1, np.float32)}, recorded.to_json())
    text = (root / "wiki.tokens").read_text()
    write_documents([text], tok, tmp_path / "same", min_tokens=0)
    write_documents([text], other, tmp_path / "other", min_tokens=0)
    ck = str(tmp_path / "ck")
    for task, data, tokenizer in [("wikitext103", root / "wiki.tokens", root / "tok.json"),
                                  ("ppl", tmp_path / "same", None)]:
        with pytest.raises(ModelLoaded):
            run(ck, task, data=str(data), tokenizer=tokenizer and str(tokenizer))
    message = r"has another vocabulary than the checkpoint was trained with \(tokenizer fingerprints"
    with pytest.raises(InputError, match=r"tokenizer .*swapped.json " + message):
        run(ck, "wikitext103", data=str(root / "wiki.tokens"), tokenizer=str(tmp_path / "swapped.json"))
    with pytest.raises(InputError, match=r"--data=.*other " + message):
        run(ck, "ppl", data=str(tmp_path / "other"))
    with pytest.raises(ModelLoaded):  # no record: no comparison
        run(str(root / "ck"), "wikitext103", data=str(root / "wiki.tokens"), tokenizer=str(tmp_path / "swapped.json"))


def test_mlm_data_of_another_vocabulary_is_refused(tmp_path):
    """--task=mlm on a sentence-split dataset made with a vocab.txt of the same size but other ids."""
    texts = [". ".join(" ".join(f"w{(i * 7 + j * 3) % 60}" for j in range(10)) for i in range(5)) + "."] * 8
    tok = train_tokenizer(texts, "wordpiece", 200)
    bert = bert_base_config()
    bert.model.max_seq_len = 32
    bert.data.tokenizer_fingerprint = tok.fingerprint
    save_params(tmp_path / "ck", {"unused": np.zeros(1, np.float32)}, bert.to_json())
    write_documents(texts, tok, tmp_path / "same", min_tokens=0, split_sentences=True)
    write_documents(texts, _swapped(tok), tmp_path / "other", min_tokens=0, split_sentences=True)
    with pytest.raises(ModelLoaded):
        run(str(tmp_path / "ck"), "mlm", data=str(tmp_path / "same"), batch_size=2)
    with pytest.raises(InputError, match=r"--data=.*other has another vocabulary than the checkpoint was trained"):
        run(str(tmp_path / "ck"), "mlm", data=str(tmp_path / "other"), batch_size=2)
