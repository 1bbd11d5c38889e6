"""One random stream per pipeline stage, as Megatron's model-parallel RNG tracker keeps one per
model-parallel rank: a generator state of its own, swapped in around the stage's work and out after.

After ``seed_everything(s)`` every rank starts from the same random state. Without separate streams
each stage would draw the same numbers for the same micro-batch (stage 1's dropout masks equal to stage
0's), which one process never does. So each stage ``k`` of data-parallel replica ``d`` draws from a
stream seeded from (the random state at the start of the Trainer call, ``k``, ``d``): deterministic
under a seed, different between stages and between replicas (one process draws one mask for its
whole batch, so replicas must not repeat each other's), and independent of what any other stage draws
or in which order a schedule runs the stages. The executor enters :meth:`StageStreams.fork` around
every F, B, W and BW of a stage and its forward-only passes, the strategy around the last stage's
evaluation step. The global streams are untouched by the stages' draws, so they stay in step across
the ranks of a pipeline (a shuffling loader reads them).

The step's own code before the pipelined call is the one thing every stage must draw *alike*: the
first stage runs it for the inputs and the last stage again for the loss, so mixup's lambda (or a
random mask applied to inputs and targets) drawn there must be the same number on both, or the inputs
are mixed with one lambda and the targets with another. :meth:`StageStreams.step_code` seeds torch's,
NumPy's and Python's generators for that code from (a seed pipeline rank 0 broadcast when the Trainer
call set up, the step, the micro-batch), the same on every rank of the pipeline, and hands the stage's
own stream back at the pipelined call.

Checkpoints store each stream under ``stage{k}_dp{d}``, so it resumes on whichever rank holds stage
``k`` under the new layout; a stage the checkpoint has no stream for starts a new one.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager

import torch

try:  # NumPy is optional for torch; a step that draws from it (timm's Mixup: np.random.beta) needs it
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every environment the tests run in
    np = None  # type: ignore[assignment]

__all__ = ["StageStreams", "drawing_from", "fingerprint"]


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1  # a 63-bit seed


def _derive(base: str, stage: int, dp_rank: int) -> int:
    return _seed(f"{base}:stage{stage}:dp{dp_rank}")


def fingerprint() -> str:
    """A fingerprint of the CPU generator's state now, without drawing from it (the loaders' shuffling
    stays as it was)."""
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


class StageStreams:
    """The random streams of this rank's stages (CPU, and the CUDA device when training on one)."""

    def __init__(self, stages: Iterable[int], dp_rank: int, device: torch.device, shared: int | None = None) -> None:
        """``shared``: the seed of the step code's draws, the same on every rank of this pipeline
        (from :func:`fingerprint` on pipeline rank 0, broadcast); from this rank's own when alone. Saved
        in checkpoints, so a resumed run draws as the uninterrupted one, however its process was seeded."""
        self.dp_rank = dp_rank
        self._devices = [device] if device.type == "cuda" else []
        base = fingerprint()
        self._states = {s: self._seeded(_derive(base, s, dp_rank)) for s in stages}
        self._pending: dict[int, Mapping[str, torch.Tensor]] = {}
        self._shared = shared if shared is not None else _seed(base)

    def _current(self) -> list[torch.Tensor]:
        return _torch_states(self._devices)

    def _install(self, states: list[torch.Tensor]) -> None:
        _set_torch_states(states, self._devices)

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

    def step_code(self, key: str) -> AbstractContextManager[Callable[[], None]]:
        """Inside, until the function it yields is called (at the pipelined call): torch's (CPU and
        CUDA), NumPy's and Python's global generators draw from a stream seeded by (the shared seed,
        ``key``): the step and the micro-batch, so every rank of the pipeline draws the same numbers in
        the step's code before the call (:func:`drawing_from`)."""
        return drawing_from(_seed(f"{self._shared}:dp{self.dp_rank}:{key}"), self._devices)

    def kept(self) -> Callable[[], None]:
        """The streams as they are now; the returned function puts them back (a pipeline step run again,
        once the optimizer step it ran on is redone, draws its first run's masks: those of checking first)."""
        saved = dict(self._states)  # each state a tensor of its own, replaced, never written in place

        def put_back() -> None:
            self._states = dict(saved)

        return put_back

    def name(self, stage: int) -> str:
        return f"stage{stage}_dp{self.dp_rank}"

    @property
    def _steps_name(self) -> str:  # the step code's seed, one per replica (every rank of it holds the same)
        return f"steps_dp{self.dp_rank}"

    def names(self) -> list[str]:
        return [*(self.name(s) for s in self._states), self._steps_name]

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each stream as tensors, under :meth:`name`, and the step code's seed (the checkpoint's keys)."""
        return {
            **{
                self.name(s): {"torch": st[0], **{f"cuda{i}": t for i, t in enumerate(st[1:])}}
                for s, st in self._states.items()
            },
            self._steps_name: {"seed": torch.tensor([self._shared], dtype=torch.int64)},
        }

    def resume(self, saved: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Take the checkpoint's streams of this rank's stages at the next :meth:`apply_pending` (right
        before the next training step, as the global streams are), and its step code's seed now."""
        self._pending = {s: saved[self.name(s)] for s in self._states if self.name(s) in saved}
        if self._steps_name in saved:  # a checkpoint from before the seed was saved keeps this call's
            self._shared = int(saved[self._steps_name]["seed"].item())

    def apply_pending(self) -> None:
        for s, state in self._pending.items():
            cuda = [state.get(f"cuda{i}") for i in range(len(self._devices))]
            # a device stream the checkpoint lacks (saved on the CPU, resumed on a GPU) starts anew
            self._states[s] = [
                state["torch"],
                *(c if c is not None else new for c, new in zip(cuda, self._states[s][1:], strict=False)),
            ]
        self._pending = {}


@contextmanager
def drawing_from(seed: int | None, devices: list[torch.device]) -> Iterator[Callable[[], None]]:
    """Torch's (CPU and ``devices``), NumPy's and Python's global generators seeded with ``seed`` (None:
    left as they are) until the function this yields is called or the block ends; then they are as
    before it, untouched by what was drawn inside. Draws after that call go to the generators as
    they were (the last stage's own stream, where the step runs inside its F)."""
    outer = _torch_states(devices)
    np_outer = np.random.get_state() if np is not None else None
    py_outer = random.getstate()
    if seed is not None:
        torch.default_generator.manual_seed(seed)
        for d in devices:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(seed)
        if np is not None:
            np.random.seed(seed % 2**32)
        random.seed(seed)
    handed_back = False

    def hand_back() -> None:
        nonlocal handed_back
        if not handed_back:
            handed_back = True
            _set_torch_states(outer, devices)
            if np is not None:
                np.random.set_state(np_outer)
            random.setstate(py_outer)

    try:
        yield hand_back
    finally:
        hand_back()


def _torch_states(devices: list[torch.device]) -> list[torch.Tensor]:
    """Torch's generator states: the CPU's, then each of ``devices``'."""
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]


def _set_torch_states(states: list[torch.Tensor], devices: list[torch.device]) -> None:
    torch.set_rng_state(states[0])
    for d, state in zip(devices, states[1:], strict=False):
        torch.cuda.set_rng_state(state, d)
