#!/usr/bin/env bash
# Copy a recorded run's JSON into results/, where book/results.md renders it.
#
#   bash scripts/import_results.sh PATH/report.json [NAME]
#
# NAME defaults to <device>-<date>, e.g. nvidia-h200-2026-12-01 (results/NAME.json). The file is
# checked first (kvlab.results.read_run: schema and provenance) and refused if it is over 300 KB.
# Only the JSON is copied: the page draws the figures from it, and logs stay out of git.
set -euo pipefail
SRC=${1:?usage: bash scripts/import_results.sh PATH/report.json [NAME]}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
NAME=$(PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$SRC" "${2:-}" <<'EOF'
import re
import sys

from kvlab import results

src, name = sys.argv[1], sys.argv[2]
r = results.read_run(src)                              # a malformed file stops here, saying why
if not name:
    device = r["provenance"]["device"]["name"]
    name = f"{device}-{r['provenance']['date'][:10]}" + ("-quick" if r.get("quick") else "")
name = re.sub(r"[^a-z0-9.]+", "-", name.lower().removesuffix(".json")).strip("-")
print(name)
EOF
)
size=$(wc -c < "$SRC")
if [ "$size" -gt 300000 ]; then
    echo "$SRC is $size bytes: too big to commit (limit 300 KB)" >&2
    exit 1
fi
DEST="results/$NAME.json"
if [ -e "$DEST" ]; then
    echo "$DEST exists already: pass another NAME" >&2
    exit 1
fi
mkdir -p results
cp "$SRC" "$DEST"
chmod 644 "$DEST"
echo "$DEST ($size bytes); check it renders: jupyter-book build book/results.md, then git add $DEST"
