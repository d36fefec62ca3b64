"""The built-book checks can fail: a progress bar left in a page is reported (tests/check_built_book.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import check_built_book  # noqa: E402

FIG = '<img alt="x" src="../_images/abc.png">'
# what a good chapter 1 page holds (take-away heading, a link to its lab) beside its figure
CH1 = FIG + ('<article><h2>What to take away<a class="headerlink" href="#what-to-take-away">#</a></h2>'
             '<p><strong>Now do <a class="reference internal" href="../labs/lab01_naive_generation.html">'
             '<span class="doc">lab 1</span></a>.</strong></p></article>')


def test_a_frozen_progress_bar_fails_the_page():
    frozen = ('<div class="cell_output docutils container"><div class="output stderr"><pre>'
              "Loading weights:   0%|          | 0/52 [00:00&lt;?, ?it/s]</pre></div></div>")
    problems = check_built_book.page_problems("book/ch01_naive_generation", CH1 + frozen)
    assert len(problems) == 1 and "1 progress bar(s) left in the page" in problems[0] and "0/52" in problems[0]
    bars = "timing rounds:  33%|███▎      | 1/3 [00:01<00:02]" * 2
    assert "2 progress bar(s)" in check_built_book.page_problems("results", bars)[0]


def test_a_clean_page_and_look_alikes_pass():
    prose = "<p>50%| of the bytes | 3/4 of the time</p><pre>share: 45% | 12 of 40</pre>"
    assert check_built_book.page_problems("book/ch01_naive_generation", CH1 + prose) == []
    assert "no figure" in check_built_book.page_problems("book/ch02_x", prose)[0]


def test_a_chapter_without_take_away_or_lab_link_fails():
    """Issue 37: every chapter ends with what to take away and a link to its lab."""
    no_take = CH1.replace("What to take away", "Summary")
    assert "no 'What to take away' section" in " ".join(check_built_book.page_problems("book/ch01_x", no_take))
    wrong_lab = CH1.replace("lab01_naive", "lab02_cached")
    assert "does not link its lab (lab 1)" in " ".join(check_built_book.page_problems("book/ch01_x", wrong_lab))
    assert check_built_book.page_problems("book/ch01_x", CH1) == []


def test_labs_link_back_and_no_dead_or_md_links():
    back = '<article><p>This lab goes with <a href="../book/ch03_hand_built_cache.html">chapter 3</a></p></article>'
    assert check_built_book.link_problems("labs/lab03_kv_cache_from_scratch", back) == []
    assert "does not link back" in check_built_book.link_problems("labs/lab03_x", back.replace("ch03", "ch02"))[0]
    dead = CH1.replace("</article>", '<p>see <a class="reference internal" href="#">chapter 7</a></p></article>')
    assert "1 link(s) to '#'" in " ".join(check_built_book.link_problems("book/ch01_x", dead))
    theme = '<a href="https://colab.research.google.com/github/kvlab/kvlab/blob/main/book/ch01_naive_generation.md" class="btn">'
    binder = '<a href="https://mybinder.org/v2/gh/kvlab/kvlab/main?urlpath=tree/book/ch01_naive_generation.md">'
    assert len([p for p in check_built_book.link_problems("book/ch01_x", CH1 + theme + binder) if ".md file" in p]) == 2
    fine = theme.replace("book/ch01_naive_generation.md", "labs/lab01_naive_generation.ipynb")
    assert check_built_book.link_problems("book/ch01_x", CH1 + fine) == []


def test_a_lab_or_solution_page_with_outputs_fails():
    executed = '<div class="cell_output docutils container"><pre>PASSED check_naive_generate</pre></div>'
    for page in ("labs/lab01_naive_generation", "solutions/lab01_naive_generation"):
        link = '<article><a href="../book/ch01_naive_generation.html">chapter 1</a></article>'
        assert check_built_book.page_problems(page, link) == []
        problems = check_built_book.page_problems(page, link + executed)
        assert len(problems) == 1 and "shown unexecuted" in problems[0], problems
