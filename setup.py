"""Builds cython_ext/ into p2ptrain._kernels (dense codes) and p2ptrain._sparse (sparse codes),
with OpenMP where the compiler has it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from Cython.Build import cythonize
from setuptools import Extension, setup

# No -ffast-math and no FMA contraction: every member must compute bit-identical bytes,
# whatever its CPU (aarch64 compilers contract a*b+c into FMA by default).
BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-strict-aliasing"]


def compiler_has_openmp() -> bool:
    """Try to compile and link a tiny OpenMP program with the compiler Python was built with."""
    if os.environ.get("P2PTRAIN_NO_OPENMP"):
        return False
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return False
    source = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as handle:
            handle.write(source)
        result = subprocess.run(
            [cc, "-fopenmp", src, "-o", os.path.join(tmp, "probe")],
            capture_output=True,
            check=False,
        )
    return result.returncode == 0


openmp = compiler_has_openmp()
print(f"p2ptrain: building kernels {'with' if openmp else 'without'} OpenMP", file=sys.stderr)
extensions = [
    Extension(
        f"p2ptrain.{name}",
        sources=[f"cython_ext/{source}"],
        extra_compile_args=BASE_FLAGS + (["-fopenmp"] if openmp else []),
        extra_link_args=["-fopenmp"] if openmp else [],
    )
    for name, source in (("_kernels", "kernels.pyx"), ("_sparse", "sparse.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    )
)
