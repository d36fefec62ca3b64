"""Install the book's library into a Python that lacks it (Colab, Binder, a bare Jupyter).

Run as a script from a clone of the repository, by the setup block of every lab (see kvlab.course.labs):

    python kvlab/course/install.py --release 0.1.0

It checks that the clone holds the release the lab was generated for, installs
requirements-lab.txt and then the library itself (editable: the notebooks find the bundled model
in the clone). An installed torch is kept (Colab's CUDA build): torch's line is dropped from the
requirements, with a warning when that torch lies outside the tested range. Standard library only.
"""

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

SRC = Path(__file__).resolve().parents[2]   # kvlab/course/install.py -> the clone


def _release(src: Path) -> str:
    m = re.search(r'__version__ = "([^"]+)"', (src / "kvlab" / "__init__.py").read_text())
    return m.group(1) if m else "?"


def _version_tuple(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def _in_range(version: str, spec: str) -> bool:
    """Enough of PEP 440 for the ``>=a,<b`` ranges of requirements-lab.txt."""
    ops = {">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
           ">": lambda a, b: a > b, "==": lambda a, b: a == b}
    v = _version_tuple(version)
    for op, bound in re.findall(r"(>=|<=|==|<|>)\s*([\d.]+)", spec):
        if not ops[op](v, _version_tuple(bound)):
            return False
    return True


def requirements(src: Path, torch_version: str | None) -> list[str]:
    """The lines of requirements-lab.txt to install, without torch's when a torch is installed."""
    out = []
    for line in (src / "requirements-lab.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if torch_version and re.match(r"torch\b(?![-_\w])", line):
            if not _in_range(torch_version, line[len("torch"):]):
                print(f"warning: keeping the installed torch {torch_version}, outside the tested "
                      f"range {line}")
            continue
        out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--release", required=True, help="the kvlab version the lab was generated for")
    args = ap.parse_args(argv)
    found = _release(SRC)
    if found != args.release:
        sys.exit(f"{SRC} holds kvlab {found}, but this lab belongs to release {args.release}: "
                 "download the lab again from the book, or clone the matching release")
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run(pip + requirements(SRC, torch_version), check=True)
    subprocess.run(pip + ["--no-deps", "-e", str(SRC)], check=True)
    print(f"kvlab {found} installed from {SRC}" + (f" (kept torch {torch_version})" if torch_version else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
