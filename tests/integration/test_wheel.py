"""The wheel, not the editable install: ci/check_wheel.sh builds it from this checkout,
installs it into a fresh virtual environment, imports every module of the package from
there and compresses a tensor (also a step of .ci/run)."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(),
                    reason="no .venv (make setup): the check installs torch from there")
def test_wheel_installs_imports_and_compresses():
    r = subprocess.run(["bash", str(ROOT / "ci" / "check_wheel.sh")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ci/check_wheel.sh failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "passed" in r.stdout
