"""Pretrained weights read stage by stage (``TwoBPStrategy(pretrained=...)``), without processes: which
file tensor goes to which of the model's tensors (the module path found, aliases, what the file lacks or
holds beyond the model), every refusal before a byte is read, and the read itself into the tensors a rank
holds. The read on 2 ranks through Trainer, against one process loading the file whole:
``tests/test_materialize.py`` (``pretrained-hf-llama``, ``pretrained-our-checkpoint``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning import checkpoint as ckpt
from lightning_twobp.lightning.checkpoint import CheckpointError
from lightning_twobp.lightning.pretrained import load, plan
from lightning_twobp.monitor import peak_rss_mb, reset_peak_rss

from conftest import Regressor, quiet_trainer, regression_data, tiny_llama_config

transformers = pytest.importorskip("transformers", reason="Hugging Face models are what users load")
safetensors = pytest.importorskip("safetensors.torch", reason="the Hugging Face weights format")


def _config(**kw) -> transformers.LlamaConfig:
    return tiny_llama_config(**kw)


def _saved(folder: Path, model: nn.Module) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    return folder


class Wrapper(nn.Module):
    """A LightningModule's layout: the Hugging Face model under ``model``, a head of the user's own."""

    def __init__(self, config: Any, meta: bool = False, cls: Any = None) -> None:
        super().__init__()
        with torch.device("meta") if meta else torch.device("cpu"):
            self.model = (cls or transformers.LlamaForCausalLM)(config)
        self.value = nn.Linear(16, 1)


def _source(seed: int = 7, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config(**kw))


def test_the_weights_go_under_the_module_they_were_saved_from_and_are_read_bitwise(tmp_path):
    source = _source()
    found = plan(_saved(tmp_path, source), Wrapper(_config(), meta=True))
    assert found.prefix == "model."
    assert found.missing == ("value.bias", "value.weight") and found.unused == ()
    target = Wrapper(_config())
    assert load(found, target) == len(source.state_dict())
    for name, value in source.state_dict().items():
        assert torch.equal(target.model.state_dict()[name], value), name


def test_a_rank_reads_only_the_tensors_it_holds(tmp_path):
    """The other ranks' layers are on meta (or set aside): only the real tensors are read."""
    source = _source()
    target = Wrapper(_config(), meta=True)
    layer = target.model.model.layers[1]
    layer.to_empty(device="cpu")
    assert load(plan(_saved(tmp_path, source), target), target) == len(layer.state_dict())
    for name, value in layer.state_dict().items():
        assert torch.equal(value, source.model.layers[1].state_dict()[name]), name
    assert all(p.is_meta for p in target.model.model.layers[0].parameters())


def test_a_base_model_goes_into_its_causal_lm_and_what_it_lacks_is_named(tmp_path):
    base = transformers.LlamaModel(_config())
    found = plan(_saved(tmp_path, base), Wrapper(_config(), meta=True))
    assert found.keys["model.model.norm.weight"] == "norm.weight"  # from_pretrained adds the base prefix
    assert found.missing == ("model.lm_head.weight", "value.bias", "value.weight")


def test_a_causal_lm_file_goes_into_its_base_model(tmp_path):
    """As from_pretrained drops the base-model prefix: a LightningModule holding a LlamaModel backbone."""
    source = _source()
    target = nn.Module()
    target.backbone = transformers.LlamaModel(_config())
    found = plan(_saved(tmp_path, source), target)
    assert (found.prefix, found.missing, found.unused) == ("backbone.", (), ("lm_head.weight",))
    load(found, target)
    for name, value in source.model.state_dict().items():
        assert torch.equal(target.backbone.state_dict()[name], value), name


def test_a_tied_weight_saved_once_is_read_through_its_other_name(tmp_path):
    source = _source(tie_word_embeddings=True)
    assert "lm_head.weight" not in safetensors.load_file(_saved(tmp_path, source) / "model.safetensors")
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(_config(tie_word_embeddings=True))
    found = plan(tmp_path, target)
    assert found.missing == () and found.unused == ()
    load(found, target)
    assert torch.equal(target.lm_head.weight, source.model.embed_tokens.weight)


def test_a_file_holding_both_names_of_a_tied_weight_says_which_is_not_read(tmp_path):
    _saved(tmp_path, _source())  # untied: lm_head and embed_tokens differ
    torch.manual_seed(0)
    found = plan(tmp_path, transformers.LlamaForCausalLM(_config(tie_word_embeddings=True)))
    assert found.unused == ("lm_head.weight",)


def test_another_torch_distributed_checkpoint_is_read_by_its_own_names(tmp_path):
    """A dcp.save of a model's state dict (torchtitan's, say), not this strategy's checkpoint: no name
    is taken for this strategy's "model." part."""
    source = _source()
    dcp.save(source.state_dict(), checkpoint_id=tmp_path)
    target = Wrapper(_config())
    found = plan(tmp_path, target)
    assert (found.source.kind, found.prefix, found.unused) == ("dcp", "model.", ())
    load(found, target)
    assert torch.equal(target.model.lm_head.weight, source.lm_head.weight)


def test_a_folder_is_read_as_from_pretrained_reads_it_and_two_saves_are_named(tmp_path):
    """save_pretrained leaves an earlier model.safetensors beside new shards and their index:
    from_pretrained reads model.safetensors, and so does the read, saying so; without it, the index's
    shards; without either, the folder's two saves are refused."""
    _saved(tmp_path, _source())
    newer = _source(seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        newer.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    target = transformers.LlamaForCausalLM(_config())
    found = plan(tmp_path, target)
    assert "model.safetensors is read, as from_pretrained reads it" in found.source.notes[0]
    load(found, target)
    want = transformers.LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in target.state_dict().items())
    assert torch.equal(target.lm_head.weight, _source().lm_head.weight)
    (tmp_path / "model.safetensors").rename(tmp_path / "old.safetensors")
    load(plan(tmp_path, target), target)
    assert all(torch.equal(v, newer.state_dict()[k]) for k, v in target.state_dict().items())
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"21 tensor\(s\) are in more than one file .* no model.safetensors.index"):
        plan(tmp_path, target)


def test_an_unreadable_header_is_refused_naming_the_file(tmp_path):
    (tmp_path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")
    with pytest.raises(ValueError, match=r"the header of .*model.safetensors cannot be read .* Git LFS pointer"):
        plan(tmp_path, Wrapper(_config(), meta=True))


def test_a_classifier_over_a_causal_lms_file_reads_the_body(tmp_path):
    """The head is the model's own (warned as missing), the file's lm_head not read (warned as unused)."""
    _saved(tmp_path, _source())
    with torch.device("meta"):
        target = transformers.LlamaForSequenceClassification(_config(num_labels=3))
    found = plan(tmp_path, target)
    assert (found.prefix, found.missing, found.unused) == ("", ("score.weight",), ("lm_head.weight",))


def test_a_model_and_optimizer_checkpoint_of_dcp_reads_the_model(tmp_path):
    source = _source()
    optimizer = torch.optim.Adam(source.parameters())
    source(torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    optimizer.step()
    dcp.save({"model": source.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=tmp_path)
    target = transformers.LlamaForCausalLM(_config())
    found = plan(tmp_path, target)
    assert (found.prefix, found.missing, len(found.unused)) == ("", (), 63)  # Adam's step and two moments
    load(found, target)
    assert torch.equal(target.lm_head.weight, source.lm_head.weight)


def test_a_quantized_checkpoint_is_refused(tmp_path):
    state = _source().state_dict()
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].to(torch.float8_e4m3fn)
    safetensors.save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"are quantized: 1 tensor\(s\) .*down_proj.weight \(F8_E4M3\)"):
        plan(tmp_path, transformers.LlamaForCausalLM(_config()))


def test_old_names_transformers_renames_are_read_renamed(tmp_path):
    """BERT checkpoints of 2018 name LayerNorm's weight gamma, which from_pretrained renames: so does the
    read."""
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    source = transformers.BertModel(config)
    old = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v + 1.0
        for k, v in source.state_dict().items()
    }
    safetensors.save_file(old, tmp_path / "model.safetensors")
    config.save_pretrained(tmp_path)
    target = transformers.BertModel(config)
    found = plan(tmp_path, target)
    assert found.missing == found.unused == ()
    assert sum(k.endswith("LayerNorm.gamma") for k in found.keys.values()) == 3  # read through the renaming
    load(found, target)
    want = transformers.BertModel.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(target.state_dict()[k], v) for k, v in want.items())


MIXTRAL = dict(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, num_local_experts=3,
)  # fmt: skip


def test_experts_transformers_fuses_are_fused_on_the_rank_that_holds_them(tmp_path):
    """Mixtral's checkpoint holds one tensor per expert (and ``block_sparse_moe``), which from_pretrained
    renames and fuses into one stacked tensor per layer: the read does it with transformers' own
    conversion, only for the layers the rank holds, and equals from_pretrained."""
    config = transformers.MixtralConfig(**MIXTRAL)
    torch.manual_seed(1)
    _saved(tmp_path, transformers.MixtralForCausalLM(config))
    want = transformers.MixtralForCausalLM.from_pretrained(tmp_path).state_dict()
    target = Wrapper(config, meta=True, cls=transformers.MixtralForCausalLM)
    found = plan(tmp_path, target)
    assert found.missing == ("value.bias", "value.weight") and found.unused == ()
    assert len(found.converted.conversions) == 4  # gate_up_proj and down_proj of each layer
    layer = target.model.model.layers[1]
    layer.to_empty(device="cpu")
    assert load(found, target) == len(layer.state_dict())
    for name, value in layer.state_dict().items():
        assert torch.equal(value, want[f"model.layers.1.{name}"]), name
    assert all(q.is_meta for q in target.model.model.layers[0].parameters())
    whole = Wrapper(config, cls=transformers.MixtralForCausalLM)
    load(found, whole)
    assert all(torch.equal(whole.model.state_dict()[k], v) for k, v in want.items())
    with torch.device("meta"):  # a classifier over the causal LM's file: its body converted, its head missing
        classifier = transformers.MixtralForSequenceClassification(config)
    assert plan(tmp_path, classifier).missing == ("score.weight",)


def test_a_conversion_that_writes_another_shape_is_refused_before_reading(tmp_path):
    """Two experts in the file, three in the model: the fused tensor's shape is checked on meta."""
    _saved(
        tmp_path, transformers.MixtralForCausalLM(transformers.MixtralConfig(**(MIXTRAL | {"num_local_experts": 2})))
    )
    with torch.device("meta"):
        target = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))
    with pytest.raises(ValueError, match=r"gate_up_proj: \(3, 64, 16\) in the model, \(2, 64, 16\) converted"):
        plan(tmp_path, target)


def test_a_bf16_file_is_cast_to_the_models_dtype(tmp_path):
    source = _source().to(torch.bfloat16)
    target = transformers.LlamaForCausalLM(_config())
    load(plan(_saved(tmp_path, source), target), target)
    assert target.lm_head.weight.dtype == torch.float32
    assert torch.equal(target.lm_head.weight, source.lm_head.weight.float())


def test_the_module_path_can_be_named_and_a_wrong_one_is_refused(tmp_path):
    _saved(tmp_path, _source())
    assert plan(tmp_path, Wrapper(_config(), meta=True), prefix="model").prefix == "model."
    nowhere = r"none of the pretrained file's 21 tensor names .* under the module 'encoder'"
    with pytest.raises(ValueError, match=nowhere):
        plan(tmp_path, Wrapper(_config(), meta=True), prefix="encoder")


def test_weights_that_fit_nothing_or_two_modules_alike_are_refused_with_the_fix(tmp_path):
    _saved(tmp_path, _source())
    # a bare "weight" left after dropping "lm_head." would fit any Linear: not a pairing
    nothing = r"none of the pretrained file's 21 tensor names .*TwoBPStrategy\(pretrained_prefix="
    with pytest.raises(ValueError, match=nothing):
        plan(tmp_path, nn.Linear(3, 3))
    twins = nn.Module()
    with torch.device("meta"):
        twins.student, twins.teacher = (transformers.LlamaForCausalLM(_config()) for _ in range(2))
    with pytest.raises(ValueError, match=r"match 21 tensors under each of the modules 'student', 'teacher'"):
        plan(tmp_path, twins)


def test_a_shape_that_differs_is_refused_before_anything_is_read(tmp_path):
    _saved(tmp_path, _source())
    target = transformers.LlamaForCausalLM(_config(vocab_size=40))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"2 tensor\(s\) differ in shape: model.embed_tokens.weight: \(40, 16\) in"):
        plan(tmp_path, target)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


def _bin_saved(folder: Path, model: nn.Module, shards: int = 1) -> Path:
    """``model``'s weights as transformers 4.x saved them without safetensors: ``pytorch_model.bin``, or
    ``shards`` files and their index."""
    folder.mkdir(exist_ok=True)
    state = model.state_dict()
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return folder
    names = [f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin" for i in range(shards)]
    where = {key: names[i % shards] for i, key in enumerate(state)}
    for name in names:
        torch.save({k: v for k, v in state.items() if where[k] == name}, folder / name)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))
    return folder


@pytest.mark.parametrize("shards", [1, 3])
def test_pytorch_model_bin_is_read_mapped_like_safetensors(tmp_path, shards):
    source = _source()
    folder = _bin_saved(tmp_path, source, shards)
    torch.save({"stale": torch.zeros(2)}, tmp_path / "other.bin")  # beside the index: not read
    found = plan(folder, Wrapper(_config(), meta=True))
    assert found.source.kind == "torch" and found.prefix == "model." and found.unused == ()
    target = Wrapper(_config())
    assert load(found, target) == len(source.state_dict())
    for name, value in source.state_dict().items():
        assert torch.equal(target.model.state_dict()[name], value), name


def test_safetensors_beside_pytorch_model_bin_are_preferred_as_from_pretrained_does(tmp_path):
    _bin_saved(tmp_path, _source(seed=1))
    _saved(tmp_path, _source(seed=2))
    target = Wrapper(_config())
    load(plan(tmp_path, target), target)
    assert torch.equal(target.model.lm_head.weight, _source(seed=2).lm_head.weight)


def test_a_lightning_checkpoint_file_is_read_by_its_state_dict(tmp_path, no_leftover_process_group):
    """A model trained by one process without the strategy goes on under it from its ``.ckpt``: the
    state dict read, the optimizer's state beside it not."""
    trained = Regressor()
    one = quiet_trainer("auto", max_steps=2, devices=1)
    one.fit(trained, regression_data(32))
    one.save_checkpoint(tmp_path / "one.ckpt")
    found = plan(tmp_path / "one.ckpt", Regressor())
    assert found.source.kind == "torch" and found.prefix == "" and found.missing == found.unused == ()
    model = Regressor()
    quiet_trainer(TwoBPStrategy(pretrained=tmp_path / "one.ckpt")).validate(model, regression_data(32), verbose=False)
    for name, value in trained.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_saved_state_dict_is_read_and_one_among_several_is_asked_for(tmp_path):
    weights = {k: v + 1.0 for k, v in Regressor().state_dict().items()}
    optimizer = torch.optim.AdamW(Regressor().parameters()).state_dict()
    torch.save({"model": weights, "optimizer": optimizer, "step": 3}, tmp_path / "train.pt")
    model = Regressor()
    load(plan(tmp_path / "train.pt", model), model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    torch.save({"model": weights, "ema": weights}, tmp_path / "two.pt")
    with pytest.raises(ValueError, match=r"holds 6 of the model's tensors under each of 'ema.', 'model.': two copies"):
        plan(tmp_path / "two.pt", model)


class NotATensor:
    """An object a pickle may hold: torch.load(weights_only=True) does not make it."""


def test_a_torch_file_holding_objects_is_refused_not_unpickled(tmp_path):
    """As a Lightning checkpoint whose hyperparameters hold a config object: named, with the two fixes."""
    torch.save({"state_dict": Regressor().state_dict(), "extra": NotATensor()}, tmp_path / "objects.ckpt")
    named = r"beyond tensors, .*\(UnpicklingError: .*Unsupported global: GLOBAL test_pretrained.NotATensor.*\)\. If you"
    with pytest.raises(ValueError, match=named + r" trust the file, .*add_safe_globals.* or save its state dict alone"):
        plan(tmp_path / "objects.ckpt", Regressor())
    with torch.serialization.safe_globals([NotATensor]):  # allowed by the user: read
        assert len(plan(tmp_path / "objects.ckpt", Regressor()).keys) == 6


def test_tensors_a_torch_file_holds_without_data_are_refused_before_reading(tmp_path):
    torch.save(nn.Linear(2, 2, device="meta").state_dict(), tmp_path / "meta.pt")
    with pytest.raises(ValueError, match=r"holds tensors without data or shards of a sharded save \(bias, weight\)"):
        plan(tmp_path / "meta.pt", nn.Linear(2, 2))


def test_a_hugging_face_folder_is_read_as_from_pretrained_picks_its_files(tmp_path):
    """pytorch_model.bin before its index's shards, and before any safetensors file but model.safetensors
    (a peft adapter saved beside the model is not the model)."""
    _bin_saved(tmp_path, _source(seed=1))
    _bin_saved(tmp_path, _source(seed=2), shards=2)  # an index and its shards beside it: another save
    safetensors.save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "adapter_model.safetensors")
    target = Wrapper(_config())
    found = plan(tmp_path, target)
    assert found.source.kind == "torch" and "pytorch_model.bin is read" in found.source.notes[0]
    load(found, target)
    assert torch.equal(target.model.lm_head.weight, _source(seed=1).lm_head.weight)


class WithState(nn.Module):
    """A module with extra state (Transformer Engine's fp8 metadata, say): a dict, no tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def get_extra_state(self) -> dict:
        return {"counter": 3}

    def set_extra_state(self, state: dict) -> None:
        pass


def test_a_state_dict_among_other_entries_compiled_names_and_extra_state(tmp_path):
    """Tensors beside the state dict are named as not read; torch.compile's ``_orig_mod.`` is read as the
    plain model's; a module's extra state is no tensor (kept as built, and named)."""
    weights = {"0.lin._orig_mod.weight": torch.ones(2, 2), "0.lin._orig_mod.bias": torch.ones(2)}
    torch.save({"model": weights, "metrics": {"acc": torch.tensor(0.9)}}, tmp_path / "run.pt")
    model = nn.Sequential(WithState())
    found = plan(tmp_path / "run.pt", model)
    assert found.unused == ("metrics.acc",) and found.missing == ("0._extra_state",)
    assert load(found, model) == 2
    assert torch.equal(model[0].lin.weight, torch.ones(2, 2)) and torch.equal(model[0].lin.bias, torch.ones(2))


class BigAndSmall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):  # another rank's: never read here
            self.big = nn.Linear(4096, 4096, bias=False)
        self.small = nn.Linear(64, 64)


def test_the_export_names_its_files_as_the_reader_wants(tmp_path):
    """diffusers' from_pretrained reads diffusion_pytorch_model.safetensors (a trial found only model.safetensors
    written): --weights-name names the file, and shards and their index after it, as save_pretrained does."""
    from safetensors.torch import load_file

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    ckpt.save({}, tmp_path / "m.ckpt", model, [], {})
    args = [str(tmp_path / "m.ckpt"), str(tmp_path / "out"), "--safetensors", "--weights-name"]
    assert ckpt.main([*args, "diffusion_pytorch_model.safetensors"]) == 0
    read = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(read[n], q) for n, q in model.state_dict().items()) and len(read) == 4
    assert ckpt.main([*args, "diffusion_pytorch_model.safetensors", "--max-shard-size", "20KB"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "diffusion_pytorch_model-00001-of-00002.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
        "diffusion_pytorch_model.safetensors.index.json",
    ]
    # a variant's index, where from_pretrained(..., variant="fp16") looks (transformers' _add_variant)
    assert ckpt.main([*args, "model.fp16.safetensors", "--max-shard-size", "20KB"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("model.")) == [
        "model.fp16-00001-of-00002.safetensors",
        "model.fp16-00002-of-00002.safetensors",
        "model.safetensors.index.fp16.json",
    ]
    # the plain name beside it leaves the variant's files (a review: model*.safetensors removed them)
    assert ckpt.main([*args, "model.safetensors"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("model.")) == [
        "model.fp16-00001-of-00002.safetensors",
        "model.fp16-00002-of-00002.safetensors",
        "model.safetensors",
        "model.safetensors.index.fp16.json",
    ]
    assert ckpt._index_name("model-v1.5.safetensors") == "model-v1.5.safetensors.index.json"  # a dot, no variant
    with pytest.raises(ValueError, match=r"--weights-name 'weights.bin': a file name ending in .safetensors"):
        ckpt.to_safetensors(tmp_path / "m.ckpt", tmp_path / "out", weights_name="weights.bin")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").is_file(), reason="reads the resident peak from /proc")
def test_a_torch_file_is_mapped_so_a_rank_touches_only_its_own_tensors(tmp_path):
    """A 64 MiB weight of another rank's in the file costs this rank's read nothing."""
    torch.save(
        {"big.weight": torch.randn(4096, 4096), **nn.Linear(64, 64).state_dict(prefix="small.")}, tmp_path / "w.pt"
    )
    model = BigAndSmall()
    reset_peak_rss()
    before = peak_rss_mb()
    assert load(plan(tmp_path / "w.pt", model), model) == 2
    assert peak_rss_mb() - before < 24, "the other rank's 64 MiB tensor was read"


def test_one_safetensors_file_is_read_alone(tmp_path):
    """Named alone, one file is read even where its folder holds another save."""
    _saved(tmp_path, _source(seed=1))
    safetensors.save_file(
        {k: v.contiguous() for k, v in _source(seed=2).state_dict().items() if "lm_head" not in k},
        tmp_path / "other.safetensors",
    )
    target = Wrapper(_config())
    load(plan(tmp_path / "model.safetensors", target), target)
    assert torch.equal(target.model.lm_head.weight, _source(seed=1).lm_head.weight)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: d / "missing", r"it does not exist here \(every rank reads it"),
        (lambda d: d, r"it holds no \*.safetensors file, no pytorch_model.bin and no .metadata"),
        (lambda d: _touch(d / "pytorch_model.bin"), r"neither safetensors nor a torch.save file of torch >= 1.6"),
        (lambda d: _legacy(d / "old.pt"), r"load it once and torch.save it again, or save it as safetensors"),
        (lambda d: _lfs(d / "pytorch_model.bin"), r"it is a Git LFS pointer, not the weights \(.*git lfs pull"),
        (lambda d: _touch(d / "model.safetensors.index.json"), r"pass the directory that holds it, '.*'"),
        (lambda d: 3, r"pretrained=3\): a path, of a directory or a file"),
    ],
)
def test_a_path_that_cannot_be_read_is_refused_when_the_strategy_is_made(tmp_path, make, match):
    with pytest.raises(ValueError, match=match):
        TwoBPStrategy(pretrained=make(tmp_path))
    with pytest.raises(ValueError, match=r"give the weights too, pretrained='<directory>'"):
        TwoBPStrategy(pretrained_prefix="model")


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _lfs(path: Path) -> Path:
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")
    return path


def _legacy(path: Path) -> Path:
    torch.save(Regressor().state_dict(), path, _use_new_zipfile_serialization=False)
    return path


def _regressor_weights(folder: Path) -> Path:
    """Weights for the Regressor that no build of it makes (its own plus one)."""
    safetensors.save_file({k: v + 1.0 for k, v in Regressor().state_dict().items()}, folder / "model.safetensors")
    return folder


def test_a_resumed_fit_keeps_the_checkpoint_and_later_calls_read_nothing(tmp_path, no_leftover_process_group):
    """One process under the strategy: the weights are read at the first setup; a checkpoint resumed
    after it wins, and a validate after that keeps the model's weights."""
    weights = _regressor_weights(tmp_path)
    first = Regressor()
    trainer = quiet_trainer(TwoBPStrategy(pretrained=weights), max_steps=2)
    trainer.fit(first, regression_data(32))
    saved = {k: v.clone() for k, v in first.state_dict().items()}
    assert not torch.equal(saved["layers.0.weight"], Regressor().state_dict()["layers.0.weight"] + 1.0)
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    second = Regressor()
    again = quiet_trainer(TwoBPStrategy(pretrained=weights), max_steps=2)
    again.fit(second, regression_data(32), ckpt_path=tmp_path / "two.ckpt")  # at step 2 already: no step
    again.validate(second, regression_data(32), verbose=False)
    for k, v in saved.items():
        assert torch.equal(second.state_dict()[k], v), k


def test_a_weight_no_rank_holds_is_not_saved(tmp_path):
    model = Regressor()
    with torch.device("meta"):
        model.extra = nn.Linear(2, 2)
    nobody = r"not saved: 2 weight\(s\) are on the meta device on every rank, .* \(extra.bias, extra.weight\)"
    with pytest.raises(CheckpointError, match=nobody):
        ckpt.save({}, tmp_path / "c.ckpt", model, [], {})
    assert list(tmp_path.iterdir()) == []


class FineTuned(Regressor):
    """A Hugging Face LLaMa fine-tuned under the strategy (the Regressor's data: x as token ids)."""

    def __init__(self) -> None:
        super().__init__()
        del self.layers
        self.model = transformers.LlamaForCausalLM(_config())

    def training_step(self, batch, batch_idx):
        ids = (batch[0].abs() * 10).long() % 32
        return self.model(input_ids=ids, labels=ids).loss


def test_a_fine_tuned_model_goes_back_to_hugging_face(tmp_path, no_leftover_process_group):
    """pretrained= in, twobp-consolidate --safetensors out: from_pretrained reads the trained weights."""
    _saved(tmp_path / "hf", _source())
    model = FineTuned()
    trainer = quiet_trainer(TwoBPStrategy(pretrained=tmp_path / "hf"), max_steps=2)
    trainer.fit(model, regression_data(32))
    trainer.save_checkpoint(tmp_path / "tuned.ckpt")
    out = tmp_path / "out"
    assert ckpt.main([str(tmp_path / "tuned.ckpt"), str(out), "--safetensors", "--prefix", "model"]) == 0
    _config().save_pretrained(out)
    back = transformers.LlamaForCausalLM.from_pretrained(out)
    trained = model.model.state_dict()
    assert not torch.equal(trained["lm_head.weight"], _source().lm_head.weight)  # it trained
    for name, value in back.state_dict().items():
        assert torch.equal(value, trained[name]), name
    with pytest.raises(ValueError, match=r"--prefix 'encoder': no weight of .* its modules: model \(e.g. --prefix"):
        ckpt.to_safetensors(tmp_path / "tuned.ckpt", out, "encoder")
    shards = ["tuned.ckpt", str(out), "--safetensors", "--prefix", "model", "--max-shard-size", "20KB"]
    assert ckpt.main([str(tmp_path / shards[0]), *shards[1:]]) == 0  # over the single file: it is removed
    assert not (out / "model.safetensors").exists() and len(list(out.glob("model-*-of-*.safetensors"))) >= 2
    back = transformers.LlamaForCausalLM.from_pretrained(out)
    assert all(torch.equal(value, trained[name]) for name, value in back.state_dict().items())


@pytest.mark.skipif(not Path("/proc/self/clear_refs").is_file(), reason="reads the resident peak from /proc")
def test_the_export_to_hugging_face_holds_one_shard_at_a_time(tmp_path):
    """A 128 MiB model written in 16 MiB shards: the process holds a shard and the buffers reading and
    writing it (DCP's read buffer, its unpickled copy, safetensors' bytes: 65-82 MB measured on a first
    export, 0-34 on later ones in the process), never the model (it used to, twice: 250 MB)."""
    model = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(8)))
    ckpt.save({}, tmp_path / "big.ckpt", model, [], {})
    reset_peak_rss()
    before = peak_rss_mb()
    assert ckpt.to_safetensors(tmp_path / "big.ckpt", tmp_path / "hf", max_shard_bytes=17 * 2**20) == 8
    assert peak_rss_mb() - before < 125, "more than a shard and its buffers held at once"
    assert len(list((tmp_path / "hf").glob("model-*-of-00008.safetensors"))) == 8
    read = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(8)))
    load(plan(tmp_path / "hf", read), read)
    assert all(torch.equal(a, b) for a, b in zip(read.parameters(), model.parameters(), strict=True))


def _equal_to_from_pretrained(folder: Path, cls: Any, config: Any, wrapped: bool = False) -> Any:
    """A fresh ``cls(config)`` read from ``folder`` (held as a LightningModule's ``self.model`` where
    ``wrapped``) against ``cls.from_pretrained(folder)``, tensor by tensor; the plan."""
    want = cls.from_pretrained(folder).state_dict()
    target: nn.Module = cls(config)
    if wrapped:
        holder = nn.Module()
        holder.model = target
        target = holder
    found = plan(folder, target)
    load(found, target)
    got = target.model.state_dict() if wrapped else target.state_dict()
    assert [k for k, v in want.items() if not torch.equal(got[k], v)] == []
    return found


def test_a_checkpoint_whose_names_transformers_moves_is_read_as_from_pretrained_reads_it(tmp_path):
    """Llava's Hub layout (``language_model.lm_head``, ``language_model.model.*``, which transformers 5
    moves to ``lm_head`` and ``model.language_model.*``), in a LightningModule: the head read too (it was
    left as built, warned only)."""
    text = tiny_llama_config(vocab_size=80)
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=70)
    _saved(tmp_path, transformers.LlavaForConditionalGeneration(config))
    found = _equal_to_from_pretrained(tmp_path, transformers.LlavaForConditionalGeneration, config, wrapped=True)
    assert found.missing == found.unused == ()


def test_a_conversion_of_a_name_the_model_has_too_is_applied(tmp_path):
    """Qwen3-VL-MoE's Hub experts are stored transposed under the model's own names; from_pretrained
    transposes them (``Transpose(check_dims=True)``), and so does the read."""
    text = dict(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )  # fmt: skip
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=16, patch_size=2,
        temporal_patch_size=1, spatial_merge_size=1, deepstack_visual_indexes=[0],
    )  # fmt: skip
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)
    cls = transformers.Qwen3VLMoeForConditionalGeneration
    state = cls(config).state_dict()
    hub = {k: v.transpose(1, 2).contiguous() if k.endswith("_proj") and v.dim() == 3 else v for k, v in state.items()}
    safetensors.save_file(hub, tmp_path / "model.safetensors")
    config.save_pretrained(tmp_path)
    found = _equal_to_from_pretrained(tmp_path, cls, config)
    assert len(found.converted.conversions) == 2 and found.missing == found.unused == ()


def test_layers_the_model_lacks_are_named_not_refused_and_quantized_parts_are_refused(tmp_path):
    """A file with one more MoE layer than the model (a multi-token-prediction layer) into a classifier:
    the extra layer and the head named as from_pretrained names them. GPT-OSS's MXFP4 experts (blocks and
    scales in place of the weight): refused, not left as built."""
    moe = dict(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
        num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8,
    )  # fmt: skip
    _saved(
        tmp_path / "three", transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(num_hidden_layers=3, **moe))
    )
    with torch.device("meta"):
        two = transformers.Qwen3MoeForSequenceClassification(transformers.Qwen3MoeConfig(num_hidden_layers=2, **moe))
    found = plan(tmp_path / "three", two)
    assert found.missing == ("score.weight",) and "model.layers.2.mlp.experts.0.up_proj.weight" in found.unused
    state = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(num_hidden_layers=1, **moe)).state_dict()
    packed = {k: v for k, v in state.items() if "experts" not in k}
    packed["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(3, 16, 2, 8, dtype=torch.uint8)
    packed["model.layers.0.mlp.experts.gate_up_proj_scales"] = torch.zeros(3, 16, 2, dtype=torch.uint8)
    safetensors.save_file(packed, tmp_path / "model.safetensors")
    with torch.device("meta"):
        one = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(num_hidden_layers=1, **moe))
    with pytest.raises(
        ValueError, match=r"quantized: model.layers.0.mlp.experts.gate_up_proj_blocks \(U8\) is a part of"
    ):
        plan(tmp_path, one)


class Drafted(nn.Module):
    """A policy model and a draft head of the same blocks (not a Hugging Face model) beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = transformers.LlamaForCausalLM(_config())
        self.draft = nn.Module()
        self.draft.layers = nn.ModuleList([transformers.models.llama.modeling_llama.LlamaDecoderLayer(_config(), 0)])
        self.draft.norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(16)


def test_beside_a_hugging_face_model_what_fits_two_places_or_nowhere_is_still_refused(tmp_path):
    """Reading as from_pretrained does never overrides a refusal: a draft head's file fits the draft and
    the policy's layers alike; a BERT file fits nothing of a LLaMa; a model and its EMA are two copies."""
    model = Drafted()
    safetensors.save_file(model.draft.state_dict(), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"match 10 tensors under each of the modules 'draft', 'model.model'"):
        plan(tmp_path, model)
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    )
    _saved(tmp_path / "bert", bert)
    with pytest.raises(ValueError, match=r"none of the pretrained file's .* tensor names"):
        plan(tmp_path / "bert", Wrapper(_config(), meta=True))
    weights = _source().state_dict()
    torch.save({"model": weights, "ema": weights}, tmp_path / "two.pt")
    with pytest.raises(ValueError, match=r"under each of 'ema.', 'model.': two copies"):
        plan(tmp_path / "two.pt", _source())


class Adapted(nn.Module):
    """peft's LoRA layout (``q_proj.base_layer``, ``q_proj.lora_A``, ``q_proj.lora_B``), built by hand."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, 2, bias=False)
        self.lora_B = nn.Linear(2, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_the_base_models_weights_go_into_the_layers_an_adapter_wraps(tmp_path):
    """A LoRA fine-tune started from the base model's file: its q_proj.weight is the adapted layer's
    base_layer.weight (peft maps it so); the adapter's own weights keep their initialization, named."""
    _saved(tmp_path, _source())
    target = Wrapper(_config())
    for layer in target.model.model.layers:
        layer.self_attn.q_proj = Adapted(layer.self_attn.q_proj)
    found = plan(tmp_path, target)
    assert found.unused == () and all(".lora_" in n for n in found.missing if n.startswith("model."))
    load(found, target)
    for i, layer in enumerate(target.model.model.layers):
        assert torch.equal(layer.self_attn.q_proj.base_layer.weight, _source().model.layers[i].self_attn.q_proj.weight)
