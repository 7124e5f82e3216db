#!/usr/bin/env bash
# Builds the offline kit for a GPU machine (sm_90, Python 3.12, torch 2.11.0+cu130 preinstalled,
# no package index) into OUT (default .gpu, git-ignored): fbgemm-gpu 1.6.0 repacked for sm_90 only
# (465 MB wheel -> ~54 MB, its inference library included), torchrec 1.6.1 and the wheels of its needs that such a machine lacks,
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
# (torchmetrics and lightning-utilities: the job's held-out AUC and NE come from torchrec.metrics)
python3 -m pip download -q $platform -d "$out" torchrec==1.6.1 tensordict==0.15.3 pyvers==0.2.3 \
  crc32c==2.9.post0 torchmetrics==1.0.3 lightning-utilities==0.15.3
[ -n "$(ls "$out"/iopath-*.whl 2>/dev/null)" ] || (cd "$out" && python3 -m pip wheel -q --no-deps iopath==0.1.10)
cp "$here/setup.sh" "$out/setup.sh"
# The kit travels with the working tree to the GPU machine, which takes 64 MiB in all.
python3 - "$out" <<'PY'
import os, subprocess, sys
kit = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(sys.argv[1]) for f in fs)
tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.path.getsize(f) for f in tracked if f and os.path.isfile(f))
print(f"kit {kit / 2**20:.1f} MiB + tree {tree / 2**20:.1f} MiB = {(kit + tree) / 2**20:.1f} MiB of 64")
if kit + tree > 64 << 20:
    sys.exit("over the 64 MiB a GPU machine is sent: shrink the kit (pack_fbgemm.py) or the tree")
PY
