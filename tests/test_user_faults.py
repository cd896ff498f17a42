"""Hardening round 4, through the commands users type (subprocesses): no output lands on an input or on anything
training made, the inputs megajax handled poorly, and errors found before the workdir is touched. Every case ends in
a non-zero exit with one ``error:`` line naming the cause and the fix, no traceback, no new file or directory
anywhere in the test's tree, and every byte already there unchanged. The processes of a test run side by side (a
few at a time): each fails before compiling, so a case costs an interpreter start."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, assert_one_error_line, child_env, run_commands, train_config, tree_of
from downstream_fixtures import wordpiece_tokenizer

from megajax.config import bert_base_config, stored_run
from megajax.convert.__main__ import main as convert_main
from megajax.data.preprocess import write_documents
from megajax.data.tokenizer import train_tokenizer
from megajax.evaluation.generate import Sampling
from megajax.evaluation.inputs import InputError
from megajax.evaluation.runner import read_inputs
from megajax.training.loop import train


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """What a user has on disk: a training workdir, its export, the export as Hugging Face and Megatron-LM
    directories, a preprocessed dataset with the corpus it came from, and an eval results file."""
    root = tmp_path_factory.mktemp("world")
    config = train_config(steps=2)
    config.checkpoint.update(every_steps=1, async_save=False)
    train(config, root / "run")
    convert_main(["export", f"--checkpoint={root / 'run'}", f"--output={root / 'export'}"])
    convert_main(["megajax-to-hf", f"--checkpoint={root / 'export'}", f"--output={root / 'hf'}"])
    convert_main(["megajax-to-megatron", f"--checkpoint={root / 'export'}", f"--output={root / 'mt'}", "--tp=2"])
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{i}" for i in rng.integers(0, 400, 60)) for _ in range(40)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = train_tokenizer(texts, "bpe", 300)
    tokenizer.save(root / "tokenizer.json")
    write_documents(texts, tokenizer, root / "d" / "small", min_tokens=0)
    (root / "results.json").write_text(json.dumps({"task": "ppl", "ppl": 12.5}) + "\n")
    return root


def test_no_command_writes_on_an_input_or_on_what_training_made(world):
    """The lost-data class: outputs inside, equal to or above an input, and over a training checkpoint, a workdir
    or a dataset file, each refused through the command that would have written it, --overwrite or not."""
    w = world
    convert, evaluate = ["-m", "megajax.convert"], [str(ROOT / "eval.py")]
    ppl = [*evaluate, f"--checkpoint={w / 'run'}", "--task=ppl", f"--data={w / 'd' / 'small'}"]
    preprocess = ["-m", "megajax.data.preprocess", f"--input={w / 'corpus.jsonl'}", "--workers=1", "--min_tokens=0"]
    cases = {  # name: (argv, what the error line says)
        "export over a training step": ([*convert, "export", "--checkpoint=run", "--output=run/checkpoints/2",
                                         "--overwrite"], "is inside the input"),
        "hf over the checkpoints": ([*convert, "megajax-to-hf", "--checkpoint=run", "--output=run/checkpoints",
                                     "--overwrite"], "is inside the input"),
        "export from elsewhere over a step": ([*convert, "export", "--checkpoint=export",
                                               "--output=run/checkpoints/2", "--overwrite"],
                                              "is a training checkpoint: megajax does not write over it even with "
                                              "--overwrite"),
        "hf over a workdir": ([*convert, "megajax-to-hf", "--checkpoint=export", "--output=run", "--overwrite"],
                              "is a training workdir"),
        "megatron over a dataset file": ([*convert, "megajax-to-megatron", "--checkpoint=export", "--tp=1",
                                          "--output=d/small.json", "--overwrite"], "is part of a preprocessed dataset"),
        "convert inside its input": ([*convert, "hf-to-megajax", "--hf=hf", "--output=hf/megajax"],
                                     "is inside the input"),
        "convert above its input": ([*convert, "export", "--checkpoint=export", f"--output={w}", "--overwrite"],
                                    "holds the input"),
        "convert onto its input": ([*convert, "megatron-to-megajax", "--megatron=mt", "--output=mt",
                                    "--vocab_size=1000", "--overwrite"], "is the input"),
        "eval over the dataset's sidecar": ([*ppl, "--output=d/small.json"], "is part of a preprocessed dataset"),
        "eval over the sidecar, --overwrite": ([*ppl, "--output=d/small.json", "--overwrite"],
                                               "does not write over it even with --overwrite"),
        "eval inside its checkpoint": ([*ppl, "--output=run/ppl.json"], "is inside the input"),
        "eval predictions over a dataset file": ([*evaluate, "--checkpoint=run", "--task=mnli",
                                                  "--predictions=d/small.bin", "--overwrite"],
                                                 "is part of a preprocessed dataset"),
        "eval over an earlier result": ([*ppl, "--output=results.json"], "already exists (a JSON results file): "
                                                                         "pass --overwrite"),
        "preprocess onto a dataset": ([*preprocess, "--tokenizer=tokenizer.json", "--output_prefix=d/small"],
                                      "a dataset already lies there"),
        "preprocess to a directory prefix": ([*preprocess, "--tokenizer=tokenizer.json", "--output_prefix=d/"],
                                             "is a directory; give a file prefix inside it"),
        "preprocess onto its tokenizer": ([*preprocess, "--tokenizer=d/small.tokenizer.json",
                                           "--output_prefix=d/small", "--overwrite"], "is the input"),
        "lm_eval inside its checkpoint": (["-m", "megajax.lm_eval", "--model", "megajax", "--model_args",
                                           "pretrained=run", "--tasks", "lambada_openai", "--output_path", "run/lm"],
                                          "is inside the input"),
        "median onto its input": (["-m", "megajax.evaluation.median", "results.json", "--output=results.json",
                                   "--overwrite"], "is the input"),
        "train in a checkpoint": ([str(ROOT / "train.py"), "--config=gpt_tiny", "--workdir=run/checkpoints/2"],
                                  "is a training checkpoint, not a training workdir"),
        "train above its data": ([str(ROOT / "train.py"), "--config=gpt_tiny", "--workdir=d",
                                  "--config.data.source=indexed", "--config.data.path=d/small"], "holds the input"),
    }
    before = tree_of(w)
    results = run_commands({name: (argv, {}) for name, (argv, _) in cases.items()}, cwd=w)
    assert_one_error_line(results, {name: message for name, (_, message) in cases.items()})
    assert tree_of(w) == before  # nothing new anywhere, every byte the same


def test_inputs_once_handled_poorly_or_found_after_the_workdir(world, tmp_path):
    """Damaged files, a sidecar without its keys, a GPU platform that is not installed, config files and flags
    absl or Python would have answered with a traceback, the pipeline's mesh, and data or fine-tuning inputs that
    used to fail after the workdir existed. None leaves a workdir, a lock or an output directory behind."""
    w = world
    for name in ("hf", "mt"):
        (tmp_path / name).symlink_to(w / name)
    damaged_hf, damaged_mt = tmp_path / "hf-damaged", tmp_path / "mt-damaged"
    damaged_hf.mkdir()
    (damaged_hf / "config.json").write_bytes((w / "hf" / "config.json").read_bytes())
    (damaged_hf / "model.safetensors").write_bytes((w / "hf" / "model.safetensors").read_bytes()[:1000])
    rank = pathlib.Path("iter_0000000") / "mp_rank_00" / "model_optim_rng.pt"
    (damaged_mt / rank).parent.mkdir(parents=True)
    (damaged_mt / "latest_checkpointed_iteration.txt").write_text("0")
    (damaged_mt / rank).write_bytes((w / "mt" / rank).read_bytes()[:5000])
    (damaged_mt / "iter_0000000" / "mp_rank_01").mkdir()  # and mp_rank_01 present (named below when missing)
    (damaged_mt / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt").write_bytes(
        (w / "mt" / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt").read_bytes())
    one_rank = tmp_path / "mt-one-rank"
    (one_rank / "iter_0000000" / "mp_rank_00").mkdir(parents=True)
    (one_rank / "latest_checkpointed_iteration.txt").write_text("0")
    (one_rank / rank).write_bytes((w / "mt" / rank).read_bytes())
    bare = tmp_path / "bare"  # a dataset whose sidecar lacks its keys
    bare.mkdir()
    for suffix in (".bin", ".idx.npy"):
        (bare / f"small{suffix}").write_bytes((w / "d" / f"small{suffix}").read_bytes())
    (bare / "small.json").write_text('{"vocab_size": 300}')
    (tmp_path / "odd.bin").write_bytes(b"\0")  # an odd number of bytes for uint16 ids
    for suffix in (".idx.npy", ".json"):
        (tmp_path / f"odd{suffix}").write_bytes((w / "d" / f"small{suffix}").read_bytes())
    (tmp_path / "syntax.py").write_text("def get_config(:\n    pass\n")
    (tmp_path / "damaged.json").write_text((w / "tokenizer.json").read_text()[:200])  # cut mid-file
    (tmp_path / "qqp").mkdir()  # QQP files with no usable row
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / "qqp" / name).write_text("not\tthe\tQQP header\nnor a row\n")
    wordpiece_tokenizer().save(str(tmp_path / "qqp" / "tokenizer.json"))
    (tmp_path / "sealed").mkdir()
    (tmp_path / "sealed" / "metrics.jsonl").write_text("")
    (tmp_path / "sealed" / "metrics.jsonl").chmod(0o444)
    immutable = subprocess.run(["chattr", "+i", str(tmp_path / "sealed" / "metrics.jsonl")],
                               capture_output=True).returncode == 0  # root ignores file modes
    train_py, random_data = [str(ROOT / "train.py"), "--config=gpt_tiny"], ["--config.data.source=random"]
    cases = {  # name: (argv, environment, what the error line says)
        "truncated safetensors": (["-m", "megajax.convert", "hf-to-megajax", "--hf=hf-damaged", "--output=out"], {},
                                  f"{damaged_hf / 'model.safetensors'} cannot be read as safetensors"),
        "truncated megatron rank": (["-m", "megajax.convert", "megatron-to-megajax", "--megatron=mt-damaged",
                                     "--output=out", "--vocab_size=1000"], {},
                                    "model_optim_rng.pt cannot be read as a PyTorch checkpoint"),
        "truncated rank, allowing pickle": (["-m", "megajax.convert", "megatron-to-megajax", "--megatron=mt-damaged",
                                             "--output=out", "--vocab_size=1000", "--allow_pickle"], {},
                                            "the file is truncated or damaged"),
        "a megatron rank missing": (["-m", "megajax.convert", "megatron-to-megajax", "--megatron=mt-one-rank",
                                     "--output=out", "--vocab_size=1000"], {},
                                    "lacks mp_rank_01: its args say tensor_model_parallel_size=2"),
        "megatron tp that does not divide": (["-m", "megajax.convert", "megajax-to-megatron",
                                              f"--checkpoint={w / 'export'}", "--output=new/dir/mt", "--tp=3"], {},
                                             "tensor-parallel size 3 must divide"),
        "sidecar without keys, eval": ([str(ROOT / "eval.py"), f"--checkpoint={w / 'run'}", "--task=ppl",
                                        "--data=bare/small"], {}, "lacks what a dataset's sidecar holds"),
        "sidecar without keys, train": ([*train_py, "--workdir=run1", "--config.data.source=indexed",
                                         "--config.data.path=bare/small"], {}, "lacks what a dataset's sidecar holds"),
        "no GPU backend": ([*train_py, "--workdir=run2"], {"JAX_PLATFORMS": "cuda"},
                           "). For NVIDIA GPUs install the gpu extra (pip install 'megajax[gpu]')"),
        "config syntax": ([str(ROOT / "train.py"), f"--config={tmp_path / 'syntax.py'}", "--workdir=run3"], {},
                          f"config file {tmp_path / 'syntax.py'}, line 1:"),
        "override not a number": ([*train_py, "--config.train.steps=ten", "--workdir=run4"], {},
                                  "--config.train.steps=ten: config.train.steps takes a whole number"),
        "override before --config": ([str(ROOT / "train.py"), "--config.train.steps=ten", "--config=gpt_tiny",
                                      "--workdir=run5"], {}, "config.train.steps takes a whole number"),
        "mesh with pipe": ([*train_py, *random_data, "--cpu_devices=8", "--mesh=2x4x2", "--workdir=run6"], {},
                           "mesh 2x4x2 (pipe x data x model) needs 16 devices but 8 are present"),
        "pipeline microbatches": ([*train_py, *random_data, "--cpu_devices=8", "--mesh=2x2x1", "--workdir=run7",
                                   "--config.parallel.pipeline_microbatches=3"], {},
                                  "parallel.pipeline_microbatches=3 must be a multiple of mesh.pipe=2"),
        "metrics not writable": ([*train_py, *random_data, "--workdir=sealed", "--config.train.steps=1"], {},
                                 "cannot write "),
        "missing data path": ([*train_py, "--workdir=run8", "--config.data.source=indexed",
                               "--config.data.path=nowhere/corpus"], {}, "no preprocessed dataset at"),
        "odd-sized token file": ([*train_py, "--workdir=run9", "--config.data.source=indexed",
                                  "--config.data.path=odd"], {}, "not a whole number of uint16 ids"),
        "tokenizer larger than the model": ([*train_py, "--workdir=run10", "--config.data.source=indexed",
                                             f"--config.data.path={w / 'd' / 'small'}",
                                             "--config.model.vocab_size=100"], {},
                                            "tokenizer has 300 ids but model.vocab_size=100"),
        "init_from another trunk": ([str(ROOT / "train.py"), "--config=finetune_tiny_pair", "--workdir=run11",
                                     f"--config.init_from={w / 'run'}"], {}, "holds a model.name='gpt' checkpoint"),
        "squad window too short": ([str(ROOT / "train.py"), "--config=finetune.py:squad1,336m", "--workdir=run12",
                                    "--config.model.max_seq_len=64"], {}, "model.max_seq_len=64 leaves no room for "
                                                                          "a SQuAD context"),
        "QQP files that cannot train": ([str(ROOT / "train.py"), "--config=finetune.py:qqp,336m", "--workdir=run13",
                                         "--config.data.task_dir=qqp", "--config.data.tokenizer=qqp/tokenizer.json"],
                                        {}, "QQP file"),
        "generate without a tokenizer": ([str(ROOT / "eval.py"), "--checkpoint=converted", "--task=generate",
                                          "--prompt=w1"], {}, "held no tokenizer megajax reads"),
        "a damaged tokenizer file": ([str(ROOT / "eval.py"), f"--checkpoint={w / 'run'}", "--task=ppl",
                                      f"--data={w / 'd' / 'small'}", "--tokenizer=damaged.json"], {},
                                     "tokenizer damaged.json cannot be read"),
        "a damaged checkpoint": ([str(ROOT / "eval.py"), "--checkpoint=damaged-run", "--task=ppl",
                                  f"--data={w / 'd' / 'small'}"], {}, "is damaged"),
        "tp of zero": (["-m", "megajax.convert", "megajax-to-megatron", f"--checkpoint={w / 'export'}", "--tp=0",
                        "--output=mt0"], {}, "argument --tp: '0': give a whole number >= 1"),
        "a seed's result twice": (["-m", "megajax.evaluation.median", f"{w / 'results.json'}",
                                   f"{w / 'results.json'}"], {}, "is given twice"),
        "predictions onto the results": ([str(ROOT / "eval.py"), f"--checkpoint={w / 'run'}", "--task=mnli",
                                          "--output=r.json", "--predictions=qqp/../r.json"], {},
                                         "is also where --output goes"),
        "an empty output": ([str(ROOT / "eval.py"), f"--checkpoint={w / 'run'}", "--task=ppl",
                             f"--data={w / 'd' / 'small'}", "--output="], {}, "--output='' is empty"),
        "cpu devices not a number": ([*train_py, "--cpu_devices=abc", "--workdir=run14"], {},
                                     "--cpu_devices='abc': give a whole number of devices"),
        "a tokenizer indexed data ignores": ([*train_py, "--workdir=run15", "--config.data.source=indexed",
                                              f"--config.data.path={w / 'd' / 'small'}",
                                              f"--config.data.tokenizer={w / 'tokenizer.json'}"], {},
                                             "is read with data.source=tfds, task, sft or preference"),
        "a directory as preprocess input": (["-m", "megajax.data.preprocess", "--input=qqp",
                                             f"--tokenizer={w / 'tokenizer.json'}", "--output_prefix=p"], {},
                                            "input qqp is a directory: give its files"),
        "no workers": (["-m", "megajax.data.preprocess", f"--input={w / 'corpus.jsonl'}",
                        f"--tokenizer={w / 'tokenizer.json'}", "--output_prefix=p", "--workers=0"], {},
                       "--workers=0: give a whole number >= 1"),
        "overwrite an HF directory with a README": (["-m", "megajax.convert", "megajax-to-hf",
                                                     f"--checkpoint={w / 'export'}", "--output=hf-readme",
                                                     "--overwrite"], {}, "replacing it would delete them"),
        "lm-eval's folder for the checkpoint is a workdir": (["-m", "megajax.lm_eval", "--model", "megajax",
                                                              "--model_args", "pretrained=run", "--tasks",
                                                              "lambada_openai", "--output_path", "lm"], {},
                                                             "--output_path=lm/run is a training workdir"),
    }
    convert_main(["megatron-to-megajax", f"--megatron={w / 'mt'}", f"--output={tmp_path / 'converted'}",
                  "--vocab_size=1000"])  # Megatron-LM saves no tokenizer
    (tmp_path / "hf-readme").mkdir()  # an HF directory a user annotated
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "hf-readme" / name).write_bytes((w / "hf" / name).read_bytes())
    (tmp_path / "hf-readme" / "README.md").write_text("my notes")
    (tmp_path / "lm").mkdir()  # lm-eval names its results folder after pretrained=: here, a training workdir
    (tmp_path / "lm" / "run").mkdir()
    (tmp_path / "lm" / "run" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "run").symlink_to(w / "run")
    shutil.copytree(w / "run", tmp_path / "damaged-run")  # one byte flipped in the state's index (OCDBT): every
    for index in (tmp_path / "damaged-run" / "checkpoints").glob("*/state/d/*"):  # array's read fails at once
        data = bytearray(index.read_bytes())
        data[len(data) // 2] ^= 0xFF
        index.write_bytes(bytes(data))
    before, world_before = tree_of(tmp_path), tree_of(w)
    try:
        results = run_commands({name: (argv, env) for name, (argv, env, _) in cases.items()}, cwd=tmp_path)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(tmp_path / "sealed" / "metrics.jsonl")], check=True)
    assert_one_error_line(results, {name: message for name, (_, _, message) in cases.items()})
    assert "train:" not in results["metrics not writable"][1]  # refused before compiling, not after
    assert tree_of(tmp_path) == before and tree_of(w) == world_before  # no workdir, lock or output left


def test_mlm_and_ppl_check_a_tokenizer_given_against_the_checkpoint(world, tmp_path):
    """eval.py --tokenizer with tasks that read token ids: another vocabulary is refused (not ignored)."""
    config = bert_base_config()
    config.model.update(vocab_size=300)
    other = train_tokenizer(["x y z w v"] * 5, "bpe", 300)
    other.save(tmp_path / "other.json")
    config.data.tokenizer_fingerprint = "0" * 16  # the checkpoint's training vocabulary: not the one given
    with pytest.raises(InputError, match="has another vocabulary than the checkpoint was trained with"):
        read_inputs("mlm", stored_run(config), data=None, prompt=None, tokenizer=str(tmp_path / "other.json"),
                    stride=None, batch_size=8, max_new_tokens=1, sampling=Sampling())
    gpt = train_config()
    gpt.data.tokenizer_fingerprint = "0" * 16
    with pytest.raises(InputError, match="has another vocabulary"):
        read_inputs("ppl", stored_run(gpt), data=str(world / "d" / "small"), prompt=None,
                    tokenizer=str(tmp_path / "other.json"), stride=None, batch_size=8, max_new_tokens=1,
                    sampling=Sampling())


def test_a_mesh_smaller_than_the_devices_says_so(tmp_path, capfd):
    config = train_config(data=2, model=2, steps=1)
    config.checkpoint.enabled = False
    train(config, tmp_path / "run")
    err = capfd.readouterr().err
    assert "note: mesh 2x2 uses 4 of the 8 devices present; the other 4 stay idle" in err
    assert "done: step 1/1; " in err and "no checkpoint (checkpoint.enabled=False)" in err
    assert os.path.isfile(tmp_path / "run" / "metrics.jsonl")


def test_ctrl_c_during_start_up_is_one_line_and_leaves_nothing(tmp_path):
    """SIGINT half a second in (imports, config checks or compiling, as the machine goes): exit 130, one line
    saying nothing was saved, no traceback, no workdir left."""
    env = {**child_env(), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    run = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config=gpt_tiny", "--workdir=run",
                            "--config.data.source=random", "--config.train.steps=50"], cwd=tmp_path, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    run.send_signal(signal.SIGINT)
    assert run.wait(timeout=120) == 128 + signal.SIGINT
    stderr = run.stderr.read()
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGINT ") and "nothing was saved" in last, stderr[-2000:]
    assert "Traceback" not in stderr and not (tmp_path / "run").exists()
