#!/usr/bin/env bash
# Builds the offline kit for a GPU machine (sm_90, Python 3.12, torch 2.11.0+cu130 preinstalled,
# no package index) into OUT (default .gpu, git-ignored): fbgemm-gpu 1.6.0 repacked for sm_90 only
# (465 MB wheel -> ~59 MB), torchrec 1.6.1 and the wheels of its needs that such a machine lacks,
# and setup.sh. Run on a machine that reaches PyPI; docs/gpu.md says how the kit is used.
set -euo pipefail
out=${1:-.gpu}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
platform="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
if [ ! -f "$out/fb160.tar.xz" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q $platform -d "$tmp" fbgemm-gpu==1.6.0
  python3 "$here/pack_fbgemm.py" "$tmp"/fbgemm_gpu-1.6.0-*.whl "$out/fb160" --drop-unused
  rm -rf "$tmp"
fi
python3 -m pip download -q $platform -d "$out" torchrec==1.6.1 tensordict==0.15.3 pyvers==0.2.3 \
  crc32c==2.9.post0
[ -n "$(ls "$out"/iopath-*.whl 2>/dev/null)" ] || (cd "$out" && python3 -m pip wheel -q --no-deps iopath==0.1.10)
cp "$here/setup.sh" "$out/setup.sh"
du -sh "$out"
