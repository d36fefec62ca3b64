"""Turn the book's MyST Markdown chapters into .ipynb notebooks that nbval can execute.

    python scripts/myst_to_ipynb.py book/ch01_naive_generation.md ... --out-dir DIR

The GPU machine has no Jupyter Book (nor jupytext), so scripts/gpu_check.sh executes the chapters
through nbval instead; only their code cells matter there. A code cell is a fenced
```` ```{code-cell} ```` block; its leading ``:key: value`` option lines (or a ``---`` YAML block) are
dropped. Text between code cells becomes one Markdown cell.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat

FENCE = "```{code-cell}"


def _strip_options(lines: list[str]) -> list[str]:
    if lines and lines[0].strip() == "---":                  # a YAML options block
        end = next((i for i, l in enumerate(lines[1:], 1) if l.strip() == "---"), None)
        if end is None:
            raise ValueError("a code cell's '---' options block is never closed")
        return lines[end + 1:]
    while lines and lines[0].startswith(":"):                # short options, e.g. ':tags: [hide-input]'
        lines = lines[1:]
    return lines


def convert(text: str) -> nbformat.NotebookNode:
    """A notebook with the code cells (and the text between them) of a MyST Markdown notebook."""
    lines = text.splitlines()
    if lines and lines[0].strip() == "---":                  # the front matter (jupytext, kernelspec)
        lines = lines[next(i for i, l in enumerate(lines[1:], 1) if l.strip() == "---") + 1:]
    cells, prose, i = [], [], 0
    while i < len(lines):
        if not lines[i].startswith(FENCE):
            prose.append(lines[i])
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"the code cell opened on line {i + 1} is never closed")
        if "".join(prose).strip():
            cells.append(nbformat.v4.new_markdown_cell("\n".join(prose).strip()))
        cells.append(nbformat.v4.new_code_cell("\n".join(_strip_options(lines[i + 1:end]))))
        prose, i = [], end + 1
    if "".join(prose).strip():
        cells.append(nbformat.v4.new_markdown_cell("\n".join(prose).strip()))
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("sources", nargs="+", type=Path)
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for src in args.sources:
        nb = convert(src.read_text())
        out = args.out_dir / (src.stem + ".ipynb")
        nbformat.write(nb, out)
        print(f"{src} -> {out} ({sum(c.cell_type == 'code' for c in nb.cells)} code cells)")


if __name__ == "__main__":
    main()
