"""Drop-in fast modules. Same constructor arguments, attribute names and state_dict keys as
the reference (``bert_fast.reference``), so ``load_state_dict(strict=True)`` works both ways
and ``optimize()`` can hand them the original submodules. The modules only hold parameters
and call ops; the data path is: tokens -> embedding_sum -> blocks (attention, add_layernorm,
linear_act, add_layernorm) -> output.
"""

import operator
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from . import ops
from .backend import _GLOBAL_HOOKS, backend_of, resolve_backend
from .checks import (check_dropout, check_encoder_inputs, check_encoder_shapes, check_flag,
                     check_pred_position_values, check_pred_positions, check_size, check_valid_lens)
from .cuda_graph import DEFAULT_MAX_GRAPHS, clear_cuda_graphs, graphed_forward
from .extension import require_extension
from .ops._autograd import autocasting
from .ops.add_layernorm import MAX_HIDDEN
from .reference import AddNorm, BERTModel, MaskLM, NextSentencePred


# The forwards below read submodules and Parameters from the dicts nn.Module keeps them in
# (what ``self.ln.weight`` returns), not through nn.Module.__getattr__: ~0.5 us a lookup,
# ~10 lookups a layer, a tenth of the host time of a small forward (`--suite host`).

def _hook_dicts(module):
    """The dicts nn.Module.__call__ reads a module's hooks from."""
    return module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks


def _all_plain(modules):
    """Whether none of ``modules`` has a hook or a forward set on the instance (accelerate's
    hooks do that), nor a weight or bias that is a plain attribute rather than a Parameter
    (FSDP1's flat parameters, use_orig_params=False, put views of its flat buffer there): what
    lets a forward compute them instead of calling them. Attribute reads, no generator: this
    runs for every layer and call."""
    for module in modules:
        attributes = module.__dict__
        if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
                or "forward" in attributes or "weight" in attributes or "bias" in attributes):
            return False
    return True


def _parameters_read(module, cls, forward_hook_done=None):
    """Whether a forward may read ``module``'s Parameters instead of calling it: it is a ``cls``
    itself (not a subclass with its own forward, such as a LoRA layer), plain (_all_plain's test,
    inlined: this runs several times a layer), and no global module hook is set. Else the module
    is called, so what it does, and its hooks, happen as in the reference. ``forward_hook_done``:
    a test of forward hooks whose effect the caller makes itself (those pass)."""
    attributes = module.__dict__
    forward_hooks = module._forward_hooks
    return (type(module) is cls
            and not ((forward_hooks and not (forward_hook_done and all(map(forward_hook_done, forward_hooks.values()))))
                     or module._forward_pre_hooks or module._backward_hooks
                     or module._backward_pre_hooks or "forward" in attributes
                     or "weight" in attributes or "bias" in attributes)
            and not any(_GLOBAL_HOOKS))


def _table_read(table, padding_idx_applied=False, forward_hook_done=None):
    """_parameters_read for an nn.Embedding, whose lookup an embedding op then does: not where
    the module's lookup is more than a row read (max_norm renormalises the rows it reads, in
    place; scale_grad_by_freq, sparse and, unless the op applies it, padding_idx change the
    gradient), set at construction or later."""
    return (_parameters_read(table, nn.Embedding, forward_hook_done) and table.max_norm is None
            and not table.scale_grad_by_freq and not table.sparse and (padding_idx_applied or table.padding_idx is None))


def _linear(module, x):
    """``module(x)``; for a plain nn.Linear without hooks, F.linear on its Parameters (what its
    forward does, without the ~2 us of host time of a module call); called as a module while
    torch.jit.trace records module calls."""
    if _parameters_read(module, nn.Linear) and not torch._C._get_tracing_state():
        params = module._parameters
        return F.linear(x, params["weight"], params["bias"])
    return module(x)


_ACTIVATION_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh")}
_ACTIVATION_MODULES = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": partial(nn.GELU, approximate="tanh")}


def activation_name(module):
    """The ops' name of what ``module`` computes ("relu", "gelu", "gelu_tanh") where a forward
    may compute it instead of calling it: a plain nn.ReLU or nn.GELU (no hook, no forward set
    on the instance); else None."""
    cls = type(module)
    if cls is nn.ReLU:
        name = "relu"
    elif cls is nn.GELU:
        name = "gelu" if module.approximate == "none" else "gelu_tanh"
    else:
        return None
    return name if _all_plain((module,)) else None


def _normalized_size(norm_shape, num_hiddens):
    shape = (norm_shape,) if isinstance(norm_shape, int) else tuple(norm_shape)
    if shape != (num_hiddens,):
        raise ValueError(f"norm_shape must be [num_hiddens] = [{num_hiddens}] (LayerNorm over the "
                         f"hidden features), got {list(shape)}; other shapes are not supported")
    return shape


class _KeepsQKVPacked:
    """For modules whose pack_qkv_ keeps W_q, W_k and W_v back to back in one buffer: pack them
    again where PyTorch gives every Parameter a new tensor of its own."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)          # .to(), .cuda(), .half() ...
        self.pack_qkv_()
        return self

    def __setstate__(self, state):
        super().__setstate__(state)          # copy.deepcopy (pickling keeps shared storage)
        self.pack_qkv_()


class FastMultiHeadAttention(_KeepsQKVPacked, nn.Module):
    """The reference MultiHeadAttention; self-attention runs one packed QKV GEMM.

    Unlike the reference it does not keep ``attention_weights`` (never materialised).
    """

    def __init__(self, key_size, query_size, value_size, num_hiddens, num_heads, dropout,
                 bias=False, *, backend=None, **kwargs):
        super().__init__(**kwargs)
        for name, size in (("key_size", key_size), ("query_size", query_size), ("value_size", value_size),
                           ("num_hiddens", num_hiddens), ("num_heads", num_heads)):
            check_size(name, size)
        check_dropout(dropout)
        if num_hiddens % num_heads != 0:
            raise ValueError(f"num_hiddens ({num_hiddens}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.backend = resolve_backend(backend)
        self.dropout = nn.Dropout(dropout)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=bias)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=bias)
        self.W_v = nn.Linear(value_size, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        # The packed projection reads W_q/W_k/W_v as one (3H, in) weight in place: keep them packed.
        self._qkv_packing = None
        self.pack_qkv_()
        self.register_load_state_dict_post_hook(_repack_after_load)

    def _qkv_params(self):
        """W_q, W_k, W_v's weights, then their biases if they have them (dict reads: this runs
        on every forward, and nn.Module attribute lookups cost ~0.5 us each)."""
        projections = [self._modules[name]._parameters for name in ("W_q", "W_k", "W_v")]
        return tuple(p["weight"] for p in projections) + tuple(p["bias"] for p in projections if p["bias"] is not None)

    def _packed_qkv(self):
        """(3H, in) weight and (3H,) bias (or None) of the packed projection (packed_qkv)."""
        sub = self._modules
        return packed_qkv(self, (sub["W_q"], sub["W_k"], sub["W_v"]))

    def _qkv(self, X):
        """The packed (..., 3H) projection of X: one GEMM, or, where W_q, W_k or W_v must be
        called (as _parameters_read says), the three modules' outputs."""
        sub = self._modules
        w_q, w_k, w_v = sub["W_q"], sub["W_k"], sub["W_v"]
        if type(w_q) is type(w_k) is type(w_v) is nn.Linear and _all_plain((w_q, w_k, w_v)) and not any(_GLOBAL_HOOKS):
            return F.linear(X, *self._packed_qkv())
        _drop_packing(self)
        return torch.cat([w_q(X), w_k(X), w_v(X)], dim=-1)

    @torch.no_grad()
    def pack_qkv_(self):
        """Store W_q, W_k and W_v (weights, and biases) back to back in one buffer, in place, so
        that the packed projection is read without concatenating it on every call: 6 H^2 bytes
        of copies (bf16) and two launches saved per layer and call.

        Done at construction, after ``.to()``/``.cuda()``/``.half()`` and after
        ``load_state_dict`` (also with ``assign=True``); call it after replacing the Parameters
        by hand. The Parameters stay the same objects (their ``.data`` is moved; optimizers and
        ``optimize()``'s sharing are kept); state_dict keys and values are unchanged (the three
        share one storage: ``torch.save`` and safetensors' ``save_file`` keep them as three
        tensors; safetensors' ``save_model``/``load_model`` refuse views of a shared storage). Meta
        tensors, tensor subclasses (FSDP's DTensors) and Parameters of different dtype, device
        or width are left as they are (the concatenation stays). Returns self.
        """
        projections = [self._modules[name] for name in ("W_q", "W_k", "W_v")]
        # Pruning, weight_norm or a parametrization takes "weight" (or "bias") out of the
        # Linear's Parameters (the forward then calls the modules): nothing of theirs to pack.
        plain = [all(type(m) is nn.Linear and name in m._parameters for m in projections) for name in ("weight", "bias")]
        for name, packable in zip(("weight", "bias"), plain):
            if packable:
                _pack_back_to_back_([m._parameters[name] for m in projections])
        self._qkv_packing = _QKVPacking.of(self._qkv_params()) if all(plain) else None
        return self

    def forward(self, queries, keys, values, valid_lens=None, *, unpadding=None):
        """As the reference. With ``unpadding`` (skip_padding), ``queries`` is the (N, H)
        packed valid tokens of a self-attention and ``unpadding`` says where they sit."""
        # The dropout module's own mode, as the reference's module call follows it (MC dropout
        # turns the Dropout modules of an eval model on).
        dropout_p = _dropout_rate(self._modules["dropout"])
        backend = backend_of(self.backend, queries)
        if unpadding is not None:
            context = ops.unpadded_self_attention(self._qkv(queries), self.num_heads, unpadding, valid_lens,
                                                  dropout_p, backend=backend)
        elif queries is keys and keys is values:
            context = ops.packed_self_attention(self._qkv(queries), self.num_heads, valid_lens, dropout_p,
                                                backend=backend)
        else:
            context = ops.multi_head_attention(self.W_q(queries), self.W_k(keys), self.W_v(values),
                                               self.num_heads, valid_lens, dropout_p)
        return _linear(self._modules["W_o"], context)


def _back_to_back_view(tensors):
    """The concatenation of ``tensors`` along dim 0 as a view (no copy) of their detached
    memory when they are plain contiguous tensors lying back to back in one storage, else None.
    The address test that rejects separate allocations comes first."""
    first = tensors[0]
    if any(type(t) not in (torch.Tensor, nn.Parameter) for t in tensors):
        return None     # tensor subclasses (DTensor, FSDP's) have no storage of their own to view
    end = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
    dtype, device, row_shape = first.dtype, first.device, first.shape[1:]
    # Adjacent addresses may still be two allocations side by side: one storage, or no view.
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.dtype != dtype or t.device != device or not t.is_contiguous() or t.shape[1:] != row_shape
                or t.untyped_storage().data_ptr() != storage):
            return None
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *row_shape), first.stride(), first.storage_offset())


def packed_qkv(holder, projections):
    """The (3H, in) weight and (3H,) bias (or None) of the Q, K and V nn.Linear ``projections``
    (their Parameters in ``_parameters``) read as one.

    Where autograd records nothing (inference), the packed weight is the buffer the three
    weights lie in back to back (pack_qkv_, done at construction, after ``.to()`` and after
    ``load_state_dict``), their live memory: no copy. The buffer is remembered in
    ``holder._qkv_packing`` with the Parameters and their layouts (_QKVPacking): while it is
    held its memory cannot be reused, so the same Parameters with the same addresses, shapes
    and strides are still its parts. Under autograd (and for Parameters not packed, while
    torch.compile traces, and under torch.func's transforms, whose wrapped tensors have no
    memory to view: vmap over stacked Parameters) they are concatenated: the concatenation's
    native autograd costs the host less than a Function handing each Parameter its slice of the
    gradient (measured), and training reads each weight once. Where some projections have a
    bias and some not, the missing ones are zeros."""
    parameters = [m._parameters for m in projections]
    weights = tuple([p["weight"] for p in parameters])
    biases = tuple([p["bias"] for p in parameters if p["bias"] is not None])
    params = weights + biases
    if (len(biases) in (0, 3) and not (torch.is_grad_enabled() and any(p.requires_grad for p in params))
            and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()):
        packing = _packing_of(holder, params)
        if packing is not None:
            return packing.weight, packing.bias
    else:
        # Training reads no packing: dropped (the next inference call makes it again), it keeps
        # no Parameter alive that was replaced since (FSDP2's shards: a full QKV per layer).
        _drop_packing(holder)
    if len(biases) not in (0, 3):
        biases = [p["bias"] if p["bias"] is not None else p["weight"].new_zeros(p["weight"].shape[0])
                  for p in parameters]
    return torch.cat(weights), torch.cat(biases) if biases else None


def _drop_packing(holder):
    """Forget ``holder``'s packed QKV where a call does not read it (training, projections
    called as modules: quantized, wrapped): the Parameters it names may have been replaced, and
    it would keep them and their buffer alive. Not while torch.compile traces (a mutation)."""
    if holder._qkv_packing is not None and not torch.compiler.is_compiling():
        holder._qkv_packing = None


def _packing_of(holder, params):
    """``holder._qkv_packing`` where it holds ``params``, else their packing made anew and kept
    (after ``copy.deepcopy`` or unpickling the kept one names the old addresses), or None where
    they are not back to back."""
    packing = holder._qkv_packing
    if packing is None or not packing.holds(params):
        # (None: a stale packing dropped, which would keep the replaced Parameters and their
        # buffer alive; FSDP2's fully_shard replaces them by shards.)
        packing = holder._qkv_packing = _QKVPacking.of(params)
    return packing


class _QKVPacking(NamedTuple):
    """The packed QKV weight and bias (views of one buffer each, detached), the Parameters
    they are made of, and those Parameters' addresses and strides when the views were made."""
    params: tuple
    addresses: tuple
    strides: tuple
    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, params):
        """The packing of W_q, W_k, W_v's weights (and biases), or None if they are not packed."""
        weight = _back_to_back_view(params[:3])
        bias = _back_to_back_view(params[3:]) if len(params) > 3 else None
        if weight is None or (len(params) > 3 and bias is None):
            return None
        return cls(params, tuple(map(_DATA_PTR, params)), tuple(map(_STRIDE, params)), weight, bias)

    def holds(self, params):
        """Whether ``params`` are still the packed ones, at the same addresses with the same
        strides: the views hold the buffer, so its memory cannot have been handed to another
        tensor; the strides, because ``p.data = p.data.t()`` keeps the address (~0.8 us more a
        layer, timeit on the CI machine's CPU). Not seen: ``p.data = p.data[:k]``, a row slice
        at the same address (the shapes too would cost ~1.3 us more a layer)."""
        return (len(params) == len(self.params) and all(map(operator.is_, params, self.params))
                and tuple(map(_DATA_PTR, params)) == self.addresses and tuple(map(_STRIDE, params)) == self.strides)


_DATA_PTR, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.stride


def _packable(params):
    """Whether pack_qkv_ can put these Parameters in one buffer."""
    return (all(type(p) in (torch.Tensor, nn.Parameter) and not p.is_meta for p in params)
            and len({(p.dtype, p.device, p.shape[1:]) for p in params}) == 1)


def _pack_back_to_back_(params):
    """Move the Parameters' data into one buffer, back to back, in place (the same Parameter
    objects, their values unchanged), unless they are packed already or cannot be (a None
    among them, meta tensors, tensor subclasses, mixed dtypes, devices or widths)."""
    if not _packable(params) or _back_to_back_view(params) is not None:
        return
    # The buffer in the Parameters' own mode, whatever the caller's: normal tensors stay normal
    # in inference mode (an inference tensor could not be trained any more), and Parameters
    # made in inference mode stay inference tensors (given a normal tensor as .data, such a
    # Parameter can no longer be viewed, even by F.linear: "Inference tensors do not track
    # version counter").
    with torch.inference_mode(any(p.is_inference() for p in params)):
        buffer = torch.cat([p.detach() for p in params])
    for param, part in zip(params, buffer.split([p.shape[0] for p in params])):
        param.data = part


def _repack_after_load(module, incompatible_keys):
    # load_state_dict(assign=True) replaces the Parameters; plain loads copy into them (a no-op).
    module.pack_qkv_()


class FastAddNorm(AddNorm):
    """``LayerNorm(X + dropout(Y))``: the reference's module, forward through the op."""

    def __init__(self, normalized_shape, dropout, *, backend=None, **kwargs):
        check_dropout(dropout)
        super().__init__(normalized_shape, dropout, **kwargs)
        self.backend = resolve_backend(backend)

    def forward(self, X, Y):
        sub = self._modules
        ln, dropout = sub["ln"], sub["dropout"]
        if not (type(ln) is nn.LayerNorm and type(dropout) is nn.Dropout and _all_plain((ln, dropout))
                and not any(_GLOBAL_HOOKS)):      # (_parameters_read for both, in one call)
            return ln(dropout(Y) + X)        # the reference's forward, calling the modules
        return ops.add_layernorm(Y, X, ln._parameters["weight"], ln._parameters["bias"], ln.eps,
                                 dropout.p, dropout.training, backend=backend_of(self.backend, X))


class FastPositionWiseFFN(nn.Module):
    """The reference PositionWiseFFN, ``dense2(relu(dense1(X)))``, with dense1's bias and the
    activation in one op. ``relu`` is the activation module under the book's name, whatever it
    computes: nn.ReLU, or nn.GELU for activation "gelu"/"gelu_tanh". Another module put there
    (or one with a hook) is called, as the reference calls it."""

    def __init__(self, ffn_num_input, ffn_num_hiddens, ffn_num_outputs, *, activation="relu",
                 backend=None, **kwargs):
        super().__init__(**kwargs)
        for name, size in (("ffn_num_input", ffn_num_input), ("ffn_num_hiddens", ffn_num_hiddens),
                           ("ffn_num_outputs", ffn_num_outputs)):
            check_size(name, size)
        self.backend = resolve_backend(backend)
        if activation not in ops.ACTIVATIONS:
            raise ValueError(f"activation must be one of {ops.ACTIVATIONS}, got {activation!r}")
        self.dense1 = nn.Linear(ffn_num_input, ffn_num_hiddens)
        self.relu = _ACTIVATION_MODULES[activation]()
        self.dense2 = nn.Linear(ffn_num_hiddens, ffn_num_outputs)

    @property
    def activation(self):
        """The ops' name of what ``relu`` computes ("relu", "gelu", "gelu_tanh"), or None where
        the module is called."""
        return activation_name(self._modules["relu"])

    def __setstate__(self, state):
        # Pickled before the activation was the module ``relu``: it was the attribute
        # ``activation``, a name.
        name = state.pop("activation", None)
        super().__setstate__(state)
        if "relu" not in self._modules:
            self.relu = _ACTIVATION_MODULES[name]()

    def forward(self, X):
        sub = self._modules
        dense1, activation = sub["dense1"], activation_name(sub["relu"])
        if activation is not None and _parameters_read(dense1, nn.Linear):
            params = dense1._parameters
            hidden = ops.linear_act(X, params["weight"], params["bias"], activation,
                                    backend=backend_of(self.backend, X))
        else:
            hidden = sub["relu"](dense1(X))
        return _linear(sub["dense2"], hidden)


class FastEncoderBlock(nn.Module):
    """The reference EncoderBlock (post-norm), fast path.

    ``forward(X, valid_lens)`` as the reference. Inside FastBERTEncoder with skip_padding,
    X is the (N, H) packed valid tokens and ``unpadding`` says where they sit in (B, L).
    """

    def __init__(self, key_size, query_size, value_size, num_hiddens, norm_shape, ffn_num_input,
                 ffn_num_hiddens, num_heads, dropout, use_bias=False, *, activation="relu",
                 backend=None, **kwargs):
        super().__init__(**kwargs)
        for name, size in (("num_hiddens", num_hiddens), ("ffn_num_hiddens", ffn_num_hiddens),
                           ("num_heads", num_heads)):
            check_size(name, size)
        check_dropout(dropout)
        norm_shape = _normalized_size(norm_shape, num_hiddens)
        for name, size in (("query_size", query_size), ("key_size", key_size),
                           ("value_size", value_size), ("ffn_num_input", ffn_num_input)):
            if size != num_hiddens:
                raise ValueError(f"{name} ({size}) must equal num_hiddens ({num_hiddens}): the block "
                                 f"feeds its hidden state to that layer")
        self.attention = FastMultiHeadAttention(key_size, query_size, value_size, num_hiddens,
                                                num_heads, dropout, use_bias, backend=backend)
        self.addnorm1 = FastAddNorm(norm_shape, dropout, backend=backend)
        self.ffn = FastPositionWiseFFN(ffn_num_input, ffn_num_hiddens, num_hiddens,
                                       activation=activation, backend=backend)
        self.addnorm2 = FastAddNorm(norm_shape, dropout, backend=backend)

    def forward(self, X, valid_lens=None, *, unpadding=None):
        """``valid_lens`` may also be an ops.KeyMask (what FastBERTEncoder prepares once).
        A tensor ``valid_lens`` must have shape (B,) or (B, L) for X of shape (B, L, H), as the
        reference's (checked here: the block is public API; no sync)."""
        if unpadding is None and valid_lens is not None and not isinstance(valid_lens, ops.KeyMask):
            shape = X.shape
            if len(shape) != 3:
                raise ValueError(f"X must have shape (batch, seq_len, num_hiddens), got {tuple(shape)}")
            check_valid_lens(valid_lens, shape[0], shape[1])
        sub = self._modules
        fused = self._fused_layer(X, valid_lens, unpadding)
        if fused is not None:
            return fused
        Y = sub["addnorm1"](X, sub["attention"](X, X, X, valid_lens, unpadding=unpadding))
        return sub["addnorm2"](Y, sub["ffn"](Y))

    def _fused_layer(self, X, valid_lens, unpadding=None):
        """The whole layer in one call (ops.encoder_layer: one autograd node when autograd
        records, else the launchers alone) where it applies: eager, triton/cuda backends, the
        block's own plain submodules; else None.

        A hook (or a forward set on the instance) on the block's submodules, but the attention's
        dropout whose weights are never materialised, takes the per-op path, which calls the
        module. Runs once per layer and call: written for host time (no generators; ~0.4 us a
        Python call on the CI machine)."""
        if torch.compiler.is_compiling() or X.dim() != (3 if unpadding is None else 2):
            return None
        if unpadding is None and X.numel() == 0:
            return None     # no sequence or no token: the CPU flash attention divides by L (SIGFPE)
        sub = self._modules
        attention, addnorm1, ffn, addnorm2 = sub["attention"], sub["addnorm1"], sub["ffn"], sub["addnorm2"]
        if not (type(attention) is FastMultiHeadAttention and type(addnorm1) is FastAddNorm
                and type(ffn) is FastPositionWiseFFN and type(addnorm2) is FastAddNorm):
            return None
        backend = backend_of(attention.backend, X)
        if (backend == "torch" or not attention.backend == addnorm1.backend == ffn.backend == addnorm2.backend
                or any(_GLOBAL_HOOKS) or torch._C._get_tracing_state()):
            return None
        a, f, n1, n2 = attention._modules, ffn._modules, addnorm1._modules, addnorm2._modules
        w_o, dense2 = a["W_o"], f["dense2"]
        if not _all_plain((attention, addnorm1, ffn, addnorm2, a["W_q"], a["W_k"], a["W_v"], w_o, f["dense1"],
                           dense2, n1["ln"], n1["dropout"], n2["ln"], n2["dropout"])):
            return None
        if not type(n1["dropout"]) is type(n2["dropout"]) is nn.Dropout:
            return None
        # Each dropout as its own module's mode says (the reference calls them); one rate for all three.
        p = _dropout_rate(a["dropout"])
        if not p == _dropout_rate(n1["dropout"]) == _dropout_rate(n2["dropout"]):
            return None
        activation = activation_name(f["relu"])
        if activation is None:
            return None
        key_mask = ops.prepare_key_mask(valid_lens, X.shape[1], backend, X.dtype) if unpadding is None else unpadding
        return fused_layer(X, key_mask, backend, attention.num_heads, float(p),
                           activation, (a["W_q"], a["W_k"], a["W_v"], w_o, f["dense1"], dense2),
                           (n1["ln"], n2["ln"]), attention)


def _dropout_rate(dropout):
    """The rate an nn.Dropout applies now: its p in training mode, else 0."""
    return dropout.p if dropout.training else 0.0


def fused_layer(X, key_mask, backend, num_heads, dropout_p, activation, linears, norms, packing_holder,
                recompute=False):
    """ops.encoder_layer for a post-norm layer given by its modules, or None where it does not
    apply (the caller's per-op path then runs): FastEncoderBlock's and bert_fast.hf's layers.
    ``key_mask``: a KeyMask or None for X (B, L, H); skip_padding's ops.Unpadding for X (N, H).

    ``linears``: W_q, W_k, W_v, W_o, dense1, dense2, which must be plain nn.Linear (read by
    their Parameters: the caller has checked their hooks); ``norms``: the two
    nn.LayerNorm. ``packing_holder``: the module whose ``_qkv_packing`` (pack_qkv_) says where
    the QKV weights lie back to back, read in place. Under autocast for X's device the layer
    makes autocast's casts (LayerSpec.amp_dtype); autocast for another device only, or fp64
    (which autocast leaves alone), takes the per-op path. ``recompute``: the layer keeps only
    its input for the backward, which runs its forward again (activation checkpointing)."""
    w_q, w_k, w_v, w_o, dense1, dense2 = linears
    ln1, ln2 = norms
    linear, norm = nn.Linear, nn.LayerNorm
    if not (type(w_q) is linear and type(w_k) is linear and type(w_v) is linear and type(w_o) is linear
            and type(dense1) is linear and type(dense2) is linear and type(ln1) is norm and type(ln2) is norm):
        return None
    amp_dtype = None
    if autocasting():
        if not torch.is_autocast_enabled(X.device.type) or X.dtype == torch.float64:
            return None
        amp_dtype = torch.get_autocast_dtype(X.device.type)
    q, k, v, o = w_q._parameters, w_k._parameters, w_v._parameters, w_o._parameters
    d1, d2, g1, g2 = dense1._parameters, dense2._parameters, ln1._parameters, ln2._parameters
    try:
        flat = (q["weight"], k["weight"], v["weight"], q["bias"], k["bias"], v["bias"], o["weight"], o["bias"],
                g1["weight"], g1["bias"], d1["weight"], d1["bias"], d2["weight"], d2["bias"], g2["weight"], g2["bias"])
    except KeyError:    # a weight that is not a Parameter (FSDP1's flat parameters, pruning): modules called
        return None
    if (flat[3] is None) != (flat[4] is None) or (flat[3] is None) != (flat[5] is None):
        return None        # some Q/K/V projections with a bias, some without
    # The layer's Triton add-norms skip their input checks (the layer makes their inputs): what
    # they would reject takes the per-op path, which says what is wrong.
    hidden = X.shape[-1]
    if not ln1.normalized_shape == ln2.normalized_shape == (hidden,) or hidden > MAX_HIDDEN:
        return None
    spec = ops.LayerSpec(num_heads, dropout_p, activation, ln1.eps, ln2.eps, backend == "cuda", amp_dtype)
    if spec.extension:
        require_extension(X)
    # The QKV weight (and bias) read in place where pack_qkv_ keeps them back to back.
    packing = _packing_of(packing_holder, flat[:3] if flat[3] is None else flat[:6])
    packed = (None, None) if packing is None else (packing.weight, packing.bias)
    return ops.encoder_layer(spec, X, key_mask, flat, packed, recompute)


class FastBERTEncoder(nn.Module):
    """Drop-in for the reference BERTEncoder.

    Keyword-only options:
      activation: "relu" (the reference), "gelu" (erf, original BERT) or "gelu_tanh".
      learn_pos_embedding: False keeps the reference's quirk (no gradient reaches
        pos_embedding); True makes the position table learnable.
      skip_padding: compute valid tokens only (1-D valid_lens).
        Valid positions match the exact mode; padded positions of the output are zeros
        (the exact mode computes real values there).
      backend: "auto" (default: for CUDA inputs cuda where the compiled extension runs on that
        GPU, else triton, and triton inside CUDA-graph captures; torch for the rest), "torch",
        "triton" or "cuda" (see bert_fast.backend).
      check_inputs: check values: token ids in [0, vocab_size), segment ids in {0, 1}, no NaN
        in valid_lens (one host sync per forward; under torch.compile too, inside the graph);
        set False (or flip the attribute) in a production loop that already guarantees them.
        Types, shapes, dtypes (ids: int64 or int32) and devices are checked on every forward
        whatever it says (no sync; see bert_fast.checks).
      cuda_graphs: replay inference forwards from CUDA graphs captured per shape bucket
        (bert_fast.cuda_graph: buckets, costs, limits; at most ``max_cuda_graphs`` graphs, an
        attribute, default 8); training, non-CUDA inputs and recording autograd run eagerly
        with one CudaGraphFallbackWarning each.
    """

    def __init__(self, vocab_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens,
                 num_heads, num_layers, dropout, max_len=1000, key_size=768, query_size=768,
                 value_size=768, *, activation="relu", learn_pos_embedding=False,
                 skip_padding=False, backend=None, check_inputs=True, cuda_graphs=False, **kwargs):
        super().__init__(**kwargs)
        for name, size in (("vocab_size", vocab_size), ("num_hiddens", num_hiddens),
                           ("ffn_num_hiddens", ffn_num_hiddens), ("num_heads", num_heads),
                           ("num_layers", num_layers), ("max_len", max_len)):
            check_size(name, size)
        check_dropout(dropout)
        self.backend = resolve_backend(backend)
        self.learn_pos_embedding = check_flag("learn_pos_embedding", learn_pos_embedding)
        self.skip_padding = check_flag("skip_padding", skip_padding)
        self.check_inputs = check_flag("check_inputs", check_inputs)
        self.cuda_graphs = check_flag("cuda_graphs", cuda_graphs)
        self.max_cuda_graphs = DEFAULT_MAX_GRAPHS
        self.token_embedding = nn.Embedding(vocab_size, num_hiddens)
        self.segment_embedding = nn.Embedding(2, num_hiddens)
        self.blks = nn.Sequential()
        for i in range(num_layers):
            self.blks.add_module(f"{i}", FastEncoderBlock(
                key_size, query_size, value_size, num_hiddens, norm_shape, ffn_num_input,
                ffn_num_hiddens, num_heads, dropout, True, activation=activation,
                backend=self.backend))
        self.pos_embedding = nn.Parameter(torch.randn(1, max_len, num_hiddens))

    def clear_cuda_graphs(self):
        """Drop the CUDA graphs captured for this encoder (cuda_graphs=True); the next calls
        capture again. Returns how many were dropped."""
        return clear_cuda_graphs(self)

    def pack_qkv_(self):
        """FastMultiHeadAttention.pack_qkv_() for every block (done at construction, after
        ``.to()`` and ``load_state_dict``); returns self."""
        for blk in self.blks:
            blk.attention.pack_qkv_()
        return self

    def validate_inputs(self, tokens, segments, valid_lens=None):
        """What forward checks when check_inputs is True: shapes and values (bert_fast.checks:
        one host sync). Returns tokens (under torch.compile: made to depend on the check)."""
        return check_encoder_inputs(tokens, segments, valid_lens, vocab_size=self.token_embedding.num_embeddings,
                             max_len=self.pos_embedding.shape[1], device=self.pos_embedding.device,
                             skip_padding=self.skip_padding)

    def forward(self, tokens, segments, valid_lens=None):
        if self.cuda_graphs:
            return graphed_forward(self, tokens, segments, valid_lens)
        return self._forward(tokens, segments, valid_lens)

    def _forward(self, tokens, segments, valid_lens=None, *, num_tokens=None):
        """The eager forward; ``num_tokens`` (skip_padding): a static bound on the valid tokens
        instead of counting them on the host (what a CUDA graph captures)."""
        if self.check_inputs:
            tokens = self.validate_inputs(tokens, segments, valid_lens)
        else:   # always on: no tensor op, no sync
            pos = self._parameters["pos_embedding"]
            check_encoder_shapes(tokens, segments, valid_lens, max_len=pos.shape[1], device=pos.device,
                                 skip_padding=self.skip_padding)
        backend = backend_of(self.backend, tokens)
        sub = self._modules
        token_table, segment_table = sub["token_embedding"], sub["segment_embedding"]
        if _table_read(token_table) and _table_read(segment_table):
            called = None
            # The token table's gradient without atomics where PyTorch is asked for deterministic
            # algorithms (as its own embedding backward follows that setting).
            embed = dict(token_weight=token_table.weight, segment_weight=segment_table.weight,
                         pos_weight=self.pos_embedding, learn_pos_embedding=self.learn_pos_embedding,
                         backend=backend, deterministic=torch.are_deterministic_algorithms_enabled())
        else:       # a hook on a table, a subclass, a padding_idx...: the reference's sum, calling them
            pos = self.pos_embedding if self.learn_pos_embedding else self.pos_embedding.detach()
            called = token_table(tokens) + segment_table(segments) + pos[:, :tokens.shape[1], :]
        if not (self.skip_padding and valid_lens is not None):
            X = ops.embedding_sum(tokens, segments, **embed) if called is None else called
            # valid_lens in the form the attention reads, once for all the layers.
            key_mask = ops.prepare_key_mask(valid_lens, tokens.shape[1], backend, X.dtype)
            for blk in self.blks:
                X = blk(X, key_mask)
            return X
        if valid_lens.dim() != 1:
            raise ValueError("skip_padding=True needs 1-D valid_lens of shape (batch,)")
        unpadding = ops.unpadding_for(valid_lens, tokens.shape[1], num_tokens)
        if called is None:
            X = ops.embedding_sum(ops.unpad(tokens, unpadding), ops.unpad(segments, unpadding),
                                  positions=unpadding.indices % tokens.shape[1], **embed)
        else:
            X = ops.unpad(called, unpadding)
        for blk in self.blks:
            X = blk(X, valid_lens, unpadding=unpadding)
        return ops.pad(X, unpadding)


class FastMaskLM(MaskLM):
    """The reference MaskLM (the same MLP and state_dict), gathering X[b, pred_positions[b, k]]
    with (B, P) indices: the book's flattened ones made an exported model with a dynamic number
    of predictions P guard on P != 1 (torch.export), refusing one prediction per sequence."""

    def forward(self, X, pred_positions):
        check_pred_positions(pred_positions, X.shape[0], X.device)
        rows = torch.arange(X.shape[0], device=X.device)[:, None].expand_as(pred_positions)
        return self._modules["mlp"](X[rows, pred_positions])


class FastBERTModel(BERTModel):
    """Drop-in for the reference BERTModel: FastBERTEncoder plus the reference's heads (its
    MaskLM as FastMaskLM: the same values and state_dict).

    Takes FastBERTEncoder's keyword-only options. The forward pass is the reference's.
    """

    def __init__(self, vocab_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens,
                 num_heads, num_layers, dropout, max_len=1000, key_size=768, query_size=768,
                 value_size=768, hid_in_features=768, mlm_in_features=768,
                 nsp_in_features=768, **options):
        # Not BERTModel.__init__: it would allocate a reference encoder only to replace it.
        nn.Module.__init__(self)
        for name, size in (("hid_in_features", hid_in_features), ("mlm_in_features", mlm_in_features),
                           ("nsp_in_features", nsp_in_features)):
            check_size(name, size)
        self.encoder = FastBERTEncoder(vocab_size, num_hiddens, norm_shape, ffn_num_input,
                                       ffn_num_hiddens, num_heads, num_layers, dropout,
                                       max_len=max_len, key_size=key_size, query_size=query_size,
                                       value_size=value_size, **options)
        self.hidden = nn.Sequential(nn.Linear(hid_in_features, num_hiddens), nn.Tanh())
        self.mlm = FastMaskLM(vocab_size, num_hiddens, mlm_in_features)
        self.nsp = NextSentencePred(nsp_in_features)

    def forward(self, tokens, segments, valid_lens=None, pred_positions=None):
        """The reference's forward; with the encoder's check_inputs, the MLM positions' values
        are checked first (in eager mode), before anything runs on the device."""
        if pred_positions is not None and self.encoder.check_inputs and isinstance(tokens, torch.Tensor):
            check_pred_positions(pred_positions, tokens.shape[0], tokens.device)
            check_pred_position_values(pred_positions, tokens.shape[-1])
        return super().forward(tokens, segments, valid_lens, pred_positions)
