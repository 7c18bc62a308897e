"""Build script: the Python package plus the pybind11 extension ``fastgate._C`` built through CMake.

Set ``FASTGATE_SKIP_EXT=1`` to install without the extension (the pure-Python ops are then used).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


# FASTGATE_SKIP_EXT=1 leaves the extension out of the build altogether: returning early from build_extension left
# setuptools expecting its output (an editable install failed with "can't copy ... _C...so")
SKIP_EXT = os.environ.get("FASTGATE_SKIP_EXT") == "1"
if SKIP_EXT:
    print("FASTGATE_SKIP_EXT=1: not building fastgate._C (pure-Python ops will be used)")


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake = os.environ.get("CMAKE", "cmake")
        configure = [
            cmake,
            str(ROOT),
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        subprocess.run(configure, cwd=build_dir, check=True)
        subprocess.run([cmake, "--build", ".", "--parallel", "2"], cwd=build_dir, check=True)


setup(
    packages=[
        "fastgate",
        "fastgate.ops",
        "fastgate.retrieval",
        "fastgate.gates",
        "fastgate.methods",
        "fastgate.eval",
        "fastgate.train",
        "fastgate.scheduler",
        "fastgate.assets",
        "fastgate.engine",
        "fastgate.serving",
        "fastgate.entrypoints",
        "fastgate.entrypoints.http",
        "fastgate.kernels",
        "fastgate.calibrations",  # data only (no __init__.py): named so that setuptools neither warns nor guesses
        "fastgate.checkpoints",
    ],
    package_dir={"fastgate": "fastgate", "fastgate.kernels": "kernels"},
    # the shipped learned-gate weights (fastgate/checkpoints/<model>-<kind>/), small safetensors + JSON
    package_data={"fastgate.checkpoints": ["*/*.json", "*/*.safetensors"], "fastgate.calibrations": ["*.json"]},
    ext_modules=[] if SKIP_EXT else [CMakeExtension("fastgate._C")],
    cmdclass={"build_ext": CMakeBuild},
)
