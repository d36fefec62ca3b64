"""The recorded-results machinery: python -m kvlab.report, kvlab.results (the results page's reader),
and the GPU check script's CPU dry run. No timing is asserted: only that every number is there,
positive, and labelled with what produced it."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from kvlab import machine, report, results
from kvlab.paths import REPO_ROOT

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMOKE = """---
kernelspec:
  name: python3
---

# A smoke notebook: the GPU check's nbval stages, in seconds

```{code-cell} ipython3
:tags: [hide-input]
import os
from kvlab import loading
```

Some text between the cells.

```{code-cell} ipython3
---
tags: [remove-input]
---
assert str(loading.pick_device()) == os.environ["KVLAB_DEVICE"]
print("quick:", os.environ.get("KVLAB_QUICK"))
```
"""


def _converter():
    spec = importlib.util.spec_from_file_location("myst_to_ipynb", REPO_ROOT / "scripts" / "myst_to_ipynb.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """scripts/gpu_check.sh on this CPU: quick, nothing installed, a smoke notebook for each nbval
    stage (the real solutions and chapters have their own tests), the report for real."""
    d = tmp_path_factory.mktemp("gpu_check")
    (d / "smoke_chapter.md").write_text(SMOKE)
    nbformat.write(_converter().convert(SMOKE), d / "smoke_solution.ipynb")
    env = dict(os.environ, KVLAB_DEVICE="cpu", KVLAB_QUICK="1", KVLAB_SKIP_INSTALL="1",
               KVLAB_CHECK_SOLUTIONS=str(d / "smoke_solution.ipynb"),
               KVLAB_CHECK_CHAPTERS=str(d / "smoke_chapter.md"), KVLAB_COMMIT=COMMIT,
               # quick grids are small; a generous budget keeps a busy machine from skipping a section
               KVLAB_REPORT_BUDGET="300",
               PYTHON=sys.executable, PYTHONPATH=str(REPO_ROOT))
    out = d / "out"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    return proc, out


def test_gpu_check_dry_run_passes(dry_run):
    proc, out = dry_run
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["chapters.log", "gpu_check.log", "report.json", "report.log", "report.png",
                     "solutions.log"], files
    assert len(files) <= 8, "the device tool brings back at most 8 files"
    for stage in ("solutions: ok", "report: ok", "chapters: ok"):
        assert stage in log, log[-2000:]
    assert "2 passed" in (out / "solutions.log").read_text()
    assert "2 passed" in (out / "chapters.log").read_text()


def test_report_json_is_complete(dry_run):
    _, out = dry_run
    r = results.read_run(out / "report.json")
    assert r["complete"] and r["quick"]
    p = r["provenance"]
    assert p["git"] == {"commit": COMMIT, "source": "KVLAB_COMMIT"}
    assert p["device"]["device"] == "cpu" and p["device"]["name"].startswith("CPU")
    assert p["device"]["memory_bytes"] > 0 and p["device"]["torch_threads"] >= 1
    assert {"torch", "transformers", "python"} <= set(p["versions"])
    assert p["models"]["kvlab-tiny"]["kind"] == "tiny"
    assert set(r["sections"]) == set(report.SECTIONS)
    for name, sec in r["sections"].items():
        assert sec["status"] in ("ok", "truncated"), (name, sec)
        assert sec["rows"], name
        for row in sec["rows"]:
            for k, v in row.items():
                if isinstance(v, float) and k != "first_difference":
                    assert v > 0, (name, row)
    for name in ("ours_vs_transformers", "compiled"):
        assert all(row["identical_tokens"] for row in r["sections"][name]["rows"]), name


def test_results_render_the_run(dry_run):
    _, out = dry_run
    r = results.read_run(out / "report.json")
    md = results.markdown(r)
    assert "recorded on CPU" in md and f"at {COMMIT[:12]}" in md and "not re-run by this build" in md
    assert "| model | new tokens N |" in md and "measured / floor" in md
    assert "measured on CPU" in results.markdown(r, fresh=True)
    import matplotlib
    matplotlib.use("Agg")
    fig = results.run_figure(r)
    assert fig is not None and len(fig.axes) == 4       # speed-up, per position, batch, floor


def test_committed_results_load_and_are_small():
    files = sorted((REPO_ROOT / "results").glob("*.json"))
    assert files, "commit at least one recorded run under results/"
    for path in files:
        r = results.read_run(path)
        text = path.read_text()
        assert len(text) < 300_000 and "data:image" not in text, f"{path.name}: keep results small, no images"
        if r["provenance"]["device"]["device"] == "cpu":
            assert "cpu" in path.name.lower(), f"{path.name}: a CPU run must say so in its name"
    assert results.by_machine(results.read_all())


def test_partial_run_renders_as_cut_off(dry_run, tmp_path):
    _, out = dry_run
    r = json.loads((out / "report.json").read_text())
    r["complete"] = False
    r["sections"] = {"speedup": r["sections"]["speedup"]}
    (tmp_path / "cut.json").write_text(json.dumps(r))
    assert "cut off after 1 section" in results.markdown(results.read_run(tmp_path / "cut.json"))


@pytest.mark.parametrize("mutate, needle", [
    (lambda r: r.pop("provenance"), "provenance.device.name"),
    (lambda r: r["provenance"]["git"].pop("commit"), "provenance.git.commit"),
    (lambda r: r.update(schema=99), "schema 99"),
    (lambda r: r.update(kind="other"), "not a kvlab.report result"),
])
def test_results_reject_malformed_files(dry_run, tmp_path, mutate, needle):
    _, out = dry_run
    r = json.loads((out / "report.json").read_text())
    mutate(r)
    (tmp_path / "bad.json").write_text(json.dumps(r))
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        results.read_run(tmp_path / "bad.json")


def test_write_json_is_atomic(tmp_path):
    target = tmp_path / "r.json"
    report.write_json({"a": 1}, target)
    with pytest.raises(ValueError):                       # NaN is not JSON: nothing half-written
        report.write_json({"a": float("nan")}, target)
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"], "a temporary file was left behind"


def test_commit_from_environment(monkeypatch):
    monkeypatch.setenv("KVLAB_COMMIT", "abc123")
    assert machine.git_commit() == {"commit": "abc123", "source": "KVLAB_COMMIT"}


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="unknown section"):
        report.run(device="cpu", sections=["speed"])
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            report.run(device="cuda")
    with pytest.raises(SystemExit):
        report.main(["--out", "results.txt"])


def test_spent_budget_skips_sections_but_writes_provenance():
    r = report.run(device="cpu", quick=True, budget=0, sections=("speedup", "per_position"))
    assert r["complete"] and r["provenance"]["models"]["kvlab-tiny"]["kind"] == "tiny"
    assert all(s["status"] == "skipped" and "budget" in s["reason"] for s in r["sections"].values())
    json.dumps(r, allow_nan=False)


def test_myst_converter_keeps_code_drops_options():
    nb = _converter().convert(SMOKE)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert code[0].startswith("import os") and code[1].startswith("assert str(")
    assert not any(":tags:" in c or "remove-input" in c for c in code)
    with pytest.raises(ValueError, match="never closed"):
        _converter().convert("```{code-cell} ipython3\nx = 1\n")


def test_wheels_are_never_committed():
    assert "/wheels/" in (REPO_ROOT / ".gitignore").read_text().split()
    reqs = (REPO_ROOT / "scripts" / "gpu_requirements.txt").read_text()
    assert "transformers==5.24" in reqs and "nbval" in reqs


def test_every_key_the_report_writes_has_a_label(dry_run):
    """The results page names each column and each section note in words, never by its raw key."""
    _, out = dry_run
    r = results.read_run(out / "report.json")
    keys = {k for sec in r["sections"].values() for row in sec.get("rows", []) for k in row}
    keys |= {k for sec in r["sections"].values() for k, v in sec.items()
             if k not in ("rows", "status", "seconds") and not isinstance(v, (dict, list))}
    assert {"achieved_GBps", "of_read_probe", "copy_GBps", "bandwidth_probe"} <= keys
    assert not keys - set(results.HEADERS), f"no label for {sorted(keys - set(results.HEADERS))}"
    md = results.markdown(r)
    assert "achieved (GB/s)" in md and "share of the read probe's bandwidth" in md
    assert "copy bandwidth (GB/s)" in md and "bandwidth measured by the best of several read-only kernels" in md
    assert "achieved_GBps" not in md and "of read probe" not in md


def test_results_say_what_eager_compiling_means_and_print_shares_as_percentages():
    """Issue 37 reread: "compile backend eager" unexplained, and a probe share printed as 0.17 where the
    rest of the book prints 17%."""
    from kvlab import results

    sec = {"status": "ok", "seconds": 1.0, "backend": "eager", "mode": "default",
           "rows": [{"model": "m", "achieved_GBps": 6.0, "of_read_probe": 0.1534}]}
    md = results.section_markdown("compiled", sec)
    assert "compile backend eager, i.e. TorchDynamo only" in md and "without Inductor" in md
    assert "| 15.3% |" in md and "0.153" not in md
    assert "inductor, torch.compile's default" in results.section_markdown("compiled", dict(sec, backend="inductor"))
