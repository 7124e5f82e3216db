# On the GPU machine, from the checkout's root, with the kit in .gpu/:  . .gpu/setup.sh
# Unpacks the kit into /tmp/site (once per machine) and puts it and the plugin on PYTHONPATH.
S=/tmp/site
if [ ! -f "$S/.ok" ]; then
  mkdir -p "$S"
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .gpu/fb160.tar.xz "$S" || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S" .gpu/*.whl || return 1
  touch "$S/.ok"
fi
export PYTHONPATH="$S:$PWD/plugin${PYTHONPATH:+:$PYTHONPATH}"
# The native op (the CPU id map and row copies; the CPU ranks of the CUDA tests use it), built in
# place against this machine's torch once (about a minute); without it the torch twins serve.
if ! python3 -c "import torchrec_kvzch._C" 2>/dev/null; then
  python3 setup.py -q build_ext --inplace > /tmp/kvzch_build.log 2>&1 \
    || echo "native op not built (/tmp/kvzch_build.log): the torch id map serves"
fi
python3 -c "import torch, fbgemm_gpu, torchrec, torchrec_kvzch as k; print('torch', torch.__version__, 'fbgemm-gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, 'native op', k.native_status(), torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
