"""What machine a recorded run was on: device, memory, load, driver and the commit (for ``kvlab.report``)."""

from __future__ import annotations
import os
import platform
import subprocess
from pathlib import Path

import torch

from . import paths, provenance


def git_commit() -> dict:
    env = os.environ.get("KVLAB_COMMIT", "").strip()
    if env:
        return dict(commit=env, source="KVLAB_COMMIT")
    if not (paths.REPO_ROOT / ".git").exists():
        return dict(commit="unknown", source="no .git and no KVLAB_COMMIT")
    try:
        git = ["git", "-C", str(paths.REPO_ROOT)]
        commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return dict(commit=commit, source="git", dirty=dirty)
    except (OSError, subprocess.SubprocessError) as e:
        return dict(commit="unknown", source=f"git failed: {e}")


def memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    """The host's 1/5/15-minute load: on a shared machine, how much else was running (noise)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_info(device: torch.device) -> dict:
    """What the numbers were measured on: the device's name and memory, the host, the drivers."""
    info = dict(device=str(device), name=provenance.device_name(device).split(" (")[0],
                host_memory_bytes=memory_bytes(), cpu_cores=os.cpu_count(),
                torch_threads=torch.get_num_threads(), platform=platform.platform(),
                load_average_start=load_average())
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, memory_bytes=p.total_memory, capability=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), driver=nvidia_driver())
    else:
        info.update(memory_bytes=info["host_memory_bytes"])
    return info
