"""The built book in a real browser: headless Chromium (Debian's package) driven by Playwright,
over the HTML served on localhost, as a reader sees it. For every page of _toc.yml:

* no word of a table (a header above all) is broken over two lines;
* it loads with no JavaScript error and no failed request, and asks nothing of the network (any
  request that leaves localhost is blocked and reported: the book must work offline);
* it shows no traceback or error output (a lab's NotImplementedError stub is source: fine);
* no output block or listing needs horizontal scrolling at the default width (1280 px), and no
  progress bar was left in an output;
* every figure loads (natural width > 0) and every equation is typeset by MathJax (no raw TeX);
* a screenshot goes to _build/screenshots/ (kept by CI as an artefact).

Figures are PNG images, so their font sizes cannot be read from the page: tests/test_draw.py checks
them on the saved figures (kvlab.provenance.small_texts). tests/check_built_book.py checks, from the
HTML, each chapter's take-away and lab link, the labs' links back, dead '#' links and .md launches.

And once: the search page finds "DynamicCache" and the chapter that teaches it; lab pages have
launch (Binder, Colab) and download buttons whose URLs derive from _config.yml; the memory
calculator shows its static fallback.

usage: python tests/browser_check.py BUILD_HTML_DIR [--screenshots DIR] [--chromium PATH]
(run by `make test` after the strict build; ends with an 'N passed, N failed' line)
"""

import argparse
import functools
import http.server
import json
import re
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())


def toc_files() -> list[str]:
    """Every page of _toc.yml, in order (parts, chapters and nested sections)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for e in entries or []:
            if "file" in e:
                files.append(e["file"])
            walk(e.get("sections"))
            walk(e.get("chapters"))

    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    return files


def source_of(page: str) -> str:
    for ext in (".md", ".ipynb"):
        if (ROOT / f"{page}{ext}").exists():
            return (ROOT / f"{page}{ext}").read_text()
    return ""


def expected_launch_urls(page: str) -> dict[str, str]:
    """Binder and Colab URLs of a notebook page, derived from _config.yml as sphinx-book-theme does."""
    repo = CONFIG["repository"]
    org_repo = urlparse(repo["url"]).path.strip("/")
    branch, launch = repo["branch"], CONFIG["launch_buttons"]
    path = (Path(repo.get("path_to_book") or "") / f"{page}.ipynb").as_posix()
    return {
        "binder": f"{launch['binderhub_url'].rstrip('/')}/v2/gh/{org_repo}/{branch}?urlpath=",
        "colab": f"{launch['colab_url'].rstrip('/')}/github/{org_repo}/blob/{branch}/{path}",
        "binder_path": path,
    }


class Server:
    """The built HTML on 127.0.0.1 (a free port), in a thread."""

    def __init__(self, directory: Path):
        handler = functools.partial(_QuietHandler, directory=str(directory))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


# Runs in the page: figures, equations, error outputs.
PAGE_PROBE = r"""async () => {
  await Promise.all([...document.images].map(i => i.complete ? null :
      new Promise(r => { i.addEventListener('load', r); i.addEventListener('error', r); })));
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  const main = document.querySelector('main') || document.body;
  const broken = [...main.querySelectorAll('img')].filter(i => !(i.naturalWidth > 0))
      .map(i => i.getAttribute('src'));
  const maths = [...main.querySelectorAll('.math')];
  const untypeset = maths.filter(m => !m.querySelector('mjx-container')).map(m => m.textContent.slice(0, 60));
  // raw TeX left in prose (outside code and the hidden MathJax assistive markup)
  const walker = document.createTreeWalker(main, NodeFilter.SHOW_TEXT);
  const raw = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (n.parentElement.closest('pre, code, script, style, mjx-container, .highlight')) continue;
    if (/\\\[|\\\(|\$\$/.test(n.textContent)) raw.push(n.textContent.trim().slice(0, 60));
  }
  const outputs = [...main.querySelectorAll('.cell_output, .output')];
  const errors = outputs.filter(o => o.matches('.traceback, .error') || o.querySelector('.traceback, .error')
      || /Traceback \(most recent call last\)|Error in callback/.test(o.textContent))
      .map(o => o.textContent.trim().slice(0, 120));
  // nothing a reader needs behind a horizontal scroll bar: any block of the page that scrolls
  // sideways (outputs, listings, tables in their scrollable containers), or that reaches past the
  // text column
  const scrolls = [...main.querySelectorAll('*')].filter(b => b.clientWidth > 0
      && b.scrollWidth > b.clientWidth + 2 && /auto|scroll/.test(getComputedStyle(b).overflowX))
      .map(b => b.textContent.trim().split('\n')[0].slice(0, 80));
  const column = main.querySelector('article') || main;
  const right = column.getBoundingClientRect().right;
  const wide = [...column.querySelectorAll('.cell_output, .cell_input, table, pre, img')].filter(b =>
      b.getBoundingClientRect().right > right + 2)
      .map(b => 'past the column: ' + (b.textContent || b.getAttribute('src') || '').trim().slice(0, 80));
  // a progress bar left in a page (tqdm's text "45%|####  | 9/20 [00:01<...]"), frozen where the build left it
  const bars = outputs.filter(o => PROGRESS_BAR.test(o.textContent)).map(o => o.textContent.trim().slice(0, 80));
  // a word of a table split over two lines ("criti cal batc h"): the word's range has line boxes at
  // two heights. Hyphens may break a word; a slash only where the page put a <wbr> (two text nodes).
  const split = [];
  for (const cell of main.querySelectorAll('table th, table td')) {
    const tw = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let n = tw.nextNode(); n; n = tw.nextNode()) {
      const words = /[^\s-]+/g;
      for (let m = words.exec(n.textContent); m; m = words.exec(n.textContent)) {
        const r = document.createRange();
        r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
        const tops = new Set([...r.getClientRects()].filter(x => x.width > 0).map(x => Math.round(x.top)));
        if (tops.size > 1) split.push(m[0]);
      }
    }
  }
  return {images: main.querySelectorAll('img').length, broken, maths: maths.length, untypeset, raw, errors,
          scrolls: [...new Set(scrolls.concat(wide))], bars, split: [...new Set(split)]};
}"""

# tqdm's text: a percentage, a bar between pipes, a count (JavaScript regex; also used in Python)
PROGRESS_BAR_RE = r"\d{1,3}%\|[^|\n]{0,120}\|\s*\d+(\.\d+)?[kMG]?/\d+(\.\d+)?[kMG]?\s*\[\d"
PAGE_PROBE = PAGE_PROBE.replace("PROGRESS_BAR", f"new RegExp({json.dumps(PROGRESS_BAR_RE)})")


# Pages the probe must fail (and one it must pass), checked before the book: a check that cannot fail
# is no check. Widths as in the book's column.
_SELF_TEST = {
    "wide": '<main style="width:600px"><div class="cell_output"><pre style="white-space:pre;overflow:auto">'
            + "x " * 400 + "</pre></div></main>",
    "table": '<main style="width:600px"><article><div style="overflow-x:auto"><table><tr>'
             + "<td style='white-space:nowrap'>a wide cell</td>" * 40 + "</tr></table></div></article></main>",
    "bar": '<main><div class="cell_output"><div class="output"><pre>timing rounds:   0%|          | 0/3 '
           "[00:00&lt;?, ?it/s]</pre></div></div></main>",
    "clean": '<main style="width:600px"><div class="cell_output"><pre style="white-space:pre-wrap">'
             + "x " * 400 + "</pre></div></main>"
             + "<table><tr><th>critical batch</th><th>measured/<wbr>floor</th><th>look-up</th></tr></table>",
    # the CSS that broke chapter 7's headers: a column squeezed below its longest word
    "split": '<main style="width:600px"><table><tr><th style="overflow-wrap:anywhere">critical batch</th>'
             + "<td style='white-space:nowrap'>a wide cell that takes the room</td>" * 6 + "</tr></table></main>",
}


def self_test(page) -> list[str]:
    """The probe reports a wide output block, a frozen progress bar and a table word broken over two
    lines, and nothing on a clean page."""
    found = {}
    for name, body in _SELF_TEST.items():
        page.set_content(f"<html><body>{body}</body></html>")
        found[name] = page.evaluate(PAGE_PROBE)
    problems = []
    if not found["wide"]["scrolls"]:
        problems.append("self-test: the probe missed an output block that needs horizontal scrolling")
    if not found["table"]["scrolls"]:
        problems.append("self-test: the probe missed a table in a container that scrolls sideways")
    if not found["bar"]["bars"]:
        problems.append("self-test: the probe missed a progress bar left in an output")
    if not found["split"]["split"]:
        problems.append("self-test: the probe missed a table header broken inside a word")
    if found["clean"]["scrolls"] or found["clean"]["bars"] or found["clean"]["split"]:
        problems.append(f"self-test: the probe flagged a clean page: {found['clean']}")
    return problems


def check_page(page, base: str, name: str, shots: Path) -> tuple[list[str], dict]:
    problems, failed, console = [], [], []
    page.on("console", lambda m: console.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: console.append(f"JavaScript error: {e}"))
    page.on("requestfailed", lambda r: failed.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: failed.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    page.goto(base + name + ".html", wait_until="load")
    page.wait_for_load_state("networkidle")
    probe = page.evaluate(PAGE_PROBE)
    problems += console + failed
    problems += [f"figure did not load: {s}" for s in probe["broken"]]
    problems += [f"equation not typeset: {t!r}" for t in probe["untypeset"]]
    problems += [f"raw TeX on the page: {t!r}" for t in probe["raw"]]
    problems += [f"error output: {t!r}" for t in probe["errors"]]
    problems += [f"needs horizontal scrolling: {t!r}" for t in probe["scrolls"]]
    problems += [f"progress bar left in the page: {t!r}" for t in probe["bars"]]
    problems += [f"a table breaks a word over two lines: {w!r}" for w in probe["split"]]
    page.screenshot(path=str(shots / f"{name.replace('/', '__')}.png"))
    if probe["maths"]:   # the first displayed equation, close up
        eq = page.query_selector("div.math mjx-container") or page.query_selector(".math mjx-container")
        if eq:
            eq.screenshot(path=str(shots / f"{name.replace('/', '__')}.equation.png"))
    return problems, probe


def check_search(page, base: str) -> list[str]:
    """search.html finds DynamicCache and the chapter whose source uses it most."""
    chapters = [f for f in toc_files() if f.startswith("book/")]
    teacher = max(chapters, key=lambda f: source_of(f).count("DynamicCache"))
    page.goto(base + "search.html?q=DynamicCache", wait_until="load")
    try:
        page.wait_for_selector("#search-results ul.search li, ul.search li", timeout=30_000)
    except Exception:
        return ["search: no result for 'DynamicCache'"]
    page.wait_for_timeout(1000)   # results arrive one by one
    hrefs = page.eval_on_selector_all("ul.search li a", "els => els.map(a => a.getAttribute('href'))")
    if not any(h and h.split("?")[0].split("#")[0].endswith(teacher + ".html") for h in hrefs):
        return [f"search: 'DynamicCache' does not find {teacher} (found {hrefs[:8]})"]
    return []


def check_lab_buttons(page, base: str, name: str) -> list[str]:
    """The launch and download buttons of a lab page, their URLs derived from _config.yml."""
    exp, problems = expected_launch_urls(name), []
    hrefs = page.eval_on_selector_all("a[href]", "els => els.map(a => a.href)")
    binder = [h for h in hrefs if h.startswith(exp["binder"])]
    colab = [h for h in hrefs if h == exp["colab"]]
    if not binder or exp["binder_path"] not in binder[0]:
        problems.append(f"no Binder button to {exp['binder']}...{exp['binder_path']}")
    if not colab:
        problems.append(f"no Colab button to {exp['colab']}")
    if not (ROOT / exp["binder_path"]).exists():
        problems.append(f"the launch buttons open {exp['binder_path']}, which is not in the repository")
    if CONFIG["repository"]["url"].rstrip("/") not in [h.rstrip("/") for h in hrefs]:
        problems.append("no repository button to " + CONFIG["repository"]["url"])
    downloads = [h for h in hrefs if h.startswith(base) and h.endswith(".ipynb") and "_sources" in h]
    if not downloads:
        return problems + ["no download button for the .ipynb"]
    r = page.request.get(downloads[0])
    try:
        nb = json.loads(r.body())
        ok = r.status == 200 and "NotImplementedError" in json.dumps(nb["cells"])
    except (ValueError, KeyError):
        ok = False
    if not ok:
        problems.append(f"download button {downloads[0]} does not give the lab notebook")
    return problems


def check_calculator(page, shots: Path) -> list[str]:
    fallback = page.query_selector(".kvlab-widget-fallback")
    if fallback is None or not fallback.is_visible():
        return ["the memory calculator shows no static fallback"]
    fallback.screenshot(path=str(shots / "memory-calculator-fallback.png"))
    ok = fallback.evaluate("f => [...f.querySelectorAll('img')].every(i => i.naturalWidth > 0)"
                           " && /KV cache/.test(f.textContent)")
    return [] if ok else ["the memory calculator's fallback lacks its numbers or chart"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html", type=Path)
    ap.add_argument("--screenshots", type=Path, default=ROOT / "_build" / "screenshots")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    args.screenshots.mkdir(parents=True, exist_ok=True)
    server = Server(args.html)
    results: dict[str, list[str]] = {}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            ctx = browser.new_context(viewport={"width": 1280, "height": 900})
            # The book must not need the network: every request that leaves localhost is refused
            # (and so shows up as a failed request).
            ctx.route(re.compile(r"^(?!http://127\.0\.0\.1[:/]).*"), lambda route: route.abort("blockedbyclient"))
            page = ctx.new_page()
            results["self-test"] = self_test(page)
            page.close()
            print(("FAIL " if results["self-test"] else "ok   ") + "self-test: the probe can fail")
            for p in results["self-test"]:
                print("     -", p)
            for name in toc_files():
                page = ctx.new_page()
                problems, probe = check_page(page, server.url, name, args.screenshots)
                if name.startswith("labs/"):
                    problems += check_lab_buttons(page, server.url, name)
                if "calculator_widget(" in source_of(name):
                    problems += check_calculator(page, args.screenshots)
                results[name] = problems
                print(f"{'FAIL' if problems else 'ok  '} {name}: {probe['images']} images, "
                      f"{probe['maths']} equations", flush=True)
                for p in problems:
                    print("     -", p)
                page.close()
            page = ctx.new_page()
            results["search: DynamicCache"] = check_search(page, server.url)
            page.screenshot(path=str(args.screenshots / "search.png"))
            print(("FAIL " if results["search: DynamicCache"] else "ok   ") + "search: DynamicCache")
            for p in results["search: DynamicCache"]:
                print("     -", p)
            if not any("calculator_widget(" in source_of(n) for n in toc_files()):
                results["memory calculator"] = ["no page of the book shows the memory calculator"]
            browser.close()
    finally:
        server.close()
    failed = sum(1 for p in results.values() if p)
    print(f"screenshots: {args.screenshots}")
    print(f"browser: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
