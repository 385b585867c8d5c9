"""The compiled extension (csrc/): loading it, building it on demand, and what it provides.

``pip install --no-build-isolation -e .`` builds it as ``bert_fast._C`` (the C++ CPU ops always,
the CUDA ops too where CUDA and a CUDA build of PyTorch are present; see setup.py). Without it
the package still imports and runs its torch and Triton paths; ``build_extension()`` compiles it
on demand with torch.utils.cpp_extension.load (ninja, cached between runs). Its ops are
``torch.ops.bert_fast.ext_*`` (schemas in csrc/registration.cpp); loading it also registers their
fake kernels and autograd, which live next to the Triton ops in bert_fast/ops/.

Nothing here runs at ``import bert_fast``: the extension is loaded when ``backend="cuda"`` is
asked for, by ``build_extension()`` or by ``python -m bert_fast.info``.
"""

import importlib
import os
import pathlib
import sys
import threading

import torch

from .cxx_runtime import shared_cxx_runtime_flags
from .ops._autograd import compile_time_constant

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
JIT_NAME = "bert_fast_ext"
OPS = ("ext_embedding_sum_fwd", "ext_embedding_sum_bwd", "ext_add_layernorm_fwd", "ext_add_layernorm_bwd")

# at::parallel_for runs serially unless the extension itself is compiled with OpenMP (ATen's
# parallel backend is chosen by _OPENMP in the headers); at run time it shares torch's libgomp.
OPENMP_FLAGS = ["-fopenmp"] if sys.platform.startswith("linux") else []

# torch's own shared libstdc++, never a private static copy (cxx_runtime.py); setup.py links the same.
SHARED_CXX_RUNTIME = shared_cxx_runtime_flags()

_lock = threading.Lock()
_state = {"loaded_from": None, "error": None, "cuda_kernels": False}
_image_problems = {}     # GPU index -> kernel_image_problem(index)

# OPS by name, as the C++ entry point ``torch.ops.bert_fast.<name>.default`` calls once its two
# Python frames are passed (~0.4 us a call: the eager path calls them on every layer). Filled on
# loading.
OP_ENTRIES = {}


def sources(with_cuda):
    """The files that make the extension: the C++ CPU ops always, the CUDA ones when asked."""
    files = [CSRC / "registration.cpp", *sorted(CSRC.glob("*_cpu.cpp"))]
    if with_cuda:
        files += [*sorted(CSRC.glob("*.cu")), CSRC / "cuda_ops.cpp"]
    return [str(f) for f in files]


def _has_kernel(op, dispatch_key):
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"bert_fast::{op}", dispatch_key)
    except RuntimeError:     # the op is not defined
        return False


def _ops_registered():
    return all(_has_kernel(op, "CPU") for op in OPS)


def _finish_loading(where):
    _image_problems.clear()     # answers given before this extension loaded
    # Fake kernels and autograd of the ext ops (the op modules, not the functions that
    # bert_fast.ops exports under the same names).
    for module in ("bert_fast.ops.embedding", "bert_fast.ops.add_layernorm"):
        importlib.import_module(module).register_extension_ops()
    _state["cuda_kernels"] = _has_kernel("ext_add_layernorm_fwd", "CUDA")
    for op in OPS:
        overload = getattr(torch.ops.bert_fast, op).default
        OP_ENTRIES[op] = getattr(overload, "_op", overload)
    _state["loaded_from"], _state["error"] = where, None


def load():
    """Load the built extension if there is one; True when its ops are registered. Never builds."""
    if _state["loaded_from"] is not None:    # lock-free once loaded: the ops call this per call
        return True
    with _lock:
        if _state["loaded_from"] is not None:
            return True
        try:
            importlib.import_module("bert_fast._C")
        except ImportError as e:     # not built, or built against another torch
            _state["error"] = f"bert_fast._C could not be imported ({e})"
            return False
        _finish_loading("bert_fast._C (built by setup.py)")
        return True


def loaded_from():
    """Where the loaded extension came from, or None."""
    return _state["loaded_from"]


def load_error():
    """Why load() found no extension (None once it is loaded)."""
    return _state["error"]


def has_cuda_kernels():
    """Whether the loaded extension was built with its CUDA ops."""
    return loaded_from() is not None and _state["cuda_kernels"]


def kernel_image_problem(index=None):
    """Why the loaded extension's CUDA kernels cannot run on GPU ``index`` (None: the current
    one), or None: no extension, one built without CUDA ops, or one without machine code or PTX
    for that GPU's architecture (built with BERT_FAST_CUDA_ARCHS that leave it out). Never
    builds or launches anything. The answer is kept per GPU until an extension loads: the
    backend "auto" asks on every layer of every forward."""
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    try:
        return _image_problems[index]
    except KeyError:
        pass
    if not load():
        problem = f"the extension is not built ({load_error()})"
    elif not has_cuda_kernels():
        problem = "the extension was built without its CUDA ops"
    else:
        problem = torch.ops.bert_fast.ext_cuda_kernel_image_problem(index) or None
    _image_problems[index] = problem
    return problem


def build_extension(verbose=True, with_cuda=None):
    """Make the extension's ops available, compiling them first if no built copy loads.

    with_cuda: build the CUDA ops too; by default when PyTorch is a CUDA build and the CUDA
    toolkit (nvcc) is found. The build is cached by torch.utils.cpp_extension (under
    TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), so later calls only load it.
    Returns where the ops came from. With ``BERT_FAST_NO_JIT=1`` (CI) it never compiles: no
    built copy is an error, so tests cannot pass on a JIT build while the install's is missing.
    """
    if load():
        return loaded_from()
    if os.environ.get("BERT_FAST_NO_JIT", "0") == "1":
        raise RuntimeError(f"no built bert_fast extension loads ({load_error()}), and BERT_FAST_NO_JIT=1 "
                           "forbids compiling one now: install with `pip install --no-build-isolation -e .`")
    from torch.utils import cpp_extension

    if not CSRC.is_dir():
        raise RuntimeError(f"cannot build the bert_fast extension: its sources ({CSRC}) are not here. "
                           "Install bert_fast from a source checkout with "
                           "`pip install --no-build-isolation -e .`, which compiles it.")
    if with_cuda is None:
        # As setup.py: a CUDA_HOME without CUDA's headers (nvcc linked from elsewhere) cannot build them.
        home = cpp_extension.CUDA_HOME
        with_cuda = (torch.version.cuda is not None and home is not None
                     and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")))
    with _lock:
        if _state["loaded_from"] is not None:
            return loaded_from()
        if _ops_registered():    # an earlier build in this process, under another name
            _finish_loading("an extension already loaded in this process")
            return loaded_from()
        if verbose:
            print(f"bert_fast: building the extension ({'C++ CPU + CUDA' if with_cuda else 'C++ CPU'} ops) "
                  f"with ninja, MAX_JOBS={os.environ.get('MAX_JOBS', 'auto')}; cached after the first build ...",
                  flush=True)
        try:
            cpp_extension.load(
                name=JIT_NAME + ("_cuda" if with_cuda else ""), sources=sources(with_cuda),
                extra_cflags=["-O3", *OPENMP_FLAGS], extra_ldflags=OPENMP_FLAGS + SHARED_CXX_RUNTIME,
                extra_cuda_cflags=["-O3"] if with_cuda else None,
                extra_include_paths=[str(CSRC)], with_cuda=with_cuda, is_python_module=False, verbose=verbose)
        except Exception as e:
            raise RuntimeError(
                f"building the bert_fast extension failed: {e}\n"
                "It needs a C++20 compiler and ninja (pip install ninja); the CUDA ops also need the CUDA "
                "toolkit (nvcc, CUDA_HOME) matching torch.version.cuda. Build without the CUDA ops with "
                "bert_fast.build_extension(with_cuda=False); the torch and triton backends work without "
                "the extension.") from e
        _finish_loading(f"JIT build ({JIT_NAME})")
        if verbose:
            print("bert_fast: extension built and loaded", flush=True)
        return loaded_from()


def require_extension(tensor):
    """Raise a clear error unless the extension's ops can run on ``tensor``'s device. The ops
    ask on every call: the first test is the common case, answered without a device object."""
    if _state["loaded_from"] is not None and (tensor.is_cpu or (tensor.is_cuda and _state["cuda_kernels"])):
        return
    device = tensor.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the extension's ops run on CPU and CUDA tensors, got a tensor on {device}")
    problem = _extension_problem(device.type)
    if problem is not None:
        raise RuntimeError(problem)


@compile_time_constant
def _extension_problem(device_type):
    """Why the extension's ops cannot run on ``device_type``, or None, loading it if needed.
    A constant for torch.compile: traced (even fullgraph) before anything loaded the extension,
    Dynamo runs this once instead of tracing load()'s lock and import."""
    if not load():
        return (f"backend='cuda' needs bert_fast's compiled extension, which is not built: "
                f"{load_error()}. Build it with `pip install --no-build-isolation -e .` in the "
                f"source checkout, or call bert_fast.build_extension(); or use backend='triton'.")
    if device_type == "cuda" and not has_cuda_kernels():
        return ("the loaded bert_fast extension has no CUDA ops (it was built without CUDA). "
                "Rebuild it where nvcc and a CUDA build of PyTorch are present "
                "(`pip install --no-build-isolation -e .`), or use backend='triton'.")
    return None
