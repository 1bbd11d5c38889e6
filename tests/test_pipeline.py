"""Every schedule, run for real on gloo processes, against one process with the same micro-batching.

For each schedule and pipeline degree p in {2, 4}: micro-batch counts {1 where allowed, p, 2p, an odd
count}, stages per rank {1, 2} where the schedule allows, split and fused backward, and at 2p the split
fused where it loses at costs that price BW below B + W (schedules.fusion: some micro-batches' backward
as one BW, the others split, on one stage). The mean loss and every
parameter gradient must equal the single-process reference (fp32, rtol 1e-5), and so must a forward-only
pass (evaluation) on the same layout. One process group per
(schedule, p) runs all of its configurations, to keep process start-up out of the CI budget.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.engine import p2p as p2p_module
from lightning_twobp.models.llama import LlamaConfig, build_llama
from lightning_twobp.partition import even_sizes, split_sequential
from lightning_twobp.processes import run_distributed
from lightning_twobp.schedules import Costs, Schedule, build_schedule, schedule_spec
from lightning_twobp.schedules.fusion import fuse_where_split_loses, num_fused

import conftest
from conftest import launch

# The cases that end well share one launch per world size (the fixture at the end): a test's first call
# may wait for the whole launch. The cases that fail on purpose have launches of their own.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

VOCAB, SEQ, MB_SIZE = 32, 8, 2


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def configs(name: str, p: int) -> list[tuple[int, int, bool | str]]:
    """(stages per rank, micro-batches, split) that the schedule allows for p ranks; split "mixed": the split
    schedule fused where it loses (:func:`_mixed`)."""
    odd = 3 if p == 2 else 5
    ms = [1, p, 2 * p, odd]
    splits = [True] if schedule_spec(name).split_only else [True, False]
    out = []
    for split in splits:
        if name in ("1f1b", "zb-h1", "zb-h2"):
            out += [(1, m, split) for m in ms]
        elif name == "gpipe":
            out += [(spr, m, split) for spr in (1, 2) for m in ms]
        elif name == "interleaved-1f1b":
            out += [(1, m, split) for m in (1, odd)] + [(2, m, split) for m in (p, 2 * p, 3 * p)]
        elif name in ("zb-v", "v-half", "v-min"):
            out += [(2, m, split) for m in ms]
    spr = 2 if name in ("zb-v", "v-half", "v-min", "interleaved-1f1b") else 1
    return out + [(spr, 2 * p, "mixed")]


# BW at 0.9 of B + W: the fusion pass fuses some backwards of every schedule and keeps others split (ZB-H1
# at p = 4: 11 of 32 fused; GPipe and 1F1B at p = 4 keep joined W of fewer micro-batches, 3W0+1+2; at p = 2
# they fuse every backward)
MIXED_COSTS = Costs(f=1.0, b=1.0, w=1.0, bw=1.8)


def _mixed(name: str, num_stages: int, m: int, spr: int) -> Schedule:
    sched = build_schedule(name, num_stages, m, stages_per_rank=spr, costs=MIXED_COSTS)
    overlaps = schedule_spec(name).overlaps
    fused = fuse_where_split_loses(sched, MIXED_COSTS, (lambda r: r.period) if overlaps else None, 1 + overlaps)
    assert num_fused(fused) > 0, str(fused)
    return fused


def _check_schedule(rank: int, world: int, name: str) -> list[str]:
    failures = []
    for spr, m, split in configs(name, world):
        num_stages = world * spr
        if split == "mixed":
            sched = _mixed(name, num_stages, m, spr)
        else:
            sched = build_schedule(name, num_stages, m, stages_per_rank=spr, split_backward=bool(split))
        torch.manual_seed(0)
        model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=num_stages, n_heads=2, max_seq_len=SEQ))
        ref = copy.deepcopy(model)
        ids = torch.randint(0, VOCAB, (m, MB_SIZE, SEQ))
        tgt = torch.randint(0, VOCAB, (m, MB_SIZE, SEQ))
        ref_loss = sum(loss_fn(ref(ids[i]), tgt[i]) for i in range(m)) / m
        ref_loss.backward()

        parts = split_sequential(model, even_sizes(len(model), num_stages))
        mine = {s: parts[s] for s in sched.stages_of(rank)}
        ex = PipelineExecutor(sched, mine, loss_fn=loss_fn)
        res = ex.step(list(ids) if 0 in mine else None, list(tgt) if num_stages - 1 in mine else None)

        tag = f"{name} p={world} stages/rank={spr} m={m} split={split}"
        if num_stages - 1 in mine and not torch.allclose(res.loss, ref_loss.detach(), rtol=1e-5, atol=0):
            failures.append(f"{tag}: loss {res.loss.item()} != {ref_loss.item()}")
        owned = {id(q) for mod in mine.values() for q in mod.parameters()}
        checked = 0
        for (n, q), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=False):
            if id(q) not in owned:
                continue
            checked += 1
            if q.grad is None or not torch.allclose(q.grad, r.grad, rtol=1e-5, atol=1e-7):
                diff = "missing" if q.grad is None else f"max diff {(q.grad - r.grad).abs().max().item():.3g}"
                failures.append(f"{tag}: grad of {n} {diff}")
        if checked == 0:
            failures.append(f"{tag}: rank {rank} checked no parameters")
        if any(st.in_flight for st in ex.stages.values()):
            failures.append(f"{tag}: micro-batches still in flight after the step")
        # evaluation on the same layout: stage-major order deadlocked where stages alternate between ranks;
        # the last micro-batch smaller (a last batch), its shapes sent ahead of it
        evaluated = [*ids[:-1], ids[-1][:1]]
        outs = ex.forward_only(evaluated if 0 in mine else None, m)
        if num_stages - 1 in mine:
            with torch.no_grad():
                expected = [ref(x) for x in evaluated]
            if outs is None or len(outs) != m:
                failures.append(f"{tag}: forward-only returned {outs if outs is None else len(outs)} outputs")
            elif not all(torch.allclose(o, e, rtol=1e-5, atol=1e-6) for o, e in zip(outs, expected, strict=True)):
                failures.append(f"{tag}: forward-only outputs differ from one process's")
    return failures


NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min"]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_schedule_matches_single_process(launches, request, name, p):
    results = launches[p][request.node.name]
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)


def _second_step_and_record(rank: int, world: int) -> dict:
    """Two steps in a row reuse the exchanged shapes; record=True gives one record per op."""
    sched = build_schedule("1f1b", world, 4)
    torch.manual_seed(0)
    model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, max_seq_len=SEQ))
    parts = split_sequential(model, even_sizes(len(model), world))
    ex = PipelineExecutor(sched, {rank: parts[rank]}, loss_fn=loss_fn, record=True)
    ids = torch.randint(0, VOCAB, (4, MB_SIZE, SEQ))
    losses = []
    for _ in range(2):
        res = ex.step(list(ids) if rank == 0 else None, list(ids) if rank == world - 1 else None)
        losses.append(None if res.loss is None else res.loss.item())
    return {
        "records": len(res.records),
        "ops": len(ex.ops),
        "held": sorted(res.held_bytes.values()),
        "monotone": all(r.end >= r.start for r in res.records),
        "losses": losses,
    }


def test_repeated_steps_and_recording(launches, request):
    out = launches[2][request.node.name]
    for r in out:
        assert r["records"] > 0 and r["monotone"]
        assert len(r["held"]) == 4 and min(r["held"]) > 0
    # no optimizer step between them: the second step sees the same weights and data
    assert out[1]["losses"][0] == out[1]["losses"][1]


class _Boom(torch.nn.Module):
    def forward(self, x):
        if x.shape[0] == MB_SIZE and getattr(self, "armed", 0):
            raise ValueError("boom")
        return x


def _failing(rank: int, world: int) -> None:
    sched = build_schedule("1f1b", world, 2)
    model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, max_seq_len=SEQ))
    boom = _Boom()
    stages = [model[:2], torch.nn.Sequential(boom, model[2])]
    ex = PipelineExecutor(sched, {rank: stages[rank]}, loss_fn=loss_fn)
    ids = torch.randint(0, VOCAB, (2, MB_SIZE, SEQ))
    boom.armed = 1
    ex.step(list(ids) if rank == 0 else None, list(ids) if rank == 1 else None)


def test_failure_names_rank_step_and_action():
    with pytest.raises(RuntimeError) as info:
        run_distributed(_failing, 2, timeout=60)
    msg = str(info.value)
    assert "rank 1, step 0, op 1 (1F0)" in msg and "boom" in msg and "ERROR HERE" in msg


class _RunningMean(torch.nn.Module):
    """Subtracts a running mean of its inputs kept by rebinding its buffer (``self.mean = ...``, not written in
    place) and counts its calls in a Python attribute: the probe's update of either used to stay."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
            self.calls += 1
        return x - self.mean


class _OwnDraw(torch.nn.Module):
    """Drops features with a mask drawn from a generator of its own (torchtune's LayerDropout keeps one per
    layer), which forking torch's global generators does not cover: the probe's draw used to stay."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, x):
        return x * (torch.rand(x.shape[-1], generator=self.generator) > 0.3)


def _batchnorm(rank: int, world: int) -> list[str]:
    """BatchNorm statistics after a step equal one process's: the shape exchange leaves no trace (nor in a
    buffer a layer rebinds, nor in a Python attribute it counts with, nor in a module's own generator)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        _RunningMean(16),  # of the ReLU's output: a BatchNorm's has mean 0
        _OwnDraw(),
        torch.nn.Linear(16, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.Linear(16, 4),
    )
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 6, 8), torch.randint(0, 4, (4, 6))
    (sum(F.cross_entropy(ref(x[i]), y[i]) for i in range(4)) / 4).backward()
    sched = build_schedule("zb-h1", world, 4)
    parts = split_sequential(model, [5, 3])
    ex = PipelineExecutor(sched, {rank: parts[rank]}, loss_fn=F.cross_entropy)
    ex.step(list(x) if rank == 0 else None, list(y) if rank == 1 else None)
    bad = [] if model[3].calls == (4 if rank == 0 else 0) else [f"{model[3].calls} calls of the running mean"]
    if rank == 0 and not torch.equal(model[4].generator.get_state(), ref[4].generator.get_state()):
        bad.append("the module's own generator drew more than one process's")
    mine = {id(b) for b in parts[rank].buffers()}
    for (n, a), (_, b) in zip(model.named_buffers(), ref.named_buffers(), strict=False):
        if id(a) in mine and not torch.allclose(a.float(), b.float(), rtol=1e-5):
            bad.append(f"buffer {n} differs")
    if len(mine) < 2:
        bad.append("no buffers checked")
    owned = {id(q) for q in parts[rank].parameters()}
    for (n, q), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=False):
        if id(q) in owned and not torch.allclose(q.grad, r.grad, rtol=1e-5, atol=1e-7):
            bad.append(f"grad {n} differs")
    return bad


def test_batchnorm_statistics_match_single_process(launches, request):
    assert launches[2][request.node.name] == [[], []]


class _FailsOnCall(torch.nn.Module):
    """Raises on its ``at``-th call (1 = the shape exchange's probe, 2 = the first real F). It counts in a list:
    the probe puts a plain attribute back (``self.calls += 1`` would count the first real F as call 1 again)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, [0]

    def forward(self, x):
        self.calls[0] += 1
        if self.calls[0] == self.at:
            raise ValueError("boom")
        return x


def _failing_first_stage(rank: int, world: int, at: int) -> None:
    sched = build_schedule("1f1b", world, 2)
    model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, max_seq_len=SEQ))
    stages = [torch.nn.Sequential(model[0], _FailsOnCall(at)), model[1:]]
    ex = PipelineExecutor(sched, {rank: stages[rank]}, loss_fn=loss_fn)
    ids = torch.randint(0, VOCAB, (2, MB_SIZE, SEQ))
    ex.step(list(ids) if rank == 0 else None, list(ids) if rank == 1 else None)


@pytest.mark.parametrize("at, where", [(1, "rank 0, step 0, shape exchange"), (2, "rank 0, step 0, op 0 (0F0)")])
def test_failure_on_a_first_stage_is_named(at, where):
    with pytest.raises(RuntimeError) as info:
        run_distributed(_failing_first_stage, 2, at, timeout=60)
    assert where in str(info.value) and "boom" in str(info.value)


def _grads_match(model, ref, owned) -> list[str]:
    bad = []
    for (n, q), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=False):
        if id(q) in owned and (q.grad is None or not torch.allclose(q.grad, r.grad, rtol=1e-5, atol=1e-7)):
            bad.append(f"grad of {n} differs")
    return bad


def _steps_without_collectives(rank: int, world: int, name: str) -> list[str]:
    """After the first step no collective runs: back-to-back steps may overlap, and a change of the
    first stage's input shapes (another sequence length) is agreed on by a message, not a collective."""
    spr = 2 if name == "zb-v" else 1
    sched = build_schedule(name, world * spr, 4, stages_per_rank=spr)
    torch.manual_seed(0)
    model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=2 * world * spr, n_heads=2, max_seq_len=2 * SEQ))
    ref = copy.deepcopy(model)
    parts = split_sequential(model, even_sizes(len(model), world * spr))
    mine = {s: parts[s] for s in sched.stages_of(rank)}
    ex = PipelineExecutor(sched, mine, loss_fn=loss_fn)
    last = sched.num_stages - 1

    def step(ids):
        return ex.step(list(ids) if 0 in mine else None, list(ids) if last in mine else None)

    step(torch.randint(0, VOCAB, (4, MB_SIZE, SEQ)))
    import torch.distributed as dist

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective ran inside a pipeline step")

    names = ("all_gather_object", "broadcast_object_list", "all_reduce", "all_gather", "barrier", "broadcast")
    saved = {fn: getattr(dist, fn) for fn in names}
    for fn in names:
        setattr(dist, fn, forbidden)
    batches = [torch.randint(0, VOCAB, (4, MB_SIZE, t)) for t in (SEQ, SEQ, 2 * SEQ, 2 * SEQ, SEQ)]
    model.zero_grad(set_to_none=True)
    try:
        for ids in batches:
            step(ids)
    finally:  # the next case of the launch may use them
        for fn, original in saved.items():
            setattr(dist, fn, original)
    for ids in batches:
        for i in range(4):
            (loss_fn(ref(ids[i]), ids[i]) / 4).backward()
    return _grads_match(model, ref, {id(q) for mod in mine.values() for q in mod.parameters()})


BACK_TO_BACK = [("1f1b", 2), ("zb-h2", 4), ("zb-v", 2)]


@pytest.mark.parametrize("name, p", BACK_TO_BACK)
def test_steps_run_back_to_back_without_collectives_and_follow_shape_changes(launches, request, name, p):
    assert launches[p][request.node.name] == [[]] * p


class _Widens(torch.nn.Module):
    """Returns float64 once ``widen`` is set: a change on one rank that no signature covers."""

    widen = False

    def forward(self, x):
        return x.double() if self.widen else x


class _ToFloat(torch.nn.Module):
    def forward(self, x):
        return x.float()


def _local_change(rank: int, world: int, reset: bool) -> list[str]:
    sched = build_schedule("1f1b", world, 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Widens(), _ToFloat(), torch.nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    parts = [model[:2], model[2:]]
    ex = PipelineExecutor(sched, {rank: parts[rank]}, loss_fn=F.cross_entropy)
    x, y = torch.randn(2, 3, 8), torch.randint(0, 4, (2, 3))
    ex.step(list(x) if rank == 0 else None, list(y) if rank == 1 else None)
    model[1].widen = ref[1].widen = True
    if reset:
        ex.reset_shapes()
    model.zero_grad(set_to_none=True)
    ex.step(list(x) if rank == 0 else None, list(y) if rank == 1 else None)
    (sum(F.cross_entropy(ref(x[i]), y[i]) for i in range(2)) / 2).backward()
    return _grads_match(model, ref, {id(q) for q in parts[rank].parameters()})


def test_a_change_on_one_rank_is_refused_by_name_or_followed_after_reset_shapes():
    with pytest.raises(RuntimeError) as info:
        run_distributed(_local_change, 2, False, timeout=60)
    msg = str(info.value)
    assert "the output stage 0 sends for micro-batch 0 changed" in msg and "float64" in msg
    assert "reset_shapes() on every rank" in msg
    assert run_distributed(_local_change, 2, True, timeout=60) == [[], []]


class _Vanishes(torch.nn.Module):
    """Sends its own process ``sig`` (SIGKILL: it dies; SIGSTOP: it hangs) on its ``at``-th call."""

    def __init__(self, sig: int, at: int) -> None:
        super().__init__()
        self.sig, self.at, self.calls = sig, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            import os

            os.kill(os.getpid(), self.sig)
        return x


def _lost_rank(rank: int, world: int, sig: int, victim: int) -> None:
    sched = build_schedule("zb-h1", world, 4)
    torch.manual_seed(0)
    model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=world, n_heads=2, max_seq_len=SEQ))
    parts = split_sequential(model, even_sizes(len(model), world))
    stage = parts[rank]
    if rank == victim:  # calls: 1 = the probe of step 0, then 4 forwards per step: dies in step 2
        stage = torch.nn.Sequential(_Vanishes(sig, at=1 + 4 * 2 + 2), *stage)
    ex = PipelineExecutor(sched, {rank: stage}, loss_fn=loss_fn, timeout=3)
    ids = torch.randint(0, VOCAB, (4, MB_SIZE, SEQ))
    for _ in range(4):
        ex.step(list(ids) if rank == 0 else None, list(ids) if rank == world - 1 else None)


@pytest.mark.parametrize("p, victim", [(2, 1), (4, 2)])
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_killed_or_hung_rank_is_named_by_the_survivors(p, victim, how):
    import signal

    with pytest.raises(RuntimeError) as info:
        run_distributed(_lost_rank, p, getattr(signal, how), victim, timeout=60)
    msg = str(info.value)
    assert f"rank {victim} died without a report" in msg or how == "SIGSTOP"
    named = f"pipeline rank {victim} (stage {victim}, global rank {victim}, host "
    assert named in msg and "stopped answering" in msg, msg[-3000:]
    assert ("its connection closed: the process died" in msg) if how == "SIGKILL" else ("nothing came for 3 s" in msg)
    assert "step 2" in msg


@pytest.fixture(scope="module")
def launches(request) -> dict[int, conftest.Launch]:
    """The cases that end well, in one launch per world size (2 and 4)."""
    cases: dict[int, dict] = {2: {}, 4: {}}
    for p in (2, 4):
        cases[p] |= {f"test_schedule_matches_single_process[{n}-{p}]": (_check_schedule, (n,)) for n in NAMES}
    cases[2]["test_repeated_steps_and_recording"] = (_second_step_and_record, ())
    cases[2]["test_batchnorm_statistics_match_single_process"] = (_batchnorm, ())
    for name, p in BACK_TO_BACK:
        test = "test_steps_run_back_to_back_without_collectives_and_follow_shape_changes"
        cases[p][f"{test}[{name}-{p}]"] = (_steps_without_collectives, (name,))
    return {p: launch(request, p, c, timeout=840) for p, c in cases.items()}


def test_evaluations_header_says_each_tensors_dtype_and_shape_or_hands_over_to_an_object():
    """forward_only's messages: a fixed-size header, then the tensors as they are; what the header cannot
    say (a non-tensor, an unknown dtype, more than it holds) goes as an object after a header saying so."""
    values = (torch.zeros(3, 4, 5), torch.ones((), dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bool))
    header = p2p_module._header(values, "gloo")
    assert header is not None and header.shape == (p2p_module._HEADER,)
    assert p2p_module._read_header(header) == [(t.dtype, tuple(t.shape), tuple(range(t.dim()))) for t in values]
    # a dense tensor with permuted strides (an LSTM's batch-first output) travels in its memory order, with it
    lstm_like = torch.zeros(12, 2, 5).transpose(0, 1)
    assert p2p_module._read_header(p2p_module._header((lstm_like,), "gloo")) == [(torch.float32, (12, 2, 5), (1, 0, 2))]
    assert p2p_module._header((torch.zeros(2), None), "gloo") is None
    assert p2p_module._header((torch.zeros(2, dtype=torch.float8_e4m3fn),), "gloo") is None
    assert p2p_module._header(tuple(torch.zeros(1, 1) for _ in range(64)), "gloo") is None  # 1 + 64 * 6 words
    # NCCL cannot send int16 or complex tensors: those go as an object, through the host
    for dtype in (torch.int16, torch.complex64):
        assert p2p_module._header((torch.zeros(2, dtype=dtype),), "gloo") is not None
        assert p2p_module._header((torch.zeros(2, dtype=dtype),), "nccl") is None
    assert p2p_module._header(values, "nccl") is not None

    assert p2p_module._read_header(torch.full((p2p_module._HEADER,), -1)) is None
