"""A learner's labs: nothing overwrites them, the in-sync check tells them from a stale lab, `make grade`
scores them (kvlab.course.grade), and the instructors' release (kvlab.course.release) is what nbgrader makes.

Everything runs on temporary copies of the repository's solutions/, labs/ and _config.yml."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

from kvlab.course import grade, labs, release
from kvlab.paths import REPO_ROOT

NBGRADER = "nbgrader==0.9.6"
LAB1, LAB2 = "lab01_naive_generation.ipynb", "lab02_cached_generation.ipynb"
# A plausible lab 2 mistake: the naive loop of lab 1 again, returning only the new tokens.
WRONG_CACHED = """@torch.no_grad()
def cached_generate(model, input_ids, max_new_tokens):
    ids = input_ids
    for _ in range(max_new_tokens):
        logits = model(ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
    return ids[:, input_ids.shape[1]:]"""


def copy_repo(dest: Path) -> Path:
    for name in ("solutions", "labs"):
        shutil.copytree(REPO_ROOT / name, dest / name)
    shutil.copy(REPO_ROOT / "_config.yml", dest)
    return dest


def run(module, *args, env=None):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, **(env or {})))


def edit(path: Path, fn):
    nb = json.loads(path.read_text())
    fn(nb)
    path.write_text(json.dumps(nb, indent=1) + "\n")


def fill_with_solution(root: Path, name: str):
    """Paste the solution's code into every exercise cell of labs/NAME, as a learner would (no fences)."""
    sol = {c["id"]: labs.cell_source(c) for c in json.loads((root / "solutions" / name).read_text())["cells"]}

    def fill(nb):
        for cell in nb["cells"]:
            if cell["id"] in nb["metadata"]["kvlab"]["exercises"]:
                cell["source"] = "\n".join(line for line in sol[cell["id"]].split("\n") if "SOLUTION" not in line)
    edit(root / "labs" / name, fill)


def set_cell(root: Path, folder: str, name: str, index: int, text: str):
    def change(nb):
        nb["cells"][index]["source"] = text
    edit(root / folder / name, change)


# --- python -m kvlab.course.labs: a learner's cells are never overwritten -------------------------------------

def test_regenerating_refuses_a_learners_lab_and_overwrite_keeps_a_backup(tmp_path):
    root = copy_repo(tmp_path)
    fill_with_solution(root, LAB1)
    set_cell(root, "labs", LAB2, 5, "prompt = 'my own prompt'")            # "try it on a prompt of your own"
    for name in (LAB1, LAB2, "lab04_memory_math.ipynb"):                    # a maintainer edits solutions/
        set_cell(root, "solutions", name, 0, "# Changed by a maintainer\n")
    before = {n: (root / "labs" / n).read_bytes() for n in (LAB1, LAB2)}

    r = run("kvlab.course.labs", "--root", root)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"labs/{LAB1}: cell 4 (exercise naive_generate), cell 9 (exercise sample_generate)" in r.stderr
    assert f"labs/{LAB2}: cell 6 (prompt = 'my own prompt')" in r.stderr
    assert "--overwrite" in r.stderr and "labs/backup/" in r.stderr
    assert {n: (root / "labs" / n).read_bytes() for n in before} == before, "a learner's lab was changed"
    assert "wrote labs/lab04_memory_math.ipynb" in r.stdout, "a lab nobody touched is still regenerated"

    r = run("kvlab.course.labs", "--root", root, "--overwrite")
    assert r.returncode == 0, r.stdout + r.stderr
    saved = re.findall(r"saved your version of (labs/\S+) to (labs/backup/\S+\.ipynb)", r.stdout)
    assert sorted(s[0] for s in saved) == [f"labs/{LAB1}", f"labs/{LAB2}"], r.stdout
    for lab, backup in saved:
        assert (root / backup).read_bytes() == before[Path(lab).name]
    assert run("kvlab.course.labs", "--root", root, "--check").returncode == 0
    assert json.loads((root / "labs" / LAB1).read_text())["cells"][0]["source"] == ["# Changed by a maintainer\n"]


def test_check_ignores_a_learners_cells_but_not_a_stale_lab(tmp_path):
    root = copy_repo(tmp_path)
    fill_with_solution(root, LAB1)
    set_cell(root, "labs", LAB1, 13, "My answer: the linear term dominates at these lengths.")
    edit(root / "labs" / LAB1, lambda nb: nb["cells"].insert(6, nbformat.v4.new_code_cell("print('scratch')").copy()))
    edit(root / "labs" / LAB2, lambda nb: nb["cells"][1].update(execution_count=1, outputs=[
        {"output_type": "stream", "name": "stdout", "text": "ran\n"}]))
    r = run("kvlab.course.labs", "--root", root, "--check")
    assert r.returncode == 0, "a completed lab is not out of date:\n" + r.stdout + r.stderr

    set_cell(root, "solutions", LAB1, 4, "Try it on a prompt of your own (changed), then run the grader.")
    set_cell(root, "solutions", LAB2, 3, labs.cell_source(json.loads((root / "solutions" / LAB2).read_text())["cells"][3])
             .replace("# BEGIN SOLUTION", "# a new hint\n    # BEGIN SOLUTION"))
    r = run("kvlab.course.labs", "--root", root, "--check")
    assert r.returncode == 1
    assert f"labs/{LAB1}: cell 5 (Try it on a prompt of your own, then run...) differs from solutions/" in r.stdout
    assert f"labs/{LAB2}: cell 4 (exercise cached_generate) differs from solutions/" in r.stdout   # untouched stub

    fill_with_solution(root, LAB2)   # the learner now works in that exercise: the change is still reported
    r = run("kvlab.course.labs", "--root", root, "--check")
    assert "cell 4 (exercise cached_generate) was changed in solutions/ after you began it" in r.stdout, r.stdout


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "labs").glob("lab*.ipynb")), ids=lambda p: p.name)
def test_the_repositorys_labs_hold_no_hand_edits(path):
    """The in-sync check lets a learner's cells through; in the book's own repository there must be
    none: a lab edited by hand (not through solutions/ and `python -m kvlab.course.labs`) fails here."""
    lab = json.loads(path.read_text())
    mine = labs.learner_cells(lab)
    assert not mine, f"{path.name}: edited by hand: " + ", ".join(labs.describe(lab, k) for k in mine)


def test_the_record_tells_stubs_from_a_learners_code():
    lab = json.loads((REPO_ROOT / "labs" / LAB1).read_text())
    assert labs.started(lab) == [] and labs.learner_cells(lab) == []
    assert sorted(sum(lab["metadata"]["kvlab"]["exercises"].values(), [])) == [
        "naive_generate", "sample_generate", "the timing loop that fills step_ms"]
    lab["cells"][3]["source"] = lab["cells"][3]["source"] + ["\n# a note\n"]
    assert labs.started(lab) == [3] and labs.learner_cells(lab) == [3]
    del lab["cells"][8]                           # a deleted exercise is a started one
    assert labs.started(lab) == [-1, 3]
    lab["metadata"].pop("kvlab")                  # no record: unknown, so graded by running it
    assert labs.started(lab) is None


# --- make grade ---------------------------------------------------------------------------------------

def test_a_fresh_checkout_has_nothing_to_grade():
    r = run("kvlab.course.grade")
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(list((REPO_ROOT / "labs").glob("lab*.ipynb")))
    assert f"0 of {n} started" in r.stdout and "running nbval" not in r.stdout
    assert len(re.findall(r"^lab\d\d\w*\s+not started\s+-$", r.stdout, re.M)) == n, r.stdout
    assert run("kvlab.course.grade", "--which").stdout.strip() == "mode=maintainer"


def test_a_broken_notebook_is_in_progress_with_a_message(tmp_path):
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "lab01_x.ipynb").write_text('{"cells": [')
    row = grade.grade_lab(tmp_path / "labs" / "lab01_x.ipynb", tmp_path)
    assert row.status == "in progress" and "invalid JSON" in row.failures[0][1] and "backup" not in row.failures[0][1]
    assert grade.which_mode(tmp_path) == ("learner", ["lab01_x.ipynb"])


def test_make_grade_runs_the_grader_module():
    r = subprocess.run(["make", "-n", "grade", "LAB=07"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert "-m kvlab.course.grade --lab 07" in r.stdout, r.stdout + r.stderr


def _toy_solution(path: Path, exercises: int):
    """A lab without a model: exercise i returns i * x; its check (defined in the notebook) tests it."""
    cells = [nbformat.v4.new_markdown_cell(f"# {path.stem}"), nbformat.v4.new_code_cell(
        "def check_times(f, k):\n    got = f(3)\n    assert got == 3 * k, f'times_{k}(3) returned {got}, not {3 * k}\\nsecond line'")]
    for i in range(1, exercises + 1):
        cells.append(nbformat.v4.new_code_cell(
            f"def times_{i}(x):\n    # BEGIN SOLUTION\n    return {i} * x\n    # END SOLUTION"))
        cells.append(nbformat.v4.new_code_cell(f"check_times(times_{i}, {i})"))
    nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, path)


def test_the_scorecard_counts_a_mix_of_labs(tmp_path, monkeypatch):
    (tmp_path / "solutions").mkdir()
    shutil.copy(REPO_ROOT / "_config.yml", tmp_path)
    for name in ("lab01_done", "lab02_wrong", "lab03_half", "lab04_untouched", "lab05_notes"):
        _toy_solution(tmp_path / "solutions" / f"{name}.ipynb", exercises=2)
    assert labs.sync(tmp_path) == 0
    fill_with_solution(tmp_path, "lab01_done.ipynb")
    fill_with_solution(tmp_path, "lab02_wrong.ipynb")
    set_cell(tmp_path, "labs", "lab02_wrong.ipynb", 4, "def times_2(x):\n    return x + 2")
    set_cell(tmp_path, "labs", "lab03_half.ipynb", 2, "def times_1(x):\n    return x")
    set_cell(tmp_path, "labs", "lab05_notes.ipynb", 0, "# my notes")   # not an exercise: still not started
    summary = tmp_path / "summary.md"
    r = run("kvlab.course.grade", "--root", tmp_path, env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert "3 of 5 started: 1 passed, 2 in progress" in out, out
    assert re.search(r"^lab01_done\s+passed\s+\d+\s*$", out, re.M), out
    assert re.search(r"^lab02_wrong\s+in progress\s+\d+\s+1 of 2 checks fail$", out, re.M), out
    # named as the learner finds it: the heading above, every cell counted from the top from 1, and
    # pytest's own name (nbval counts code cells only, from 0), read back from the run itself
    where = 'check_times under "lab02_wrong" (cell 6 from the top, pytest\'s Cell 4)'
    assert f"    {where}: AssertionError: times_2(3) returned 5, not 6\n" in out, out   # first line only
    assert "    check_times under \"lab03_half\" (cell 6 from the top, pytest's Cell 4): NotImplementedError: " \
           "Exercise: write times_2" in out                                                  # lab03's stub
    ran = json.loads((tmp_path / "_build" / "grade" / "lab02_wrong.json").read_text())
    assert [n.split("::")[-1] for n, c in ran.items() if c["outcome"] == "failed"] == ["Cell 4"], ran
    assert re.search(r"^lab04_untouched\s+not started\s+-$", out, re.M)
    assert re.search(r"^lab05_notes\s+not started\s+-$", out, re.M)
    md = summary.read_text()
    assert "| lab | status | seconds |" in md and md.count("| not started |") == 2, md
    assert "| lab02_wrong | in progress :x: |" in md and f"`{where}`: AssertionError: times_2(3)" in md
    assert "**3 of 5 started: 1 passed, 2 in progress**" in md

    r = run("kvlab.course.grade", "--root", tmp_path, "--lab", "1", "--require-pass")
    assert r.returncode == 0 and "1 of 1 started: 1 passed" in r.stdout, r.stdout + r.stderr
    assert run("kvlab.course.grade", "--root", tmp_path, "--lab", "04", "--require-pass").returncode == 1
    assert run("kvlab.course.grade", "--root", tmp_path, "--lab", "04").returncode == 0


def test_a_learners_real_labs_completed_and_wrong(tmp_path):
    """Lab 1 filled with the solution's code passes and is in sync; lab 2 with a mistake shows the
    grader's message; the other seven are not started (and not run)."""
    root = copy_repo(tmp_path)
    fill_with_solution(root, LAB1)
    set_cell(root, "labs", LAB2, 3, WRONG_CACHED)
    r = run("kvlab.course.grade", "--root", root, env={"KVLAB_QUICK": "1"})
    out = r.stdout
    assert r.returncode == 1, out + r.stderr
    assert re.search(r"^lab01_naive_generation\s+passed\s+\d+\s*$", out, re.M), out
    assert re.search(r"^lab02_cached_generation\s+in progress\s+\d+", out, re.M), out
    assert re.search(r'check_cached_generate under "Exercise 1: `cached_generate`" \(cell 7 from the top, '
                     r"pytest's Cell 3\): GraderFailure: .*use_cache=False", out), out
    assert f"2 of {len(list((root / 'labs').glob('lab*.ipynb')))} started: 1 passed, 1 in progress" in out
    assert (root / "_build" / "grade" / "lab02_cached_generation.log").exists()
    assert run("kvlab.course.labs", "--root", root, "--check").returncode == 0
    assert run("kvlab.course.grade", "--root", root, "--which").stdout.strip() == "mode=learner"
    r = run("kvlab.course.grade", "--root", root, "--which", env={"GITHUB_REPOSITORY": "kvlab/kvlab"})
    assert r.returncode == 1 and "a learner's work belongs in a fork" in r.stderr


# --- the instructors' release -------------------------------------------------------------------------

def _stubs_alike(text: str) -> str:
    """nbgrader writes a bare `raise NotImplementedError()` where the labs name the exercise."""
    return re.sub(r"raise NotImplementedError\(.*\)", "raise NotImplementedError()", text)


def nbgrader_venv() -> Path:
    """nbgrader in a virtualenv of its own under the temporary folder (kept for the next run): its
    Jupyter server dependencies stay out of the project's environment."""
    venv = Path(tempfile.gettempdir()) / f"kvlab-{NBGRADER.replace('==', '-')}"
    if not (venv / "bin" / "nbgrader").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", NBGRADER],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"pip install {NBGRADER} failed (PyPI is needed once):\n{r.stdout}{r.stderr}"
    return venv


def test_release_marks_the_cells_and_nbgrader_makes_labs_from_it(tmp_path):
    written = release.write_release(tmp_path / "course")
    course = tmp_path / "course"
    assert course / "nbgrader_config.py" in written
    for lab in sorted((REPO_ROOT / "labs").glob("lab*.ipynb")):
        ours = json.loads((course / "release" / lab.stem / lab.name).read_text())
        src = json.loads((course / "source" / lab.stem / lab.name).read_text())
        want = json.loads(lab.read_text())
        assert [labs.cell_source(c) for c in ours["cells"]] == [labs.cell_source(c) for c in want["cells"]]
        marks = [c["metadata"].get("nbgrader", {}) for c in src["cells"]]
        assert sum(m.get("solution", False) for m in marks) == len(want["metadata"]["kvlab"]["exercises"])
        assert all(m["locked"] and m["points"] == 1 for m in marks if m.get("grade")) and any(m.get("grade") for m in marks)
        assert any("# BEGIN SOLUTION" in labs.cell_source(c) for c in src["cells"])

    venv = nbgrader_venv()
    shutil.rmtree(course / "release")
    r = subprocess.run([str(venv / "bin" / "nbgrader"), "generate_assignment", "*", "--force"], cwd=course,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"))
    assert r.returncode == 0, r.stdout + r.stderr
    for lab in sorted((REPO_ROOT / "labs").glob("lab*.ipynb")):
        theirs = json.loads((course / "release" / lab.stem / lab.name).read_text())
        want = json.loads(lab.read_text())
        assert [(c["cell_type"], _stubs_alike(labs.cell_source(c))) for c in theirs["cells"]] == \
               [(c["cell_type"], _stubs_alike(labs.cell_source(c))) for c in want["cells"]], lab.name


def test_release_refuses_a_filled_lab(tmp_path):
    root = copy_repo(tmp_path / "repo")
    fill_with_solution(root, LAB1)
    with pytest.raises(SystemExit, match="filled-in exercises"):
        release.write_release(tmp_path / "course", root, "01")


def test_grade_module_imports_only_the_standard_library():
    """The first CI step runs `python3 -m kvlab.course.grade --which` before anything is installed."""
    code = ("import sys; import kvlab.course.grade, kvlab.course.labs; "
            "bad = [m for m in ('torch', 'nbformat', 'yaml', 'pytest') if m in sys.modules]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
    assert grade.upstream(REPO_ROOT) == labs.repository()["url"].split("github.com/")[1]


# --- issue 35: a file a person wrote is never lost, whatever state it is in ---------------------------

def _conflicted(text: str) -> str:
    """``text`` as git leaves it after a merge conflict inside the learner's cells."""
    lines = text.split("\n")
    i = next(k for k, line in enumerate(lines) if "def naive_generate" in line)
    return "\n".join(lines[:i] + ["<<<<<<< HEAD"] + lines[i:i + 3] + ["======="] + lines[i:i + 2]
                     + [">>>>>>> origin/main"] + lines[i + 3:])


BROKEN = {
    "merge conflict": lambda text: _conflicted(text),
    "half-saved": lambda text: text[: len(text) // 2],
    "a list": lambda text: "[]",
    "an empty object": lambda text: "{}",
    "no cells": lambda text: '{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}',
}


@pytest.mark.parametrize("state", list(BROKEN) + ["a folder"])
def test_a_lab_in_any_state_survives_regenerating_and_overwrite(tmp_path, capsys, state):
    root = copy_repo(tmp_path)
    fill_with_solution(root, LAB1)
    path = root / "labs" / LAB1
    if state == "a folder":
        path.unlink()
        (path / "mine.py").parent.mkdir()
        (path / "mine.py").write_text("my work")
        snapshot = lambda: (path / "mine.py").read_bytes()   # noqa: E731
    else:
        path.write_text(BROKEN[state](path.read_text()))
        snapshot = path.read_bytes
    before = snapshot()

    assert labs.sync(root) == 1
    err = capsys.readouterr().err
    assert f"labs/{LAB1}" in err and "Nothing was changed" in err and "--overwrite" in err, err
    assert snapshot() == before, f"{state}: the lab was changed without --overwrite"

    rc = labs.sync(root, overwrite=True)
    out, err = capsys.readouterr()
    if state == "a folder":
        assert rc == 1 and "folder" in err and snapshot() == before
        assert not (root / "labs" / "backup").exists()
        return
    assert rc == 0, err
    saved = re.findall(rf"saved your version of labs/{LAB1} to (labs/backup/\S+\.ipynb)", out)
    assert len(saved) == 1, out
    assert (root / saved[0]).read_bytes() == before, "the backup is not byte for byte"
    assert labs.sync(root, check=True) == 0


def test_grade_names_a_backup_only_when_there_is_one(tmp_path, capsys):
    root = copy_repo(tmp_path)
    path = root / "labs" / LAB1
    path.write_text(_conflicted(path.read_text()))
    row = grade.grade_lab(path, root)
    assert row.status == "in progress" and "merge-conflict" in row.failures[0][1]
    assert "git checkout" in row.failures[0][1] and "backup" not in row.failures[0][1]
    assert labs.sync(root, overwrite=True) == 0
    saved = labs.backups_of(path, root)
    path.write_text("[]")
    msg = grade.grade_lab(path, root).failures[0][1]
    assert str(saved[-1].relative_to(root)) in msg and "not a notebook" in msg
    path.unlink()
    path.mkdir()
    assert "folder" in grade.grade_lab(path, root).failures[0][1]


def test_a_failed_backup_writes_nothing(tmp_path, capsys):
    root = copy_repo(tmp_path)
    path = root / "labs" / LAB1
    path.write_text("{}")
    (root / "labs" / "backup").write_text("not a folder")
    assert labs.sync(root, overwrite=True) == 1
    err = capsys.readouterr().err
    assert f"labs/{LAB1}: not written" in err and "labs/backup is a file" in err, err
    assert path.read_text() == "{}" and (root / "labs" / "backup").read_text() == "not a folder"


def test_release_never_replaces_an_instructors_file(tmp_path, capsys):
    course = tmp_path / "course"
    release.write_release(course, REPO_ROOT, "01")
    release.write_release(course, REPO_ROOT, "01")            # its own files: replaced quietly
    config, source = course / "nbgrader_config.py", next((course / "source").rglob("*.ipynb"))
    config.write_text(config.read_text() + "c.Exchange.root = '/srv/exchange'\n")
    source.write_text(source.read_text().replace("Lab 1", "Lab 1 (our course)"))
    before = {p: p.read_bytes() for p in course.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match="nbgrader_config.py") as err:
        release.write_release(course, REPO_ROOT, "01")
    assert str(source.relative_to(course)) in str(err.value) and "--overwrite" in str(err.value)
    assert {p: p.read_bytes() for p in course.rglob("*") if p.is_file()} == before
    release.write_release(course, REPO_ROOT, "01", overwrite=True)
    out = capsys.readouterr().out
    for changed in (config, source):
        saved = re.search(rf"saved your {re.escape(str(changed.relative_to(course)))} to (\S+)", out)
        assert saved and Path(saved.group(1)).read_bytes() == before[changed], out


@pytest.mark.parametrize("out, needle", [("", "OUT is empty"), ("a_file", "is a file"),
                                         ("/sys/kvlab-course", "not writable")])
def test_release_refuses_an_out_it_cannot_use(tmp_path, monkeypatch, out, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("keep me")
    with pytest.raises(SystemExit, match=needle):
        release.main([out, "--lab", "01", "--root", str(REPO_ROOT)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and (tmp_path / "a_file").read_text() == "keep me"
