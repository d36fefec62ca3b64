#!/usr/bin/env bash
# Download, on a machine with network, the wheels scripts/gpu_check.sh installs on the GPU machine
# (which has none): scripts/gpu_requirements.txt and everything it needs, built for that machine's
# Python (3.12, CPython, x86-64 Linux), into wheels/ at the repository root.
#
#   bash scripts/fetch_wheels.sh              # then carry wheels/ with the device call
#
# wheels/ is git-ignored: NEVER commit it. The device call carries it (carry=["wheels"]); the
# working tree plus the wheels must stay under the device tool's 64 MiB, so wheels of packages the
# GPU image already holds in a version that satisfies everything (numpy 2.5 there) are dropped.
# Override the target with GPU_PYTHON_VERSION=3.11 (say) if the machine's Python changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
PYVER=${GPU_PYTHON_VERSION:-3.12}
DEST=wheels
# pip matches a manylinux tag exactly: list every glibc the machine (Ubuntu 24.04, glibc 2.39) runs.
PLATFORMS=()
for n in 17 24 26 27 28 31 34 35 39; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# Preinstalled on the GPU image (device README's KINDS.md, 2026-11) and big: not carried.
PREINSTALLED=(numpy)

mkdir -p "$DEST"
"$PY" -m pip download --quiet --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --abi "cp${PYVER/./}" --abi abi3 --abi none "${PLATFORMS[@]}" \
    -d "$DEST" -r scripts/gpu_requirements.txt
for name in "${PREINSTALLED[@]}"; do
    rm -f "$DEST/$name"-*.whl
done
# One version of each package: two would make pip's choice depend on the machine.
dups=$(ls "$DEST" | sed -E 's/-[0-9][^-]*-.*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then
    echo "wheels/ holds two versions of: $dups; empty wheels/ and run this again" >&2
    exit 1
fi
echo "$(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST/ (git-ignored; carry it, never commit it)"
