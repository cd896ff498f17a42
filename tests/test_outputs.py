"""Where a command may write (megajax.outputs): every writing command asks these functions before it starts, so the
rule is tested here on stand-ins of each kind of thing megajax writes (laid out as the writers lay them out), and
through the commands themselves in test_user_faults.py."""

import json
import os

import pytest

from megajax.outputs import (
    Kind,
    OutputPathError,
    claim_dataset,
    claim_directory,
    claim_file,
    claim_folder,
    claim_workdir,
    kind_of,
    write_json,
)


@pytest.fixture
def disk(tmp_path):
    """A training workdir, an export, a Hugging Face and a Megatron-LM directory, a dataset and a results file."""
    run = tmp_path / "run"
    for item in ("config", "state", "data"):
        (run / "checkpoints" / "4" / item).mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "train.lock").write_text("")
    for item in ("config", "params"):
        (tmp_path / "export" / "0" / item).mkdir(parents=True)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "mt" / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "mt" / "latest_checkpointed_iteration.txt").write_text("1")
    (tmp_path / "d").mkdir()
    for suffix, content in ((".bin", b"\0\0"), (".idx.npy", b"x"), (".json", b'{"dtype": "uint16", "tokens": 1}')):
        (tmp_path / "d" / f"small{suffix}").write_bytes(content)
    (tmp_path / "results.json").write_text('{"task": "ppl", "ppl": 3.0}\n')
    (tmp_path / "notes.txt").write_text("mine")
    return tmp_path


def _snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_kinds_are_recognised(disk):
    assert kind_of(disk / "run") is Kind.WORKDIR
    assert kind_of(disk / "run" / "checkpoints") is Kind.CHECKPOINTS
    assert kind_of(disk / "run" / "checkpoints" / "4") is Kind.CHECKPOINT
    assert kind_of(disk / "export") is Kind.MODEL and kind_of(disk / "export" / "0") is Kind.MODEL
    assert kind_of(disk / "hf") is Kind.HF_MODEL
    assert kind_of(disk / "mt") is Kind.MEGATRON
    assert all(kind_of(disk / "d" / f"small{s}") is Kind.DATASET for s in (".bin", ".idx.npy", ".json"))
    assert kind_of(disk / "results.json") is None and kind_of(disk / "d") is None and kind_of(disk / "nothing") is None


# Output kinds, each with an input it reads: every verb's directory output must avoid the same places.
VERBS = [(Kind.MODEL, "hf"), (Kind.HF_MODEL, "export"), (Kind.MEGATRON, "export")]


@pytest.mark.parametrize("kind,source", VERBS)
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_output_never_lands_on_in_or_above_an_input_or_training_output(disk, kind, source, overwrite):
    before = _snapshot(disk)
    refused = {  # output: what the error says
        source: f"is the input {disk / source}",
        f"{source}/sub": f"is inside the input {disk / source}",
        ".": f"holds the input {disk / source}",
        "run": "is a training workdir",
        "run/checkpoints": "is a training run's checkpoints directory",
        "run/checkpoints/4": "is a training checkpoint",
        "run/checkpoints/5": "inside",
        "run/export": f"is inside {disk / 'run'}, which is a training workdir",
        "mt/iter_0000002": "which is a Megatron-LM checkpoint",
        "d/small.json": "is part of a preprocessed dataset",
        "notes.txt": "is a file, not a directory",
    }
    for output, message in refused.items():
        with pytest.raises(OutputPathError, match="^--output=") as error:
            claim_directory(disk / output, kind, inputs=[disk / source], overwrite=overwrite)
        assert message in str(error.value), (output, str(error.value))
    assert _snapshot(disk) == before  # nothing written


@pytest.mark.parametrize("kind,source", VERBS)
def test_overwrite_replaces_only_an_earlier_output_of_the_same_kind(disk, kind, source):
    same = {Kind.MODEL: "export", Kind.HF_MODEL: "hf", Kind.MEGATRON: "mt"}[kind]
    inputs = [disk / "elsewhere"]
    with pytest.raises(OutputPathError, match="already exists .* pass --overwrite to replace it"):
        claim_directory(disk / same, kind, inputs=inputs)
    assert claim_directory(disk / same, kind, inputs=inputs, overwrite=True) == disk / same
    for other in {"export", "hf", "mt", "d"} - {same}:
        with pytest.raises(OutputPathError, match=r"already holds .*: --overwrite replaces only"):
            claim_directory(disk / other, kind, inputs=inputs, overwrite=True)
    (disk / "empty").mkdir()
    assert claim_directory(disk / "empty", kind) == disk / "empty"
    assert claim_directory(disk / "new" / "deeper", kind) == disk / "new" / "deeper"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_results_file_never_lands_on_a_dataset_an_input_or_inside_a_checkpoint(disk, overwrite):
    before = _snapshot(disk)
    refused = {
        "d/small.json": "is part of a preprocessed dataset: megajax does not write over it even with --overwrite",
        "d/small.bin": "is part of a preprocessed dataset",
        "run/eval.json": f"is inside the input {disk / 'run'}",
        "export/eval.json": "which is a megajax model checkpoint",
        "hf/config.json": "which is a Hugging Face model directory",
        "in.json": f"is the input {disk / 'in.json'}",
        "notes.txt": "already holds a file megajax did not write",
        "d": "is a directory",
        "no/such/dir/x.json": "does not exist; create it first",
    }
    (disk / "in.json").write_text("{}")
    for output, message in refused.items():
        with pytest.raises(OutputPathError) as error:
            claim_file(disk / output, flag="output", inputs=[disk / "run", disk / "in.json"], overwrite=overwrite)
        assert message in str(error.value), (output, str(error.value))
    assert _snapshot(disk) == {**before, "in.json": b"{}"}


def test_an_earlier_results_file_is_replaced_only_with_overwrite(disk):
    with pytest.raises(OutputPathError, match="already exists .a JSON results file.: pass --overwrite"):
        claim_file(disk / "results.json")
    assert claim_file(disk / "results.json", overwrite=True) == disk / "results.json"
    assert claim_file(None) is None and claim_file(disk / "new.json") == disk / "new.json"
    write_json(disk / "results.json", {"task": "ppl", "ppl": 2.5})
    assert json.loads((disk / "results.json").read_text()) == {"task": "ppl", "ppl": 2.5}
    assert sorted(p.name for p in disk.glob(".results.json*")) == []  # no temporary file left


def test_a_dataset_prefix_is_checked_for_each_file_it_writes(disk):
    with pytest.raises(OutputPathError, match="is a directory; give a file prefix inside it"):
        claim_dataset(f"{disk / 'd'}{os.sep}")
    with pytest.raises(OutputPathError, match="a dataset already lies there .*pass --overwrite"):
        claim_dataset(disk / "d" / "small")
    assert claim_dataset(disk / "d" / "small", overwrite=True) == disk / "d" / "small"
    with pytest.raises(OutputPathError, match=r"its file .*small\.tokenizer\.json is the input"):
        claim_dataset(disk / "d" / "small", inputs=[disk / "d" / "small.tokenizer.json"], overwrite=True)
    (disk / "notes.json").write_text("{}")
    with pytest.raises(OutputPathError, match="notes.json exists and is not part of a dataset"):
        claim_dataset(disk / "notes", overwrite=True)
    with pytest.raises(OutputPathError, match="which is a training workdir"):
        claim_dataset(disk / "run" / "corpus")
    with pytest.raises(OutputPathError, match="is inside the input"):
        claim_dataset(disk / "tok" / "corpus", inputs=[disk / "tok"])
    assert claim_dataset(disk / "d" / "other") == disk / "d" / "other"


def test_a_workdir_is_new_empty_a_workdir_or_beside_other_files(disk):
    assert claim_workdir(disk / "run") == disk / "run"  # resumed
    assert claim_workdir(disk / "d") == disk / "d"  # other files: training adds its own beside them
    assert claim_workdir(disk / "fresh") == disk / "fresh"
    refused = {"export": "is a megajax model checkpoint", "run/checkpoints/4": "is a training checkpoint",
               "run/sub": "which is a training workdir", "hf": "is a Hugging Face model directory",
               "d/small.bin": "is part of a preprocessed dataset", "notes.txt": "is a file",
               "data": f"is the input {disk / 'data'}", "data/run": "is inside the input",
               "above": "holds the input"}
    for workdir, message in refused.items():
        with pytest.raises(OutputPathError, match="^--workdir=") as error:
            claim_workdir(disk / workdir, inputs=[disk / "data", disk / "above" / "corpus"])
        assert message in str(error.value), (workdir, str(error.value))
    with pytest.raises(OutputPathError, match="holds the input"):
        claim_folder(disk / "lm", flag="output_path", inputs=[disk / "lm" / "run"])
    with pytest.raises(OutputPathError, match="--workdir='' is empty"):  # not the current directory, silently
        claim_workdir("")
    for blank in ("", " "):
        with pytest.raises(OutputPathError, match="is empty; give a file prefix"):
            claim_dataset(blank)
    with pytest.raises(OutputPathError, match="has leading or trailing spaces"):
        claim_file(" x.json")


def test_symbolic_links_are_followed(disk):
    (disk / "link").symlink_to(disk / "run")
    with pytest.raises(OutputPathError, match="is inside the input"):
        claim_file(disk / "link" / "x.json", inputs=[disk / "run"])
    with pytest.raises(OutputPathError, match="is a training workdir"):
        claim_directory(disk / "link", Kind.MODEL, overwrite=True)


def test_overwrite_never_deletes_what_megajax_did_not_write(disk):
    """A Hugging Face directory with a README beside the weights, an export with a user's notes: replacing either
    would delete them, so --overwrite refuses; a results file is replaced only by results, predictions only by
    predictions, and a JSON file of another shape (a tokenizer) by neither."""
    (disk / "hf" / "README.md").write_text("mine")
    (disk / "export" / "notes.txt").write_text("mine")
    for name, kind in (("hf", Kind.HF_MODEL), ("export", Kind.MODEL)):
        with pytest.raises(OutputPathError, match="also holds .*replacing it would delete them"):
            claim_directory(disk / name, kind, overwrite=True)
    (disk / "odds.json").write_text('{"q1": 0.5, "q2": -1.0}')
    (disk / "tokenizer.json").write_text('{"version": "1.0", "model": {"vocab": {"a": 0}, "merges": ["a b"]}}')
    assert claim_file(disk / "odds.json", overwrite=True, kind=Kind.PREDICTIONS) == disk / "odds.json"
    with pytest.raises(OutputPathError, match="already holds a JSON predictions file, not a JSON results file"):
        claim_file(disk / "odds.json", overwrite=True)
    with pytest.raises(OutputPathError, match="already holds a file megajax did not write"):
        claim_file(disk / "tokenizer.json", overwrite=True, kind=Kind.PREDICTIONS)


def test_paths_are_normalised_and_suggestions_lie_outside(disk):
    """``a/../b`` is ``b`` (nothing made on the way); a file name ending in a separator is a directory; the path
    suggested for an output inside a checkpoint lies beside the outermost recognised directory."""
    assert claim_directory(disk / "new" / ".." / "e3", Kind.MODEL) == disk / "e3"
    assert not (disk / "new").exists()
    with pytest.raises(OutputPathError, match="is a directory"):
        claim_file(f"{disk / 'results'}{os.sep}")
    with pytest.raises(OutputPathError, match=f"e.g. at {disk / 'run-params'}$"):
        claim_directory(disk / "run" / "checkpoints" / "4" / "params", Kind.MODEL)
    (disk / "dangling").symlink_to(disk / "nowhere")
    with pytest.raises(OutputPathError, match="is a symbolic link to .*nowhere, which does not exist"):
        claim_workdir(disk / "dangling")
