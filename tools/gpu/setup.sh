# On the GPU machine, from the checkout's root, with the kit in .gpu/:  . .gpu/setup.sh
# Unpacks the kit into /tmp/site (once per machine) and puts it and the plugin on PYTHONPATH.
# The plugin's native op is not built there: on CUDA the id map runs on torch ops, and on CPU
# (the CPU ranks of the CUDA tests) the plugin falls back to them too.
S=/tmp/site
if [ ! -f "$S/.ok" ]; then
  mkdir -p "$S"
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .gpu/fb160.tar.xz "$S" || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S" .gpu/*.whl || return 1
  touch "$S/.ok"
fi
export PYTHONPATH="$S:$PWD/plugin${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, fbgemm_gpu, torchrec, torchrec_kvzch as k; print('torch', torch.__version__, 'fbgemm-gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, 'native op', k.native_status(), torch.cuda.get_device_name())"
