"""Builds the native ops (`torchrec_kvzch._C`) and lays out the packages: the code under
plugin/, and the shipped sharding configs from the top-level configs/ as package data of
`torchrec_kvzch.configs`, so that `--config NAME` works from an installed wheel. Everything
else is in setup.cfg."""
import platform

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# On x86-64 the id map compares a bucket's keys with AVX2 (x86-64-v3: every x86 server CPU since
# 2013); `torchrec_kvzch.table.native` does not load the op on a CPU without it.
X86_64 = platform.machine().lower() in ("x86_64", "amd64")

setup(
    package_dir={"": "plugin", "torchrec_kvzch.configs": "configs"},
    packages=find_packages("plugin") + ["torchrec_kvzch.configs"],
    package_data={"torchrec_kvzch.configs": ["*.yaml"]},
    ext_modules=[
        CppExtension(
            "torchrec_kvzch._C",
            ["plugin/torchrec_kvzch/table/csrc/ops.cpp"],  # which includes the others: see there
            # fp-contract=off keeps the id-seeded initializer bit-identical to its torch twin.
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"] + (["-mavx2"] if X86_64 else []),
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
