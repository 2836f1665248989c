"""Builds gradcomp.torch (the DDP communication hook) the way PyTorch extensions are built.

    pip install --no-build-isolation .

compiles gradcomp's C++ extension (python/src/torch_ext.cpp, over the header-only library in
include/) with torch.utils.cpp_extension against the torch that is installed, and installs it
with the Python package (python/gradcomp). --no-build-isolation is needed: the extension must be
built against that torch, not one pip would fetch into an isolated environment.

Where the installed torch has CUDA and the CUDA toolkit is found (CUDA_HOME, or nvcc on PATH),
the extension also gets the CUDA path of the hook (python/src/torch_ext_cuda.cpp, its bindings,
and python/src/cuda_bucket.cu, compiled by nvcc for the architectures torch's builder picks:
TORCH_CUDA_ARCH_LIST, else the GPUs it sees).
Where torch has no CUDA (Debian's python3-torch, CPU only), or no toolkit is found, the
extension is the CPU one, and this script says so.
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

    with_cuda = False
    if os.environ.get("GRADCOMP_TORCH_CUDA") == "0":
        _say("GRADCOMP_TORCH_CUDA=0: building the CPU extension (the hook takes CPU buckets)")
    elif torch.version.cuda is None:
        _say(f"torch {torch.__version__} has no CUDA (or is a ROCm build): building the CPU "
             "extension (the hook takes CPU buckets)")
    elif cpp_extension.CUDA_HOME is None:
        _say(f"torch {torch.__version__} has CUDA {torch.version.cuda}, but no CUDA toolkit was "
             "found (set CUDA_HOME): building the CPU extension (the hook takes CPU buckets)")
    else:
        with_cuda = True
        _say(f"torch {torch.__version__} has CUDA {torch.version.cuda}; building the extension "
             f"with the hook's CUDA path (nvcc from {cpp_extension.CUDA_HOME})")

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
    headers += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "python" / "src").glob("*.hpp"))
    if not with_cuda:
        ext = cpp_extension.CppExtension(
            name="gradcomp._torch_ext",
            sources=["python/src/torch_ext.cpp"],
            depends=headers,
            include_dirs=[str(ROOT / "include")],
            extra_compile_args=cxx_flags,
            language="c++",
        )
        return [ext], {"build_ext": cpp_extension.BuildExtension}
    headers += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "include").rglob("*.cuh"))
    nvcc_flags: List[str] = ["-std=c++20", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr"]
    extra = os.environ.get("GRADCOMP_NVCCFLAGS")
    if extra:
        nvcc_flags += extra.split()
    ext = cpp_extension.CUDAExtension(
        name="gradcomp._torch_ext",
        sources=["python/src/torch_ext.cpp", "python/src/torch_ext_cuda.cpp",
                 "python/src/cuda_bucket.cu"],
        depends=headers,
        include_dirs=[str(ROOT / "include")],
        define_macros=[("GRADCOMP_TORCH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )
    # ninja compiles the three sources at once where it is installed.
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
