"""``twobp-train``: Hydra recipes trained with ``Trainer(strategy="twobp")``.

    twobp-train                                    # the default recipe: tiny LLaMa, 2 CPU processes
    twobp-train recipe=llama7b-4gpu                # the 2BP paper's 7B run on 4 GPUs
    twobp-train schedule=gpipe strategy.split_backward=false trainer.max_steps=50
    twobp-train -m schedule=1f1b,zb-h1             # a sweep: one run per schedule

The config is ``conf/config.yaml`` (one default per group) with the recipe, ``recipes/<name>.yaml``
(the config group ``recipe``), on top; every value can be overridden on the command line;
``twobp-train --help`` lists the recipes, the groups and the common overrides. Lightning launches the processes (gloo
on CPU, NCCL on
GPU); under torchrun or SLURM it uses the processes that exist. Each run writes its config, logs, a
sharded checkpoint and ``summary.json`` under ``outputs/<recipe>/<time>/``.

Multirun: Lightning's script launcher starts the other ranks by re-running the command line, which
under ``-m`` would re-run the whole sweep in every child. So under ``-m`` each job is run as a child
``twobp-train`` with that job's overrides (one ordinary run, whose own ranks Lightning launches), one
job after another.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from lightning_twobp.config import CONF_DIR

__all__ = ["CheckpointNotFound", "Refused", "instantiate_data", "main", "resume_path", "train"]


class Refused(ValueError):
    """A recipe's configuration refused before anything is built; the message names the fix."""


class CheckpointNotFound(FileNotFoundError):
    """``ckpt_path=last`` found no checkpoint of an earlier run."""


# Printed as one line, as twobp-plan prints its refusals: a traceback above the fix only buries it.
_REFUSED = (Refused, CheckpointNotFound)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Build everything from ``cfg`` and fit; returns the run summary (on rank 0, else ``{}``)."""
    import lightning_twobp  # noqa: F401  (registers "twobp" for configs that name it as a string)

    if cfg.get("threads_per_process") and cfg.trainer.accelerator == "cpu":
        torch.set_num_threads(int(cfg.threads_per_process))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else os.getcwd()
    data = instantiate_data(cfg)  # first: a config error there is refused before a large model is built
    with torch.device("meta") if cfg.get("build_on_meta") else contextlib.nullcontext():
        model = instantiate(cfg.model)  # on meta, each rank makes its own stages at setup
    strategy = instantiate(cfg.strategy, _convert_="all")  # balance may be a list
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate(lg) for lg in (cfg.get("logger") or {}).values()]
    trainer: pl.Trainer = instantiate(
        cfg.trainer, strategy=strategy, callbacks=callbacks, logger=loggers or False, default_root_dir=out_dir
    )
    trainer.fit(model, datamodule=data, ckpt_path=resume_path(cfg.get("ckpt_path"), out_dir, cfg.get("model")))
    if cfg.get("validate"):
        trainer.validate(model, datamodule=data)
    summary: dict[str, Any] = next((c.summary for c in callbacks if hasattr(c, "summary")), {})
    rank = trainer.global_rank
    if torch.distributed.is_initialized():
        # Lightning leaves the process group up; tearing it down here lets its threads stop before
        # the interpreter exits (otherwise gloo can abort at exit with "terminate called ...").
        torch.distributed.destroy_process_group()
    return summary if rank == 0 else {}


# which data groups fit which models: what a mismatch is told to use instead
_DATA_FOR = (
    "data=images for ResNet, data=masked-counting (or masked-tokens) for BERT, data=counting (or tokens) for the LMs"
)


def instantiate_data(cfg: DictConfig) -> Any:
    """``cfg.data`` built; a data group that reads a field the model does not have (``data=counting``
    with ``model=tiny-resnet``) is refused naming both groups and the ones that fit."""
    from omegaconf.errors import InterpolationKeyError, MissingMandatoryValue

    try:
        return instantiate(cfg.data)
    except InterpolationKeyError as e:
        if "'model." not in str(e):
            raise  # another missing key (a typo in an interpolation): Hydra's message names it
        choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
        raise Refused(
            f"data={choices.get('data', '?')} does not fit model={choices.get('model', '?')} ({e}): use {_DATA_FOR}"
        ) from e
    except MissingMandatoryValue as e:
        key = getattr(e, "full_key", "") or "a value"
        example = (
            f"{key}=data/my-corpus/train.bin (twobp-tokenize writes token files)"
            if key.endswith("_path")
            else f"{key}=..."
        )
        raise Refused(f"{key} has no value: give it on the command line, e.g. {example}") from e


def resume_path(ckpt_path: str | None, out_dir: str, model: DictConfig | None = None) -> str | None:
    """``ckpt_path`` as given, or for ``last`` the newest complete checkpoint of this recipe's earlier
    runs (``outputs/<recipe>/*/checkpoints/*.ckpt``, the run directory's siblings) whose ``model`` config (in
    the run's ``.hydra/config.yaml``) is ``model``, else the newest: a newer run with other overrides
    (``model.vocab_size``) holds other shapes, which failed in torch's loader naming neither checkpoint nor
    fix; where the newest differs, a line names the keys. Lightning's own ``"last"`` would look only in this
    run's new, empty directory."""
    if ckpt_path != "last":
        return ckpt_path
    from lightning_twobp.lightning.checkpoint import MANIFEST

    runs = Path(out_dir).resolve().parent
    found = sorted(
        (m.parent for m in runs.glob(f"*/checkpoints/*.ckpt/{MANIFEST}")),
        key=lambda p: (p / MANIFEST).stat().st_mtime,
        reverse=True,
    )
    if not found:
        raise CheckpointNotFound(
            f"ckpt_path=last: no complete checkpoint under {runs}/*/checkpoints/ (earlier runs of this recipe); "
            f"pass a checkpoint's path, quoted for Hydra when it holds '=': "
            f"'ckpt_path=\"outputs/.../checkpoints/epoch=0-step=10.ckpt\"'"
        )
    wanted = {} if model is None else _flat(OmegaConf.to_container(model, resolve=True))
    differs = {path: _differences(_run_model(path.parent.parent), wanted) for path in found}
    same = [path for path in found if not differs[path]]
    chosen = same[0] if same else found[0]  # none alike: the newest (a changed lr resumes; a shape says so below)
    if differs[found[0]]:
        said = "; ".join(differs[found[0]][:4])
        what = f"resuming {chosen}, the newest with this model config" if same else "resuming it all the same"
        fix = "a checkpoint of other shapes fails to load: pass ckpt_path= one of this model"
        if getattr(rank_zero_only, "rank", 0) == 0:  # every rank resolves it alike
            print(f"twobp: ckpt_path=last: the newest checkpoint, {found[0]}, was written with {said}; {what} ({fix})")
    return str(chosen)


def _run_model(run: Path) -> dict[str, Any] | None:
    """The ``model`` config an earlier run saved (Hydra's ``.hydra/config.yaml``), flat; None when unknown."""
    saved = run / ".hydra" / "config.yaml"
    if not saved.is_file():
        return None
    cfg = OmegaConf.load(saved)
    model = cfg.get("model") if isinstance(cfg, DictConfig) else None
    if not isinstance(model, DictConfig):
        return None
    try:
        return _flat(OmegaConf.to_container(model, resolve=True))
    except Exception:  # an interpolation into another group of that run's config: compare as written
        return _flat(OmegaConf.to_container(model, resolve=False))


def _flat(tree: Any, prefix: str = "model") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{key}").items()}


def _differences(saved: dict[str, Any] | None, wanted: dict[str, Any]) -> list[str]:
    """``key: theirs (that run) -> ours (this run)`` for each key that differs; none where either is unknown."""
    if saved is None or not wanted:
        return []
    keys = sorted(saved.keys() | wanted.keys())
    return [f"{k} {saved.get(k)!r} there, {wanted.get(k)!r} here" for k in keys if saved.get(k) != wanted.get(k)]


def _launched_by_lightning(cfg: DictConfig) -> bool:
    """Whether Lightning will start the other ranks by re-running this command line."""
    devices = cfg.trainer.get("devices", 1)
    many = (
        devices == -1
        or devices == "auto"
        or (isinstance(devices, int) and devices > 1)
        or cfg.trainer.get("num_nodes", 1) > 1
    )
    external = any(k in os.environ for k in ("LOCAL_RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"))
    return many and not external


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN and _launched_by_lightning(cfg):
        job = [
            sys.executable,
            "-m",
            "lightning_twobp.train",
            *hc.overrides.task,
            f"hydra.run.dir={hc.runtime.output_dir}",
        ]
        print(f"sweep job {hc.job.num}: {' '.join(hc.overrides.task)}", flush=True)
        done = subprocess.run(job)
        if done.returncode:
            raise SystemExit(
                f"sweep job {hc.job.num} ({' '.join(hc.overrides.task)}) failed with exit code {done.returncode}"
            )
        return
    if OmegaConf.select(cfg, "print_config", default=False) and os.environ.get("LOCAL_RANK", "0") == "0":
        print(OmegaConf.to_yaml(cfg, resolve=True))  # once per machine: Lightning's launcher re-runs this script
    try:
        train(cfg)
    except _REFUSED as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"twobp-train: error: {e}\n(HYDRA_FULL_ERROR=1 for the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
