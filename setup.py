"""Builds the native ops (`torchrec_kvzch._C`); everything else is in setup.cfg."""
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "torchrec_kvzch._C",
            ["plugin/torchrec_kvzch/store/csrc/kvzch_ops.cpp",
             "plugin/torchrec_kvzch/store/csrc/checkpoint_ops.cpp"],
            # fp-contract=off keeps the id-seeded initializer bit-identical to its torch twin.
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
