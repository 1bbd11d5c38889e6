"""twobp-train runs end to end (short), the way a user starts it: Lightning launches the processes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

TRAIN = str(Path(sys.executable).parent / "twobp-train")  # the console script of this environment


def _run(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([TRAIN, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_default_recipe_trains_checkpoints_and_summarises(tmp_path):
    out = _run(["trainer.max_steps=30", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["schedule"] == "zb-h1" and summary["num_stages"] == 2
    assert summary["first_train_loss"] > 5.0 and summary["final_train_loss"] < 4.0, "the loss did not fall"
    assert len(summary["peak_memory_bytes_per_rank"]) == 2 and summary["samples_per_s"] > 0
    assert Path(summary["checkpoint"], "meta.pt").is_file(), "ModelCheckpoint wrote no sharded checkpoint"
    assert (Path(summary["log_dir"]) / "metrics.csv").is_file()
    assert "run summary: 30 steps" in out.stdout and "twobp-consolidate" in out.stdout
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()


_NO_TRANSFORMERS = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                      reason="cpu-tiny-hf-gpt2 builds a Hugging Face model: pip install transformers")


@pytest.mark.parametrize("recipe", ["cpu-tiny-bert", "cpu-tiny-mamba", "cpu-tiny-resnet",
                                    pytest.param("cpu-tiny-hf-gpt2", marks=_NO_TRANSFORMERS)])
def test_tiny_recipes_learn(recipe, tmp_path):
    _run([f"recipe={recipe}", "trainer.max_steps=40", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_train_loss"] < summary["first_train_loss"], summary


def test_multirun_runs_each_job_once(tmp_path):
    """Under -m each job is one ordinary run (Lightning's launcher re-runs only that job's command)."""
    out = _run(["-m", "trainer.max_steps=3", "schedule=1f1b,zb-h1", "callbacks=none", "logger=none",
                f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path, timeout=300)
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0", "1"], (jobs, out.stdout[-2000:])
    assert out.stdout.count("sweep job") == 2


def test_trains_on_a_tokenized_text_file(tmp_path):
    """The real-data path a user takes: local text -> twobp-tokenize -> data=tokens."""
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    tok = subprocess.run([str(Path(sys.executable).parent / "twobp-tokenize"), str(text), "--out", str(tmp_path / "corpus"),
                          "--val-fraction", "0.1"], capture_output=True, text=True, timeout=60)
    assert tok.returncode == 0, tok.stderr
    _run(["data=tokens", f"data.train_path={tmp_path}/corpus/train.bin", f"data.val_path={tmp_path}/corpus/val.bin",
          "data.num_workers=0", "model.vocab_size=384", "trainer.max_steps=20", "trainer.val_check_interval=10",
          "callbacks=none", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    metrics = (tmp_path / "run" / "logs" / "version_0" / "metrics.csv").read_text()
    assert "val_loss" in metrics and "train_loss" in metrics


def test_under_torchrun(tmp_path):
    """Processes started by torchrun: Lightning reads the ranks from the environment, twobp-train
    launches nothing itself, and every rank writes into the one run directory it is given."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "lightning_twobp.train", "trainer.max_steps=5", f"hydra.run.dir={tmp_path}/run"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["num_stages"] == 2 and len(summary["peak_memory_bytes_per_rank"]) == 2
