"""Optimizer post-validation: stepping before the global check is bitwise the same as checking first."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_twobp.engine import PipelineExecutor
from lightning_twobp.engine.post_validation import StepValidation
from lightning_twobp.models.llama import LlamaConfig, build_llama
from lightning_twobp.partition import even_sizes, split_sequential
from lightning_twobp.schedules import build_schedule

import conftest
from conftest import launch


def _single_process_run(overlap: bool, nan_at: int | None, max_norm: float | None, steps: int = 8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    sv = StepValidation(opt, max_norm=max_norm, overlap=overlap)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(5, 6, generator=gen) * (1 + 3 * (i % 3)), torch.randint(0, 3, (5,), generator=gen))
        for i in range(steps)
    ]

    def grads_of(i):
        x, y = batches[i]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if i == nan_at:
            model[2].bias.grad[0] = float("nan")

    redone = _train(steps, grads_of, opt, sv, sched)
    return [q.detach().clone() for q in model.parameters()], sv, redone


def _train(steps: int, grads_of, opt, sv: StepValidation, sched=None) -> int:
    """``steps`` optimizer steps validated by ``sv``; a step that ran on speculative weights is run again.
    Returns how many were."""
    redone = 0
    for i in range(steps):
        grads_of(i)
        v = sv.validate()
        if v is not None and v.redone:  # step i ran on speculative weights: run it again
            redone += 1
            opt.zero_grad(set_to_none=True)
            grads_of(i)
        sv.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    sv.validate()
    return redone


@pytest.mark.parametrize("max_norm, nan_at", [(None, None), (None, 3), (0.5, None), (0.5, 5), (100.0, None)])
def test_speculative_steps_equal_checking_first_bitwise(max_norm, nan_at):
    sync, sv_sync, _ = _single_process_run(False, nan_at, max_norm)
    spec, sv_spec, redone = _single_process_run(True, nan_at, max_norm)
    for a, b in zip(sync, spec, strict=False):
        assert torch.equal(a, b)
    assert sv_sync.skipped_steps == sv_spec.skipped_steps == (0 if nan_at is None else 1)
    if max_norm == 0.5:
        assert redone > 0  # some steps clipped: the speculative ones were redone
    if max_norm in (None, 100.0) and nan_at is None:
        assert redone == 0
    assert all(torch.isfinite(q).all() for q in spec)


class DecaysEveryParameter(torch.optim.SGD):
    """An optimizer of the user's whose step changes parameters without a gradient too (weight decay on all)."""

    @torch.no_grad()
    def step(self, closure=None):
        for q in (q for g in self.param_groups for q in g["params"] if q.grad is None):
            q.mul_(0.9)
        return super().step(closure)


def _frozen_first_layer(optimizer: type, overlap: bool, steps: int = 6) -> tuple[list[torch.Tensor], StepValidation]:
    """A Linear frozen before another (a LoRA's base), both in the optimizer, clipped at 0.05 so that every
    speculative step is put back and redone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model[0].requires_grad_(False)
    opt = optimizer(model.parameters(), lr=0.05, weight_decay=0.1)
    sv = StepValidation(opt, max_norm=0.05, overlap=overlap)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)) for _ in range(steps)]

    def grads_of(i):
        F.cross_entropy(model(batches[i][0]), batches[i][1]).backward()

    assert _train(steps, grads_of, opt, sv) == (steps - 1 if overlap else 0)
    return [q.detach().clone() for q in model.parameters()], sv


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, DecaysEveryParameter])
def test_the_copy_holds_a_frozen_parameter_only_where_the_step_may_change_it(optimizer):
    """torch's optimizers leave a parameter without a gradient as it is, so the copy to put back leaves the
    frozen layer out (before, every frozen weight in the optimizer was copied every step); an optimizer of
    the user's may change it, and the copy holds it: both bitwise equal to checking first."""
    first, _ = _frozen_first_layer(optimizer, overlap=False)
    spec, sv = _frozen_first_layer(optimizer, overlap=True)
    for a, b in zip(first, spec, strict=True):
        assert torch.equal(a, b)
    copied = {tuple(t.shape) for t in sv._params.values()}
    assert len(sv._params) == (2 if optimizer is torch.optim.AdamW else 4), copied
    assert ((6, 6) in copied) == (optimizer is DecaysEveryParameter)


def test_a_step_that_cannot_be_put_back_keeps_no_gradients():
    """Without clipping (``on_nonfinite="stop"``) a speculative step is never redone, so its gradients go with
    zero_grad and are not held through the next pipeline step (they were until stop 58: a copy of every
    gradient); the parameters whose gradient was not finite are still named at the verdict."""
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sv = StepValidation(opt, overlap=True, rollback=False)
    model(torch.randn(4, 3)).sum().backward()
    model[1].bias.grad[0] = float("inf")
    grads = [weakref.ref(q.grad) for q in model.parameters()]
    sv.before_step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(g() is None for g in grads)  # the next pipeline step runs without them
    verdict = sv.validate()
    assert verdict is not None and verdict.nonfinite and not verdict.redone
    assert sv.nonfinite_params == [model[1].bias]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_a_step_that_cannot_be_put_back_names_non_finite_gradients_of_any_dtype(dtype):
    """Review 65: the flags kept instead of the gradients took each gradient's norm in float32, which torch
    refuses for a float64 gradient ("64-true": every step of a zb-v fit raised) or a complex one."""
    w, b = torch.nn.Parameter(torch.ones(3, dtype=dtype)), torch.nn.Parameter(torch.ones(2, dtype=dtype))
    opt = torch.optim.SGD([w, b], lr=0.1)
    sv = StepValidation(opt, overlap=True, rollback=False)
    w.grad, b.grad = torch.ones_like(w), torch.full_like(b, float("inf"))
    sv.before_step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    verdict = sv.validate()
    assert verdict is not None and verdict.nonfinite and sv.nonfinite_params == [b]


def test_gradients_zeroed_in_place_are_refused():
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sv = StepValidation(opt, max_norm=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    sv.before_step()
    opt.step()
    opt.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match="set_to_none=True"):
        sv.validate()


def test_validate_is_required_between_speculative_steps():
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sv = StepValidation(opt)
    model(torch.randn(2, 3)).sum().backward()
    sv.before_step()
    with pytest.raises(RuntimeError, match="call validate"):
        sv.before_step()
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        StepValidation(opt, max_norm=0.0)


VOCAB, SEQ = 32, 8


def _pipeline_run(rank: int, world: int, name: str, overlap: bool, max_norm: float | None, nan_at: int | None):
    spr = 2 if name == "zb-v" else 1
    sched = build_schedule(name, world * spr, 4, stages_per_rank=spr)
    torch.manual_seed(0)
    model = build_llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=2 * world * spr, n_heads=2, max_seq_len=SEQ))
    parts = split_sequential(model, even_sizes(len(model), world * spr))
    mine = {s: parts[s] for s in sched.stages_of(rank)}
    loss_fn = lambda out, y: F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))  # noqa: E731
    ex = PipelineExecutor(sched, mine, loss_fn=loss_fn)
    params = [q for mod in mine.values() for q in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=0.02)
    sv = StepValidation(opt, max_norm=max_norm, overlap=overlap)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, VOCAB, (4, 2, SEQ), generator=gen) for _ in range(6)]
    last = sched.num_stages - 1

    def pipeline(i):
        ids = batches[i]
        ex.step(list(ids) if 0 in mine else None, list(ids) if last in mine else None)
        if i == nan_at and rank == world - 1:
            params[-1].grad.view(-1)[0] = float("inf")

    redone = _train(len(batches), pipeline, opt, sv)
    return [q.detach().clone() for q in params], sv.skipped_steps, redone


def _compare_modes(rank: int, world: int, name: str, max_norm: float | None, nan_at: int | None) -> list[str]:
    sync, skipped_a, _ = _pipeline_run(rank, world, name, False, max_norm, nan_at)
    spec, skipped_b, redone = _pipeline_run(rank, world, name, True, max_norm, nan_at)
    bad = [f"parameter {i} differs" for i, (a, b) in enumerate(zip(sync, spec, strict=False)) if not torch.equal(a, b)]
    if skipped_a != skipped_b or skipped_a != (nan_at is not None):
        bad.append(f"skipped {skipped_a} vs {skipped_b}")
    if nan_at is not None and redone == 0:
        bad.append("the step with an overflow was not redone")
    return bad


PIPELINES = [("zb-h2", 2), ("zb-v", 2)]
CHECKS = [(None, None), (0.3, None), (None, 2), (0.3, 3)]


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, p", PIPELINES)
@pytest.mark.parametrize("max_norm, nan_at", CHECKS)
def test_post_validation_over_a_pipeline_equals_checking_first(two_ranks, request, name, p, max_norm, nan_at):
    # Clipping by the global norm over both ranks, and an inf injected on the last rank only.
    assert two_ranks[request.node.name] == [[]] * p


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    """Every pipeline case, in one launch of 2 ranks: a test's first call may wait for all of them."""
    test = "test_post_validation_over_a_pipeline_equals_checking_first"
    cases = {
        f"{test}[{max_norm}-{nan_at}-{name}-{p}]": (_compare_modes, (name, max_norm, nan_at))
        for max_norm, nan_at in CHECKS
        for name, p in PIPELINES
    }
    assert {p for _, p in PIPELINES} == {2}
    return launch(request, 2, cases, timeout=840)


def test_clipping_that_starts_after_the_first_step_is_redone_not_dropped():
    """Review 63: rollback was decided at the first optimizer step only: clipping that began later
    (configure_gradient_clipping clipping from global step 1 on) found no copy to put back, and validate()
    let the unclipped speculative step stand (a 2-rank zb-h2 fit 16x off one process's weights)."""
    from lightning_twobp.lightning.optimizer_checks import OptimizerChecks
    from lightning_twobp.options import PipelineOptions

    q = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([q], lr=1.0)
    checks = OptimizerChecks(
        PipelineOptions(schedule="zb-h2"), None, torch.device("cpu"), lambda r: [r], 0, frozenset()
    )
    g1, g2 = torch.full((4,), 0.01), torch.full((4,), 10.0)
    q.grad = g1.clone()
    checks.before_step(None, opt, None, [])  # no clipping at the first step
    opt.step()
    q.grad = g2.clone()
    checks.validate(None)
    checks.clip_by_norm(opt, 0.05)  # clipping from the second step on
    checks.before_step(None, opt, None, [])
    opt.step()
    verdict = checks.validate(None)
    assert verdict is not None and verdict.clipped and verdict.redone
    expected = -g1 - g2 * (0.05 / (float(g2.norm()) + 1e-6))
    torch.testing.assert_close(q.detach(), expected, rtol=1e-6, atol=1e-7)
