"""The random streams of ``lightning/rng.py`` in one process: the step code's draws, seeded alike for a
step and micro-batch, leave the global generators as they were."""

from __future__ import annotations

import random

import numpy as np
import torch

from lightning_twobp.lightning.rng import StageStreams, drawing_from


def _draw() -> tuple:
    return torch.rand(3).tolist(), float(np.random.rand()), random.random()


def _global() -> tuple:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _same(a: tuple, b: tuple) -> bool:
    np_a, np_b = a[1], b[1]
    numpy_same = np.array_equal(np_a[1], np_b[1]) and np_a[2:] == np_b[2:]
    return torch.equal(a[0], b[0]) and numpy_same and a[2] == b[2]


def test_step_code_draws_alike_for_a_key_and_hands_the_generators_back():
    """Two ranks' streams built from other states but one shared seed draw the same numbers for a step
    and micro-batch, other numbers for another; the generators are untouched after, and the draws
    after the pipelined call come from the generators as they were before."""
    torch.manual_seed(1)
    a = StageStreams([0], 0, torch.device("cpu"), shared=42)
    torch.manual_seed(2)
    b = StageStreams([1], 0, torch.device("cpu"), shared=42)
    before = _global()
    with a.step_code("training_step:(0, 0):[0]:mb0"):
        first = _draw()
    assert _same(before, _global())
    with b.step_code("training_step:(0, 0):[0]:mb0") as hand_back:
        assert _draw() == first
        hand_back()
        after_call = _draw()
    with a.step_code("training_step:(0, 0):[0]:mb1"):
        assert _draw() != first
    torch.set_rng_state(before[0]), np.random.set_state(before[1]), random.setstate(before[2])
    assert after_call == _draw()  # what the generators as they were before would have drawn


def test_drawing_from_none_leaves_no_trace():
    """Profiling runs the step's code before the pipeline exists: its draws leave every generator as it was."""
    before = _global()
    with drawing_from(None, []):
        _draw()
    assert _same(before, _global())


def test_a_resumed_stream_takes_the_saved_step_code_seed():
    """The step code's seed is in the streams' checkpoint state: a run seeded otherwise, resumed, draws
    what the saved run drew."""
    saved = StageStreams([0], 0, torch.device("cpu"), shared=42)
    with saved.step_code("training_step:(2, 0):[2]:mb0"):
        want = _draw()
    resumed = StageStreams([0], 0, torch.device("cpu"), shared=8)
    resumed.resume(saved.state_dict())
    with resumed.step_code("training_step:(2, 0):[2]:mb0"):
        assert _draw() == want


def test_cuda_generator_states_come_back_in_device_order():
    """A checkpoint keeps device i's CUDA generator as ``cuda{i}``; sorted as text, ``cuda10`` came before
    ``cuda2`` and a host with more than ten GPUs resumed each device with another's stream (a cold review)."""
    from lightning_twobp.lightning.checkpoint import cuda_states

    state = {f"cuda{i}": torch.tensor([i]) for i in (0, 1, 10, 11, 2, 9)} | {"torch": torch.tensor([99])}
    assert [int(t) for t in cuda_states(state)] == [0, 1, 2, 9, 10, 11]
