"""The compiled CPU kernels (cct/native); everything else about the package is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the layers run their numpy
bodies (``cct device_query`` says which).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("cct.native._kernels", ["cct/native/_kernels.c"], optional=True,
                             extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"])])
