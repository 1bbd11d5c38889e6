"""The 2BP paper's four models: paper sizes on meta, the Sequential contract, and 2-process pipelined
fits (``Trainer(strategy=TwoBPStrategy(...))``) against one process."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning.contract import find_sequential
from lightning_twobp.models import BertMLM, LlamaLM, MambaLM, PipelineModule, ResNetClassifier
from lightning_twobp.models.base import WarmupThenDecay
from lightning_twobp.models.mamba import selective_scan
from lightning_twobp.processes import run_distributed

from conftest import lightning_env, quiet_trainer

# ---------------------------------------------------------------------------------------- paper sizes
# Expected counts by hand (V vocab, d width, L layers, F ffn hidden):
#   LLaMa-7b: 2Vd (embedding, untied head) + L(4d^2 + 3dF + 2d) + d = 6,738,415,616, as Meta's LLaMa-7B.
#   BERT-Large MLM: HF's BertForMaskedLM (tied, no pooler) holds 335,174,458; ours has no token-type
#     embedding (-2d = -2,048) and an untied decoder (+Vd = +31,254,528): 366,426,938.
#   Mamba-1.4B (V = 50288, the checkpoint's padded vocabulary): Vd + L(26,441,728) + d = 1,372,194,816 as
#     the tied reference; the untied head adds Vd = 102,989,824: 1,475,184,640.
#   ResNet-152 / -50: torchvision's 60,192,808 / 25,557,032 (same layout, counted by hand).
PAPER = {
    "llama-7b": (
        LlamaLM,
        dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_hidden=11008, max_seq_len=1024),
        6_738_415_616,
        (1, 1024),
        (1, 1024, 32000),
    ),
    "bert-large": (
        BertMLM,
        dict(vocab_size=30522, dim=1024, n_layers=24, n_heads=16, ffn_hidden=4096, max_seq_len=512),
        335_174_458 - 2 * 1024 + 30522 * 1024,
        (1, 512),
        (1, 512, 30522),
    ),
    # max_seq_len only sizes sample_input; 128 keeps the meta forward of 48 scans short
    "mamba-1.4b": (
        MambaLM,
        dict(vocab_size=50288, dim=2048, n_layers=48, max_seq_len=128),
        1_372_194_816 + 50288 * 2048,
        (1, 128),
        (1, 128, 50288),
    ),
    "resnet-152": (ResNetClassifier, dict(depth=152), 60_192_808, (1, 3, 224, 224), (1, 1000)),
    "resnet-50": (ResNetClassifier, dict(depth=50), 25_557_032, (1, 3, 224, 224), (1, 1000)),
}


@pytest.mark.parametrize("name", list(PAPER))
def test_paper_size_on_meta(name):
    cls, kwargs, expected, in_shape, out_shape = PAPER[name]
    with torch.device("meta"):
        model = cls(**kwargs)
    count = sum(q.numel() for q in model.parameters())
    assert count == expected, f"{name}: {count:,} parameters, expected {expected:,}"
    x = model.sample_input(1)
    assert x.is_meta and tuple(x.shape) == in_shape
    assert tuple(model.layers(x).shape) == out_shape


def test_paper_sizes_in_the_papers_ranges():
    counts = {}
    for name in ("llama-7b", "bert-large", "mamba-1.4b", "resnet-152"):
        cls, kwargs, *_ = PAPER[name]
        with torch.device("meta"):
            counts[name] = sum(q.numel() for q in cls(**kwargs).parameters())
    assert 6.6e9 < counts["llama-7b"] < 6.8e9
    d = 1024
    assert 3.3e8 < counts["bert-large"] - 30522 * d < 3.45e8, "BERT-Large less the untied decoder is ~335M"
    assert 1.36e9 < counts["mamba-1.4b"] - 50288 * 2048 < 1.38e9, "Mamba-1.4B less the untied head is ~1.37B"
    with torch.device("meta"):
        assert len(ResNetClassifier(depth=152).layers) == 1 + 50 + 1  # stem, 3 + 8 + 36 + 3 blocks, head


# ---------------------------------------------------------------------------------------- tiny models
TINY = {
    "llama": (LlamaLM, dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)),
    "bert": (BertMLM, dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=16)),
    "mamba": (MambaLM, dict(vocab_size=64, dim=32, n_layers=2, d_state=8, max_seq_len=16, scan_chunk=4)),
    "resnet-batchnorm": (ResNetClassifier, dict(depth="tiny", width=8, image_size=64, num_classes=10, norm="batch")),
    "resnet-groupnorm": (ResNetClassifier, dict(depth="tiny", width=8, image_size=64, num_classes=10, norm="group")),
    # the same BatchNorm model, its blocks checkpointed: B's recompute must not count a micro-batch twice
    "resnet-batchnorm-ac": (ResNetClassifier, dict(depth="tiny", width=8, image_size=64, num_classes=10, norm="batch")),
}


@pytest.mark.parametrize("name", list(TINY))
def test_every_layer_maps_one_tensor_to_one_tensor(name):
    cls, kwargs = TINY[name]
    model = cls(**kwargs).eval()
    assert find_sequential(model) == ("layers", model.layers), "the metrics must not count as a second Sequential"
    x = model.sample_input(2)
    full = model.layers(x)
    for layer in model.layers:  # so any contiguous slice is a stage
        x = layer(x)
        assert isinstance(x, torch.Tensor)
    torch.testing.assert_close(x, full)
    with torch.device("meta"):
        meta = cls(**kwargs)
    assert meta.layers(meta.sample_input(3)).shape == (3, *full.shape[1:])
    same = cls(**kwargs)  # the seed: every process builds the same weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=False))


def test_selective_scan_chunks_match_the_recurrence():
    g = torch.Generator().manual_seed(0)
    b, length, d, n = 2, 13, 5, 3
    kw = dict(generator=g, dtype=torch.float64)
    u, delta = torch.randn(b, length, d, **kw), torch.rand(b, length, d, **kw)
    A = -3 * torch.rand(d, n, **kw)
    B, C = torch.randn(b, length, n, **kw), torch.randn(b, length, n, **kw)
    D = torch.randn(d, **kw)
    h, ys = torch.zeros(b, d, n, dtype=torch.float64), []
    for t in range(length):  # h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t; y_t = C_t h_t + D u_t
        h = torch.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1))
    ref = torch.stack(ys, 1) + u * D
    for chunk in (1, 4, 16):  # 13 steps: a short last chunk, and one chunk longer than the sequence
        torch.testing.assert_close(selective_scan(u, delta, A, B, C, D, chunk), ref, rtol=1e-12, atol=1e-12)


def test_adamw_groups_and_lr_schedule():
    model = MambaLM(vocab_size=16, dim=8, n_layers=1, lr=0.1, weight_decay=0.1)
    opt = model.configure_optimizers()["optimizer"]
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.95)
    decayed = {id(q) for q in opt.param_groups[0]["params"]}
    mixer = model.layers[1].mixer
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    assert id(mixer.in_proj.weight) in decayed and not decayed & {id(mixer.A_log), id(mixer.D), id(mixer.dt_proj.bias)}
    warm = WarmupThenDecay(warmup_steps=4, total_steps=14, decay="cosine")
    assert [warm(s) for s in (0, 3)] == [0.25, 1.0]
    assert warm(9) == pytest.approx(0.55) and warm(14) == pytest.approx(0.1) and warm(100) == pytest.approx(0.1)
    assert WarmupThenDecay(0, 0, "constant")(7) == 1.0
    with pytest.raises(ValueError, match="lr_decay='linear'"):
        LlamaLM(vocab_size=16, dim=8, n_layers=1, n_heads=2, lr_decay="linear")


def test_fit_with_warmup_and_cosine_steps_the_schedule():
    model = LlamaLM(
        vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=16, lr=0.01, warmup_steps=2, lr_decay="cosine"
    )
    trainer = _trainer("auto", 1, max_steps=3)
    trainer.fit(model, _data("llama", BATCH))
    # LambdaLR steps after every optimizer step: the lr now is the one step 3 would use
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * WarmupThenDecay(2, 3, "cosine")(3))


# ---------------------------------------------------------------------------------------- pipelined fits
BATCH, STEPS, LR = 8, 2, 0.05
# (strategy kwargs) per tiny model: a spread of schedules, 2BP everywhere (zb-* are split by definition)
PIPELINE = {
    "llama": dict(schedule="zb-h1", num_microbatches=4),
    "bert": dict(schedule="1f1b"),  # 2 * pipeline_degree = 4 micro-batches
    "mamba": dict(schedule="zb-v", num_microbatches=2),  # 4 stages of one layer each, in a V
    "resnet-batchnorm": dict(schedule="1f1b", num_microbatches=2),
    "resnet-groupnorm": dict(schedule="zb-h1", num_microbatches=4),
    "resnet-batchnorm-ac": dict(schedule="zb-h1", num_microbatches=2, activation_checkpointing="full"),
}


def _data(name: str, batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    n = BATCH * STEPS
    if name.startswith("resnet"):
        x, y = torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
    elif name == "bert":
        # Exactly 4 masked tokens per sequence: every micro-batch's mean then weighs tokens as the
        # whole batch's mean does (see BertMLM), so the pipeline and one process agree exactly.
        x = torch.randint(1, 64, (n, 16), generator=g)
        pos = torch.rand(n, 16, generator=g).argsort(dim=1)[:, :4]
        y = torch.full_like(x, -100).scatter(1, pos, x.gather(1, pos))
        x = x.scatter(1, pos, 0)  # token 0 is [MASK]
    else:
        tokens = torch.randint(0, 64, (n, 17), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _model(name: str) -> PipelineModule:
    cls, kwargs = TINY[name]
    model = cls(**kwargs)
    # SGD, not the models' AdamW: Adam's first step is lr * sign(grad), so a gradient within rounding
    # of zero could flip an update by 2 lr; SGD keeps the comparison at rounding level.
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=LR)
    return model


def _trainer(strategy, devices: int, **kw) -> pl.Trainer:
    return quiet_trainer(strategy, devices, max_steps=kw.pop("max_steps", STEPS), **kw)


def _results(model: PipelineModule, trainer: pl.Trainer, name: str) -> dict:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # validation_step after training: the pipeline forward-only, BatchNorm on its running statistics
    metrics.update(trainer.validate(model, _data(name, BATCH), verbose=False)[0])
    # After a pipelined Trainer call the model is whole, the other ranks' layers on the meta device:
    # what this rank trained is what is not on meta.
    return {
        "params": {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta},
        # BatchNorm's running statistics and batch counts (the only buffers that training changes)
        "buffers": {
            n: b.clone() for n, b in model.named_buffers() if ("running_" in n or "num_batches" in n) and not b.is_meta
        },
        "metrics": metrics,
    }


def _fit_all_pipelined(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for name in TINY:  # one spawn for every model: starting processes is the slow part on 2 cores
        model = _model(name)
        trainer = _trainer(TwoBPStrategy(**PIPELINE[name]), world)
        trainer.fit(model, _data(name, BATCH))
        out[name] = _results(model, trainer, name)
    return out


@pytest.fixture(scope="module")
def pipelined() -> list[dict]:
    return run_distributed(_fit_all_pipelined, 2, timeout=180)


def _reference(name: str) -> tuple[dict, dict]:
    # One intra-op thread, as every rank of run_distributed has: CPU kernels split their reductions by
    # thread, and the tiny ResNets' norms (few values per group) amplify such rounding differences.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit_reference(name)
    finally:
        torch.set_num_threads(threads)


def _fit_reference(name: str) -> tuple[dict, dict]:
    model = _model(name)
    initial = {n: q.detach().clone() for n, q in model.named_parameters()}
    if name.startswith("resnet-batchnorm"):
        # BatchNorm sees one micro-batch at a time: the reference is batch = micro-batch with the
        # gradients of m of them accumulated into each of the STEPS optimizer steps.
        m = PIPELINE[name]["num_microbatches"]
        trainer = _trainer("auto", 1, accumulate_grad_batches=m)
        trainer.fit(model, _data(name, BATCH // m))
    else:
        trainer = _trainer("auto", 1)
        trainer.fit(model, _data(name, BATCH))
    return _results(model, trainer, name), initial


@pytest.mark.dist
@pytest.mark.parametrize("name", list(TINY))
def test_pipelined_fit_matches_one_process(pipelined, name):
    ref, initial = _reference(name)
    assert all(not torch.equal(ref["params"][n], initial[n]) for n in initial), "every parameter must train"
    seen = set()
    for rank, out in enumerate(pipelined):
        got = out[name]
        for n, value in got["params"].items():
            seen.add(n)
            torch.testing.assert_close(value, ref["params"][n], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {n}")
        for n, value in got["buffers"].items():
            torch.testing.assert_close(value, ref["buffers"][n], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {n}")
        # train_*: the step's mean over micro-batches (the BatchNorm reference logs per micro-batch)
        keys = ("val_loss", "val_acc") + (() if name.startswith("resnet-batchnorm") else ("train_loss", "train_acc"))
        for key in keys:
            if key in ref["metrics"]:
                assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5), f"rank {rank} {key}"
    assert seen == set(ref["params"]), "every parameter lives on exactly one rank"
    if name.startswith("resnet-batchnorm"):
        assert sum(len(out[name]["buffers"]) for out in pipelined) == len(ref["buffers"]) > 0
    assert math.isfinite(pipelined[0][name]["metrics"]["train_loss"]) and "val_loss" in ref["metrics"]
