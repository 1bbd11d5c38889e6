"""twobp-train runs end to end (short), the way a user starts it: Lightning launches the processes."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # an end-to-end run: last (conftest.py)

TRAIN = str(Path(sys.executable).parent / "twobp-train")  # the console script of this environment


def _run(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([TRAIN, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_default_recipe_trains_checkpoints_and_summarises(tmp_path):
    out = _run(
        ["trainer.max_steps=30", "callbacks.monitor.trace_steps=[10]", f"hydra.run.dir={tmp_path}/run"], tmp_path
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # the monitor's figures: FLOPs measured on step 1, the traced step written where the summary says
    assert summary["flops_per_batch"] > 0 and summary["tokens_per_s"] > 0
    assert [Path(t).name for t in summary["traces"]] == ["step10.json", "step10.png"]
    assert all(Path(t).is_file() for t in summary["traces"]) and "step10.json" in out.stdout
    assert summary["steps"] == 30 and summary["schedule"] == "zb-h1" and summary["num_stages"] == 2
    assert summary["first_train_loss"] > 5.0 and summary["final_train_loss"] < 4.0, "the loss did not fall"
    assert len(summary["peak_memory_bytes_per_rank"]) == 2 and summary["samples_per_s"] > 0
    assert Path(summary["checkpoint"], "meta.pt").is_file(), "ModelCheckpoint wrote no sharded checkpoint"
    assert (Path(summary["log_dir"]) / "metrics.csv").is_file()
    assert "run summary: 30 steps" in out.stdout and "twobp-consolidate" in out.stdout
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()


_NO_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="cpu-tiny-hf-gpt2 builds a Hugging Face model: pip install transformers",
)


@pytest.mark.parametrize(
    "recipe",
    ["cpu-tiny-bert", "cpu-tiny-mamba", "cpu-tiny-resnet", pytest.param("cpu-tiny-hf-gpt2", marks=_NO_TRANSFORMERS)],
)
def test_tiny_recipes_learn(recipe, tmp_path):
    _run([f"recipe={recipe}", "trainer.max_steps=40", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_train_loss"] < summary["first_train_loss"], summary


def test_multirun_runs_each_job_once(tmp_path):
    """Under -m each job is one ordinary run (Lightning's launcher re-runs only that job's command)."""
    out = _run(
        [
            "-m",
            "trainer.max_steps=3",
            "schedule=1f1b,zb-h1",
            "callbacks=none",
            "logger=none",
            f"hydra.sweep.dir={tmp_path}/sweep",
        ],
        tmp_path,
        timeout=300,
    )
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0", "1"], (jobs, out.stdout[-2000:])
    assert out.stdout.count("sweep job") == 2


def test_trains_on_a_tokenized_text_file(tmp_path):
    """The real-data path a user takes: local text -> twobp-tokenize -> data=tokens."""
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    tok = subprocess.run(
        [
            str(Path(sys.executable).parent / "twobp-tokenize"),
            str(text),
            "--out",
            str(tmp_path / "corpus"),
            "--val-fraction",
            "0.1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tok.returncode == 0, tok.stderr
    _run(
        [
            "data=tokens",
            f"data.train_path={tmp_path}/corpus/train.bin",
            f"data.val_path={tmp_path}/corpus/val.bin",
            "data.num_workers=0",
            "model.vocab_size=384",
            "trainer.max_steps=20",
            "trainer.val_check_interval=10",
            "callbacks=none",
            f"hydra.run.dir={tmp_path}/run",
        ],
        tmp_path,
    )
    metrics = (tmp_path / "run" / "logs" / "version_0" / "metrics.csv").read_text()
    assert "val_loss" in metrics and "train_loss" in metrics


def test_under_torchrun(tmp_path):
    """Processes started by torchrun: Lightning reads the ranks from the environment, twobp-train
    launches nothing itself, and every rank writes into the one run directory it is given."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "lightning_twobp.train",
            "trainer.max_steps=5",
            f"hydra.run.dir={tmp_path}/run",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["num_stages"] == 2 and len(summary["peak_memory_bytes_per_rank"]) == 2


def _agent(node: int, port: int, tmp_path: Path, extra: list[str]) -> subprocess.Popen:
    """One node: a torchrun agent with one process, joining a c10d rendezvous on localhost, in a
    session of its own (so the node can be killed whole, agent and worker)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "twobp-test",
            "-m",
            "lightning_twobp.train",
            "trainer.devices=1",
            "trainer.num_nodes=2",
            "callbacks=none",
            f"hydra.run.dir={tmp_path}/run",
            *extra,
        ],
        stdout=open(tmp_path / f"node{node}.log", "w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def _final_loss(run: Path) -> float:
    rows = [line.split(",") for line in (run / "logs" / "version_0" / "metrics.csv").read_text().splitlines()]
    col = rows[0].index("train_loss")
    return float([r for r in rows[1:] if len(r) > col and r[col]][-1][col])


def test_two_nodes_train_as_one_process_and_a_lost_node_is_named(tmp_path):
    """Two torchrun agents (``--nnodes 2``, a c10d rendezvous on localhost) train the default recipe:
    the last loss equals one process's; then a node killed mid-run (agent and worker) ends the other's
    job with an error naming the lost pipeline rank, within the pipeline timeout."""
    from lightning_twobp.processes import free_port

    steps = ["trainer.max_steps=5", "trainer.log_every_n_steps=1"]
    one = tmp_path / "one"
    one.mkdir()
    _run([*steps, "trainer.devices=1", "callbacks=none", f"hydra.run.dir={one}/run"], one)
    two = tmp_path / "two"
    two.mkdir()
    port = free_port()
    nodes = [_agent(n, port, two, steps) for n in range(2)]
    codes = [p.wait(timeout=300) for p in nodes]
    assert codes == [0, 0], [(two / f"node{n}.log").read_text()[-3000:] for n in range(2)]
    assert abs(_final_loss(two / "run") - _final_loss(one / "run")) <= 1e-5 * abs(_final_loss(one / "run"))

    lost = tmp_path / "lost"
    lost.mkdir()
    port = free_port()
    # node 0 first, so that its agent hosts the rendezvous store: killing node 1 then cannot take the
    # store down with it (node 0's agent would then end its worker before the worker names node 1)
    nodes = [_agent(0, port, lost, ["trainer.max_steps=100000", "strategy.pipeline_timeout=60"])]
    deadline = time.monotonic() + 60
    while True:  # until node 0's agent listens on the rendezvous port
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "node 0's agent never opened the rendezvous store"
            time.sleep(0.2)
    nodes.append(_agent(1, port, lost, ["trainer.max_steps=100000", "strategy.pipeline_timeout=60"]))
    logs = [lost / f"node{n}.log" for n in range(2)]
    deadline = time.monotonic() + 240
    while "twobp: " not in "".join(p.read_text() for p in logs if p.exists()):  # the pipeline is built
        assert time.monotonic() < deadline, [p.read_text()[-2000:] for p in logs]
        time.sleep(1)
    time.sleep(10)  # some steps in
    try:
        for pid in _tree(nodes[1].pid):  # the second node dies whole: its agent and its worker
            os.kill(pid, signal.SIGKILL)
        code = nodes[0].wait(timeout=180)
    finally:
        for p in nodes:
            for pid in _tree(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    text = logs[0].read_text()
    assert code != 0, text[-3000:]
    assert re.search(r"pipeline rank [01] \(stage [01], global rank [01], host [^)]+\) stopped answering", text), text[
        -3000:
    ]
