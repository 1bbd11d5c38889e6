"""The strategy's ``save_checkpoint`` and ``load_checkpoint``: what of the pipeline goes into a
checkpoint beside Lightning's own state (its layout, the stages' random streams) and the fixes a
checkpoint needs when it comes back on another layout (LR schedulers' per-group base rates). The
files themselves: :mod:`.checkpoint`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_twobp.engine.failure import FailureChannel
from lightning_twobp.lightning import checkpoint as ckpt
from lightning_twobp.lightning.checkpoint import set_rng_state
from lightning_twobp.lightning.failures import save_refused
from lightning_twobp.lightning.preemption import Preempted
from lightning_twobp.lightning.rng import StageStreams
from lightning_twobp.private import unset_training_data

if TYPE_CHECKING:
    from lightning_twobp.lightning.pipeline import Pipeline
    from lightning_twobp.lightning.strategy import TwoBPStrategy

log = logging.getLogger(__name__)

__all__ = ["at_stop", "check_storage_options", "load", "refusal", "save", "set_rng_state"]


def check_storage_options(storage_options: Any) -> None:
    if storage_options is not None:
        raise TypeError(
            "TwoBPStrategy.save_checkpoint(..., storage_options=...) is not supported: the checkpoint is "
            "written with torch.distributed.checkpoint, not through a CheckpointIO plugin"
        )


def at_stop(checkpoint: dict[str, Any], loader_states: Any) -> dict[str, Any]:
    """``checkpoint`` with the training loader's position ``loader_states`` (kept by
    :meth:`.preemption.StopSignals.settle` at the end of the last step trained, once every rank agreed to
    stop), where it is not None: Lightning took the next batch before the step at whose start the ranks
    stopped, so its own position counts a batch that was never trained (the resumed run skipped it).
    ``[]`` (the stop came as a new epoch began): no position, that epoch's loader starts anew."""
    fit = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    if loader_states is not None and "combined_loader" in fit:
        fit["combined_loader"] = loader_states
    return checkpoint


def refusal(trainer: Any, failures: FailureChannel | None) -> str | None:
    """Why a save must not run now (an error in the middle of a step on this rank: the other ranks are
    not at this step boundary, and a save would wait on them), or None. Preemption, a non-finite stop and a
    hand-clipped one (HookScaleError) happen on every rank at one step boundary, so their checkpoints are
    consistent (a step they know to be wrong is refused by ``OptimizerChecks.save_refusal``)."""
    from lightning_twobp.lightning.optimizer_checks import HookScaleError, NonFiniteError

    return save_refused(trainer, failures, (Preempted, NonFiniteError, HookScaleError))


def save(
    strategy: TwoBPStrategy,
    checkpoint: dict[str, Any],
    filepath: Any,
    pipeline: Pipeline | None,
    failures: FailureChannel | None,
    refused: str | None,
) -> None:
    """Every rank writes its stages, and the random streams of its stages, into the directory
    ``filepath`` (nothing, with a warning, where the save is ``refused``); ``failures`` names the ranks
    gone when one is lost during the save."""
    if refused is not None:  # never wait on ranks not at this step boundary; never save non-finite weights
        log.warning("twobp: not saving %s: %s", filepath, refused)
        return
    streams = pipeline.streams if pipeline is not None else None
    # who is gone: a dead or stopped process here, else a failure a live rank told (it closed its links)
    lost = (lambda: failures.roll_call() or failures.first(wait=1.0) or "") if failures is not None else None
    path = Path(strategy.broadcast(str(filepath)))
    layout = {
        "pipeline_degree": strategy.pipeline_degree,
        "stages_per_rank": strategy.stages_per_rank,
        "schedule": strategy.schedule_name,
        # what the numerics follow: a resume under schedule="auto" that chooses otherwise is said (_say_rechosen)
        "num_microbatches": strategy.num_microbatches,
        "run": _run_label(strategy),
        # Informational: under "shard" each parameter is stored as its replicas' DTensor shards, which
        # torch.distributed.checkpoint reads back into any layout (shards or whole tensors) by name.
        "data_parallel": strategy.options.data_parallel,
        "dp_degree": strategy.dp_degree,
    }
    lm, group = strategy.lightning_module, strategy.io_group
    states = streams.state_dict() if streams is not None else None
    ckpt.save(checkpoint, path, lm, strategy.optimizers, layout, group, states, lost)


def load(
    strategy: TwoBPStrategy, checkpoint_path: Any, weights_only: bool | None, streams: StageStreams
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """The checkpoint Lightning restores from, this rank's weights and optimizer state loaded by name,
    and the random states to restore right before the next training step."""
    path = Path(strategy.broadcast(str(checkpoint_path)))
    lm = strategy.lightning_module
    if lm.trainer.state.fn == TrainerFn.FITTING:
        # The fit loop set its data up early where the user's code read trainer.estimated_stepping_batches
        # (OneCycleLR's total_steps, in configure_optimizers) and then skips loading the checkpoint's loader
        # position: the resumed run re-read the epoch from its first batch (Lightning #20550, one process
        # alike). Undone, the loop sets its data up again after the restore, as it does when nothing reads it.
        unset_training_data(lm.trainer)
    checkpoint = ckpt.load(
        path,
        lm,
        strategy.optimizers,
        weights_only,
        strict=lm.strict_loading,
        group=strategy.io_group,
        streams=streams.names(),
    )
    streams.resume(checkpoint.pop("twobp_streams", {}))
    _keep_local_base_lrs(strategy.lr_scheduler_configs, checkpoint.get("lr_schedulers", []))
    # Each rank's random streams come back right before the next training step (not now: setting up
    # the loaders and the sanity check would draw from them first, which the uninterrupted run did not).
    resume_rng = checkpoint.pop("twobp_rng", None)
    _announce_relayout(strategy, checkpoint.get("twobp", {}))
    return checkpoint, resume_rng


def _keep_local_base_lrs(configs: list[Any], states: list[dict[str, Any]]) -> None:
    """LR schedulers were saved from rank 0: a rank with other param groups keeps its own per-group
    base learning rates (the groups' lr came back by name) and takes the shared step count."""
    for config, state in zip(configs, states, strict=False):
        local = getattr(config.scheduler, "base_lrs", None)
        if local is not None and len(state.get("base_lrs", local)) != len(local):
            state["base_lrs"] = list(local)
            state.pop("_last_lr", None)


def _run_label(strategy: TwoBPStrategy) -> str:
    """The schedule this call runs, as schedule="auto" names its choice (its label) or as given."""
    if strategy.auto_choice is not None:
        return str(strategy.auto_choice.best.label)
    return f"{strategy.schedule_name} (m={strategy.num_microbatches})"


def _say_rechosen(strategy: TwoBPStrategy, saved: dict[str, Any]) -> None:
    """A resume under schedule="auto", which profiled and chose again for this run (from fresh timings, so
    not always as before): where it chose another schedule or micro-batch count than the checkpoint's run,
    the resumed run trains exactly but not bitwise as the uninterrupted one (the micro-batches' losses sum in
    another order; the stages' random streams follow another cut). Said, with how to keep the saved run's."""
    if strategy.requested.schedule != "auto" or "run" not in saved:
        return
    now = _run_label(strategy)
    if saved["run"] != now:
        rank_zero_warn(
            f"twobp: schedule='auto' chose {now} for this run; the checkpoint was trained under {saved['run']}: "
            f"the resumed run is not bitwise the uninterrupted one (another choice sums the micro-batches in "
            f"another order and cuts the stages' random streams otherwise). To resume as saved, name that "
            f"schedule and num_microbatches={saved.get('num_microbatches')} (or auto_schedules= with it alone)"
        )


def _announce_relayout(strategy: TwoBPStrategy, saved: dict[str, Any]) -> None:
    _say_rechosen(strategy, saved)
    degree, spr = strategy.pipeline_degree, strategy.stages_per_rank
    if saved.get("pipeline_degree") != degree or saved.get("stages_per_rank") != spr:
        rank_zero_info(
            f"twobp: resuming a checkpoint saved with pipeline_degree={saved.get('pipeline_degree')}, "
            f"stages_per_rank={saved.get('stages_per_rank')} on pipeline_degree={degree}, "
            f"stages_per_rank={spr}: weights and optimizer state re-partition by name"
        )
    mode = strategy.options.data_parallel
    if saved.get("data_parallel", "replicate") != mode:  # checkpoints before issue 22 were replicated
        rank_zero_info(
            f"twobp: resuming a checkpoint saved with data_parallel={saved.get('data_parallel', 'replicate')!r} "
            f"under data_parallel={mode!r}: each rank reads its own part of every tensor"
        )
