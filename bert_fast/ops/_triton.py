"""Triton, where it is installed (Linux), and what the op files need around it.

On a machine without Triton the op files still import: ``triton``/``tl`` are stand-ins that
accept the decorators and annotations at definition time, and every launcher first calls
``require_triton()``, which raises a clear error. The torch paths never need Triton.

On a CPU-only machine, kernels run under Triton's interpreter when ``TRITON_INTERPRET=1`` is
set before this module is first imported (the test suite does that); launchers accept CPU
tensors only in that mode.
"""

import contextlib
import functools
import operator
import os
import re

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


_PROXY_MODE = torch._C._TorchDispatchModeKey.PROXY


def values_on_host(*tensors):
    """Whether the tensors' values can be read, and branched on, here without a device sync and
    outside any trace: eager plain CPU tensors (None allowed). Not while torch.compile,
    torch.jit.trace or make_fx trace (a branch would be baked into the graph for every later
    input), nor under functorch's transforms."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._get_tracing_state() or torch._C._get_dispatch_mode(_PROXY_MODE) is not None):
        return False
    return all(t is None or (type(t) is torch.Tensor and t.is_cpu) for t in tensors)


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


def launch(kernel, like):
    """``kernel``, ready for ``[grid](...)``; ``like`` is one of the tensors it is launched on.

    Eager, on plain tensors: the kernel's _EagerLauncher (Triton's launcher, with what it works
    out per call kept per kind of call), launched with ``like``'s device current (_OnDevice).
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
        launcher = eager_launcher(kernel)
        index = _other_cuda_device(like)
        return launcher if index is None else _OnDevice(launcher, index)
    if HAS_TRITON and _interpreted(kernel):
        return kernel
    return torch.library.wrap_triton(kernel)


def _other_cuda_device(like):
    """The index of ``like``'s CUDA device when that is not the current device, else None."""
    if like.is_cuda:
        index = like.get_device()
        # torch.cuda.current_device() less its lazy-init check: with a CUDA tensor in hand, CUDA
        # is initialised.
        if index != torch._C._cuda_getDevice():
            return index
    return None


class _OnDevice:
    """A launcher for tensors on another CUDA device than the current one: Triton launches on
    the current device (its kernel loaded there, that device's stream), which for tensors on
    another GPU is an illegal address (or another device's stream) - the case of a model moved
    to "cuda:1" without torch.cuda.set_device(1). PyTorch's own ops and our extension's switch
    to their tensors' device (a device guard); this does the same around the launch. Inside
    torch.compile's graphs Inductor sets the device itself."""

    def __init__(self, launcher, index):
        self.launcher, self.index = launcher, index

    def __getitem__(self, grid):
        launch_on_grid = self.launcher[grid]

        def on_device(*args, **kwargs):
            with torch.cuda.device(self.index):
                return launch_on_grid(*args, **kwargs)
        return on_device


def eager_launcher(kernel):
    """The _EagerLauncher of a compiled Triton kernel (a JITFunction); anything else (the
    interpreter's kernels, a tool's stand-in) as it is."""
    launcher = _EAGER_LAUNCHERS.get(id(kernel))      # (each value holds its kernel: ids stay unique)
    if launcher is None:
        launcher = _EAGER_LAUNCHERS[id(kernel)] = _EagerLauncher(kernel) if _jit_function(kernel) else kernel
    return launcher


_EAGER_LAUNCHERS = {}


def _jit_function(kernel):
    from triton.runtime.jit import JITFunction
    return isinstance(kernel, JITFunction)


# Triton compile options every eager launch gives instead of leaving them to Triton's defaults:
# what the kernels were written, tuned and measured with. enable_fp_fusion (a*b+c contracted to
# one FMA): on by default up to Triton 3.9, which warns once a process that it is unset ("the
# default will change to DISABLED in Triton 3.10"), off from 3.10, where it would make every
# kernel's arithmetic slower and its rounding other than what the tests checked.
# TRITON_FORCE_DISABLE_FP_FUSION=1 still turns it off (Triton's own switch). A launch that names
# an option itself keeps its value. Under torch.compile Inductor compiles the kernels with
# Triton's defaults (torch 2.13 names the option for Inductor's own kernels only).
PINNED_OPTIONS = {"enable_fp_fusion": True}


def with_pinned_options(kwargs):
    """A launch's keyword arguments with PINNED_OPTIONS added where it does not name them."""
    return {**PINNED_OPTIONS, **kwargs}


def pinned(launch_on_grid):
    """``launch_on_grid`` (Triton's ``kernel[grid]``) called with PINNED_OPTIONS added."""
    return lambda *args, **kwargs: launch_on_grid(*args, **with_pinned_options(kwargs))


# Scalar argument types whose values go into an _EagerLauncher key as they are.
_KEYED_SCALARS = (int, bool, float, str, type(None))


class _EagerLauncher:
    """``kernel[grid](*args, **kwargs)`` for the eager path, with Triton's per-launch work done
    once per kind of call.

    Triton's launcher (``JITFunction.run``) binds the arguments, works out the specialisation
    (each pointer's dtype and 16-byte alignment, each int's width, whether it is 1 or a multiple
    of 16), builds a cache key from it and the options, finds the compiled kernel, and launches
    it: 5 us for a 2-argument kernel on the CI machine's CPU, 13-24 us for ours (20-38
    arguments), a quarter of the eager GPU path's host time. Here a kind of call's first launch
    goes through Triton's launcher, which compiles or finds the kernel, and the CompiledKernel it
    returns is kept under a key that holds **more** than Triton specialises on: the argument
    types, every tensor's dtype and 16-byte alignment, every scalar's exact value, the keyword
    arguments (constexprs and launch options, e.g. num_warps) with their types, and the current
    device. Calls with equal keys get the same CompiledKernel from Triton, so later ones launch
    it directly, as Triton's launcher ends: 6 us instead of 16 for 38 arguments.

    Calls the key cannot describe always take Triton's launcher: an argument of another kind
    (a tuple, a tensor descriptor), a runtime argument passed by keyword, a kernel with pre-run
    hooks. Not seen after a kind of call's first launch: changes of Triton's global options
    (TRITON_DEBUG and the like) and of a kernel's globals (Triton's ``used_global_vals``
    check). Launch hooks (a profiler's) are still called: the CompiledKernel's launch reads them.
    """

    # Keys kept per argument layout before that layout's cache starts afresh (a key holds shapes).
    MAX_KEYS = 256

    def __init__(self, kernel):
        from triton.compiler.compiler import CompiledKernel
        from triton import knobs
        from triton.runtime import driver
        self.kernel = kernel
        self.knobs = knobs
        self.compiled_type = CompiledKernel
        self.driver = driver
        self.layouts = {}         # argument types -> _ArgumentLayout, or None: not keyable
        # Launch as JITFunction.run does where that code is known (Triton 3.6 to 3.9, ~1.5 us
        # less a launch), else through the CompiledKernel's own launcher, which Triton keeps.
        self.direct = (3, 6) <= _version(triton.__version__) < (3, 10)

    def __getitem__(self, grid):
        if callable(grid):              # a grid of the launch's arguments: Triton works it out
            return pinned(self.kernel[grid])
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs):
        layout = self.layouts.get(tuple(map(type, args)))
        if layout is None or self.kernel.pre_run_hooks:
            return self.first_launch(grid, args, kwargs)
        active = self.driver.active
        device = active.get_current_device()
        try:
            entry = layout.entries.get(layout.key(args, kwargs, device))
        except TypeError:        # an unhashable keyword argument
            entry = None
        if entry is None:
            return self.first_launch(grid, args, kwargs)
        compiled, tail = entry
        args += tail
        stream = active.get_current_stream(device)
        if not self.direct:
            if len(grid) != 3:
                grid = (tuple(grid) + (1, 1))[:3]
            compiled[grid](*args, stream=stream)
            return compiled
        # What JITFunction.run does once it has the kernel (Triton 3.6 to 3.9), except that the
        # launch metadata (a dict for the launch hooks) is only built when a hook will read it.
        enter, leave = self.knobs.runtime.launch_enter_hook, self.knobs.runtime.launch_exit_hook
        metadata = (None if enter is None or not getattr(enter, "calls", True)
                    else compiled.launch_metadata(grid, stream, *args))
        size = len(grid)
        compiled.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, metadata, enter, leave, *args)
        return compiled

    def first_launch(self, grid, args, kwargs):
        """Triton's launcher; the CompiledKernel it returns is kept when later calls may reuse it."""
        compiled = self.kernel[grid](*args, **with_pinned_options(kwargs))
        if not isinstance(compiled, self.compiled_type) or self.kernel.pre_run_hooks:
            return compiled          # (not a CompiledKernel: a tool's stand-in for Triton's launcher)
        if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata", "launch_metadata")):
            return compiled          # pragma: no cover - a Triton whose CompiledKernel launches otherwise
        types = tuple(map(type, args))
        if types not in self.layouts:
            self.layouts[types] = _ArgumentLayout.of(types, self.kernel.params)
        layout = self.layouts[types]
        tail = layout.tail(kwargs) if layout is not None else None
        if tail is not None:
            if len(layout.entries) >= self.MAX_KEYS:
                layout.entries.clear()
            try:
                layout.entries[layout.key(args, kwargs, self.driver.active.get_current_device())] = (compiled, tail)
            except TypeError:    # an unhashable keyword argument: such calls take Triton's launcher
                pass
        return compiled


class _ArgumentLayout:
    """Where the tensors and the scalars are in one sequence of positional argument types, and
    the launches seen with it (_EagerLauncher)."""

    def __init__(self, tensors, scalars, rest):
        self.tensors, self.scalars = _getter(tensors), _getter(scalars)
        self.rest = rest            # the kernel's parameters after the positional arguments
        self.entries = {}           # key -> (CompiledKernel, the values of ``rest``)

    @classmethod
    def of(cls, types, params):
        """The layout of ``types``, or None when a call with them cannot be keyed: an argument
        of another kind, or a runtime parameter left to keywords."""
        if len(types) > len(params) or any(not param.is_constexpr for param in params[len(types):]):
            return None
        tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
        scalars = [i for i, t in enumerate(types) if t in _KEYED_SCALARS]
        if len(tensors) + len(scalars) != len(types):
            return None
        return cls(tensors, scalars, params[len(types):])

    def key(self, args, kwargs, device):
        tensors = self.tensors(args)
        # A misaligned tensor's entry is a tuple, so no two calls that Triton would tell apart
        # by alignment share a key.
        return (device, self.scalars(args), tuple([t.dtype if t.data_ptr() % 16 == 0 else (t.dtype,) for t in tensors]),
                tuple(kwargs.items()), tuple(map(type, kwargs.values())))

    def tail(self, kwargs):
        """The values of ``rest`` (given by keyword or defaulted), or None when one has no value."""
        try:
            return tuple(kwargs[param.name] if param.name in kwargs else param.default for param in self.rest)
        except AttributeError:       # pragma: no cover - a Triton whose params lack defaults
            return None


def _version(text):
    """(major, minor) of a version string such as "3.6.0" or "3.7.0+git1234"."""
    return tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", text).groups())


def _getter(positions):
    """A function of a tuple giving the tuple of its items at ``positions``."""
    if len(positions) == 1:
        (position,) = positions
        return lambda args: (args[position],)
    return operator.itemgetter(*positions) if positions else lambda args: ()


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


def rows(t, row_size):
    """``t`` for a kernel that walks it as rows of ``row_size`` with unit stride along a row:
    ``(tensor, row stride, number of rows)``. A plain contiguous ``t`` is passed as it is (a
    reshape is one more dispatcher call, ~1.5 us on the eager path); anything else (other
    layouts, and the fake and functional tensors of tracing, whose contiguity may be unknown
    while sizes are symbolic) is reshaped to (rows, row_size): a view when possible, else a copy.
    """
    if type(t) is torch.Tensor and t.is_contiguous():
        return t, row_size, t.numel() // row_size
    t = t.reshape(-1, row_size)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.shape[0]


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
