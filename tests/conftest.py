"""What the tests share: a tiny seeded regressor and its data, Lightning's environment for a rank of
``run_distributed``, a quiet Trainer, and one launch of ranks that runs many tests' cases.

Spawned ranks import this module by name (``conftest``), as they import the test modules: the tests
folder is on their ``sys.path``, as it is on pytest's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp import TwoBPStrategy  # importing the package registers "twobp"
from lightning_twobp.processes import free_port, run_distributed


# ---------------------------------------------------------------------------------------------- model
def mlp(widths: Sequence[int], dropout: float = 0.0) -> nn.Sequential:
    """Linear layers of ``widths`` with a Tanh between each two: (6, 16, 2) is Linear, Tanh, Linear; with
    ``dropout``, a Dropout before each Tanh (Linear, Dropout, Tanh, Linear)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers += [*([nn.Dropout(dropout)] if dropout else []), nn.Tanh()] if i else []
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


class Regressor(pl.LightningModule):
    """An ordinary LightningModule, nothing in it about pipelines: an MLP in one nn.Sequential, seeded,
    an MSE loss logged as train_loss / val_loss (``log=False``: not logged in training), one optimizer;
    ``dropout`` adds a Dropout before each Tanh; ``layers`` builds other layers in place of the MLP."""

    def __init__(
        self,
        widths: Sequence[int] = (6, 16, 16, 2),
        lr: float = 0.1,
        optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
        scale: float = 1.0,
        log: bool = True,
        dropout: float = 0.0,
        layers: Callable[[], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = layers() if layers is not None else mlp(widths, dropout)
        self.lr, self.optimizer, self.scale, self.log_train = lr, optimizer, scale, log

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x * self.scale if self.scale != 1.0 else x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self._forward(x), y)
        if self.log_train:
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self._forward(x), y))

    def predict_step(self, batch, batch_idx):
        return self._forward(batch[0])

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=self.lr)


class AdamRegressor(Regressor):
    """The checkpoint, failure and preemption tests' model: Adam at lr 0.01, the train loss not logged."""

    def __init__(self) -> None:
        super().__init__(optimizer=torch.optim.Adam, lr=0.01, log=False)


def checkpointing_trainer(world: int, max_steps: int, callbacks: list, **kw: Any) -> pl.Trainer:
    """1F1B on ``world`` ranks; Lightning's checkpointing on when ``callbacks`` are given."""
    strategy = TwoBPStrategy(schedule="1f1b")
    return quiet_trainer(
        strategy, world, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(callbacks), **kw
    )


def tiny_llama_config(**kw: Any) -> Any:
    """A Hugging Face LLaMa of 16 wide, untied (``kw`` overrides: vocab_size, num_hidden_layers, ...)."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
    sizes: dict[str, Any] = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    return transformers.LlamaConfig(**(sizes | kw))


def regression_data(
    n: int = 64, d_in: int = 6, d_out: int = 2, batch_size: int = 8, seed: int = 1, scale: float = 1.0, **kw: Any
) -> DataLoader:
    """``n`` random (x, y) pairs from a seeded generator, x drawn first, in batches of ``batch_size``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    x = x * scale if scale != 1.0 else x
    return DataLoader(TensorDataset(x, torch.randn(n, d_out, generator=g)), batch_size=batch_size, **kw)


def own_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights this rank holds: after a pipelined Trainer call the model is whole again, with the
    layers of other pipeline ranks on the meta device (no weights here)."""
    return {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}


# ---------------------------------------------------------------------------------------------- schedules
def cost_strategy(w_half: bool = False):
    """Hypothesis' stage costs: B > W, W > B, (with ``w_half``: W = B/2,) and any with comm > 0."""
    from hypothesis import strategies as st

    from lightning_twobp.schedules import Costs

    half = [st.builds(lambda f, b: Costs(f=f, b=b, w=b / 2), st.floats(0.25, 2.0), st.floats(0.5, 3.0))]
    return st.one_of(
        st.builds(Costs, f=st.just(1.0), b=st.floats(1.0, 3.0), w=st.floats(0.25, 1.0)),  # B > W
        st.builds(Costs, f=st.just(1.0), b=st.floats(0.25, 1.0), w=st.floats(1.0, 3.0)),  # W > B
        *(half if w_half else []),
        st.builds(
            Costs,
            f=st.floats(0.25, 3.0),
            b=st.floats(0.25, 3.0),
            w=st.floats(0.0, 3.0),
            comm=st.sampled_from([0.1, 0.5, 1.0]),
        ),  # comm > 0
    )


# ---------------------------------------------------------------------------------------------- trainer
class Reduces(pl.Callback):
    """How many reduces over the data-parallel replicas the strategy started in the call
    (``ReplicaReduce.started``; None without one)."""

    started: int | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        reduce = trainer.strategy._pipeline.reduce  # type: ignore[attr-defined]
        self.started = reduce.started if reduce is not None else None


def quiet_trainer(strategy: Any = "auto", devices: int = 1, **kw: Any) -> pl.Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar, model summary or DistributedSampler
    (every rank of one pipeline reads the same batches); ``kw`` adds to or overrides these."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    return pl.Trainer(devices=devices, strategy=strategy, **(defaults | kw))


# ---------------------------------------------------------------------------------------------- ranks
def lightning_env(rank: int, world: int) -> None:
    """Lightning's environment for a rank of ``run_distributed``, as torchrun sets it: the processes
    exist already, and so does their process group, at the MASTER_PORT ``run_distributed`` exported."""
    os.environ.update(
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ["MASTER_PORT"],
    )


def _run_cases(rank: int, world: int, cases: dict[str, tuple[Callable, tuple]]) -> dict[str, tuple[str, Any]]:
    """On each rank: every case in turn, in one process group, ranks meeting at a barrier between cases."""
    out: dict[str, tuple[str, Any]] = {}
    for name, (fn, args) in cases.items():
        try:
            out[name] = ("ok", fn(rank, world, *args))
        except BaseException:  # this case's failure, reported to its test; the next cases still run
            out[name] = ("error", traceback.format_exc())
        try:
            dist.barrier()
        except RuntimeError as err:  # a step failed part-way on one rank, which closed the links: stop here
            gone = f"not run: the process group was closed after {name} ({err})"
            out.update({rest: ("error", gone) for rest in cases if rest not in out})
            break
    return out


class Launch:
    """The per-rank results of the cases one launch ran, by test name (``request.node.name``)."""

    def __init__(self, ranks: list[dict[str, tuple[str, Any]]]) -> None:
        self.ranks = ranks

    def __getitem__(self, name: str) -> list[Any]:
        if not self.ranks or name not in self.ranks[0]:
            raise KeyError(f"{name} was not run by this launch")
        errors = [f"--- rank {r} ---\n{res[name][1]}" for r, res in enumerate(self.ranks) if res[name][0] != "ok"]
        if errors:
            raise RuntimeError(f"{name}: a rank failed:\n" + "\n".join(errors))
        return [res[name][1] for res in self.ranks]


def wanted(request: pytest.FixtureRequest) -> set[str]:
    """The names of the tests this session runs in the module of ``request``."""
    return {item.name for item in request.session.items if getattr(item, "module", None) is request.module}


def launch(
    request: pytest.FixtureRequest, world: int, cases: dict[str, tuple[Callable, tuple]], timeout: float
) -> Launch:
    """Run, in one launch of ``world`` ranks, each case ``name: (fn, args)`` whose test this session runs
    (``name`` is the test's ``request.node.name``): ``fn(rank, world, *args)`` on every rank, one case
    after the other. Starting processes and importing torch and Lightning is most of a small test's time
    on a 2-core machine, so tests of the same world size share one start. Cases must leave the process
    group as they found it (an error raised on every rank, before any pipeline step, does)."""
    chosen = {name: case for name, case in cases.items() if name in wanted(request)}
    if not chosen:
        return Launch([])
    return Launch(run_distributed(_run_cases, world, chosen, timeout=timeout))


# ---------------------------------------------------------------------------------------------- order
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``slow`` end-to-end runs last, in their own order (whole modules: a module's shared launch
    starts once): the quick tests report first, and CI, which runs everything, still runs them once."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)


@pytest.fixture
def no_leftover_process_group():
    """For tests that run a Trainer in the test process: Lightning starts a one-rank process group there
    and sets MASTER_PORT, which later tests' subprocesses would inherit (and find the port taken). Undo
    both."""
    env = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


# ---------------------------------------------------------------------------------------------- scripts
_SCRIPT_HEADER = """
import os, signal, sys, time
from pathlib import Path
import lightning.pytorch as pl
sys.path.insert(0, {tests!r})
from conftest import AdamRegressor, regression_data
from lightning_twobp import TwoBPStrategy
"""


def user_script(folder: Path, body: str) -> subprocess.Popen:
    """``python train.py`` as a user starts it (Lightning's launcher starts the other ranks), with this
    checkout first on the path and a free port; ``body`` may use ``{folder!r}``."""
    script = folder / "train.py"
    script.write_text(_SCRIPT_HEADER.format(tests=str(Path(__file__).parent)) + body.format(folder=str(folder)))
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, str(script)], env=env, cwd=folder, stderr=subprocess.PIPE, text=True)
