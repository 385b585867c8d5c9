"""``python -m bert_fast.info``: what this installation can run.

Prints versions, the device, each backend's availability (and why not), and the ops of the
compiled extension with the device types they were built for. Loads the extension if it is
built; never builds it.
"""

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
        for op in extension.OPS:
            keys = [key for key in ("CPU", "CUDA") if extension._has_kernel(op, key)]
            lines.append(f"            torch.ops.bert_fast.{op}: {', '.join(keys)}")
    else:
        lines.append(f"  cuda    unavailable: {extension.load_error()}; build with "
                     "`pip install --no-build-isolation -e .` or bert_fast.build_extension()")
    auto_cuda = "triton" if backend.AUTO_USES_TRITON_ON_CUDA and HAS_TRITON else "torch"
    lines.append(f"  auto    (default) torch on CPU inputs, {auto_cuda} on CUDA inputs")
    return lines


if __name__ == "__main__":
    print("\n".join(report()))
