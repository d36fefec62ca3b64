"""Grade the labs a learner filled in: nbval on ``labs/``, then a scorecard, one row per lab.

    python -m kvlab.course.grade               # every lab (what `make grade` runs)
    python -m kvlab.course.grade --lab 07      # one lab (`make grade LAB=07`)
    python -m kvlab.course.grade --which       # CI: prints mode=learner or mode=maintainer

A lab is **not started** while every exercise cell still equals its stub (read from the fingerprints
``python -m kvlab.course.labs`` records in the lab's metadata, so this costs no kernel); a not-started lab is
not run and does not fail the command. A started lab runs through ``pytest --nbval-lax`` (its full
report goes to ``_build/grade/<lab>.log``); it is **passed** when every cell runs, else **in
progress**, with each failing cell and the first line of its error (the grader's message). The
command exits 1 when a started lab is in progress (with ``--require-pass``, also when a lab is not
started: what GitHub Classroom's per-lab tests use). Where ``$GITHUB_STEP_SUMMARY`` is set (GitHub
Actions), the scorecard is also appended to it as a Markdown table.

**Whose repository is this?** ``--which`` says ``learner`` when any lab is started (an exercise cell
differs from its stub), else ``maintainer``: the book's own labs are generated and never filled, so a
started lab means someone's work. In the book's own repository (``repository.url`` of ``_config.yml``
equals ``$GITHUB_REPOSITORY``) a started lab is an error instead, so a pull request that edits
``labs/`` by hand cannot switch the maintainers' tests off.

Only the standard library is imported until a lab has to run, so the first CI step needs no install.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import labs as L

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
CHECK_CALL = re.compile(r"^\s*(check_\w+)\s*\(", re.M)
RESULTS_ENV = "KVLAB_GRADE_RESULTS"


@dataclass
class Row:
    lab: str
    status: str                                    # "not started" | "in progress" | "passed"
    seconds: float | None = None
    failures: list[tuple[str, str]] = field(default_factory=list)   # (which cell, first error line)
    checks: tuple[int, int] = (0, 0)               # (grader cells that failed, grader cells)
    log: str = ""


def find_labs(root: Path, which: str | None = None) -> list[Path]:
    """The labs to grade; ``which`` is a number (7, 07) or a name's start (lab07, lab07_roofline)."""
    paths = sorted((root / "labs").glob("lab*.ipynb"))
    if not paths:
        raise SystemExit(f"no labs in {root / 'labs'}: run this from the repository's root")
    if which is None:
        return paths
    key = f"lab{int(which):02d}" if which.isdigit() else which.removesuffix(".ipynb")
    chosen = [p for p in paths if p.stem.startswith(key)]
    if len(chosen) != 1:
        names = ", ".join(p.stem[3:5] for p in paths)
        raise SystemExit(f"LAB={which!r} names {len(chosen)} labs; give one of: {names} (e.g. make grade LAB=01)")
    return chosen


# --- the pytest plugin (loaded into the nbval run with -p kvlab.course.grade) ----------------------------

_cells: dict[str, dict] = {}
_bar = None


def pytest_collection_finish(session):
    global _bar
    if os.environ.get(RESULTS_ENV):
        from tqdm import tqdm

        _bar = tqdm(total=len(session.items), desc="  cells", unit="cell", file=sys.stderr, leave=False,
                    disable=None)   # None: only on a terminal


def pytest_runtest_logreport(report):
    if not os.environ.get(RESULTS_ENV):
        return
    entry = _cells.setdefault(report.nodeid, {"outcome": "passed"})
    if report.failed:
        entry["outcome"] = "failed"
    if report.when == "teardown" and _bar is not None:
        _bar.update(1)


def pytest_exception_interact(node, call, report):
    """Keep the failing cell's id and source and its error's first line (ename: evalue)."""
    if not os.environ.get(RESULTS_ENV):
        return
    error = next((o for o in (getattr(node, "test_outputs", None) or []) if "ename" in o), None)
    if error is not None:
        message = f"{error['ename']}: {first_line(error['evalue'])}"
    else:   # a timeout, a dead kernel: nbval's own message
        message = first_line(str(call.excinfo.value) if call.excinfo else report.longreprtext)
    cell = getattr(node, "cell", {}) or {}
    _cells.setdefault(report.nodeid, {}).update(
        outcome="failed", error=message, id=cell.get("id"), source=L.cell_source(cell) if cell else "")


def pytest_sessionfinish(session, exitstatus):
    if _bar is not None:
        _bar.close()
    if os.environ.get(RESULTS_ENV):
        Path(os.environ[RESULTS_ENV]).write_text(json.dumps(_cells, indent=1))


def first_line(text: str) -> str:
    return next((line.strip() for line in ANSI.sub("", text).splitlines() if line.strip()), "(no message)")


# --- grading ---------------------------------------------------------------------------------------

def run_nbval(path: Path, root: Path, cell_timeout: int) -> tuple[int, dict, Path, float]:
    """pytest --nbval-lax on one lab: (exit code, the plugin's per-cell results, log, seconds)."""
    out_dir = root / "_build" / "grade"
    out_dir.mkdir(parents=True, exist_ok=True)
    log, results = out_dir / f"{path.stem}.log", out_dir / f"{path.stem}.json"
    results.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-s", "-p", "kvlab.course.grade", "-p", "no:cacheprovider",
           "--nbval-lax", f"--nbval-cell-timeout={cell_timeout}", "--rootdir", str(root), str(path)]
    env = dict(os.environ, **{RESULTS_ENV: str(results)})
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=root, env=env, stdout=f, stderr=sys.stderr).returncode
    seconds = time.perf_counter() - t0
    cells = json.loads(results.read_text()) if results.exists() else {}
    return rc, cells, log, seconds


def label(lab: dict, cell: dict) -> str:
    """Which cell failed, as the learner finds it in the notebook: the check it calls and the heading
    it sits under (``check_kv_cache under "Exercise 2: ..."``), its place counting every cell from the
    top, from 1, and pytest's own name for it (nbval's ``Cell N`` counts code cells only, from 0, so
    it differs: both are given, to find the cell in the notebook and in the full report)."""
    ids = [c.get("id") for c in lab["cells"]]
    if cell.get("id") not in ids:
        return "a cell"
    k = ids.index(cell["id"])
    check = CHECK_CALL.search(cell.get("source") or "")
    if check is None:
        return f"{L.describe(lab, k)}, pytest's {L.pytest_name(lab, k)}"
    heading = L.heading_above(lab, k)
    under = f' under "{heading[:50] + ("..." if len(heading) > 50 else "")}"' if heading else ""
    return f"{check.group(1)}{under} (cell {k + 1} from the top, pytest's {L.pytest_name(lab, k)})"


def read_lab(path: Path) -> dict | None:
    return L.read_notebook(path)[0]


def restore_hint(path: Path, root: Path) -> str:
    """How to get a broken lab back: its newest backup when one exists, else git (never an empty folder)."""
    saved = L.backups_of(path, root)
    if saved:
        return f"your newest backup is {saved[-1].relative_to(root)} (copy it over {path.relative_to(root)})"
    return f"restore it with git (`git checkout -- {path.relative_to(root)}`, or resolve the merge conflict)"


def grade_lab(path: Path, root: Path, cell_timeout: int = 600) -> Row:
    lab, problem = L.read_notebook(path)
    if problem:
        return Row(path.stem, "in progress", failures=[("the file", f"{problem}: {restore_hint(path, root)}")])
    started = L.started(lab)
    if started == []:
        return Row(path.stem, "not started")
    what = "no record of its stubs" if started is None else ", ".join(L.describe(lab, k) for k in started)
    print(f"{path.stem}: started ({what}): running nbval", flush=True)
    rc, cells, log, seconds = run_nbval(path, root, cell_timeout)
    failed = [c for c in cells.values() if c.get("outcome") == "failed"]
    n_checks = sum(1 for c in lab["cells"] if c["cell_type"] == "code" and CHECK_CALL.search(L.cell_source(c)))
    row = Row(path.stem, "passed", seconds, [(label(lab, c), c.get("error", "failed")) for c in failed],
              (sum(1 for c in failed if CHECK_CALL.search(c.get("source") or "")), n_checks),
              str(log.relative_to(root)))
    if rc != 0 and not failed:
        row.failures = [("nbval", f"pytest exited with {rc} before running the cells: see {row.log}")]
    if row.failures:
        stubs_only = all(m.startswith("NotImplementedError: Exercise: write") for _, m in row.failures)
        row.status = "not started" if started is None and stubs_only else "in progress"
    return row


# --- the scorecard ---------------------------------------------------------------------------------

def summary_line(rows: list[Row]) -> str:
    started = [r for r in rows if r.status != "not started"]
    passed = sum(r.status == "passed" for r in started)
    line = f"{len(started)} of {len(rows)} started"
    if not started:
        return line + ": nothing to grade yet (fill in a lab's YOUR CODE HERE cells, then run make grade)"
    return line + f": {passed} passed, {len(started) - passed} in progress"


def _detail(r: Row) -> str:
    if r.status != "in progress":
        return ""
    head = f"{r.checks[0]} of {r.checks[1]} checks fail" if r.checks[1] else "fails"
    return head + (f"; {len(r.failures)} failing cells" if len(r.failures) != r.checks[0] else "")


def text_table(rows: list[Row]) -> str:
    width = max(len(r.lab) for r in rows)
    lines = [f"{'lab':<{width}}  {'status':<11}  {'seconds':>7}  what fails",
             f"{'-' * width}  {'-' * 11}  {'-' * 7}  {'-' * 30}"]
    for r in rows:
        secs = f"{r.seconds:7.0f}" if r.seconds is not None else f"{'-':>7}"
        lines.append(f"{r.lab:<{width}}  {r.status:<11}  {secs}  {_detail(r)}".rstrip())
        lines += [f"    {where}: {message}" for where, message in r.failures]
    lines.append(summary_line(rows))
    logs = [r.log for r in rows if r.status == "in progress"]
    if logs:
        lines.append("Full nbval reports: " + ", ".join(logs))
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def markdown_table(rows: list[Row]) -> str:
    mark = {"passed": "passed :white_check_mark:", "in progress": "in progress :x:", "not started": "not started"}
    lines = ["## kvlab: lab scorecard", "",
             "| lab | status | seconds | what fails (first line of the grader's message) |", "|---|---|---:|---|"]
    for r in rows:
        fails = "<br>".join(f"`{_md(w)}`: {_md(m)}" for w, m in r.failures)
        secs = f"{r.seconds:.0f}" if r.seconds is not None else ""
        lines.append(f"| {r.lab} | {mark[r.status]} | {secs} | {fails} |")
    return "\n".join(lines + ["", f"**{summary_line(rows)}**", ""])


def which_mode(root: Path) -> tuple[str, list[str]]:
    """("learner" | "maintainer", the started labs) from the labs alone."""
    started = []
    for path in find_labs(root):
        lab = read_lab(path)
        if lab is None or L.started(lab) != []:
            started.append(path.name)
    return ("learner" if started else "maintainer"), started


def upstream(root: Path) -> str | None:
    """owner/name of the book's own repository (repository.url in _config.yml), read without yaml."""
    cfg = root / "_config.yml"
    text = cfg.read_text() if cfg.exists() else ""
    m = re.search(r"^repository:\s*\n(?:[ \t]+.*\n)*?[ \t]+url:\s*[\"']?https?://github\.com/([^/\s\"']+/[^/\s\"']+?)(?:\.git)?[\"']?\s*$",
                  text, re.M)
    return m.group(1) if m else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lab", help="grade one lab: its number (07) or name (lab07_roofline)")
    ap.add_argument("--which", action="store_true", help="print mode=learner or mode=maintainer and exit")
    ap.add_argument("--require-pass", action="store_true", help="a lab not started fails too (GitHub Classroom)")
    ap.add_argument("--cell-timeout", type=int, default=600, help="seconds per cell (nbval)")
    ap.add_argument("--root", type=Path, default=L.REPO_ROOT, help="the repository (default: this one)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.which:
        return _print_mode(root)
    paths = find_labs(root, args.lab)
    rows = [grade_lab(p, root, args.cell_timeout) for p in paths]
    print("\n" + text_table(rows))
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(markdown_table(rows) + "\n")
    failed = any(r.status == "in progress" for r in rows)
    return 1 if failed or (args.require_pass and any(r.status != "passed" for r in rows)) else 0


def _print_mode(root: Path) -> int:
    mode, started = which_mode(root)
    own = upstream(root)
    if mode == "learner" and own and os.environ.get("GITHUB_REPOSITORY", "").lower() == own.lower():
        print(f"labs/ holds filled-in exercises in the book's own repository ({own}): {', '.join(started)}.\n"
              "labs/ is generated from solutions/ (python -m kvlab.course.labs); a learner's work belongs in a fork.",
              file=sys.stderr)
        return 1
    print(f"mode={mode}")
    print(f"{'learner' if started else 'maintainer'}: started labs: {', '.join(started) or 'none'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
