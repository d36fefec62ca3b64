"""Generate ``labs/`` from ``solutions/`` (the lab contract).

In a solution notebook the learner's part of a code cell is fenced by two lines::

    # BEGIN SOLUTION            (optionally followed by the exercise's name)
    ...the code a learner writes...
    # END SOLUTION

In the generated lab each fenced region becomes a stub, indented like the region, that raises
``NotImplementedError`` naming the exercise (the function or class the region sits in); every output
and execution count is cleared. Everything else is copied unchanged.

    python -m kvlab.labs            # regenerate labs/ from solutions/
    python -m kvlab.labs --check    # exit 1 if labs/ is out of date (what the tests run)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

from .models import REPO_ROOT

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_DEF = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+([A-Za-z_]\w*)")


def _exercise_name(lines: list[str], upto: int, fallback: str) -> str:
    """The innermost ``def``/``class`` above line ``upto`` that encloses it, else ``fallback``."""
    target_indent = len(lines[upto]) - len(lines[upto].lstrip())
    for line in reversed(lines[:upto]):
        m = _DEF.match(line)
        if m and len(line) - len(line.lstrip()) < target_indent:
            return m.group(1)
    return fallback


def stub_source(source: str, where: str) -> str:
    """Replace each fenced region of one cell's source with a stub."""
    lines = source.split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip().startswith(BEGIN):
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            j = i + 1
            while j < len(lines) and lines[j].strip() != END:
                if lines[j].strip().startswith(BEGIN):
                    raise ValueError(f"{where}: nested '{BEGIN}'")
                j += 1
            if j == len(lines):
                raise ValueError(f"{where}: '{BEGIN}' without a matching '{END}'")
            label = lines[i].strip()[len(BEGIN):].strip(" :")
            name = label or _exercise_name(lines, i, fallback="the code of this cell")
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f'{indent}raise NotImplementedError("Exercise: write {name} (see the instructions above)")')
            i = j + 1
        elif lines[i].strip() == END:
            raise ValueError(f"{where}: '{END}' without a '{BEGIN}'")
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out)


def make_lab(solution: nbformat.NotebookNode, where: str = "notebook") -> nbformat.NotebookNode:
    lab = nbformat.from_dict(solution)
    n_regions = 0
    for k, cell in enumerate(lab.cells):
        if cell.cell_type == "code":
            n_regions += sum(1 for line in cell.source.split("\n") if line.strip().startswith(BEGIN))
            cell.source = stub_source(cell.source, f"{where} cell {k}")
            cell.outputs = []
            cell.execution_count = None
        cell.get("metadata", {}).pop("execution", None)
    if n_regions == 0:
        raise ValueError(f"{where}: no '{BEGIN}' region, so the lab would have no exercise")
    lab.metadata.setdefault("kvlab", {})["generated_from"] = f"solutions/{Path(where).name}"
    return lab


def lab_pairs(root: Path = REPO_ROOT):
    for sol in sorted((root / "solutions").glob("lab*.ipynb")):
        yield sol, root / "labs" / sol.name


def render(sol: Path) -> str:
    nb = nbformat.read(sol, as_version=4)
    return nbformat.writes(make_lab(nb, where=str(sol)), version=4) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report labs that are out of date")
    args = ap.parse_args(argv)
    stale = []
    for sol, lab in lab_pairs():
        text = render(sol)
        if args.check:
            if not lab.exists() or lab.read_text() != text:
                stale.append(lab)
        else:
            lab.parent.mkdir(exist_ok=True)
            lab.write_text(text)
            print(f"wrote {lab.relative_to(REPO_ROOT)}")
    if stale:
        print("out of date (run `python -m kvlab.labs`): " + ", ".join(str(s.relative_to(REPO_ROOT)) for s in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
