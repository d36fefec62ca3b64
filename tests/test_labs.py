"""The lab contract: labs/ is generated from solutions/, stubs stop the learner at the first exercise."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from kvlab.course import labs
from kvlab.paths import REPO_ROOT

SOLUTIONS = sorted((REPO_ROOT / "solutions").glob("lab*.ipynb"))


def test_there_are_labs():
    assert SOLUTIONS, "no solution notebooks found"
    assert {p.name for p in SOLUTIONS} == {p.name for p in (REPO_ROOT / "labs").glob("lab*.ipynb")}


def test_labs_in_sync_with_solutions():
    r = subprocess.run([sys.executable, "-m", "kvlab.course.labs", "--check"], cwd=REPO_ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", SOLUTIONS + sorted((REPO_ROOT / "labs").glob("lab*.ipynb")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: commit notebooks without outputs"


def test_stub_replaces_region_and_names_exercise():
    src = "def f(x):\n    y = 1\n    # BEGIN SOLUTION\n    return x + y\n    # END SOLUTION\n"
    out = labs.stub_source(src, "t")
    assert "return x + y" not in out and "y = 1" in out
    assert 'raise NotImplementedError("Exercise: write f' in out
    assert "\n    raise NotImplementedError" in out  # indentation kept
    assert "write loop" in labs.stub_source("# BEGIN SOLUTION loop\nx = 1\n# END SOLUTION", "t")


@pytest.mark.parametrize("src", ["# BEGIN SOLUTION\nx = 1\n", "x = 1\n# END SOLUTION\n",
                                 "# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n"])
def test_malformed_fences_are_errors(src):
    with pytest.raises(ValueError):
        labs.stub_source(src, "t")


def _first_stub_name(nb):
    for cell in nb.cells:
        if cell.cell_type == "code" and "raise NotImplementedError(" in cell.source:
            line = next(l for l in cell.source.splitlines() if "raise NotImplementedError(" in l)
            return line.split("Exercise: write ", 1)[1].split(" (see", 1)[0]
    raise AssertionError("lab has no stub")


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "labs").glob("lab*.ipynb")), ids=lambda p: p.name)
def test_lab_stops_at_first_exercise(path):
    nb = nbformat.read(path, as_version=4)
    first = _first_stub_name(nb)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    with pytest.raises(CellExecutionError) as err:
        client.execute()
    assert err.value.ename == "NotImplementedError", f"{path.name} stopped with {err.value.ename}, not at a stub:\n{err.value}"
    assert f"Exercise: write {first}" in str(err.value), f"{path.name} stopped at another exercise than {first!r}"
