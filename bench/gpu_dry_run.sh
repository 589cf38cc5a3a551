#!/usr/bin/env bash
# bench/gpu_run.sh rehearsed on this CPU machine, before the short time on a GPU machine: a
# virtualenv stands in for the GPU machine's Python, holding every package of .venv except those
# bench/gpu_wheels.txt carries; the wheels are built for this Python, and gpu_run.sh runs the check
# on tiny fp32 models (--device cpu). A wheel missing from the list fails here, not there.
#
#   bash bench/gpu_dry_run.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-/tmp/pretrain-gpu-dry-run}
image=/tmp/pretrain-gpu-image
wheels=/tmp/pretrain-gpu-wheels
if [[ -e $out && -n $(ls -A "$out") ]]; then
    echo "error: $out is not empty; name a new or empty OUT_DIR" >&2
    exit 2
fi
rm -rf "$image" "$wheels"
.venv/bin/python -m venv "$image"
.venv/bin/python - "$image" <<'PY'
import os, re, sys, sysconfig
from importlib import metadata
from pathlib import Path

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
carried = {norm(line.split("==")[0]) for line in Path("bench/gpu_wheels.txt").read_text().splitlines()
           if re.match(r"^[A-Za-z0-9_.-]+==", line)}
site = Path(sysconfig.get_paths()["purelib"])
left_out = set()
for dist in metadata.distributions():
    if norm(dist.metadata["Name"]) in carried:
        left_out |= {Path(f).parts[0] for f in dist.files or []}
target = next(Path(sys.argv[1]).glob("lib/python*/site-packages"))
for entry in site.iterdir():
    if entry.name not in left_out and not (target / entry.name).exists():
        os.symlink(entry, target / entry.name)
print(f"[gpu_dry_run] stand-in Python without {len(carried)} carried packages ({len(left_out)} entries left out)")
PY
bash bench/gpu_wheels.sh "$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" --out "$wheels"
GPU_WHEELS=$wheels PRETRAIN_PYTHON=$image/bin/python bash bench/gpu_run.sh "$out" --device cpu --steps 1 \
    --families "dense-1b,hybrid-1b,uoe-1b grouped-gemm" --no-profile
