#!/usr/bin/env bash
# The wheels the GPU machine lacks (bench/gpu_wheels.txt), for its Python, into one folder that
# travels with the checkout (about 12 MiB; .whl/ is ignored by git):
#
#   bash bench/gpu_wheels.sh 3.12 [--out .whl]   # download the binary wheels, build the others
#   bash bench/gpu_wheels.sh 3.12 --list         # print what it would fetch, fetch nothing
#
# Then `bash bench/gpu_run.sh` on the GPU machine installs them and runs the GPU check.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage="usage: bash bench/gpu_wheels.sh PYTHON_VERSION (e.g. 3.12) [--list] [--out DIR]"
pyver=${1:-}
[[ $pyver =~ ^3\.[0-9]+$ ]] || { echo "error: $usage" >&2; exit 2; }
shift
list=0
out=.whl
while [[ $# -gt 0 ]]; do
    case $1 in
        --list) list=1 ;;
        --out) out=${2:?--out needs a folder}; shift ;;
        *) echo "error: unknown argument $1; $usage" >&2; exit 2 ;;
    esac
    shift
done
tag=cp${pyver/./}
mapfile -t entries < <(grep -E '^[A-Za-z0-9_.-]+==' bench/gpu_wheels.txt)
if [[ $list == 1 ]]; then
    for entry in "${entries[@]}"; do
        read -r spec how <<<"$entry"
        echo "$spec $how $tag"
    done
    exit 0
fi

PY=${PRETRAIN_PYTHON:-.venv/bin/python}  # builds deepspeed's wheel (its setup imports torch)
mkdir -p "$out"
platforms=()
for n in 5 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
binary=() build=()
for entry in "${entries[@]}"; do
    read -r spec how <<<"$entry"
    case $how in
        binary) binary+=("$spec") ;;
        build) build+=("$spec") ;;
        *) echo "error: bench/gpu_wheels.txt: '$entry' must end in binary or build" >&2; exit 2 ;;
    esac
done
echo "[gpu_wheels] downloading ${#binary[@]} wheels for $tag into $out" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d "$out" "${binary[@]}"
echo "[gpu_wheels] building ${build[*]} (pure Python, no compiled ops)" >&2
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "${build[@]}"
count=$(find "$out" -maxdepth 1 -type f -name '*.whl' | wc -l)
bytes=$(du -cb "$out"/*.whl | tail -1 | cut -f1)
if (( count != ${#entries[@]} )); then
    echo "error: $out holds $count wheels, bench/gpu_wheels.txt names ${#entries[@]}; empty $out and rerun" >&2
    exit 1
fi
if (( bytes > 48 * 2**20 )); then
    echo "error: the wheels take $((bytes / 2**20)) MiB; the checkout travels with at most 64 MiB" >&2
    exit 1
fi
echo "[gpu_wheels] $count wheels, $((bytes / 2**20)) MiB in $out"
