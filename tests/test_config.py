"""Every Hydra config composes and instantiates; every recipe goes through twobp-plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_twobp import TwoBPStrategy
from lightning_twobp.config import CONF_DIR, recipes
from lightning_twobp.lightning.contract import find_contract
from lightning_twobp.plan import format_plan, plan

GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in CONF_DIR.iterdir() if g.is_dir()}


def _compose(overrides: list[str], out_dir: Path):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(out_dir)
    HydraConfig.instance().set_config(cfg)  # for ${hydra:...} in callbacks and loggers
    return cfg


def _instantiate_all(cfg) -> None:
    """Every group of ``cfg`` instantiates, the model on meta with a contract of at least two layers."""
    if "HFCausalLM" in cfg.model._target_:
        pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
    with torch.device("meta"):  # the paper sizes too: no memory
        model = instantiate(cfg.model)
    contract = find_contract(model, cfg.strategy.get("layers"))
    assert len(contract.layers()) >= 2
    data = instantiate(cfg.data)
    assert data.batch_size == cfg.data.batch_size
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, TwoBPStrategy) and strategy.schedule_name == cfg.strategy.schedule
    for c in (cfg.callbacks or {}).values():
        instantiate(c)
    for lg in (cfg.logger or {}).values():
        instantiate(lg)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert trainer_cfg["_target_"] == "lightning.pytorch.Trainer"


def test_groups_exist():
    assert {"model", "data", "trainer", "strategy", "schedule", "callbacks", "logger"} <= set(GROUPS)


def _data_for(model: str) -> str:
    """Each model family reads its own batch format."""
    return "images" if "resnet" in model else "masked-counting" if "bert" in model else "counting"


@pytest.mark.parametrize(
    "override",
    [f"model={o} data={_data_for(o)}" for o in GROUPS["model"]]
    + [f"{g}={o}" for g in ("schedule", "callbacks", "logger", "strategy") for o in GROUPS[g]]
    + [
        "data=images model=tiny-resnet",
        "data=masked-counting model=tiny-bert",
        "data=tokens data.train_path=x.bin",
        "data=masked-tokens data.train_path=x.bin model=tiny-bert",
        "trainer=gpu",
        "trainer=cpu",
    ],
)
def test_every_group_option_composes_and_instantiates(override, tmp_path):
    if override == "logger=tensorboard":
        pytest.importorskip("tensorboard", reason="the tensorboard logger needs `pip install tensorboard`")
    cfg = _compose(override.split(), tmp_path)
    if "data=tokens" in override or "data=masked-tokens" in override:
        # the data module checks its files when set up, not when built
        assert cfg.data.train_path == "x.bin"
    _instantiate_all(cfg)


@pytest.mark.parametrize("recipe", recipes())
def test_every_recipe_instantiates_and_plans(recipe, tmp_path):
    cfg = _compose([f"recipe={recipe}"], tmp_path)
    _instantiate_all(cfg)
    result = plan(cfg, recipe)
    text = format_plan(result)
    assert f"twobp-plan {recipe}" in text
    # a tied weight (GPT-2's embedding and head) is one parameter of the model, held by two stages
    assert 0 < result.params <= sum(s.params for s in result.stages)
    if cfg.plan.gpu_memory_gib is not None:  # the GPU recipes are sized to fit their GPUs
        assert all(r.fits for r in result.ranks), text


def test_schedule_and_split_switch_by_override(tmp_path):
    cfg = _compose(["schedule=gpipe", "strategy.split_backward=false"], tmp_path)
    s = instantiate(cfg.strategy, _convert_="all")
    assert (s.schedule_name, s.split_backward) == ("gpipe", False)
    cfg = _compose(["recipe=llama7b-4gpu"], tmp_path)
    assert (cfg.strategy.schedule, cfg.strategy.num_microbatches) == ("1f1b", 4), "1F1B-1: m = p"


def test_zero_bubble_without_split_is_refused(tmp_path):
    cfg = _compose(["schedule=zb-h1", "strategy.split_backward=false"], tmp_path)
    with pytest.raises(Exception, match="split by definition"):
        instantiate(cfg.strategy)


def test_unknown_recipe_names_the_known_ones(tmp_path):
    with pytest.raises(Exception, match=r"(?s)recipe/llama-7b.*Available options in 'recipe'.*llama7b-4gpu"):
        _compose(["recipe=llama-7b"], tmp_path)


def test_recipe_is_a_config_group_of_the_repositorys_recipes_dir():
    assert recipes() == sorted(p.stem for p in (CONF_DIR.parent / "recipes").glob("*.yaml"))
    assert "cpu-tiny-llama" in recipes() and "llama7b-4gpu" in recipes()
    for name in recipes():
        assert (CONF_DIR / "recipe" / f"{name}.yaml").read_text().startswith("# @package _global_")
