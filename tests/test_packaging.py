"""An installed `tandem` serves the shipped model: the wheel carries models/tiny-moe as
engine/tiny-moe/, engine.config.SHIPPED_MODEL finds it there with no checkout around (and no
torch), and no installed package is the models/ scripts.  Builds a wheel offline (a few seconds)
from a copy of the tree, so the checkout gets no build/ folder."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
                              ".hypothesis", "runs", ".gl", ".whl")
CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "model.safetensors")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed: no offline wheel build")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "out"), str(src)], check=True, cwd=tmp, timeout=300)
    (found,) = (tmp / "out").glob("tandem-*.whl")
    return found


def test_the_wheel_carries_the_checkpoint_and_not_the_models_scripts(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in CHECKPOINT_FILES:
        assert f"engine/tiny-moe/{f}" in names
    assert "engine/corpus.py" in names and "worker/convert.py" in names
    assert "deploy/tasks/stdlib-heldout.jsonl" in names          # `tandem eval stdlib`
    assert not any(n.startswith("models/") for n in names)


def test_an_installed_copy_resolves_the_shipped_model(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no site-packages (neither the checkout's editable install nor torch), only the wheel
    probe = ("import sys; from engine.config import SHIPPED_MODEL, ModelConfig; "
             "ModelConfig.from_path(SHIPPED_MODEL); assert 'torch' not in sys.modules; print(SHIPPED_MODEL)")
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)}, timeout=60)
    assert out.returncode == 0, out.stderr
    shipped = Path(out.stdout.strip())
    assert shipped == site / "engine" / "tiny-moe"
    assert all((shipped / f).is_file() for f in CHECKPOINT_FILES)


def test_a_checkout_resolves_the_shipped_model_in_place() -> None:
    from engine.config import SHIPPED_MODEL

    assert SHIPPED_MODEL == ROOT / "models" / "tiny-moe"
