"""The house (issue 30): the course apart from the library, domain modules that import only the domain,
modules of one job and a bounded size, and one definition of each fact that used to be kept in several
places. Read from the source, not run."""

import ast
import pathlib
import re

import pytest

import kvlab

ROOT = pathlib.Path(kvlab.__file__).parent
REPO = ROOT.parent

# What the book builds and computes (never prints, plots, times or grades): a domain module imports
# only other domain modules (and third-party libraries).
DOMAIN = {"gpt2", "cache", "validate", "configs", "catalogue", "paths", "memory", "flops", "quant",
          "quant_cache", "batching", "roofline", "static", "paged", "paged_cache", "ragged", "pagedkernel", "pastlen", "serving", "loading",
          "reference", "quality", "speculative", "drafts", "specbatch",
          "gqa", "window", "latent", "designs", "forwardcheck", "weights", "matvec"}


def modules():
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), p


def kvlab_imports(name: str, path: pathlib.Path):
    """The kvlab modules ``path`` imports (resolved to dotted names under kvlab), anywhere in the file."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[:len(pkg) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
            yield from ([f"{mod}.{a.name}".strip(".") for a in node.names] if not node.module else [mod])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvlab"):
            mod = node.module[len("kvlab."):] if node.module != "kvlab" else ""
            yield from ([a.name for a in node.names] if not mod else [mod])
        elif isinstance(node, ast.Import):
            yield from (a.name[len("kvlab."):] for a in node.names if a.name.startswith("kvlab."))


def test_the_course_is_apart_and_nothing_outside_it_imports_it():
    assert (ROOT / "course" / "checks").is_dir()
    for name, path in modules():
        if name.startswith("course"):
            continue
        bad = [m for m in kvlab_imports(name, path) if m.split(".")[0] == "course"]
        assert not bad, f"kvlab/{path.relative_to(ROOT)} imports the course ({bad})"
    for chapter in sorted((REPO / "book").glob("*.md")):
        assert not re.search(r"(from|import) kvlab\.course", chapter.read_text()), f"{chapter.name} imports the course"


def test_domain_modules_import_only_the_domain():
    for name, path in modules():
        if name.split(".")[0] not in DOMAIN:
            continue
        bad = [m for m in kvlab_imports(name, path) if m and m.split(".")[0] not in DOMAIN | {"__version__"}]
        assert not bad, f"domain module kvlab/{path.relative_to(ROOT)} imports {bad} (measurement or presentation)"


def test_the_checker_can_fail():
    """The import walk sees a forbidden import (so the test above is not vacuous)."""
    fake = ROOT / "serving" / "engine.py"
    assert "scheduler" in [m.split(".")[-1] for m in kvlab_imports("serving.engine", fake)]


def test_no_module_over_400_lines_outside_the_course():
    for name, path in modules():
        if not name.startswith("course"):
            n = len(path.read_text().splitlines())
            assert n <= 400, f"kvlab/{path.relative_to(ROOT)} has {n} lines (split it along its jobs)"


def test_domain_modules_print_nothing():
    for name, path in modules():
        if name.split(".")[0] in DOMAIN:
            src = path.read_text()
            assert not re.search(r"^\s*print\(|\bplt\.|matplotlib", src, re.M), f"kvlab/{name} prints or plots"


def _defs(pattern: str, where=("kvlab",)) -> list[str]:
    rx = re.compile(pattern, re.M)
    return [f"{p.relative_to(REPO)}" for d in where for p in sorted((REPO / d).rglob("*.py"))
            if rx.search(p.read_text())]


@pytest.mark.parametrize("fact, pattern, owner", [
    ("EMPTY", r"^EMPTY\s*=", ["kvlab/cache.py"]),
    ("REPO_ROOT", r"^REPO_ROOT\s*=", ["kvlab/paths.py"]),
    ("first_difference", r"^def first_difference\(", ["kvlab/reference.py"]),
    ("the context rule", r"exceeds the model's context", ["kvlab/validate.py"]),
    ("the naive step", r"^def naive_step\(", ["kvlab/reference.py"]),
    ("the decode-then-rewind timer", r"^def rewinding_step\(", ["kvlab/harness.py"]),
    ("the generators' names", r"^TRANSFORMERS\s*=|\"transformers generate\"", ["kvlab/generators.py"]),
    ("cutting at end-of-sequence", r"\.index\(eos", ["kvlab/batching.py"]),
])
def test_one_definition_of_each_fact(fact, pattern, owner):
    assert _defs(pattern) == owner, f"{fact} is defined in {_defs(pattern)}, expected only {owner}"


def test_no_retyped_head_dim_and_one_cache_constructor_name():
    assert _defs(r"n_embd\s*//\s*\w*\.?n_head") == ["kvlab/gpt2.py"]     # GPTConfig.head_dim, nowhere else
    assert not _defs(r"def from_config\(|def new_cache\(cls"), "a cache sized for a model is Cls.for_model"
    assert not _defs(r"as tqdm\b"), "the progress bar is kvlab.progress.bar, not an alias of tqdm"


def test_each_cache_lists_its_own_bookkeeping():
    from kvlab.cache import Cache
    assert Cache.bookkeeping == ()
