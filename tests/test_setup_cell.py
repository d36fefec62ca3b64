"""The labs' setup block, for real: a fresh virtualenv without kvlab (torch and a kernel installed,
as on Colab or a bare Jupyter), the lab's own first cell clones the repository from a URL
(``file://`` here, github.com for readers), installs the library, and the lab then runs up to its
first exercise. Plus the pieces: one repository setting, torch kept, setup block placement."""

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import nbformat
import pytest
import yaml
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from kvlab import __version__
from kvlab.course import labs
from kvlab.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "kvlab" / "course"))
import install  # noqa: E402  (kvlab/course/install.py runs as a script from a clone: standard library only)

LAB = REPO_ROOT / "labs" / "lab01_naive_generation.ipynb"


def test_every_lab_and_solution_carries_the_setup_block_from_config():
    repo = yaml.safe_load((REPO_ROOT / "_config.yml").read_text())["repository"]
    block = labs.setup_block()
    assert repo["url"] in block and f'"--branch", "{repo["branch"]}"' in block
    assert f'"--release", "{__version__}"' in block
    for path in sorted(REPO_ROOT.glob("labs/lab*.ipynb")) + sorted(REPO_ROOT.glob("solutions/lab*.ipynb")):
        first = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        assert first.source.startswith(block + "\n"), f"{path.name}: run `python -m kvlab.course.labs`"


def test_setup_block_is_added_replaced_and_upgraded():
    block = "# Setup X\n# end of setup"
    assert labs.with_setup("import torch", block, "t") == block + "\n\nimport torch"
    assert labs.with_setup("# Setup old\nimport x\n# end of setup\nimport torch", block, "t") == block + "\nimport torch"
    old = '# Setup. old\nif 1:\n    sys.path.insert(0, "/tmp/kvlab")\n\nimport torch'
    assert labs.with_setup(old, block, "t") == block + "\n\nimport torch"
    once = labs.with_setup(old, labs.setup_block(), "t")
    assert labs.with_setup(once, labs.setup_block(), "t") == once     # idempotent
    assert once.count("# end of setup") == 1
    with pytest.raises(ValueError, match="end of setup"):
        labs.with_setup("# Setup\nimport x", block, "t")


def test_installer_keeps_an_installed_torch(tmp_path, capsys):
    (tmp_path / "requirements-lab.txt").write_text("# c\ntorch>=2.5,<2.15\ntransformers>=5.24,<5.25  # x\n")
    assert install.requirements(tmp_path, None) == ["torch>=2.5,<2.15", "transformers>=5.24,<5.25"]
    assert install.requirements(tmp_path, "2.8.0+cu126") == ["transformers>=5.24,<5.25"]
    assert "warning" not in capsys.readouterr().out
    assert install.requirements(tmp_path, "2.16.0") == ["transformers>=5.24,<5.25"]
    assert "outside the tested range" in capsys.readouterr().out


def _clone_source(dest: Path, branch: str) -> None:
    """The working tree as a git repository on the configured branch (what readers clone)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        if (REPO_ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / f, dest / f)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=" + branch]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(git + cmd, cwd=dest, check=True)


def test_lab_setup_installs_kvlab_from_a_url_in_a_fresh_venv(tmp_path, monkeypatch):
    branch = labs.repository()["branch"]
    origin = tmp_path / "origin"
    _clone_source(origin, branch)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # What Colab or a bare Jupyter already has: a torch (the CPU wheel on disk here) and a kernel.
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-compile", "torch==2.13.0", "ipykernel"],
                   check=True)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert subprocess.run([py, "-c", "import kvlab"], cwd=tmp_path, capture_output=True).returncode != 0
    kernels = tmp_path / "jupyter" / "kernels" / "fresh"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(
        '{"argv": ["%s", "-m", "ipykernel_launcher", "-f", "{connection_file}"], '
        '"display_name": "fresh", "language": "python"}' % py)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("KVLAB_REPO", origin.as_uri())
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PIP_NO_COMPILE", "1")
    nb = nbformat.read(LAB, as_version=4)
    work = tmp_path / "work"
    work.mkdir()
    client = NotebookClient(nb, timeout=900, kernel_name="fresh", resources={"metadata": {"path": str(work)}})
    with pytest.raises(CellExecutionError) as err:
        client.execute()
    assert err.value.ename == "NotImplementedError", str(err.value)
    assert "Exercise: write naive_generate" in str(err.value)
    assert (tmp_path / f"kvlab-{__version__}" / "kvlab" / "__init__.py").exists()
    installed = subprocess.run([py, "-c", "import kvlab, torch; print(kvlab.__file__, torch.__version__)"],
                               cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert f"kvlab-{__version__}" in installed and "2.13.0" in installed  # torch kept, not replaced
