"""After a book build: every page in the table of contents exists, chapters show their figures,
no page shows an error or a progress bar, labs and solutions are unexecuted (nbval runs the solutions); every chapter
has a "What to take away" section and a link to its lab, every lab (and solution) links back to its
chapter, no link of a page's text goes nowhere (``href="#"``) and no launch button opens a ``.md``.

usage: python tests/check_built_book.py BUILD_HTML_DIR
(run by `make test` after the -W build; not collected by pytest because it needs a build)
"""

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
# tqdm's text, as a bar frozen in a saved output shows it: "  0%|          | 0/52 [00:00<?, ?it/s]"
PROGRESS_BAR = re.compile(r"\d{1,3}%\|[^|\n<]{0,120}\|\s*\d+(\.\d+)?[kMG]?/\d+(\.\d+)?[kMG]?\s*\[\d")


def toc_files():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [c["file"] for c in part.get("chapters", [])]
    return files


def figure_count(text: str) -> int:
    return len(re.findall(r'<img[^>]+src="[^"]*_images/', text))


# A launch button (Colab, Binder, JupyterHub) whose target is a MyST .md file: no service can run it.
MD_LAUNCH = re.compile(r'href="(https?://[^"]*(?:colab\.research\.google\.com|mybinder\.org|/hub/)[^"]*?\.md)(?:["?&#])')


def _article(text: str) -> str:
    """The page's own content (what the reader reads), without the theme's navigation."""
    m = re.search(r"<article[^>]*>(.*)</article>", text, re.S)
    return m.group(1) if m else text


def link_problems(f: str, text: str) -> list[str]:
    """Take-away and lab link of a chapter, the link back of a lab, dead ``#`` links, ``.md`` launches."""
    problems, body = [], _article(text)
    m = re.match(r"(book/ch|labs/lab|solutions/lab)(\d\d)", f)
    if f.startswith("book/ch") and m:
        if not re.search(r"<h2[^>]*>\s*What to take away", body):
            problems.append(f"{f}: chapter has no 'What to take away' section")
        if not re.search(rf'<a [^>]*href="[^"]*labs/lab{m.group(2)}[^"]*"[^>]*>.{{0,120}}?lab {int(m.group(2))}', body,
                         re.S | re.I):
            problems.append(f"{f}: chapter does not link its lab (lab {int(m.group(2))})")
    elif m and not re.search(rf'href="[^"]*book/ch{m.group(2)}[^"]*"', body):
        problems.append(f"{f}: does not link back to its chapter (book/ch{m.group(2)})")
    dead = len(re.findall(r'<a [^>]*href="#"', body))
    if dead:
        problems.append(f"{f}: {dead} link(s) to '#' (a reference that resolved to nothing)")
    problems += [f"{f}: launch button opens a .md file: {u}" for u in MD_LAUNCH.findall(text)]
    return problems


def page_problems(f: str, text: str) -> list[str]:
    """What is wrong with the built page of ``f`` (its path in _toc.yml), given its HTML."""
    problems = []
    images = figure_count(text)
    bars = [m.group(0) for m in re.finditer(PROGRESS_BAR, text)]
    if bars:
        problems.append(f"{f}: {len(bars)} progress bar(s) left in the page, e.g. {bars[0]!r}")
    for bad in ("Traceback (most recent call last)", "Error in callback"):
        if bad in text and not f.startswith(("labs/", "solutions/")):
            problems.append(f"{f}: page shows {bad!r}")
    if f.startswith("book/ch") and images == 0:
        problems.append(f"{f}: chapter has no figure (is MPLBACKEND=Agg set? kernels need the inline backend)")
    if f.startswith(("labs/", "solutions/")) and 'class="cell_output' in text:
        problems.append(f"{f}: a lab or solution page must be shown unexecuted (_config.yml's execute exclude_patterns)")
    return problems + link_problems(f, text)


def main(html_dir: str) -> int:
    html = Path(html_dir)
    problems = []
    for f in toc_files():
        page = html / f"{f}.html"
        if not page.exists():
            problems.append(f"{page}: missing")
            continue
        text = page.read_text()
        problems += page_problems(f, text)
        print(f"{f}: {figure_count(text)} figures")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
