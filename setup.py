"""Builds gradcomp.torch (the DDP communication hook) the way PyTorch extensions are built.

    pip install --no-build-isolation .

compiles gradcomp's C++ extension (python/src/torch_ext.cpp, over the header-only library in
include/) with torch.utils.cpp_extension against the torch that is installed, and installs it
with the Python package (python/gradcomp). --no-build-isolation is needed: the extension must be
built against that torch, not one pip would fetch into an isolated environment.

Where the installed torch has no CUDA (Debian's python3-torch, CPU only) the extension is the
CPU one and this script says so. The extension has no CUDA sources yet: a torch with CUDA
builds the same CPU extension, and this script says that too.
"""

import os
import re
import sys
from pathlib import Path
from typing import List

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _version() -> str:
    """The version in include/gradcomp/config.hpp, the one CMake reads too."""
    text = (ROOT / "include" / "gradcomp" / "config.hpp").read_text(encoding="utf-8")
    parts = []
    for part in ("MAJOR", "MINOR", "PATCH"):
        found = re.search(rf"#\s*define\s+GRADCOMP_VERSION_{part}\s+(\d+)", text)
        if found is None:
            raise RuntimeError(f"GRADCOMP_VERSION_{part} not found in include/gradcomp/config.hpp")
        parts.append(found.group(1))
    return ".".join(parts)


def _say(message: str) -> None:
    print(f"gradcomp setup.py: {message}", file=sys.stderr, flush=True)


def _extensions() -> tuple:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        raise RuntimeError(
            "gradcomp: gradcomp.torch is built against the torch that is installed, and this Python "
            f"({sys.executable}) cannot import torch ({e}). Install torch first and run "
            "'pip install --no-build-isolation .' (without --no-build-isolation pip builds in an "
            "environment without torch)") from e

    if torch.version.cuda is None:
        _say(f"torch {torch.__version__} has no CUDA (or is a ROCm build): building the CPU extension")
    else:
        _say(f"torch {torch.__version__} has CUDA {torch.version.cuda}; gradcomp.torch's hook "
             "takes CPU buckets only so far, so the CPU extension is built")

    # C++20 (torch's builder adds its own -std only when none is given), optimized as CMake's
    # Release is, without the interpreter's debug information (-g0; with it the wheel was 12 MB
    # here), and
    # the headers of this checkout before any installed copy. GRADCOMP_CXXFLAGS adds flags.
    cxx_flags: List[str] = ["-std=c++20", "-O3", "-DNDEBUG", "-g0"]
    extra = os.environ.get("GRADCOMP_CXXFLAGS")
    if extra:
        cxx_flags += extra.split()
    # The headers too: setuptools rebuilds only when a listed file is newer than the module.
    headers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "include").rglob("*.hpp"))
    ext = cpp_extension.CppExtension(
        name="gradcomp._torch_ext",
        sources=["python/src/torch_ext.cpp"],
        depends=headers,
        include_dirs=[str(ROOT / "include")],
        extra_compile_args=cxx_flags,
        language="c++",
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    version=_version(),
    packages=["gradcomp", "gradcomp.torch"],
    package_dir={"": "python"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # setuptools' intermediate files under build/ beside CMake's presets, not in the source tree.
    options={"build": {"build_base": "build/setuptools"}},
)
