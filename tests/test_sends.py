"""What a rank has sent is let go of during the step, not at its end (``schedules.memory.send_releases``,
``P2P.release``), and a stage drops its outputs once sent (``Stage.drop_outputs``); exact either way,
also where no gradient flows back over an edge (its messages carry nothing, so they prove nothing and
the sends wait for the step's end). A receive buffer is made at its post and handed to its reader:
the rank keeps none between steps, and during one only those posted ahead of their reader."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.models.llama import LlamaConfig, build_llama
from lightning_twobp.partition import even_sizes, split_sequential
from lightning_twobp.schedules import build_schedule

import conftest
from conftest import launch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

VOCAB, SEQ, MB_SIZE = 32, 8, 2


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _run(rank: int, name: str, stages: int, m: int, frozen: int) -> list[str]:
    """Two steps of ``name`` against one process, the first ``frozen`` layers without gradients; the
    most tensors the rank held for sends and in receive buffers at any action's end, and what it still
    holds after the steps."""
    sched = build_schedule(name, stages, m, stages_per_rank=stages // 2)
    torch.manual_seed(0)
    model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=stages, n_heads=2, max_seq_len=SEQ))
    for layer in list(model)[:frozen]:
        layer.requires_grad_(False)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (m, MB_SIZE, SEQ))
    tgt = torch.randint(0, VOCAB, (m, MB_SIZE, SEQ))
    (sum(loss_fn(ref(ids[i]), tgt[i]) for i in range(m)) / m).backward()
    parts = split_sequential(model, even_sizes(len(model), stages))
    mine = {s: parts[s] for s in sched.stages_of(rank)}
    most = [0, 0]
    box: list[PipelineExecutor] = []

    @contextmanager
    def around(stage: int) -> Iterator[None]:
        yield
        most[0] = max(most[0], len(box[0].outgoing()))
        most[1] = max(most[1], len(box[0].p2p.receive_buffers()))

    ex = PipelineExecutor(sched, mine, loss_fn=loss_fn, around=around)
    box.append(ex)
    for _ in range(2):  # the second step reuses nothing of the first's receives
        ex.step(list(ids) if 0 in mine else None, list(tgt) if stages - 1 in mine else None)
    for q in model.parameters():
        if q.grad is not None:
            q.grad /= 2  # two steps accumulated the same gradient
    failures = [
        f"{n}: grad differs"
        for (n, q), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
        if any(q is p for mod in mine.values() for p in mod.parameters())
        and r.grad is not None
        and (q.grad is None or not torch.allclose(q.grad, r.grad, rtol=1e-5, atol=1e-7))
    ]
    if ex.outgoing():
        failures.append(f"{len(ex.outgoing())} sent tensors outlived the step")
    if ex.p2p.receive_buffers():
        failures.append(f"{len(ex.p2p.receive_buffers())} receive buffers outlived the step")
    return failures + [f"most received {most[1]}", f"most held {most[0]}"]


def _cases(rank: int, world: int) -> dict[str, list[str]]:
    return {
        "1f1b": _run(rank, "1f1b", 2, 8, 0),
        "zb-v": _run(rank, "zb-v", 4, 8, 0),
        # stage 0 (the embedding and the first block) frozen: edge 0 carries no gradients
        "zb-v frozen": _run(rank, "zb-v", 4, 8, 2),
    }


@pytest.fixture(scope="module")
def ran(request) -> conftest.Launch:
    return launch(request, 2, {"test_sends_go_during_the_step": (_cases, ())}, timeout=540)


def test_sends_go_during_the_step(ran):
    results = ran["test_sends_go_during_the_step"]
    for r, per_rank in enumerate(results):
        for case, lines in per_rank.items():
            *failures, received, most = lines
            assert not failures, (r, case, failures)
            # 1F1B posts each receive right before its reader; ZB-V a few ahead (the lowering's
            # rendezvous and posting order: one here), never a step's worth (16 per rank with m = 8)
            assert int(received.split()[-1]) <= (0 if case == "1f1b" else 1), (r, case, received)
            held = int(most.split()[-1])
            if case == "zb-v frozen" and r == 0:
                # stage 0's 8 activations wait for the step's end: no gradient comes back to prove them
                assert held >= 8, (r, case, held)
            else:
                # without the early release a rank holds every send of the step at its end: 8 in
                # 1F1B, 16 in ZB-V (m = 8 per remote direction); here a few at a time
                assert held <= 4, (r, case, held)


class _Work:
    """A posted operation that records how it was waited for."""

    def __init__(self) -> None:
        self.waited: list[tuple] = []

    def wait(self, *timeout) -> bool:
        self.waited.append(timeout)
        return True


def test_a_gpus_receives_wait_on_the_stream_and_a_cpus_are_bounded():
    """On NCCL ``wait(timeout)`` blocks the host, polling every 1-10 ms, so each receive cost a host
    synchronisation and up to a poll interval (a cold review found it; torch.distributed.pipelining waits with
    ``wait()``); on gloo the bound is what names a lost peer. The device alone decides, no GPU needed."""
    from datetime import timedelta

    from lightning_twobp.engine.p2p import P2P

    link = object.__new__(P2P)  # only what _wait reads
    link.timeout = timedelta(seconds=5)
    for device, expected in ((torch.device("cuda", 0), ()), (torch.device("cpu"), (timedelta(seconds=5),))):
        link.device, work = device, _Work()
        link._wait(work, [1], "a test's message")
        assert work.waited == [expected], device
