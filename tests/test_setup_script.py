"""scripts/setup.sh takes torch 2.13.0 (CPU) from a local wheel when pip finds one, else
from PyTorch's CPU index, and refuses a Python it cannot use: checked with `--print`,
which decides as a real run does and changes nothing (no .venv, no network: pip is asked
with --no-index).

CI's real run (`.ci/run`, on an image whose pip.conf finds-links /opt/wheels) takes the
local wheel; these tests replace pip's configuration so that they hold on any machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def setup_print(tmp_path: Path, find_links: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`bash scripts/setup.sh --print` from a copy of the script (no .venv beside it), with
    pip's configuration files off and `find_links` as its only wheel folder."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True, exist_ok=True)
    script = tmp_path / "repo" / "scripts" / "setup.sh"
    script.write_text((ROOT / "scripts" / "setup.sh").read_text())
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "KVSTRATA_TORCH"))}
    environ |= {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(find_links), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(script), "--print"], capture_output=True, text=True, env=environ, timeout=120)


def fake_torch_wheel(folder: Path) -> None:
    """A wheel that names itself torch 2.13.0+cpu: all pip's resolver reads."""
    folder.mkdir()
    info = "torch-2.13.0+cpu.dist-info"
    with zipfile.ZipFile(folder / "torch-2.13.0+cpu-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_a_local_wheel_is_used_without_an_index(tmp_path):
    fake_torch_wheel(tmp_path / "wheels")
    result = setup_print(tmp_path, tmp_path / "wheels")
    assert result.returncode == 0, result.stderr
    assert "torch==2.13.0 from a wheel pip finds without an index" in result.stdout
    assert "--index-url" not in result.stdout
    assert not (tmp_path / "repo" / ".venv").exists()


def test_without_a_local_wheel_torch_comes_from_the_cpu_index(tmp_path):
    (tmp_path / "empty").mkdir()
    result = setup_print(tmp_path, tmp_path / "empty")
    assert result.returncode == 0, result.stderr
    assert f"pip install --index-url {CPU_INDEX} torch==2.13.0" in result.stdout


def test_an_index_given_wins(tmp_path):
    fake_torch_wheel(tmp_path / "wheels")
    result = setup_print(tmp_path, tmp_path / "wheels", KVSTRATA_TORCH_INDEX="https://mirror.invalid/cpu")
    assert "--index-url https://mirror.invalid/cpu torch==2.13.0" in result.stdout


def test_a_python_it_cannot_use_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    result = setup_print(tmp_path, tmp_path / "empty", PYTHON=str(tmp_path / "no-python"))
    assert result.returncode == 1
    assert "needs Python 3.11-3.14" in result.stderr and "not found" in result.stderr
