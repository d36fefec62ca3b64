"""The notebooks' setup in one call, one table API, one notebook check, and the tests' helpers with one
home each (issue 30). Mostly read from the sources; the setup itself is run once, on the bundled model."""

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from kvlab import notebook, progress, tables
from kvlab.paths import REPO_ROOT

CHAPTERS = sorted((REPO_ROOT / "book").glob("ch*.md"))
SOLUTIONS = sorted((REPO_ROOT / "solutions").glob("lab*.ipynb"))
TESTS = REPO_ROOT / "tests"
START = re.compile(r"^(\w+) = notebook\.start\(", re.M)


def first_code_cell(chapter: Path) -> str:
    return re.search(r"```\{code-cell\}[^\n]*\n(.*?)\n```", chapter.read_text(), re.S).group(1)


def setup_cell(solution: Path) -> str:
    """The chapter-style setup of a solution: its first code cell after the generated block."""
    first = next(c for c in json.loads(solution.read_text())["cells"] if c["cell_type"] == "code")
    return "".join(first["source"]).partition("# end of setup\n")[2]


def hf_name(cell: str) -> str:
    """The name a setup cell gives the transformers model (``model, tok, device = setup.hf, ...``)."""
    setup = START.search(cell).group(1)
    for line in cell.splitlines():
        names, _, values = line.partition(" = ")
        values = [v.strip() for v in values.split("#")[0].split(",")]
        targets = [n.strip() for n in names.split(",")]
        if f"{setup}.hf" in values and len(targets) == len(values):     # an assignment, not a call's arguments
            return targets[values.index(f"{setup}.hf")]
    return ""


def test_the_checks_find_what_they_look_for():
    cell = 'import torch\nsetup = notebook.start()   # x\nmodel, tok = setup.hf, setup.tok\n'
    assert START.search(cell) and hf_name(cell) == "model"
    assert not START.search("timing.set_threads()\ndevice = loading.pick_device()\n")
    assert CHAPTERS and SOLUTIONS


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_opens_with_the_one_setup_call(chapter):
    cell = first_code_cell(chapter)
    assert START.search(cell), f"{chapter.name}: the first code cell must call notebook.start()"
    for retyped in ("timing.set_threads()", "loading.pick_device()", "provenance.banner(", "load_default("):
        assert retyped not in cell, f"{chapter.name}: {retyped} is notebook.start's job"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_every_solution_opens_with_the_one_setup_call(solution):
    cell = setup_cell(solution)
    assert START.search(cell), f"{solution.name}: the setup cell must call notebook.start()"
    for retyped in ("timing.set_threads()", "loading.pick_device()", "provenance.banner(", "load_default("):
        assert retyped not in cell, f"{solution.name}: {retyped} is notebook.start's job"


def test_the_hand_built_model_is_built_where_chapter_3_explains_it_or_from_another_model():
    """``setup.ours`` is the hand-built GPT-2 of the notebook's model; ``GPT2.from_hf(`` is typed in
    chapter 3 (which explains it) and, elsewhere, only for another model (a shape-only one, real gpt2,
    another dtype)."""
    for chapter in CHAPTERS:
        if chapter.stem.startswith("ch03"):
            continue
        own = hf_name(first_code_cell(chapter))
        assert own, f"{chapter.name}: no name bound to setup.hf"
        built = re.findall(r"GPT2\.from_hf\((\w+)", chapter.read_text())
        assert own not in built, f"{chapter.name}: GPT2.from_hf({own}) retypes setup.ours"
    for solution in SOLUTIONS:
        cells = [c for c in json.loads(solution.read_text())["cells"] if c["cell_type"] == "code"]
        own = hf_name(setup_cell(solution))
        typed = [re.findall(r"GPT2\.from_hf\((\w+)\)", "".join(c["source"])) for c in cells]   # no options
        assert not own or all(own not in t for t in typed), f"{solution.name}: GPT2.from_hf({own}) is setup.ours"


def test_no_chapter_or_solution_rederives_head_dim():
    for path in CHAPTERS + SOLUTIONS:
        code = path.read_text()
        assert not re.search(r"n_embd\s*//\s*\w*\.?n_head", code), f"{path.name}: use config.head_dim"


def test_one_table_api():
    assert not re.search(r"def print_table\(", (REPO_ROOT / "kvlab" / "harness.py").read_text())
    for path in [*CHAPTERS, *(REPO_ROOT / "kvlab").rglob("*.py")]:
        assert "print_table(" not in path.read_text(), f"{path.name} prints a table another way than tables.show"
    t = tables.show([{"ms": 1.234, "n": 3}], {"ms": "median ms", "n": "runs"}, formats={"ms": ".1f"}, display=False)
    assert t.header == ["median ms", "runs"] and t.rows == [["1.2", "3"]]


def test_one_notebook_check(monkeypatch):
    """``tables.in_notebook`` is the one check; ``progress.watched`` asks it first."""
    sources = {p.name: p.read_text() for p in (REPO_ROOT / "kvlab").rglob("*.py")}
    assert [n for n, s in sources.items() if re.search(r"def _?in_notebook\(", s)] == ["tables.py"]
    kernel = type("Shell", (), {"kernel": type("Kernel", (), {"_allow_stdin": False})()})()
    monkeypatch.delenv("KVLAB_PROGRESS", raising=False)
    monkeypatch.setattr("IPython.get_ipython", lambda: kernel)
    assert tables.in_notebook() and not progress.watched()          # a kernel driven by a program
    monkeypatch.setattr(tables, "in_notebook", lambda: False)
    monkeypatch.setattr(progress, "in_notebook", lambda: False)
    assert progress.watched()                                        # not a notebook: tqdm decides


def test_start_sets_a_notebook_up(capsys):
    before = torch.get_num_threads()
    try:
        setup = notebook.start("kvlab-tiny", seed=3, threads=1)
        out = capsys.readouterr().out
        assert torch.get_num_threads() == 1 == setup.threads and "torch threads: 1" in out
        assert torch.initial_seed() == 3
        assert setup.banner in out and "kvlab-tiny" in setup.banner          # printed outside a notebook
        assert setup.hf.kvlab_name == "kvlab-tiny" and setup.tok is not None
        assert next(setup.hf.parameters()).device.type == setup.device.type
        assert "ours" not in vars(setup)                                     # built on first use only
        ours = setup.ours
        assert setup.ours is ours and ours.kvlab_name == "kvlab-tiny"
        ids = torch.tensor([[5, 17, 3, 9]], device=setup.device)
        with torch.no_grad():
            assert torch.allclose(ours(ids), setup.hf(ids).logits, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_test_helpers_have_one_home():
    """Shared helpers live in tests/utils.py, fixtures in conftest.py; no test module defines them again."""
    helpers = {"raises", "expect_rejected", "own_copy", "attention_without_mask"}
    conftest = ast.parse((TESTS / "conftest.py").read_text())
    plain = [f.name for f in conftest.body if isinstance(f, ast.FunctionDef) and not f.decorator_list]
    assert plain == [], f"conftest.py holds fixtures only; move {plain} to tests/utils.py"
    for path in sorted(set(TESTS.glob("test_*.py")) - {Path(__file__)}):
        src = path.read_text()
        defined = {f.name for f in ast.walk(ast.parse(src)) if isinstance(f, ast.FunctionDef)}
        assert not defined & helpers, f"{path.name} defines {defined & helpers} again: import it from utils"
        assert "from conftest import" not in src, f"{path.name}: helpers come from utils, fixtures by name"
        assert not re.search(r"return (gpt2\.)?GPT2\.from_hf\(tiny\[0\]\)", src), \
            f"{path.name}: the hand-built kvlab-tiny is conftest's `ours` fixture"
