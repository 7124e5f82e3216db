# On the GPU machine, from the checkout's root, with the kit in .gpu/:  . .gpu/setup.sh
# (or . tools/gpu/setup.sh with KVZCH_KIT=.gpu: the kit is this file's folder unless named).
# Unpacks the kit into $KVZCH_SITE (default /tmp/site; once per machine) and puts it and the
# plugin on PYTHONPATH. The repacked fbgemm-gpu is one fb*.tar.xz, or fb*.part.NN pieces of one
# (make_kit.sh splits it when it would not fit the carry limit), read in order as one stream.
# KVZCH_BUILD_NATIVE=1 also builds the native op (the CPU id map and row copies) in place, about
# a minute: the CUDA path and its tests do not need it (the torch twins serve on CPU ranks).
kit=${KVZCH_KIT:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
py=${PYTHON:-python3}
S=${KVZCH_SITE:-/tmp/site}
if [ ! -f "$S/.ok" ]; then
  mkdir -p "$S"
  parts=$(ls "$kit"/fb*.part.* 2>/dev/null | sort)
  [ -n "$parts" ] || parts=$(ls "$kit"/fb*.tar.xz 2>/dev/null)
  [ -n "$parts" ] || { echo "setup.sh: no fb*.tar.xz or fb*.part.* in $kit: rebuild the kit (make gpu-kit)" >&2; return 1; }
  # shellcheck disable=SC2086 - one path per word, in order
  cat $parts | "$py" -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='fully_trusted')" "$S" \
    || { echo "setup.sh: unpacking $parts failed" >&2; return 1; }
  wheels=$(ls "$kit"/*.whl 2>/dev/null)
  if [ -n "$wheels" ]; then
    # shellcheck disable=SC2086
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S" $wheels || return 1
  fi
  touch "$S/.ok"
fi
export PYTHONPATH="$S:$PWD/plugin${PYTHONPATH:+:$PYTHONPATH}"
if [ "${KVZCH_BUILD_NATIVE:-0}" = 1 ] && ! "$py" -c "import torchrec_kvzch._C" 2>/dev/null; then
  "$py" setup.py -q build_ext --inplace > /tmp/kvzch_build.log 2>&1 \
    || echo "native op not built (/tmp/kvzch_build.log): the torch id map serves"
fi
"$py" -c "import torch, fbgemm_gpu, torchrec, torchrec_kvzch as k; print('torch', torch.__version__, 'fbgemm-gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, 'native op', k.native_status(), torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
