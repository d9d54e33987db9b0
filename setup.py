"""The compiled CPU kernels (cct/native); everything else about the package is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and the layers run their numpy
bodies (``cct device_query`` says which).  It is also copied beside its source, so that a checkout's own
tests (``python -m pytest tests`` at its root imports ``cct`` from the checkout) run the kernels that were
just built; ``cct.native`` ignores a copy built from other sources (its API version differs).
"""
import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "cct/native/_kernels.c"


class BuildExtAlsoInPlace(build_ext):
    def run(self) -> None:
        super().run()
        if not self.inplace:
            try:
                self.copy_extensions_to_source()
            except Exception as e:  # e.g. a read-only source tree: best effort, the installed package has them
                self.warn(f"compiled kernels not copied beside their source ({e}): code imported from this "
                          f"source tree runs the numpy bodies")


# the source's digest, built into the module: speeds this machine measured of the kernels (cct.engines.measured's
# cache) hold for the kernels of that source only
SOURCE_DIGEST = hashlib.sha1((Path(__file__).resolve().parent / KERNELS).read_bytes()).hexdigest()[:12]

# -fno-wrapv undoes the -fwrapv in Python's own CFLAGS (the kernels' index arithmetic never wraps; with wrapping
# defined GCC keeps MAX pooling's backward loops unoptimized: 1.12-1.15x its time on CaffeNet's pools)
setup(ext_modules=[Extension("cct.native._kernels", [KERNELS], optional=True,
                             define_macros=[("CCT_KERNELS_SOURCE", f'"{SOURCE_DIGEST}"')],
                             extra_compile_args=["-O3", "-fno-wrapv", "-ffp-contract=off", "-fno-math-errno"])],
      cmdclass={"build_ext": BuildExtAlsoInPlace})
