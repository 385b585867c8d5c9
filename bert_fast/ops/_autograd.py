"""What the ops' two call paths share: the eager thin path and the registered ops' autograd.

Every fused op is reachable two ways (STYLE.md rule 2):

* eager (what the modules run outside torch.compile): straight to the launcher when autograd
  records nothing, else through a small ``torch.autograd.Function`` whose backward calls the
  backward launcher. No ``torch.library`` dispatch per call: a custom op's Python autograd and
  dispatch layers cost several times a plain Function (pytorch/pytorch#176592, #177109), which
  on a GPU is more than the kernels of a BERT layer take (../shared/gpu-runs/h100-2026-11-23).
* compiled: the registered op (``triton_op`` or the extension's ``TORCH_LIBRARY`` op) with its
  fake kernel and ``register_autograd``, which torch.compile traces (``use_registered_op``).

The Triton ops are registered at their first use, not at import (``deferred_ops``).
"""

import functools
import sys
import threading

import torch


def use_registered_op():
    """True while torch.compile or torch.jit.trace traces: then the ops go through their
    registered form, which both record as one node (the eager launchers' Triton launches are
    invisible to jit.trace: its graph would keep the output's allocation and not the kernel).
    The registered ops exist once this has said True."""
    return (torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None) and _register_triton_ops()


def compile_time_constant(fn):
    """Mark ``fn`` as torch.compile's ``assume_constant_result`` does: Dynamo calls it when it
    traces a call of it, and puts its result in the graph as a constant. Set here by hand because
    ``torch.compiler.assume_constant_result`` imports torch._dynamo (~1.5 s on the CI machine's
    CPU), which neither ``import bert_fast`` nor eager calls otherwise need; the attribute is the
    whole of what that decorator does (torch 2.0 to 2.15). tests/test_compile.py's fresh-process
    tests compile with fullgraph before anything else ran: they fail if Dynamo stops honouring it."""
    fn._dynamo_marked_constant = True
    return fn


# Each op module's function that registers its Triton ops (triton_op, autograd), and whether it ran.
_REGISTRARS = {}
_registry_lock = threading.RLock()


def register_ops():
    """Register bert_fast's Triton ops with torch.library now, if not yet, and load the compiled
    extension, whose ops (backend "cuda") register when it loads; True.

    Call it (``bert_fast.register_ops()``) before loading a saved program that calls the ops
    (torch.jit.load, torch.export.load, AOTInductor's aoti_load_package) in a process that has
    traced nothing: deserializing looks the ops up by name and would not find them."""
    from .. import extension
    extension.load()
    return _register_triton_ops()


@compile_time_constant
def _register_triton_ops():
    """Register bert_fast's Triton ops with torch.library now, if not yet; True.

    Deferred from import: ``torch.library.triton_op`` imports torch._inductor and torch._dynamo
    (1.5-2 s and 60-70 MB on the CI machine's CPU, most of ``import bert_fast``) to look for the
    op's kernels, and eager calls never use the registered ops (the thin path). They are
    registered when use_registered_op() first says True, including while torch.compile or
    torch.export traces (this runs then as a compile-time constant, outside the trace), or when
    one is read from its module (``bert_fast.ops.attention.attention_fwd``). The extension is
    left to load where its ops are first called."""
    if all(_REGISTRARS.values()):
        return True
    with _registry_lock:
        for register, done in list(_REGISTRARS.items()):
            if not done:
                _REGISTRARS[register] = True     # first: a registration that fails is not retried half-done
                register()
    return True


def deferred_ops(module_name, register, *names):
    """Defer ``register`` (which binds ``names`` in module ``module_name``) to _register_triton_ops(),
    and return the module's ``__getattr__``: reading one of ``names`` before then registers the ops."""
    _REGISTRARS[register] = False

    def __getattr__(name):
        if name in names:
            _register_triton_ops()
            if name in vars(sys.modules[module_name]):
                return vars(sys.modules[module_name])[name]
            raise AttributeError(f"{module_name}.{name}: registering bert_fast's Triton ops failed (see the "
                                 f"first error)")
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    return __getattr__


# Whether autocast is on for any device (torch.is_autocast_enabled() alone is CUDA's); Dynamo
# traces it.
autocasting = getattr(torch._C, "_is_any_autocast_enabled", torch.is_autocast_enabled)


def records_grad(*tensors):
    """Whether autograd records an op on these tensors (grad mode on and one needs a grad)."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


# torch.autograd.Function's C entry point (what Function.apply ends in), called with the class.
_function_apply = vars(torch._C._FunctionBase)["apply"]


def thin_apply(function, *args):
    """``function.apply(*args)`` for the eager path's Functions, ~1.5 us less host time a call.

    Function.apply's Python preamble binds default arguments (for setup_context, which these
    Functions do not define) and unwraps functorch wrappers left over from a finished
    transform; neither can apply to the activations and Parameters the ops hand their Functions
    outside a transform. Inside one (vmap, grad, ...) it runs in full.
    """
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return _function_apply(function, *args)


def below_autograd(op, *args):
    """Call a registered op's device kernel directly, skipping its (Python) autograd kernel:
    for the eager path, where autograd is handled by a Function or not needed at all. About
    half the host time of a plain call of an extension op with a Python autograd formula.
    Inference mode already leaves the autograd keys out: no guard to enter there."""
    if torch.is_inference_mode_enabled():
        return op(*args)
    with _BelowAutograd():
        return op(*args)


_BelowAutograd = torch._C._AutoDispatchBelowAutograd


def _double_backward_message(what, op_name):
    return (f"double backward (create_graph=True, e.g. a gradient penalty) through {what} is not "
            f"supported by bert_fast's fused kernels ({op_name}); backend='torch' supports it with the forward "
            f"under torch.nn.attention.sdpa_kernel(SDPBackend.MATH)")


def forbid_double_backward(op_name, what):
    """Give backward op ``op_name`` an autograd formula that raises a clear error.

    The fused backward kernels have no derivative of their own. Without a formula, a custom
    op of Python's raises PyTorch's generic error, and one of the extension's (TORCH_LIBRARY)
    goes through the dispatcher's fallback, which lets a double backward run and silently
    drops the second-order terms: a wrong answer. Plain first-order training never reaches
    this (the backward runs without grad mode unless ``create_graph=True``).
    """
    def backward(ctx, *grads):
        raise NotImplementedError(_double_backward_message(what, op_name))

    torch.library.register_autograd(op_name, backward, setup_context=lambda ctx, inputs, output: None)


class _NoSecondDerivative(torch.autograd.Function):
    """Passes the first ``count`` tensors (gradients) through; differentiating them again raises
    the clear error. The other inputs (what the gradients were computed from) only connect the
    node to the graph, so that autograd.grad of a function of the gradients with respect to
    those (the Parameters, the inputs) reaches it and raises, instead of returning None."""

    @staticmethod
    def forward(ctx, message, count, *tensors):
        ctx.message = message
        return tensors[:count]

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(ctx.message)


def once_differentiable(what, op_name):
    """Decorate a Function's backward that has no derivative of its own.

    It runs without grad mode. Under ``create_graph=True`` its gradients come out attached to a
    node that raises NotImplementedError if differentiated (as the registered ops' backward do,
    see forbid_double_backward), instead of silently dropping second-order terms.
    """
    message = _double_backward_message(what, op_name)

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            if not torch.is_grad_enabled():      # no create_graph: the usual first-order backward
                return backward(ctx, *grad_outputs)
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            tensors = [g.detach().requires_grad_() for g in grads if isinstance(g, torch.Tensor)]
            if not tensors:
                return grads
            sources = [t for t in (*grad_outputs, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
            attached = iter(thin_apply(_NoSecondDerivative, message, len(tensors), *tensors, *sources))
            return tuple(next(attached) if isinstance(g, torch.Tensor) else g for g in grads)
        return wrapper
    return decorate
