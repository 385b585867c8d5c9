"""Triton, where it is installed (Linux), and what the op files need around it.

On a machine without Triton the op files still import: ``triton``/``tl`` are stand-ins that
accept the decorators and annotations at definition time, and every launcher first calls
``require_triton()``, which raises a clear error. The torch paths never need Triton.

On a CPU-only machine, kernels run under Triton's interpreter when ``TRITON_INTERPRET=1`` is
set before this module is first imported (the test suite does that); launchers accept CPU
tensors only in that mode.
"""

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:   # pragma: no cover - exercised only where Triton is absent
    HAS_TRITON = False

    class _Absent:
        """Accepts any attribute, call or decoration; kernels defined with it never run."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    triton = tl = _Absent()


# The float types our kernels take (fp64 stays on the CPU twins).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton(*tensors):
    """Raise unless Triton can run a kernel on these tensors (CUDA, or CPU when interpreting or
    when a tool routes CPU tensors to the launchers: kernels_on_cpu, bert_fast.kernel_resources)."""
    if not HAS_TRITON:
        raise RuntimeError("the triton backend needs the triton package (pip install triton; Linux only); "
                           "use backend='torch' instead")
    for t in tensors:       # is_cuda/is_cpu: no device object made (~0.3 us each, every launch)
        if t is None or t.is_cuda or (t.is_cpu and (_KERNELS_ON_CPU[0] or interpreting())):
            continue
        raise ValueError(f"Triton kernels run on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), "
                         f"got a tensor on {t.device}")


# Send CPU tensors to the Triton launchers instead of the CPU kernels: for tests under
# TRITON_INTERPRET=1, so the eager path a GPU takes (launchers, their Functions, the visible-key
# counts) runs in the interpreter (kernels_on_cpu()), for bert_fast.kernel_resources, which
# compiles the kernels those launchers ask for, for a GPU target, and for the host benchmark's
# GPU-path row (launchers_take_cpu_tensors()).
_KERNELS_ON_CPU = [False]


def cpu_kernel(t):
    """Whether an op runs its CPU kernel (plain PyTorch) on ``t`` rather than the Triton launcher."""
    return t.is_cpu and not _KERNELS_ON_CPU[0]


@contextlib.contextmanager
def launchers_take_cpu_tensors():
    """Within: CPU tensors take the Triton launchers, as CUDA tensors do. What launches (or
    compiles, or counts) the kernels is the caller's business; kernels_on_cpu() is the
    interpreter's case."""
    _KERNELS_ON_CPU[0] = True
    try:
        yield
    finally:
        _KERNELS_ON_CPU[0] = False


@contextlib.contextmanager
def kernels_on_cpu():
    """Within: CPU tensors take the Triton launchers (interpreter only), as CUDA tensors do."""
    if not (HAS_TRITON and interpreting()):
        raise RuntimeError("kernels_on_cpu() needs triton and TRITON_INTERPRET=1")
    with launchers_take_cpu_tensors():
        yield


def uses_triton(backend):
    """False for the ops' "torch" backend; True for "triton" and for "cuda" (the compiled
    extension), which runs the Triton op wherever the extension has no op of its own."""
    if backend not in ("torch", "triton", "cuda"):
        raise ValueError(f"backend must be 'torch', 'triton' or 'cuda', got {backend!r}")
    return backend != "torch"


_PROXY_MODE = torch._C._TorchDispatchModeKey.PROXY


def launch(kernel, like):
    """``kernel``, ready for ``[grid](...)``; ``like`` is one of the tensors it is launched on.

    Eager, on plain tensors: the Triton kernel itself, launched by Triton's launcher alone.
    While torch.compile, torch.export or make_fx trace (fake or functional tensors, a proxy
    mode): torch.library.wrap_triton(kernel), which puts the launch in the graph. wrap_triton
    outside a triton_op's eager dispatch (which switches it off) is not free: every launch goes
    through its higher-order op, ~120 us of host time on the CI machine's CPU against ~2 for
    the plain launch (measured with Triton's run stubbed), and adds an entry to torch's global
    ``kernel_side_table.constant_args`` that is never removed (memory that grows with every
    launch of the eager path, which runs outside the registered ops; tests/test_launch.py).

    Under TRITON_INTERPRET=1 ``@triton.jit`` makes an InterpretedFunction, which launches as it
    is and which wrap_triton of torch < 2.13 rejects (2.13 returns it unchanged): returned as is.
    """
    traced = torch.compiler.is_compiling() or torch._C._get_dispatch_mode(_PROXY_MODE) is not None
    if type(like) is torch.Tensor and not traced:
        return kernel
    if HAS_TRITON and _interpreted(kernel):
        return kernel
    return torch.library.wrap_triton(kernel)


def _interpreted(kernel):
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:       # pragma: no cover - a Triton without an interpreter
        return False
    return isinstance(kernel, InterpretedFunction)


def cdiv(a, b):
    """``triton.cdiv(a, b)`` (ceil(a / b), ints or SymInts) for the launchers' host code: the
    same arithmetic without its constexpr_function wrapper, which costs ~2 us a call on the CI
    CPU (triton 3.6 and 3.9) against ~0.1; a layer's eager launches make a dozen such calls."""
    return (a + b - 1) // b


def next_power_of_2(n):
    """``triton.next_power_of_2(n)`` for the launchers' host code, without its wrapper (see cdiv)."""
    if type(n) is int and n > 0:
        return 1 << (n - 1).bit_length()
    return triton.next_power_of_2(n)


def as_dtype(t, dtype):
    """``t.to(dtype)`` without the dispatcher call when it would change nothing (None stays None):
    the CPU kernels cast inputs to their compute dtype on every call."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def compute_dtype(dtype):
    """The CPU kernels' arithmetic dtype: fp32, or fp64 for fp64 inputs (gradchecks). What
    torch.promote_types(dtype, torch.float32) gives for float dtypes, without the call."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_rows(t, row_size):
    """``t`` as (rows, row_size) with unit stride along a row (a view when possible, else a copy)."""
    t = t.reshape(-1, row_size)
    return t if t.stride(-1) == 1 else t.contiguous()


def nothing_to_launch(n):
    """Whether a launch over ``n`` rows can be left out: ``n`` is known to be 0.

    Under torch.compile, skip_padding's token count is an unbacked size, unknown when the graph
    is traced (and a Python ``if`` on it fails the trace): its launches stay in the graph, and
    at run time Triton's launcher launches nothing for a grid of 0 programs, while a reduction's
    grid keeps its one program, which stores zero partial sums.
    """
    return type(n) is int and n == 0


# SMs per CUDA device, asked once (get_device_properties costs ~2 us; backward launchers ask per call).
_MULTIPROCESSORS = {}


def reduction_programs(device, num_row_blocks, programs_beside=1):
    """How many programs stride over ``num_row_blocks`` in a kernel that also reduces over rows.

    Each program writes one row of fp32 partial sums, so launch only enough to fill the GPU a
    few times over (``programs_beside``: programs already launched along other grid axes). In the
    interpreter few programs, so that small tests exercise programs that loop over several tiles.
    """
    if device.type == "cuda":
        multiprocessors = _MULTIPROCESSORS.get(device)
        if multiprocessors is None:
            multiprocessors = _MULTIPROCESSORS[device] = torch.cuda.get_device_properties(device).multi_processor_count
        limit = 4 * multiprocessors // programs_beside
    else:
        limit = 4
    if type(num_row_blocks) is int:
        return max(1, min(num_row_blocks, limit))
    # An unbacked size under torch.compile (see nothing_to_launch), which min() cannot compare
    # (sym_min/sym_max cost ~1.5 us more a call than min/max on ints: eager takes the line above).
    return torch.sym_max(1, torch.sym_min(num_row_blocks, limit))
