"""Where this rank stands in the run, for users' code and the strategy's hooks: the pipeline's options
as resolved for this world (degree, micro-batches, stages per rank), this rank's places in the
``("dp", "pp")`` mesh, its stages, and the mesh's groups. A mixin of
:class:`~lightning_twobp.TwoBPStrategy`, which provides ``options``, ``world_size``, ``global_rank``,
``_mesh`` and ``_built``."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_twobp.engine.stage import deferred_fraction
from lightning_twobp.lightning.layout import MeshLayout
from lightning_twobp.options import PipelineOptions
from lightning_twobp.schedules import Schedule

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_twobp.lightning.pipeline import Pipeline

__all__ = ["PipelinePlacement"]

NOT_YET = (
    "the pipeline is built in setup(), when a Trainer call starts: call trainer.fit (or validate, test, predict) first"
)
# after a call: its teardown released the pipeline ("call trainer.fit first" misled a user who just had)
ENDED = (
    "the pipeline exists only during a Trainer call (built in setup(), released at teardown) and the last "
    "call has ended: read it in a hook or callback while trainer.fit (or validate, test, predict) runs, "
    "e.g. on_train_start; strategy.stage_sizes and strategy.auto_choice stay readable after the call"
)


class PipelinePlacement:
    """Read-only placement properties (see the module's docstring)."""

    options: PipelineOptions
    world_size: int
    global_rank: int
    _mesh: DeviceMesh | None
    _timeout: timedelta | None
    _pipeline: Pipeline | None
    _calls_ended: bool  # a Trainer call has torn its pipeline down

    if TYPE_CHECKING:
        # Lightning types it Optional (a strategy not yet connected); every hook of ours runs after the
        # Trainer connected the module. For the type checker only: Lightning's property is the one that runs.
        @property
        def lightning_module(self) -> pl.LightningModule: ...

    @property
    def schedule_name(self) -> str:
        return self.options.schedule

    @property
    def split_backward(self) -> bool:
        return self.options.split_backward

    @property
    def pipeline_timeout(self) -> float | None:
        return self.options.pipeline_timeout

    @property
    def pipeline_degree(self) -> int:
        return self.options.degree(self.world_size)

    @property
    def num_microbatches(self) -> int:
        return self.options.microbatches(self.pipeline_degree)

    @property
    def stages_per_rank(self) -> int:
        return self.options.stages

    @property
    def layout(self) -> MeshLayout:
        return MeshLayout(self.world_size, self.pipeline_degree, self.global_rank)

    @property
    def process_group_timeout(self) -> timedelta | None:
        return self._timeout

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("dp", "pp")`` :class:`~torch.distributed.device_mesh.DeviceMesh` of the run."""
        if self._mesh is None:
            raise RuntimeError(f"TwoBPStrategy.device_mesh: the mesh is made when the processes start; {NOT_YET}")
        return self._mesh

    @property
    def pp_rank(self) -> int:
        """This rank's place in its pipeline, ``0 .. pipeline_degree - 1``."""
        return self.layout.pp_rank

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica, ``0 .. world_size / pipeline_degree - 1``."""
        return self.layout.dp_rank

    @property
    def dp_degree(self) -> int:
        return self.layout.dp_degree

    @property
    def schedule(self) -> Schedule:
        return self._built("schedule").executor.schedule

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """The pipeline stages this rank holds."""
        return tuple(self.schedule.stages_of(self.pp_rank))

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds stage 0 (the step runs up to the pipelined block here)."""
        return 0 in self.stage_ids

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last stage (the loss and ``self.log`` happen here)."""
        return self.schedule.num_stages - 1 in self.stage_ids

    def _built(self, what: str) -> Pipeline:
        if self._pipeline is None:
            raise RuntimeError(f"TwoBPStrategy.{what}: {ENDED if self._calls_ended else NOT_YET}")
        return self._pipeline

    @property
    def deferred_fraction(self) -> float:
        """Share of this rank's weight-gradient work that W computed so far (see
        :func:`~lightning_twobp.engine.stage.deferred_fraction`); NaN under a fused schedule, which has no W."""
        executor = self._built("deferred_fraction").executor
        if not executor.schedule.split_backward:
            return float("nan")
        return deferred_fraction(executor.stages.values())

    def describe_rank(self) -> str:
        """This rank in messages to the others: its global and pipeline rank, stages and host."""
        held = ", ".join(map(str, self.stage_ids))
        host = socket.gethostname()
        return f"global rank {self.global_rank} (pipeline rank {self.pp_rank}, stage(s) {held}, host {host})"

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group of the mesh dimension ``"pp"`` or ``"dp"`` (None before the processes start)."""
        return self._mesh.get_group(dim) if self._mesh is not None else None
