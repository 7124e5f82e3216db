# Two entry points: `make demo` (the main job) and `make test`. Both build .venv on first use.
PY      ?= python3.11
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCHREC := torchrec==1.8.0

.PHONY: demo test test-compat bench venv clean gpu-kit

venv: $(STAMP)

# Rebuilt when the pins, the packaging or the native sources change. Idempotent: a second run
# finds the stamp and does nothing. The plugin is installed with --no-build-isolation so the C++
# op compiles against the torch installed here (an isolated build would download a multi-GB
# CUDA torch).
$(STAMP): requirements.txt setup.py setup.cfg pyproject.toml $(wildcard plugin/torchrec_kvzch/table/csrc/*.cpp plugin/torchrec_kvzch/table/csrc/*.h)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-deps $(TORCHREC)
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(VPY) -c "import torchrec, fbgemm_gpu, torchrec_kvzch; torchrec_kvzch.native_status(strict=True)"
	touch $@

test: $(STAMP)
	$(VPY) -m pytest -q tests

# The main job: train on 2 processes -> checkpoint -> resume on 1 -> compare predictions.
demo: $(STAMP)
	$(VPY) -m torchrec_kvzch.job.demo --json results/demo.json

bench: $(STAMP)
	$(VPY) benchmarks/run_all.py

# The other supported stack (docs/stacks.md): torch 2.11 + fbgemm-gpu 1.6 + torchrec
# 1.6.1, what the GPU machines run. Its own venv, the plugin built from a copy of this tree (an
# editable install would replace the main venv's op); not in CI. PyPI's torch 2.11 for x86-64 is
# the CUDA build (about 3 GB with its NVIDIA libraries); it runs the suite on the CPU. (It asks
# for an older setuptools than requirements.txt pins.)
COMPAT          := .venv-compat
COMPAT_PINS     := torch==2.11.0 fbgemm-gpu-cpu==1.6.0
COMPAT_TORCHREC := torchrec==1.6.1

test-compat:
	test -x $(COMPAT)/bin/python || $(PY) -m venv $(COMPAT)
	grep -v -E '^(torch|fbgemm-gpu-cpu|setuptools)==' requirements.txt > $(COMPAT)/requirements-common.txt
	$(COMPAT)/bin/pip install --quiet --disable-pip-version-check $(COMPAT_PINS) -r $(COMPAT)/requirements-common.txt
	$(COMPAT)/bin/pip install --quiet --disable-pip-version-check --no-deps $(COMPAT_TORCHREC)
	rm -rf $(COMPAT)/src && mkdir $(COMPAT)/src
	tar -c --exclude=./.git --exclude='./.venv*' --exclude=./build --exclude='*.so' --exclude=./results . | tar -x -C $(COMPAT)/src
	$(COMPAT)/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation $(COMPAT)/src
	cd $(COMPAT)/src && ../bin/python -m pytest -q tests

# The offline kit for a GPU machine without a package index (docs/gpu.md); not part of CI.
gpu-kit:
	tools/gpu/make_kit.sh .gpu

clean:
	rm -rf $(VENV) $(COMPAT) build plugin/*.egg-info plugin/torchrec_kvzch/*.so runs
