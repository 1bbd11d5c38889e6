"""The README's main job runs end to end (short), the way a user starts it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.dist


def test_default_job_trains_and_checkpoints(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "lightning_twobp.train", "--max-steps", "30", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "trained 30 steps" in out.stdout
    final = float(out.stdout.split("final train_loss ")[1].split()[0])
    assert final < 4.0, f"the loss did not fall from ln(256) = 5.5: {final}"
    ckpts = list(tmp_path.glob("logs/version_0/checkpoints/*.ckpt"))
    assert ckpts and (ckpts[0] / "meta.pt").is_file(), "ModelCheckpoint wrote no sharded checkpoint"
