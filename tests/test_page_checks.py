"""The built-book checks can fail: a progress bar left in a page is reported (tests/check_built_book.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import check_built_book  # noqa: E402

FIG = '<img alt="x" src="../_images/abc.png">'


def test_a_frozen_progress_bar_fails_the_page():
    frozen = ('<div class="cell_output docutils container"><div class="output stderr"><pre>'
              "Loading weights:   0%|          | 0/52 [00:00&lt;?, ?it/s]</pre></div></div>")
    problems = check_built_book.page_problems("book/ch01_naive_generation", FIG + frozen)
    assert len(problems) == 1 and "1 progress bar(s) left in the page" in problems[0] and "0/52" in problems[0]
    bars = "timing rounds:  33%|███▎      | 1/3 [00:01<00:02]" * 2
    assert "2 progress bar(s)" in check_built_book.page_problems("results", bars)[0]


def test_a_clean_page_and_look_alikes_pass():
    prose = "<p>50%| of the bytes | 3/4 of the time</p><pre>share: 45% | 12 of 40</pre>"
    assert check_built_book.page_problems("book/ch01_naive_generation", FIG + prose) == []
    assert "no figure" in check_built_book.page_problems("book/ch02_x", prose)[0]
