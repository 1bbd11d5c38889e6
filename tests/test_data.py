"""lightning_twobp.data: synthetic tasks, token files and their CLI, image files, data modules."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_twobp.data import (
    BYTE_VOCAB_SIZE,
    EOT_ID,
    IGNORE_INDEX,
    CountingTokens,
    ImageDataModule,
    ImageFolder,
    ImageTensors,
    MaskedCountingTokens,
    MaskedLMDataModule,
    SyntheticImages,
    TokenDataModule,
    TokenFile,
    decode_bytes,
)
from lightning_twobp.data import tokens as tokens_mod

from conftest import quiet_trainer

Image = pytest.importorskip("PIL.Image")


# ---------------------------------------------------------------- synthetic


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=False))


def test_counting_tokens_counts_and_is_seeded():
    ds = CountingTokens(vocab_size=50, seq_len=12, size=100, seed=3)
    ids, targets = ds[7]
    assert ids.shape == targets.shape == (12,) and ids.dtype == targets.dtype == torch.long
    assert torch.equal(targets, (ids + 1) % 50)
    assert torch.equal(ids[1:], targets[:-1])
    assert _same(ds[7], CountingTokens(50, 12, 100, seed=3)[7])
    assert not all(_same(ds[i], CountingTokens(50, 12, 100, seed=4)[i]) for i in range(10))


def test_counting_tokens_matches_the_original_train_task():
    # The job in train.py materialised the same starts from the same generator: same data, same seed.
    g = torch.Generator().manual_seed(0)
    old = (torch.randint(0, 256, (64, 1), generator=g) + torch.arange(17)) % 256
    ds = CountingTokens(256, 16, 64, seed=0)
    assert all(torch.equal(ds[i][0], old[i, :-1]) and torch.equal(ds[i][1], old[i, 1:]) for i in range(64))


def test_masked_counting_statistics_and_determinism():
    V, T, mask = 40, 100, 39
    ds = MaskedCountingTokens(V, T, size=400, seed=1)
    n_scored = n_masked = n_random = n_kept = 0
    for i in range(len(ds)):
        ids, labels = ds[i]
        assert ids.shape == labels.shape == (T,) and ids.dtype == labels.dtype == torch.long
        scored = labels != IGNORE_INDEX
        assert scored.sum() == 15  # round(0.15 * 100)
        original = labels[scored]
        assert (original != mask).all() and (original < V).all() and (original >= 0).all()
        # Unscored positions are the original counting tokens, never the mask.
        assert (ids[~scored] != mask).all()
        got = ids[scored]
        n_scored += len(got)
        n_masked += int((got == mask).sum())
        n_kept += int((got == original).sum())
        n_random += int(((got != mask) & (got != original)).sum())
    assert n_masked / n_scored == pytest.approx(0.8, abs=0.04)
    # A random replacement may draw the original token (1 in 38), so "kept" is a little over 10%.
    assert n_kept / n_scored == pytest.approx(0.1 + 0.1 / 38, abs=0.03)
    assert n_random / n_scored == pytest.approx(0.1 - 0.1 / 38, abs=0.03)
    assert _same(ds[5], MaskedCountingTokens(V, T, 400, seed=1)[5])
    assert not _same(ds[5], MaskedCountingTokens(V, T, 400, seed=2)[5])


def test_masked_counting_is_recoverable_from_neighbours():
    # Unmasking with the counting rule recovers every label: the task is learnable.
    ds = MaskedCountingTokens(20, 30, size=50, seed=0, mask_token_id=7)
    for i in range(len(ds)):
        ids, labels = ds[i]
        scored = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
        clean = next(j for j in range(30) if j not in scored)
        value = int(ids[clean]) - (int(ids[clean]) > 7)  # ids skip over the mask id 7
        for j in scored:
            v = (value + j - clean) % 19
            assert labels[j] == v + (v >= 7)


def test_masked_counting_rejects_a_bad_mask_id():
    with pytest.raises(ValueError, match=r"mask_token_id 40 is outside the vocabulary of 40 ids"):
        MaskedCountingTokens(40, 10, 5, mask_token_id=40)


def test_synthetic_images_shapes_determinism_and_classes():
    ds = SyntheticImages(num_classes=5, image_size=16, size=200, seed=0)
    img, label = ds[3]
    assert img.shape == (3, 16, 16) and img.dtype == torch.float32
    assert label.dtype == torch.long and label.shape == () and 0 <= label < 5
    assert _same(ds[3], SyntheticImages(5, 16, 200, seed=0)[3])
    assert {int(ds[i][1]) for i in range(len(ds))} == set(range(5))
    # Learnable: the nearest class pattern (after upsampling) gives the label.
    pats = F.interpolate(ds.patterns, size=(16, 16), mode="bilinear", align_corners=False)
    hits = sum(int(((pats - ds[i][0]) ** 2).sum((1, 2, 3)).argmin() == ds[i][1]) for i in range(len(ds)))
    assert hits == len(ds)
    # A validation set: same patterns, other samples.
    val = SyntheticImages(5, 16, 10, seed=0, index_offset=200)
    assert torch.equal(val.patterns, ds.patterns) and not torch.equal(val[0][0], ds[0][0])


# ---------------------------------------------------------------- token files


def _write_tokens(path, ids, dtype="uint16", sidecar: dict | None = None):
    np.asarray(ids, dtype=dtype).tofile(path)
    if sidecar is not None:
        (path.parent / (path.name + ".json")).write_text(json.dumps(sidecar))
    return path


def test_tokenize_cli_round_trip(tmp_path, capsys):
    texts = ["Hello, pipeline!\nZwei Bären. ", "second file: 2BP splits the backward pass.\n" * 20]
    inputs = []
    for k, t in enumerate(texts):
        inputs.append(tmp_path / f"doc{k}.txt")
        inputs[-1].write_text(t, encoding="utf-8")
    out = tmp_path / "tok"
    assert tokens_mod.main([*map(str, inputs), "--out", str(out), "--val-fraction", "0.1"]) == 0
    total = sum(len(t.encode()) + 1 for t in texts)
    line = capsys.readouterr().out.strip()
    assert f"wrote {total:,} tokens from 2 file(s)" in line and "\n" not in line

    meta = json.loads((out / "train.bin.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == BYTE_VOCAB_SIZE and meta["tokenizer"] == "bytes"
    n_val = json.loads((out / "val.bin.json").read_text())["num_tokens"]
    assert meta["num_tokens"] + n_val == total and n_val == round(0.1 * total)

    stream = np.concatenate([np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "val.bin", np.uint16)])
    assert decode_bytes(stream) == "".join(t + "<|endoftext|>" for t in texts)
    assert (stream == EOT_ID).sum() == 2

    seq = 8
    ds = TokenFile(out / "train.bin", seq_len=seq, vocab_size=BYTE_VOCAB_SIZE)
    assert len(ds) == (meta["num_tokens"] - 1) // seq
    ids, targets = ds[1]
    assert ids.dtype == targets.dtype == torch.int64 and ids.shape == targets.shape == (seq,)
    assert torch.equal(ids[1:], targets[:-1])
    assert decode_bytes(torch.cat([ds[0][0], ds[1][0]])) == texts[0][: 2 * seq]
    # Windows do not overlap: sample i starts at i * seq_len; the last one fits with its target.
    assert ds[len(ds) - 1][1][-1] == stream[len(ds) * seq]


def test_tokenize_cli_without_val(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    tokens_mod.main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "o")])  # an earlier run with val.bin
    tokens_mod.main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "--val-fraction", "0"])
    assert not (tmp_path / "o" / "val.bin").exists() and not (tmp_path / "o" / "val.bin.json").exists()
    assert np.fromfile(tmp_path / "o" / "train.bin", np.uint16).tolist() == [97, 98, 99, EOT_ID]


def test_tokenize_cli_reports_a_missing_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tokens_mod.main([str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")])
    assert "nope.txt is not a file" in capsys.readouterr().err


def test_token_file_uint32_with_explicit_dtype(tmp_path):
    path = _write_tokens(tmp_path / "t.bin", np.arange(70_000, 70_021), dtype="uint32")
    ds = TokenFile(path, seq_len=4, dtype="uint32")
    assert len(ds) == 5 and ds[2][0].tolist() == [70_008, 70_009, 70_010, 70_011]
    assert ds[2][1].tolist() == [70_009, 70_010, 70_011, 70_012]


def test_token_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"token file .*nope\.bin does not exist: write one with `twobp-tok"):
        TokenFile(tmp_path / "nope.bin", 8)


def test_token_file_missing_sidecar(tmp_path):
    path = _write_tokens(tmp_path / "t.bin", range(100))
    with pytest.raises(ValueError, match=r"has no sidecar t\.bin\.json saying its dtype: pass dtype='uint16'"):
        TokenFile(path, 8)


def test_token_file_wrong_dtype_size(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"\x00" * 1001)
    with pytest.raises(ValueError, match=r"is 1,001 bytes, not a multiple of 2 \(uint16's item size\)"):
        TokenFile(path, 8, dtype="uint16")
    path.write_bytes(b"\x00" * 1002)
    with pytest.raises(ValueError, match=r"is 1,002 bytes, not a multiple of 4 \(uint32's item size\)"):
        TokenFile(path, 8, dtype="uint32")


def test_token_file_dtype_disagrees_with_sidecar(tmp_path):
    path = _write_tokens(tmp_path / "t.bin", range(100), sidecar={"dtype": "uint16", "num_tokens": 100})
    with pytest.raises(ValueError, match=r"dtype=uint32 was passed but t\.bin\.json says t\.bin holds uint16"):
        TokenFile(path, 8, dtype="uint32")


def test_token_file_truncated_against_sidecar(tmp_path):
    path = _write_tokens(tmp_path / "t.bin", range(100), sidecar={"dtype": "uint16", "num_tokens": 120})
    with pytest.raises(ValueError, match=r"says 120 tokens but .* holds 100 uint16s"):
        TokenFile(path, 8)


def test_token_file_too_short(tmp_path):
    path = _write_tokens(tmp_path / "tokens.bin", range(1000), sidecar={"dtype": "uint16", "num_tokens": 1000})
    with pytest.raises(ValueError, match=r"tokens\.bin holds 1,000 tokens, too short for seq_len 1000 \+ 1: use a"):
        TokenFile(path, 1000)
    assert len(TokenFile(path, 999)) == 1


def test_token_file_vocab_too_small(tmp_path):
    side = {"dtype": "uint16", "num_tokens": 100, "vocab_size": 384, "tokenizer": "bytes"}
    path = _write_tokens(tmp_path / "t.bin", range(100), sidecar=side)
    msg = r"written for vocab_size 384 \(tokenizer bytes\) but the model's vocab_size is 256: set vocab_size >= 384"
    with pytest.raises(ValueError, match=msg):
        TokenFile(path, 8, vocab_size=256)
    # Without a sidecar the file is scanned.
    bare = _write_tokens(tmp_path / "bare.bin", [1, 2, 300, 4] * 10)
    with pytest.raises(ValueError, match=r"holds token id 300, outside the model's vocab_size 256: set vocab_si"):
        TokenFile(bare, 8, dtype="uint16", vocab_size=256)
    assert len(TokenFile(bare, 8, dtype="uint16", vocab_size=301)) == 4


def test_token_file_pickles_without_its_map(tmp_path):
    import pickle

    path = _write_tokens(tmp_path / "t.bin", range(100), sidecar={"dtype": "uint16"})
    ds = TokenFile(path, 8)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._mm is None and _same(clone[3], ds[3])


# ---------------------------------------------------------------- images


def _png(path, color, size=(12, 9), mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)


def _folder(root):
    _png(root / "cat" / "a.png", (255, 0, 0))
    _png(root / "cat" / "b.PNG", (250, 5, 0), size=(20, 30))
    _png(root / "dog" / "c.jpg", (0, 0, 255))
    _png(root / "dog" / "gray.png", 128, mode="L")
    (root / "dog" / "notes.txt").write_text("not an image")
    return root


def test_image_folder_reads_resizes_and_normalises(tmp_path):
    ds = ImageFolder(_folder(tmp_path / "imgs"), image_size=8)
    assert ds.classes == ["cat", "dog"] and len(ds) == 4
    labels = [int(ds[i][1]) for i in range(len(ds))]
    assert labels == [0, 0, 1, 1]
    img, label = ds[0]
    assert img.shape == (3, 8, 8) and img.dtype == torch.float32 and label.dtype == torch.long
    red = (torch.tensor([1.0, 0.0, 0.0]) - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(img.mean((1, 2)), red, atol=1e-4)
    assert ds[1][0].shape == (3, 8, 8) and ds[3][0].shape == (3, 8, 8)  # non-square, greyscale


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"image folder .*missing does not exist"):
        ImageFolder(tmp_path / "missing", 8)
    (tmp_path / "flat").mkdir()
    _png(tmp_path / "flat" / "x.png", (0, 0, 0))
    with pytest.raises(ValueError, match=r"has no class subdirectories: put the images of class c in"):
        ImageFolder(tmp_path / "flat", 8)
    root = _folder(tmp_path / "imgs")
    (root / "empty").mkdir()
    (root / "empty" / "readme.txt").write_text("")
    with pytest.raises(ValueError, match=r"class folder .*empty holds no images \(\.jpg, \.jpeg, \.png\)"):
        ImageFolder(root, 8)


def test_image_folder_unreadable_image_names_the_file(tmp_path):
    root = _folder(tmp_path / "imgs")
    (root / "dog" / "broken.png").write_bytes(b"not a png at all")
    ds = ImageFolder(root, 8)
    i = next(k for k, (p, _) in enumerate(ds.samples) if p.name == "broken.png")
    with pytest.raises(ValueError, match=r"cannot read image .*dog/broken\.png .*replace or delete the file"):
        ds[i]


def test_image_tensors_uint8_and_float(tmp_path):
    images = torch.randint(0, 256, (6, 3, 10, 10), dtype=torch.uint8)
    torch.save({"images": images, "labels": torch.arange(6) % 3}, tmp_path / "u8.pt")
    ds = ImageTensors(tmp_path / "u8.pt", num_classes=3)
    img, label = ds[4]
    assert img.dtype == torch.float32 and img.shape == (3, 10, 10) and label == 1 and label.dtype == torch.long
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(img, (images[4].float() / 255 - mean.view(3, 1, 1)) / std.view(3, 1, 1))
    assert ImageTensors(tmp_path / "u8.pt", image_size=6)[0][0].shape == (3, 6, 6)

    floats = torch.randn(4, 3, 5, 5)
    torch.save({"images": floats, "labels": torch.zeros(4, dtype=torch.long)}, tmp_path / "f.pt")
    assert torch.equal(ImageTensors(tmp_path / "f.pt")[2][0], floats[2])


_IMG, _LAB = torch.zeros(2, 3, 4, 4), torch.zeros(2, dtype=torch.long)


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({"images": _IMG}, r"dict with keys 'images' \(N, 3, H, W\) and 'labels' \(N,\); found \['images'\]"),
        (torch.zeros(3), r"must hold a dict .*found Tensor"),
        (
            {"images": torch.zeros(2, 4, 4), "labels": _LAB},
            r"'images' must be \(N, 3, H, W\), channels first; got \(2, 4, 4\)",
        ),  # noqa: E501
        ({"images": torch.zeros(2, 4, 4, 3), "labels": _LAB}, r"channels first; got \(2, 4, 4, 3\)"),
        ({"images": _IMG, "labels": torch.zeros(3, dtype=torch.long)}, r"holds 2 images but 3 labels"),
        ({"images": _IMG, "labels": torch.zeros(2)}, r"'labels' must be an integer tensor \(N,\); got torch\.float32"),
        ({"images": _IMG.int(), "labels": _LAB}, r"uint8 \(0\.\.255\) or float; got torch\.int32"),
        (
            {"images": _IMG, "labels": torch.tensor([0, 5])},
            r"labels in \[0, 5\], outside num_classes 3: set num_classes >= 6",
        ),  # noqa: E501
    ],
)
def test_image_tensors_errors(tmp_path, obj, match):
    torch.save(obj, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=match):
        ImageTensors(tmp_path / "bad.pt", num_classes=3)


def test_image_tensors_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"image tensors file .*none\.pt does not exist: save one with torch"):
        ImageTensors(tmp_path / "none.pt")


# ---------------------------------------------------------------- data modules


def _first(loader):
    return next(iter(loader))


def test_token_data_module_synthetic():
    dm = TokenDataModule(vocab_size=64, seq_len=16, batch_size=8, num_train=20, num_val=5, seed=2)
    dm.setup("fit")
    train = dm.train_dataloader()
    assert len(train) == 2  # 20 samples, last partial batch of 4 dropped
    ids, targets = _first(train)
    assert ids.shape == targets.shape == (8, 16) and ids.dtype == targets.dtype == torch.long
    assert torch.equal(targets, (ids + 1) % 64)
    # Seeded shuffle: a second module (another process) draws the same batches; each epoch reshuffles
    # (Lightning calls set_epoch on the sampler every epoch, as on any DistributedSampler).
    other = TokenDataModule(64, 16, 8, num_train=20, num_val=5, seed=2).train_dataloader()
    assert _same(_first(dm.train_dataloader()), _first(other))
    other.sampler.set_epoch(1)
    assert not _same(_first(other), _first(dm.train_dataloader()))
    val = list(dm.val_dataloader())
    assert [b[0].shape[0] for b in val] == [5]  # unshuffled, nothing dropped
    assert torch.equal(val[0][0][0], CountingTokens(64, 16, 5, seed=3)[0][0])


def test_token_data_module_from_files(tmp_path):
    (tmp_path / "t.txt").write_text("counting is easy; text is harder. " * 40)
    tokens_mod.main([str(tmp_path / "t.txt"), "--out", str(tmp_path / "d")])
    dm = TokenDataModule(
        BYTE_VOCAB_SIZE,
        seq_len=16,
        batch_size=4,
        train_path=str(tmp_path / "d" / "train.bin"),
        val_path=str(tmp_path / "d" / "val.bin"),
    )
    ids, targets = _first(dm.train_dataloader())
    assert ids.shape == targets.shape == (4, 16) and torch.equal(ids[:, 1:], targets[:, :-1])
    assert _first(dm.val_dataloader())[0].shape[1] == 16
    with pytest.raises(ValueError, match=r"vocab_size 384 .* set vocab_size >= 384"):
        TokenDataModule(256, 16, 4, train_path=str(tmp_path / "d" / "train.bin")).train_dataloader()
    no_val = TokenDataModule(BYTE_VOCAB_SIZE, 16, 4, train_path=str(tmp_path / "d" / "train.bin"))
    assert no_val.val_dataloader() == []


def test_data_module_batch_larger_than_the_data():
    with pytest.raises(ValueError, match=r"holds 6 samples, fewer than one batch of 8 .*lower batch_size"):
        TokenDataModule(64, 16, 8, num_train=6).train_dataloader()


def test_masked_lm_data_module(tmp_path):
    dm = MaskedLMDataModule(vocab_size=30, seq_len=20, batch_size=4, num_train=8, num_val=4)
    ids, labels = _first(dm.train_dataloader())
    assert ids.shape == labels.shape == (4, 20) and ids.dtype == labels.dtype == torch.long
    assert ((labels != IGNORE_INDEX).sum(1) == 3).all()  # round(0.15 * 20)
    (tmp_path / "t.txt").write_text("masked language modelling on bytes " * 30)
    tokens_mod.main([str(tmp_path / "t.txt"), "--out", str(tmp_path / "d")])
    files = MaskedLMDataModule(BYTE_VOCAB_SIZE, 32, 4, train_path=str(tmp_path / "d" / "train.bin"))
    ids, labels = _first(files.train_dataloader())
    scored = labels != IGNORE_INDEX
    assert ids.shape == (4, 32) and (scored.sum(1) == 5).all()
    assert (labels[scored] < 256).all() and (ids == BYTE_VOCAB_SIZE - 1).any()  # bytes scored, 383 masks
    with pytest.raises(ValueError, match=r"mask_token_id 256 is train\.bin's end-of-text id"):
        MaskedLMDataModule(
            BYTE_VOCAB_SIZE, 32, 4, train_path=str(tmp_path / "d" / "train.bin"), mask_token_id=EOT_ID
        ).setup()


def test_image_data_module_synthetic_folder_and_tensors(tmp_path):
    dm = ImageDataModule(num_classes=4, image_size=12, batch_size=4, num_train=10, num_val=3)
    x, y = _first(dm.train_dataloader())
    assert x.shape == (4, 3, 12, 12) and x.dtype == torch.float32 and y.shape == (4,) and y.dtype == torch.long
    assert _first(dm.val_dataloader())[0].shape == (3, 3, 12, 12)

    root = _folder(tmp_path / "imgs")
    x, y = _first(ImageDataModule(2, 8, 2, path=str(root), val_path=str(root)).train_dataloader())
    assert x.shape == (2, 3, 8, 8) and y.dtype == torch.long
    with pytest.raises(ValueError, match=r"has 2 classes but num_classes is 1: set num_classes=2"):
        ImageDataModule(1, 8, 2, path=str(root)).setup()
    other = tmp_path / "other"
    _png(other / "cat" / "a.png", (1, 2, 3))
    _png(other / "cow" / "a.png", (1, 2, 3))
    with pytest.raises(ValueError, match=r"train only: \['dog'\], val only: \['cow'\]"):
        ImageDataModule(2, 8, 2, path=str(root), val_path=str(other)).setup()

    torch.save(
        {"images": torch.randint(0, 256, (6, 3, 10, 10), dtype=torch.uint8), "labels": torch.arange(6) % 2},
        tmp_path / "t.pt",
    )
    x, y = _first(ImageDataModule(2, 8, 3, path=str(tmp_path / "t.pt")).train_dataloader())
    assert x.shape == (3, 3, 8, 8) and y.shape == (3,)
    with pytest.raises(FileNotFoundError, match=r"image path .*nowhere does not exist"):
        ImageDataModule(2, 8, 3, path=str(tmp_path / "nowhere")).setup()


class _Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 64)

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        return F.cross_entropy(self.emb(ids).flatten(0, 1), targets.flatten())

    def validation_step(self, batch, batch_idx):
        ids, targets = batch
        self.log("val_loss", F.cross_entropy(self.emb(ids).flatten(0, 1), targets.flatten()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("num_val", [4, 0])
def test_trainer_runs_a_data_module(tmp_path, num_val):
    # Lightning accepts the module as written, including no validation set (val_dataloader -> []).
    dm = TokenDataModule(64, 8, 4, num_train=16, num_val=num_val)
    trainer = quiet_trainer(max_epochs=1, default_root_dir=tmp_path, use_distributed_sampler=True)
    trainer.fit(_Tiny(), dm)
    assert trainer.global_step == 4  # 16 samples in batches of 4
    assert ("val_loss" in trainer.callback_metrics) == bool(num_val)
