"""A regular install works: the wheel, installed into a fresh virtualenv, trains and plans from a
directory outside the repository (the Hydra configs ship inside the package)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # an end-to-end run: last (conftest.py)

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"}
    )
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv holding the wheel; the dependencies (torch, Lightning, Hydra) come from this
    environment through a .pth file, so nothing is downloaded and no CUDA build is pulled."""
    tmp = tmp_path_factory.mktemp("wheel")
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), str(REPO)],
        tmp,
    )
    (wheel,) = tmp.glob("lightning_twobp-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)], tmp)
    return venv


def test_the_wheel_trains_and_plans_outside_the_repository(installed, tmp_path):
    bin_ = installed / "bin"
    where = _run(
        [
            str(bin_ / "python"),
            "-c",
            "import lightning_twobp, lightning_twobp.config as c; print(lightning_twobp.__file__); print(c.CONF_DIR)",
        ],
        tmp_path,
    ).stdout.split()
    assert str(installed) in where[0] and where[1].endswith("lightning_twobp/configs"), where
    assert "recipe: " in _run([str(bin_ / "twobp-train"), "--help"], tmp_path).stdout
    _run([str(bin_ / "twobp-train"), "trainer.max_steps=5", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["num_stages"] == 2
    out = _run([str(bin_ / "twobp-plan"), "recipe=llama7b-4gpu", "--json", str(tmp_path / "plan.json")], tmp_path)
    assert "peak rank" in out.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["recipe"] == "llama7b-4gpu"
