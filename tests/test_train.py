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
from typing import Any

import lightning.pytorch as pl
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
    # rank 0's 0% deferred is said to be by design, not left for the user to read as a fault
    assert "0% of the weight backward deferred to W (the first stage's input takes no gradient" in out.stdout
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
    """Under -m each job is one ordinary run (Lightning's launcher re-runs only that job's command), in
    the config's own sweep directory (the README's sweep: its ``${name}`` once failed to resolve there)."""
    out = _run(["-m", "trainer.max_steps=3", "schedule=1f1b,zb-h1", "callbacks=none", "logger=none"], tmp_path, 300)
    (sweep,) = (tmp_path / "multirun" / "cpu-tiny-llama").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
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


def _agent(
    node: int, port: int, tmp_path: Path, extra: list[str], procs: int = 1, pythonpath: str | None = None
) -> subprocess.Popen:
    """One node: a torchrun agent with ``procs`` processes, joining a c10d rendezvous on localhost, in
    a session of its own (so the node can be killed whole, agent and workers); ``pythonpath`` is put
    first on the workers' path."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            str(procs),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "twobp-test",
            "-m",
            "lightning_twobp.train",
            f"trainer.devices={procs}",
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


def _metrics(run: Path) -> list[dict[str, str]]:
    lines = (run / "logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    return [dict(zip(header, line.split(","), strict=False)) for line in lines[1:]]


def _final_loss(run: Path) -> float:
    return float([r["train_loss"] for r in _metrics(run) if r.get("train_loss")][-1])


def _first_val_loss(run: Path) -> float | None:
    if not (run / "logs" / "version_0" / "metrics.csv").is_file():
        return None
    values = [r["val_loss"] for r in _metrics(run) if r.get("val_loss")]
    return float(values[0]) if values else None


# Both two-node tests against one process: batches of 32 (two sharded replicas read 16 each of the same
# shuffled order), validated after step 5 (4 batches: two replicas evaluate 4 batches of 16 each, the
# same 128 samples, and log their mean)
_ONE_PROCESS = [
    "trainer.max_steps=5",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=5",
    "+trainer.enable_checkpointing=false",  # Lightning's default ModelCheckpoint would save after validating
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    one = tmp_path_factory.mktemp("one")
    args = [*_ONE_PROCESS, "data.batch_size=32", "trainer.devices=1", "callbacks=none", f"hydra.run.dir={one}/run"]
    _run(args, one)
    return one / "run"


def _two_nodes(folder: Path, extra: list[str], procs: int = 1, pythonpath: str | None = None) -> list[subprocess.Popen]:
    """Two torchrun agents, node 0 first, so that its agent hosts the rendezvous store: killing node 1
    then cannot take the store down with it (node 0's agent would then end its workers before they
    name node 1)."""
    from lightning_twobp.processes import free_port

    folder.mkdir()
    port = free_port()
    nodes = [_agent(0, port, folder, extra, procs, pythonpath)]
    deadline = time.monotonic() + 60
    while True:  # until node 0's agent listens on the rendezvous port
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "node 0's agent never opened the rendezvous store"
            time.sleep(0.2)
    nodes.append(_agent(1, port, folder, extra, procs, pythonpath))
    return nodes


def _after(cond: Any, seconds: float) -> Any:
    """A test that holds from ``seconds`` after ``cond()`` first held."""
    since: list[float] = []

    def ready() -> bool:
        if not since and cond():
            since.append(time.monotonic())
        return bool(since) and time.monotonic() >= since[0] + seconds

    return ready


def _end(nodes: list[subprocess.Popen], timeout: float, first: Any = None) -> int:
    """Node 0's exit code (after ``first()``, if given); no process of either node outlives the call."""
    try:
        if first is not None:
            first()
        return nodes[0].wait(timeout=timeout)
    finally:
        for p in nodes:
            for pid in _tree(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _lose_node_1(nodes: list[subprocess.Popen], folder: Path, ready: Any) -> tuple[int, str]:
    """Once ``ready()``, node 1 dies whole (its agent and its workers); node 0's exit code and log."""
    logs = [folder / f"node{n}.log" for n in range(2)]
    deadline = time.monotonic() + 240

    def kill_node_1() -> None:
        while not ready():
            assert time.monotonic() < deadline, [p.read_text()[-2000:] for p in logs if p.exists()]
            time.sleep(1)
        for pid in _tree(nodes[1].pid):
            os.kill(pid, signal.SIGKILL)

    return _end(nodes, 180, kill_node_1), logs[0].read_text()


def test_two_nodes_train_as_one_process_and_a_lost_node_is_named(one_process, tmp_path):
    """Two torchrun agents (``--nnodes 2``, a c10d rendezvous on localhost) train the default recipe,
    built on the meta device: the last loss equals one process's, which built it on the CPU; then a
    node killed mid-run (agent and worker) ends the other's job with an error naming the lost pipeline
    rank, within the pipeline timeout."""
    # built on the meta device here: each rank makes its stages with the values one process built
    nodes = _two_nodes(tmp_path / "two", [*_ONE_PROCESS, "data.batch_size=32", "build_on_meta=true"])
    codes = [p.wait(timeout=300) for p in nodes]
    assert codes == [0, 0], [(tmp_path / "two" / f"node{n}.log").read_text()[-3000:] for n in range(2)]
    want = _final_loss(one_process)
    assert abs(_final_loss(tmp_path / "two" / "run") - want) <= 1e-5 * abs(want)

    lost = tmp_path / "lost"
    nodes = _two_nodes(lost, ["trainer.max_steps=100000", "strategy.pipeline_timeout=60"])
    built = _after(lambda: "twobp: " in "".join(p.read_text() for p in lost.glob("node*.log")), 10)  # some steps in
    code, text = _lose_node_1(nodes, lost, built)
    assert code != 0, text[-3000:]
    # named by the pipeline's wait, or by the roll call of this host's processes in a collective over every rank
    by_pipeline = r"pipeline rank [01] \(stage [01], global rank [01], host [^)]+\)"
    by_roll_call = r"global rank [01] \(pipeline rank [01], stage\(s\) [01], host [^)]+\), pid \d+ \(dead\)"
    assert re.search(rf"({by_pipeline}|{by_roll_call}) stopped answering", text), text[-3000:]


class LoseThisNode(pl.Callback):
    """For the workers of node 1 (torchrun's ``GROUP_RANK``): at the start of training step ``step``
    each kills its torchrun agent and itself, so the node is lost whole at a step boundary and the first
    wait of node 0's ranks on it is the step's all-gather of the sharded stages (not a random one)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and os.environ.get("GROUP_RANK") == "1":
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def test_two_sharded_nodes_train_as_one_process_and_a_lost_node_is_named(one_process, tmp_path):
    """pp2 x dp2 with ``data_parallel=shard`` on two torchrun nodes of two processes (node d holds
    replica d, each stage sharded across the nodes), one launch: the validation loss after 5 steps
    equals one process's (each replica reads 16 of the one process's 32 samples a step); at step 7 node
    1 dies whole (agent and workers), and node 0's job ends with an error naming the lost replica."""
    flush = "+logger.csv.flush_logs_every_n_steps=1"  # the validation loss on disk before node 0 fails
    layout = ["strategy.pipeline_degree=2", "strategy.data_parallel=shard", "strategy.pipeline_timeout=60"]
    lose = [f"+callbacks.lose._target_={__name__}.LoseThisNode", "+callbacks.lose.step=7"]
    folder = tmp_path / "sharded"
    steps = [*_ONE_PROCESS[1:], "trainer.max_steps=100000", "data.batch_size=16"]
    nodes = _two_nodes(folder, [*steps, flush, *layout, *lose], 2, pythonpath=str(Path(__file__).parent))
    code = _end(nodes, 300)
    text = (folder / "node0.log").read_text()
    want, got = _first_val_loss(one_process), _first_val_loss(folder / "run")
    assert want is not None and got is not None and abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert code != 0, text[-3000:]
    # node 1 held replica 1: each of node 0's ranks names its peer there, by global rank and host
    assert re.search(r"a data-parallel replica, global rank [23] \(host [^)]+\), stopped answering", text), text[-3000:]
