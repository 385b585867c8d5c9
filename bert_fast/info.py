"""``python -m bert_fast.info``: what this installation can run.

Prints versions, the device, each backend's availability (and why not), and the ops of the
compiled extension with the device types they were built for. Loads the extension if it is
built; never builds it. ``--require-extension`` exits with status 1 unless the extension built
by the install (setup.py) loaded: what scripts/install.sh and CI check after installing.
"""

import argparse
import os
import platform
import sys

import torch

from . import __version__, backend, extension
from .ops._triton import HAS_TRITON, interpreting


def _device():
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"cuda: {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
    return f"cpu only: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def report():
    """The lines ``python -m bert_fast.info`` prints."""
    lines = [f"bert_fast {__version__}", f"python {sys.version.split()[0]}",
             f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"]
    if HAS_TRITON:
        import triton
        lines.append(f"triton {triton.__version__}" + (" (interpreter: TRITON_INTERPRET=1)" if interpreting() else ""))
    else:
        lines.append("triton: not installed")
    lines.append(f"device: {_device()}")
    lines.append("backends:")
    lines.append("  torch   available (every device)")
    lines.append("  triton  " + ("available" if HAS_TRITON else "unavailable: pip install triton (Linux)"))
    if extension.load():
        kinds = "CPU and CUDA" if extension.has_cuda_kernels() else "CPU only (built without CUDA)"
        lines.append(f"  cuda    available: extension ops for {kinds}, from {extension.loaded_from()}")
        built = sys.modules.get("bert_fast._C")
        if built is not None:
            lines.append(f"            file: {built.__file__}")
        for op in extension.OPS:
            keys = [key for key in ("CPU", "CUDA") if extension._has_kernel(op, key)]
            lines.append(f"            torch.ops.bert_fast.{op}: {', '.join(keys)}")
    else:
        lines.append(f"  cuda    unavailable: {extension.load_error()}; build with "
                     "`pip install --no-build-isolation -e .` or bert_fast.build_extension()")
    if torch.cuda.is_available():
        auto_cuda = backend.backend_for("auto", torch.device("cuda"))
        problem = extension.kernel_image_problem()
        if auto_cuda == "triton" and backend.AUTO_USES_EXTENSION_ON_CUDA and problem:
            auto_cuda += f" (not cuda: {problem})"
    elif backend.AUTO_USES_TRITON_ON_CUDA and HAS_TRITON:
        auto_cuda = "cuda where the extension has kernels for the GPU, else triton"
    else:
        auto_cuda = "torch"
    if auto_cuda.startswith("cuda") and backend.AUTO_CAPTURES_TRITON:
        auto_cuda += " (triton inside CUDA-graph captures)"
    lines.append(f"  auto    (default) torch on CPU inputs, {auto_cuda} on CUDA inputs")
    chosen = os.environ.get("BERT_FAST_BACKEND")
    if chosen is not None:      # what modules built without backend= take instead of auto
        try:
            lines.append(f"BERT_FAST_BACKEND={chosen}: modules built without backend= run "
                         f"{backend.resolve_backend()}")
        except ValueError as error:
            lines.append(f"BERT_FAST_BACKEND={chosen}: every module built without backend= fails: {error}")
    return lines


def installed_extension_problem():
    """None if the extension built by the install (setup.py, as bert_fast._C) is loaded, else
    what is wrong: not built, or another build (a JIT build) loaded instead."""
    if not extension.load():
        return f"the compiled extension is not available: {extension.load_error()}"
    if not extension.loaded_from().startswith("bert_fast._C"):
        return f"the extension was loaded from {extension.loaded_from()}, not from the install's bert_fast._C"
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bert_fast.info", description="What this installation of bert_fast can run: versions, device, backends and the compiled extension's ops.")
    parser.add_argument("--require-extension", action="store_true",
                        help="exit with status 1 unless the compiled extension built by the install loaded")
    args = parser.parse_args(argv)
    print("\n".join(report()))
    if args.require_extension:
        problem = installed_extension_problem()
        if problem:
            print(f"error: {problem}. The install did not build it: rerun "
                  "`pip install --no-build-isolation -e .` and read its output (a C++20 compiler is needed; "
                  "BERT_FAST_SKIP_EXTENSION=1 installs without it on purpose).", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
