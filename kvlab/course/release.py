"""For instructors: the labs as an nbgrader course and a GitHub Classroom autograding workflow.

    python -m kvlab.course.release OUT              # every lab
    python -m kvlab.course.release OUT --lab 01     # one lab

writes, from ``solutions/`` and ``labs/`` (run ``python -m kvlab.course.labs --check`` first: it refuses a
stale ``labs/``):

* ``OUT/source/<lab>/<lab>.ipynb``: the solution, its cells marked for nbgrader: each cell holding a
  ``# BEGIN SOLUTION`` region is an autograded answer (``solution``), each cell calling a
  ``kvlab.course.checks`` grader is an autograder test (``grade``, locked, 1 point), every other cell as is.
  ``nbgrader generate_assignment <lab>`` run in OUT makes nbgrader's own release from it;
* ``OUT/release/<lab>/<lab>.ipynb``: what a learner gets: the cells of ``labs/`` (this project's stubs,
  which name the exercise, where nbgrader writes a bare ``raise NotImplementedError()``), marked alike;
* ``OUT/nbgrader_config.py``: the course (the solution fences are nbgrader's defaults);
* ``OUT/classroom/.github/workflows/classroom.yml``: GitHub Classroom autograding, one test per lab
  running ``make grade LAB=NN GRADE_ARGS=--require-pass`` (a lab not started scores 0), worth the
  number of checks in that lab. Put it into the template repository a Classroom assignment copies.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from . import labs as L
from .grade import CHECK_CALL, find_labs

NBGRADER_CONFIG = '''\
# nbgrader's configuration for the kvlab labs (written by `python -m kvlab.course.release`).
# The labs fence solutions with nbgrader's default "BEGIN SOLUTION" / "END SOLUTION".
c = get_config()  # noqa: F821 (nbgrader provides it)
c.CourseDirectory.course_id = "kvlab"
'''

CLASSROOM_HEAD = """\
# GitHub Classroom autograding for the kvlab labs (written by `python -m kvlab.course.release`): one test
# per lab runs `make grade LAB=NN` (nbval on that lab; see kvlab/course/grade.py) and scores the lab's
# points when every cell passes. --require-pass: a lab not started scores 0.
name: Autograding Tests
on:
  push:
  repository_dispatch:
  workflow_dispatch:
permissions:
  checks: write
  actions: read
  contents: read
jobs:
  run-autograding-tests:
    runs-on: ubuntu-latest
    container: python:3.11-bookworm
    if: github.actor != 'github-classroom[bot]'
    timeout-minutes: 120
    steps:
      - name: Checkout code
        uses: actions/checkout@v4
      - name: Install (CPU torch first, then the Makefile's virtualenv)
        env:
          PIP_EXTRA_INDEX_URL: https://download.pytorch.org/whl/cpu
        run: |
          python3 -m venv .venv
          .venv/bin/python -m pip install -q torch==2.13.0
          make venv
"""

CLASSROOM_TEST = """\
      - name: {name}
        id: {id}
        uses: classroom-resources/autograding-command-grader@v1
        with:
          test-name: {name}
          command: make grade LAB={num} GRADE_ARGS=--require-pass KVLAB_QUICK=1
          timeout: 30
          max-score: {points}
"""

CLASSROOM_REPORT = """\
      - name: Autograding Reporter
        uses: classroom-resources/autograding-grading-reporter@v1
        env:
{env}
        with:
          runners: {runners}
"""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "cell"


def mark(nb: dict, exercises: dict) -> dict:
    """Add nbgrader's metadata to ``nb``'s cells; ``exercises`` maps cell id to exercise names."""
    used: set[str] = set()

    def unique(base: str) -> str:
        name, n = _slug(base), 1
        while name in used:
            n += 1
            name = f"{_slug(base)}-{n}"
        used.add(name)
        return name

    for cell in nb["cells"]:
        src, meta = L.cell_source(cell), cell.setdefault("metadata", {})
        base = {"schema_version": 3, "locked": False, "solution": False, "grade": False}
        if cell.get("id") in exercises:
            meta["nbgrader"] = dict(base, solution=True, grade_id=unique("-".join(exercises[cell["id"]])))
        elif cell["cell_type"] == "code" and CHECK_CALL.search(src):
            name = CHECK_CALL.search(src).group(1)
            meta["nbgrader"] = dict(base, grade=True, locked=True, points=1, grade_id=unique(name))
    return nb


def release_lab(lab_path: Path, root: Path, out: Path) -> int:
    """Write one lab's source and release; returns its points (its grader cells)."""
    lab = json.loads(lab_path.read_text())
    exercises = (lab.get("metadata", {}).get("kvlab") or {}).get("exercises")
    if exercises is None:
        raise SystemExit(f"{lab_path}: no record of its exercises: run `python -m kvlab.course.labs` first")
    if L.started(lab):
        raise SystemExit(f"{lab_path} holds filled-in exercises: a release gives learners the stubs "
                         "(regenerate it with `python -m kvlab.course.labs --overwrite`, which keeps a backup)")
    sol = json.loads((root / "solutions" / lab_path.name).read_text())
    if [c.get("id") for c in sol["cells"]] != [c.get("id") for c in lab["cells"]]:
        raise SystemExit(f"{lab_path} and its solution have other cells: run `python -m kvlab.course.labs --check`")
    points = 0
    for kind, nb in (("source", sol), ("release", lab)):
        nb = mark(nb, exercises)
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"], cell["execution_count"] = [], None
        nb["metadata"].pop("kvlab", None)
        dest = out / kind / lab_path.stem / lab_path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        points = sum(bool(c["metadata"].get("nbgrader", {}).get("grade")) for c in nb["cells"])
    return points


def classroom_workflow(tests: list[tuple[str, str, int]]) -> str:
    """The autograding workflow: ``tests`` is (lab name, lab number, points) per lab."""
    ids = [f"lab{num}" for _, num, _ in tests]
    steps = [CLASSROOM_TEST.format(name=name, id=i, num=num, points=points)
             for (name, num, points), i in zip(tests, ids)]
    env = "\n".join(f'          {i.upper()}_RESULTS: "${{{{ steps.{i}.outputs.result }}}}"' for i in ids)
    return CLASSROOM_HEAD + "".join(steps) + CLASSROOM_REPORT.format(env=env, runners=",".join(ids))


def write_release(out: Path, root: Path = L.REPO_ROOT, which: str | None = None) -> list[Path]:
    """Everything the module docstring lists, into ``out``; returns the files written."""
    if L.sync(root, check=True) != 0:
        raise SystemExit("labs/ is out of date with solutions/ (see above): run `python -m kvlab.course.labs` first")
    tests = [(p.stem, p.stem[3:5], release_lab(p, root, out)) for p in find_labs(root, which)]
    (out / "nbgrader_config.py").write_text(NBGRADER_CONFIG)
    wf = out / "classroom" / ".github" / "workflows" / "classroom.yml"
    wf.parent.mkdir(parents=True, exist_ok=True)
    wf.write_text(classroom_workflow(tests))
    return sorted(p for p in out.rglob("*") if p.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the folder to write (the nbgrader course's root)")
    ap.add_argument("--lab", help="one lab: its number (07) or name")
    ap.add_argument("--root", type=Path, default=L.REPO_ROOT, help="the repository (default: this one)")
    args = ap.parse_args(argv)
    for path in write_release(args.out.resolve(), args.root.resolve(), args.lab):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
