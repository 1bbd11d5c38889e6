"""One random stream per pipeline stage, as Megatron's model-parallel RNG tracker keeps one per
model-parallel rank: a generator state of its own, swapped in around the stage's work and out after.

After ``seed_everything(s)`` every rank starts from the same random state. Without separate streams
each stage would draw the same numbers for the same micro-batch (stage 1's dropout masks equal to stage
0's), which one process never does. So each stage ``k`` of data-parallel replica ``d`` draws from a
stream seeded from (the random state at the start of the Trainer call, ``k``, ``d``): deterministic
under a seed, different between stages and between replicas (one process draws one mask for its
whole batch, so replicas must not repeat each other's), and independent of what any other stage draws
or in which order a schedule runs the stages. The executor enters :meth:`StageStreams.fork` around
every F, B, W and BW of a stage and its forward-only passes; the strategy around the first stage's
part of the step before the pipelined block and the last stage's part after it. The global streams
are untouched by the stages' draws, so they stay in step across the ranks of a pipeline (a shuffling
loader reads them).

Checkpoints store each stream under ``stage{k}_dp{d}``, so it resumes on whichever rank holds stage
``k`` under the new layout; a stage the checkpoint has no stream for starts a new one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

__all__ = ["StageStreams"]


def _derive(base: str, stage: int, dp_rank: int) -> int:
    digest = hashlib.sha256(f"{base}:stage{stage}:dp{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a 63-bit seed


class StageStreams:
    """The random streams of this rank's stages (CPU, and the CUDA device when training on one)."""

    def __init__(self, stages: Iterable[int], dp_rank: int, device: torch.device) -> None:
        self.dp_rank = dp_rank
        self._devices = [device] if device.type == "cuda" else []
        # A fingerprint of the state now, without drawing from it: the loaders' shuffling stays as it was.
        base = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
        self._states = {s: self._seeded(_derive(base, s, dp_rank)) for s in stages}
        self._pending: dict[int, Mapping[str, torch.Tensor]] = {}

    def _current(self) -> list[torch.Tensor]:
        return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in self._devices)]

    def _install(self, states: list[torch.Tensor]) -> None:
        torch.set_rng_state(states[0])
        for d, state in zip(self._devices, states[1:], strict=False):
            torch.cuda.set_rng_state(state, d)

    def _seeded(self, seed: int) -> list[torch.Tensor]:
        with torch.random.fork_rng(devices=self._devices):
            torch.manual_seed(seed)
            return self._current()

    @contextmanager
    def fork(self, stage: int) -> Iterator[None]:
        """Inside: the global generators draw from ``stage``'s stream; after: they are as before."""
        outer = self._current()
        self._install(self._states[stage])
        try:
            yield
        finally:
            self._states[stage] = self._current()
            self._install(outer)

    def name(self, stage: int) -> str:
        return f"stage{stage}_dp{self.dp_rank}"

    def names(self) -> list[str]:
        return [self.name(s) for s in self._states]

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each stream as tensors, under :meth:`name` (the checkpoint's keys)."""
        return {
            self.name(s): {"torch": st[0], **{f"cuda{i}": t for i, t in enumerate(st[1:])}}
            for s, st in self._states.items()
        }

    def resume(self, saved: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Take the checkpoint's streams of this rank's stages at the next :meth:`apply_pending` (right
        before the next training step, as the global streams are)."""
        self._pending = {s: saved[self.name(s)] for s in self._states if self.name(s) in saved}

    def apply_pending(self) -> None:
        for s, state in self._pending.items():
            cuda = [state.get(f"cuda{i}") for i in range(len(self._devices))]
            # a device stream the checkpoint lacks (saved on the CPU, resumed on a GPU) starts anew
            self._states[s] = [
                state["torch"],
                *(c if c is not None else new for c, new in zip(cuda, self._states[s][1:], strict=False)),
            ]
        self._pending = {}
