"""One post-norm encoder layer in one call, eager: a single autograd node in training, the
launchers alone in inference.

Training through the per-op path records ~26 autograd nodes a layer (the QKV concatenation,
each linear's view/transpose/addmm nodes, the attention's split and merge, three Functions)
and runs each one's bookkeeping in the backward: on the CPU, where the host time is all there is
at a small shape (``--suite host``), the triton backend's backward took 0.93x the reference's
and its forward+backward 0.85x. This op runs the same launchers for the whole layer

    qkv = x Wqkv^T + bqkv;  a = attention(qkv);  y = LN1(x + drop(a Wo^T + bo))
    h = act(y W1^T + b1);   out = LN2(y + drop(h W2^T + b2))

in one ``torch.autograd.Function``, whose backward chains the backward launchers and GEMMs
with the residual gradients folded into the GEMMs (``addmm(d_residual, d_z, W)``), the
gradients of b_o and b_2 summed by the add-norms' backward kernels beside their own weight and
bias gradients (one reduction for the three, no pass over the rows of their own: 4 launches a
layer fewer), b_1's summed by the kernel that masks ReLU's gradient (bias_act's backward; with
the kernels, not on the CPU), the three kernels' column sums finished by one launch after the
last of them (_DeferredSums), and the packed QKV weight's gradient computed once and handed to
W_q, W_k, W_v as three slices (no concatenation node). Saved tensors are what the per-op path
saves; the backward launchers do not check them again (the forward's launchers did).

Under autocast (for the layer's device; ``LayerSpec.amp_dtype``) the layer makes autocast's
casts itself, as the per-op path's F.linear gets them: GEMMs, attention and activation in
autocast's dtype, the add-norms in the dtype of the reference's LayerNorm: fp32 on CUDA (an fp32
op of its autocast), the residual sum's dtype on the CPU (add_layernorm.autocast_norm_dtype).

Without autograd (inference) the same forward runs with nothing saved: the per-op path's host
work between the launches (four submodule calls, each op's backend and autograd decisions, the
packed QKV lookup) is paid once per layer instead of once per op.

Where it applies (modules.fused_layer): eager, backends triton and cuda, no functorch
transform, and the block's submodules the plain fast ones without hooks; padded self-attention
(x (B, L, H), a KeyMask or None) or skip_padding's packed valid tokens (x (N, H), their
Unpadding). torch.compile traces the per-op registered ops instead (Inductor fuses across them
itself). Attention: the Triton kernels on CUDA (padded, or varlen over the packed tokens; on
the CPU with dropout, their twin); on the CPU without dropout PyTorch's fused CPU attention
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, what SDPA runs; in inference
SDPA itself, which needs no LSE), over the padded batch with the key mask, or once per sequence
of packed tokens.
"""

from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch.nn import functional as F

from .add_layernorm import (_add_layernorm_bwd_triton, _add_layernorm_fwd_cpu, _add_layernorm_fwd_triton, _ext_bwd,
                            _ext_fwd, _saved_bwd, autocast_norm_dtype)
from .attention import (_attention_bwd, _attention_fwd, _runs_kernel, _unmasked, _varlen_attention_bwd,
                        _varlen_attention_fwd, key_mask as _key_mask)
from .bias_act import _bias_act_bwd, _bias_act_bwd_triton, _bias_act_fwd, _relu_bwd
from .column_sums import joint_column_sums
from ._autograd import once_differentiable, records_grad, thin_apply
from ._triton import as_dtype, cpu_kernel
from ._philox import dropout_seed
from .padding import Unpadding

# The torch function where it is bound (~1 us less a call than the OpOverload's Python __call__).
_flash_cpu = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu",
                     torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class LayerSpec(NamedTuple):
    """What a layer's kernels need besides tensors."""
    num_heads: int
    dropout_p: float          # 0 outside training
    activation: str
    eps1: float
    eps2: float
    extension: bool           # backend "cuda": the extension's add_layernorm
    # Autocast's dtype where autocast is on for the layer's device type, else None.
    amp_dtype: torch.dtype | None = None


def _packed(parts, view):
    """W_q, W_k, W_v (or their biases) as one tensor: ``view``, the Parameters' own memory when
    pack_qkv_ put them back to back (the modules find it), else a concatenation."""
    if parts[0] is None:
        return None
    return view if view is not None else torch.cat([p.detach() for p in parts])


def _cpu_attention_args(qkv, num_heads, key_mask):
    """q, k, v (B, heads, L, d) views of qkv, the additive/bool mask and the query factor."""
    batch, seqlen, width = qkv.shape
    # (B, L, 3, heads, d) -> (B, heads, 3, L, d): a view and a transpose (Tensor.unflatten and
    # permute cost the host ~1 us more).
    q, k, v = qkv.view(batch, seqlen, 3, num_heads, width // (3 * num_heads)).transpose(1, 3).unbind(2)
    if key_mask is None:
        return q, k, v, _unmasked(q, seqlen), None
    mask, query_keep = key_mask.sdpa_mask, key_mask.query_keep
    if mask is None or not (mask.dtype == torch.bool or mask.dtype == q.dtype):
        mask, query_keep = _key_mask(key_mask.valid_lens, q.shape[2], k.shape[2], q.device)
    if mask.dtype == torch.bool:        # the fused CPU kernel takes an additive mask
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return q, k, v, mask, query_keep


def _uses_kernels(qkv, dropout_p):
    return _runs_kernel(qkv, dropout_p)


def _per_sequence(qkv, unpadding, dropout_p):
    """Whether packed tokens' attention runs PyTorch's fused CPU attention once per sequence (as
    the per-op path's SDPA calls there), rather than the varlen kernels or their CPU twin: on the
    CPU without dropout, with the per-sequence counts on the host."""
    return not (_uses_kernels(qkv, dropout_p) or unpadding.static)


def _sequence_heads(rows, num_heads):
    """q, k, v (1, heads, n, d) views of one sequence's (n, 3H) packed projection."""
    return rows.unflatten(-1, (3, num_heads, -1)).permute(1, 2, 0, 3).unsqueeze(1).unbind(0)


def _per_sequence_forward(qkv, seqlens, num_heads):
    """(context (N, H), the LSE of each non-empty sequence)."""
    outputs, lses = [], []
    for rows in qkv.split(seqlens):
        if rows.shape[0] == 0:
            continue
        out, lse = _flash_cpu(*_sequence_heads(rows, num_heads), 0.0, False, attn_mask=_unmasked(rows, rows.shape[0]))
        lses.append(lse)
        outputs.append(out[0].transpose(0, 1).reshape(rows.shape[0], -1))
    context = torch.cat(outputs) if outputs else qkv.new_empty(0, qkv.shape[-1] // 3)
    return context, lses


def _per_sequence_backward(grad, qkv, context, seqlens, num_heads, lses):
    grads, lses = [], iter(lses)
    for rows, grad_rows, out in zip(qkv.split(seqlens), grad.split(seqlens), context.split(seqlens)):
        n = rows.shape[0]
        if n == 0:
            continue
        # The attention output as the forward's kernel gave it, (1, heads, n, d), a view of the
        # context's rows (the kernel reads its operands' strides: the same bits as its own).
        out, grad_rows = (t.view(n, num_heads, -1).transpose(0, 1)[None] for t in (out, grad_rows))
        dq, dk, dv = _flash_cpu_backward(grad_rows, *_sequence_heads(rows, num_heads), out, next(lses), 0.0, False,
                                         attn_mask=_unmasked(rows, n))
        # (1, heads, n, d) each -> (n, 3, heads, d), the packed projection's layout, in one copy.
        grads.append(torch.stack((dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)), 1).view(n, -1))
    return torch.cat(grads) if grads else torch.zeros_like(qkv)


def _attention_forward(qkv, key_mask, num_heads, dropout_p, seed, saves=True):
    """(context (B, L, H) or, for packed valid tokens, (N, H); the LSEs the backward reads with
    it: a list of one tensor, or one per sequence; [None] where ``saves`` is False (inference:
    the kernels skip the LSE)). The context is all of the attention output the backward needs:
    where a kernel's output has another layout, the backward views the context in it."""
    if isinstance(key_mask, Unpadding):
        if _per_sequence(qkv, key_mask, dropout_p):
            return _per_sequence_forward(qkv, key_mask.seqlens, num_heads)
        out, lse = _varlen_attention_fwd(qkv, key_mask.cu_seqlens, num_heads, key_mask.seqlen, dropout_p, seed,
                                         key_mask.static, lse=saves)
        return out, [lse]
    if _uses_kernels(qkv, dropout_p):
        valid_lens = None if key_mask is None else key_mask.valid_lens
        counts = None if key_mask is None else key_mask.counts
        out, lse = _attention_fwd(qkv, valid_lens, num_heads, dropout_p, seed, counts, lse=saves)
        return out, [lse]
    q, k, v, mask, query_keep = _cpu_attention_args(qkv, num_heads, key_mask)
    if query_keep is not None:
        q = q * query_keep
    if saves:
        out, lse = _flash_cpu(q, k, v, 0.0, False, attn_mask=mask)
    else:       # SDPA runs the same fused CPU kernel from C++: ~2 us less host time, no LSE kept
        out, lse = F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None
    return out.transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1], -1), [lse]


def _attention_backward(grad, qkv, context, key_mask, num_heads, dropout_p, seed, lses):
    """d_qkv, qkv's shape."""
    if isinstance(key_mask, Unpadding):
        if _per_sequence(qkv, key_mask, dropout_p):
            return _per_sequence_backward(grad, qkv, context, key_mask.seqlens, num_heads, lses)
        return _varlen_attention_bwd(grad, qkv, context, lses[0], key_mask.cu_seqlens, num_heads, key_mask.seqlen,
                                     dropout_p, seed, key_mask.static, check=False)
    if _uses_kernels(qkv, dropout_p):
        valid_lens = None if key_mask is None else key_mask.valid_lens
        counts = None if key_mask is None else key_mask.counts
        return _attention_bwd(grad, qkv, context, lses[0], valid_lens, num_heads, dropout_p, seed, counts,
                              check=False)
    q, k, v, mask, query_keep = _cpu_attention_args(qkv, num_heads, key_mask)
    if query_keep is not None:
        q = q * query_keep
    # (B, L, H) -> (B, heads, L, d) views: the output as the forward's kernel gave it (see
    # _per_sequence_backward) and the gradient.
    out, grad = (t.view(*t.shape[:2], num_heads, -1).transpose(1, 2) for t in (context, grad))
    dq, dk, dv = _flash_cpu_backward(grad, q, k, v, out, lses[0], 0.0, False, attn_mask=mask)
    if query_keep is not None:
        dq = dq * query_keep
    # (B, heads, L, d) each -> (B, L, 3, heads, d), the packed projection's layout, in one copy
    # (a stack, then a permuted copy, held three such tensors at once: the training peak).
    return torch.stack((dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)), 2).view(qkv.shape)


def _layernorm_forward(extension, stats, on_cpu):
    """The add-norm's forward; ``stats``: whether a backward will read its statistics (the
    extension's op and the CPU kernel make them either way). Triton's without its input
    checks: the layer makes its inputs itself. Chosen once a layer: no launcher in between."""
    if extension:
        return _ext_fwd
    if on_cpu:
        return _add_layernorm_fwd_cpu
    return _unchecked_norm_with_stats if stats else _unchecked_norm_output


def _unchecked_norm_with_stats(x, residual, weight, bias, eps, seed, p):
    return _add_layernorm_fwd_triton(x, residual, weight, bias, eps, seed, p, True, False)


def _unchecked_norm_output(x, residual, weight, bias, eps, seed, p):
    """Where no backward follows: the kernel stores no statistics."""
    return _add_layernorm_fwd_triton(x, residual, weight, bias, eps, seed, p, False, False)


class _DeferredSums:
    """The backward's column sums on the kernels' path, made by one launch after the last kernel.

    Triton's add-norm backward (the LayerNorm's weight and bias gradients, and the branch bias's)
    and bias_act's (b_1's) each leave their column sums as fp32 partial rows; one
    joint_column_sums launch sums the layer's three buffers where a launch per kernel was three
    (host time and launches: the eager training step is host-bound on the GPU). ``add`` gives a
    placeholder (an int) per sum, ``finish`` makes them, ``take`` turns a placeholder into its
    sum and leaves anything else (None, a tensor) as it is."""

    def __init__(self):
        self.partials, self.widths, self.sums = [], [], None

    def add(self, partials, present):
        """Placeholders for the parts of ``partials`` ((programs, parts, N) or (programs, N);
        None when there are none): ``present`` flags which parts it holds, of those it could."""
        if partials is not None:
            self.partials.append(partials)
        handles = []
        for there in present:
            handles.append(len(self.widths) if there else None)
            if there:
                self.widths.append(partials.shape[-1])
        return handles

    def finish(self, dtype):
        if self.partials:
            self.sums = joint_column_sums(self.partials, dtype).split_with_sizes(self.widths)

    def take(self, value):
        return self.sums[value] if type(value) is int else value


# The add-norm backward of the cuda backend's fused layer: the extension's (True), which sums its
# own weight and bias gradients, while the branch bias's are two torch.sum launches a layer; or
# Triton's (False) on the extension forward's statistics (the same dropout mask, _philox.py),
# with every column sum of the layer in one launch (_DeferredSums); under autocast on Triton's
# forward too, whose add-norms take the branch in autocast's dtype (_mixed_add_norms). Which
# trains faster is for a GPU to say (scripts/profile_kernels.py --train --backends auto
# auto:extension-addnorm-bwd):
# on an H200 (2026-11-26, BERT-base bf16 B32 L128 training step) Triton's, 6.74 ms of kernel time
# and 371 launches a step against the extension's 7.02 ms and 443 (its branch-bias sums).
EXTENSION_ADDNORM_BACKWARD = False


def _defers_sums(spec, rows):
    """Whether the backward's column sums go through _DeferredSums: Triton's add-norms (not the
    extension's, whose backward sums its own) on the kernels' tensors."""
    return not (spec.extension and EXTENSION_ADDNORM_BACKWARD) and not cpu_kernel(rows)


def _layernorm_backward(spec, has_x_bias, grad, x, residual, weight, mean, rstd, seed, has_bias, sums=None):
    """LN(residual + drop(x))'s backward on rows: (d_residual, d_x, d_weight, d_bias, d_x_bias).
    d_x is the branch's gradient (after its dropout); d_x_bias, the gradient of the branch's
    bias (d_x's column sum), None unless ``has_x_bias``: the Triton kernel sums it with d_weight
    and d_bias, one reduction for the three and no pass of its own over d_x. With ``sums`` (a
    _DeferredSums) the last three are its placeholders."""
    p = spec.dropout_p
    if sums is not None:
        d_res, d_drop, partials = _add_layernorm_bwd_triton(grad, x, residual, weight, mean, rstd, seed, p, has_bias,
                                                            has_x_bias, check=False, defer_sums=True)
        return (d_res, d_res if d_drop is None else d_drop,
                *sums.add(partials, (weight is not None, has_bias, has_x_bias)))
    if spec.extension:
        d_res, d_drop, d_weight, d_bias = _ext_bwd(grad, x, residual, weight, mean, rstd, seed, p, has_bias)
        d_x = d_drop if p > 0.0 else d_res
        return d_res, d_x, d_weight, d_bias, (d_x.sum(0) if has_x_bias else None)
    d_res, d_drop, d_weight, d_bias, *d_x_bias = _saved_bwd(grad, x, residual, weight, mean, rstd, seed, p,
                                                            has_bias, has_x_bias)
    return d_res, d_drop if p > 0.0 else d_res, d_weight, d_bias, d_x_bias[0] if has_x_bias else None


def _layer_forward(spec, key_mask, packed, x, params, ctx=None, seeds=None):
    """The layer's output for x (B, L, H), or (N, H) packed tokens; with ``ctx`` (_EncoderLayer's
    forward) it also keeps what the backward needs. Without, nothing is kept: inference frees
    each intermediate once read, as the per-op path does (held by this function's locals to
    its end, they made the layer's peak twice the per-op path's). ``seeds``: the three dropout
    seeds to use (a recompute's: _RecomputedEncoderLayer), else drawn here."""
    (w_q, w_k, w_v, b_q, b_k, b_v, w_o, b_o, ln1_w, ln1_b, w_1, b_1, w_2, b_2, ln2_w, ln2_b) = params
    p, amp = spec.dropout_p, spec.amp_dtype
    mixed = _mixed_add_norms(spec, x)
    ln_fwd = _layernorm_forward(spec.extension and not mixed, ctx is not None, cpu_kernel(x))
    w_qkv, b_qkv = _packed((w_q, w_k, w_v), packed[0]), _packed((b_q, b_k, b_v), packed[1])
    if amp is None:
        x_gemm, norm_dtype = x, x.dtype
    else:
        # Autocast's casts, made here as the per-op path's F.linear gets them from autocast:
        # the GEMMs, the attention and the activation in autocast's dtype, the add-norms in
        # the reference's LayerNorm's (fp32 on CUDA; see autocast_norm_dtype).
        w_qkv, b_qkv, w_o, b_o, w_1, b_1, w_2, b_2 = (as_dtype(t, amp) for t in (w_qkv, b_qkv, w_o, b_o,
                                                                             w_1, b_1, w_2, b_2))
        x_gemm = as_dtype(x, amp)
        norm_dtype = autocast_norm_dtype(x_gemm, x)
        ln1_w, ln1_b, ln2_w, ln2_b = (as_dtype(t, norm_dtype) for t in (ln1_w, ln1_b, ln2_w, ln2_b))
    # (B, L, .) throughout where a GEMM allows: F.linear takes them as they are, which saves the
    # host a reshape and a view per GEMM (the backward makes the 2-D views it needs).
    qkv = F.linear(x_gemm, w_qkv, b_qkv)
    if seeds is None:
        seeds = _draw_seeds(p, x.device)
    context, lses = _attention_forward(qkv, key_mask, spec.num_heads, p, seeds[0], ctx is not None)
    projected = F.linear(context, w_o, b_o)
    if not mixed:
        projected = as_dtype(projected, norm_dtype)
    gemm_dtype = qkv.dtype
    if ctx is None:
        del x_gemm, qkv, context
    x_norm = as_dtype(x, norm_dtype)
    y, mean1, rstd1 = ln_fwd(projected, x_norm, ln1_w, ln1_b, spec.eps1, seeds[1], p)
    if ctx is None:
        del x_norm, projected, mean1, rstd1
    rows = as_dtype(y.view(-1, y.shape[-1]), gemm_dtype)
    if spec.activation == "relu":
        # The GEMM's ReLU epilogue (bias in the fp32 accumulator); its output is the mask.
        h = torch._addmm_activation(b_1, rows, w_1.t()) if b_1 is not None else torch.relu(torch.mm(rows, w_1.t()))
        act_saved = h
    else:
        z = torch.mm(rows, w_1.t())
        h = _bias_act_fwd(z, b_1, spec.activation)
        act_saved = z if ctx is not None else None
        del z
    f = F.linear(h, w_2, b_2)
    if not mixed:
        f = as_dtype(f, norm_dtype)
    if ctx is None:
        del rows, act_saved, h
    # On x's shape: the output is then the kernel's fresh tensor, not a view of it (a view
    # made inside a Function could not be edited in place, which the reference's output can).
    out, mean2, rstd2 = ln_fwd(f.view(x.shape), y, ln2_w, ln2_b, spec.eps2, seeds[2], p)
    if ctx is not None:
        # Without autocast x_norm and x_gemm are x, and rows is y's 2-D view. The packed QKV
        # view shares W_q's version counter only: W_k and W_v are saved too, so that autograd
        # raises, as for the reference, when they are changed in place before the backward.
        # Every tensor the backward reads is saved, none kept on ctx: ctx lives as long as the
        # graph (a loss still referenced in the next step's forward), saved tensors only until
        # the backward. The key mask (made once for all layers) and the seeds stay on ctx.
        versioned = (w_k, w_v) if packed[0] is not None else ()
        ctx.save_for_backward(x_norm, x_gemm, w_qkv, qkv, context, projected, y, rows, act_saved, h, f,
                              w_o, ln1_w, w_1, b_1, w_2, ln2_w, mean1, rstd1, mean2, rstd2, *versioned, *lses)
        ctx.lses_at = 21 + len(versioned)
        ctx.key_mask, ctx.seeds = key_mask, seeds
        ctx.spec, ctx.biases = spec, tuple(b is not None for b in (b_qkv, b_o, ln1_b, ln2_b))
        ctx.qkv_dtype = w_q.dtype
    return out


def _mixed_add_norms(spec, x):
    """Whether the add-norms take the branch's GEMM output in autocast's dtype as it is, beside
    the residual in their own (Triton's kernels read each input in its dtype and sum in fp32):
    under autocast on the kernels' path, where the backward is Triton's (not the extension's,
    whose ops take one dtype; nor the CPU kernels). The forward's two casts to the norm's dtype
    and the backward's two back are left out (four launches a layer), and the branch outputs
    are saved at half the size. The same arithmetic as casting: the same bits in Triton's
    interpreter (compiled, the kernels' specialisations may differ in fp32's last bits)."""
    return spec.amp_dtype is not None and not cpu_kernel(x) and not (spec.extension and EXTENSION_ADDNORM_BACKWARD)


def _draw_seeds(p, device):
    """The layer's three dropout seeds, in the per-op path's order (attention, then the two
    dropouts of the add-norms); Nones without dropout."""
    return tuple(dropout_seed(p, device) for _ in range(3)) if p > 0.0 else (None,) * 3


class _EncoderLayer(torch.autograd.Function):
    """The layer above as one node; see the module docstring."""

    @staticmethod
    def forward(ctx, spec, key_mask, packed, x, *params):
        return _layer_forward(spec, key_mask, packed, x, params, ctx)

    @staticmethod
    @once_differentiable("the fused encoder layer", "bert_fast::add_layernorm_bwd")
    def backward(ctx, grad_out):
        return _layer_backward(ctx, grad_out)


class _Kept:
    """What _layer_forward keeps for _layer_backward (the attributes it sets on a ctx and the
    saved tensors), outside autograd: _RecomputedEncoderLayer's."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class _RecomputedEncoderLayer(torch.autograd.Function):
    """The layer as one node that keeps only its input and Parameters (activation
    checkpointing): its backward runs the forward again, with the forward's dropout seeds (the
    same masks, whatever the generators did since) under the forward's autocast, then the
    layer's backward. What torch.utils.checkpoint does around _EncoderLayer, without its hooks
    on every saved tensor: on the CPU's GPU path (a 12-layer Hugging Face model, H 64, B1 L8,
    2026-11-29, docs/host-time.md) checkpointing added ~14 ms of host time to a 13 ms
    forward+backward through torch.utils.checkpoint (non-reentrant), ~3 ms (the recompute) this
    way. bert_fast.hf runs it for HF's gradient checkpointing.

    Both forwards keep what the backward reads (the first drops it once the output is made), so
    the output and the recomputed tensors come from the same kernels: the gradients are the
    plain step's, bit for bit on the CPU."""

    @staticmethod
    def forward(ctx, spec, key_mask, packed, x, *params):
        seeds = _draw_seeds(spec.dropout_p, x.device)
        ctx.save_for_backward(x, *params)
        ctx.spec, ctx.key_mask, ctx.packed, ctx.seeds = spec, key_mask, packed, seeds
        return _layer_forward(spec, key_mask, packed, x, params, _Kept(None), seeds)

    @staticmethod
    @once_differentiable("the fused encoder layer", "bert_fast::add_layernorm_bwd")
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        kept, spec = _Kept(ctx.needs_input_grad), ctx.spec
        # Under the forward's autocast (the layer makes its casts itself; this keeps any op's
        # choice of dtype the forward's).
        with torch.autocast(x.device.type, spec.amp_dtype) if spec.amp_dtype is not None else nullcontext():
            _layer_forward(spec, ctx.key_mask, ctx.packed, x, params, kept, ctx.seeds)
        return _layer_backward(kept, grad_out)


def _layer_backward(ctx, grad_out):
    """The gradients of _EncoderLayer's inputs from what _layer_forward kept on ``ctx``."""
    saved = ctx.saved_tensors
    (x_norm, x_gemm, w_qkv, qkv, context, projected, y, y_gemm, act_saved, h, f,
     w_o, ln1_w, w_1, b_1, w_2, ln2_w, mean1, rstd1, mean2, rstd2) = saved[:21]
    lses, key_mask, seeds = saved[ctx.lses_at:], ctx.key_mask, ctx.seeds
    spec, (has_b_qkv, has_b_o, has_ln1_b, has_ln2_b) = ctx.spec, ctx.biases
    p, hidden, gemm_dtype = spec.dropout_p, x_norm.shape[-1], qkv.dtype
    rows, context_rows, projected = (t.reshape(-1, hidden) for t in (x_norm, context, projected))
    if spec.amp_dtype is None:      # one tensor each in two roles (see the forward)
        rows_gemm, y = rows, y_gemm
    else:
        rows_gemm, y = x_gemm.reshape(-1, hidden), y.reshape(-1, hidden)
    needs = ctx.needs_input_grad
    # Parameters' gradients come out in the GEMMs' dtype; autograd casts each to its
    # Parameter's (autocast's casts' backward). The QKV ones are cast before the split.

    # LN2: the residual's gradient (to y), the FFN output's (through its dropout) and its
    # bias's, on rows like the rest of the backward (f is already).
    # On the kernels' path the column sums (the add-norms' weights and biases, b_2, b_1, b_o)
    # are made by one launch at the end (_DeferredSums); elsewhere as each kernel runs.
    sums = _DeferredSums() if _defers_sums(spec, f) else None
    d_res, d_f, d_ln2_w, d_ln2_b, d_b2 = _layernorm_backward(
        spec, needs[17], grad_out.reshape(-1, hidden), f, y, ln2_w, mean2, rstd2, seeds[2], has_ln2_b, sums)
    d_f = as_dtype(d_f, gemm_dtype)
    d_w2 = d_f.t().mm(h) if needs[16] else None
    d_h = d_f.mm(w_2)
    del d_f         # (each gradient freed once used: the backward's peak is the reference's)
    if sums is not None:
        # GELU's derivative reads the bias; ReLU's mask needs it only for its gradient.
        bias = b_1 if needs[15] or spec.activation != "relu" else None
        d_z, partials = _bias_act_bwd_triton(d_h, act_saved, bias, spec.activation, check=False, defer_sum=True)
        (d_b1,) = sums.add(partials, (bias is not None,))
        d_b1 = d_b1 if needs[15] else None
    elif spec.activation == "relu":
        d_z, d_b1 = _relu_bwd(d_h, act_saved, b_1 if needs[15] else None)
    else:
        d_z, d_b1 = _bias_act_bwd(d_h, act_saved, b_1, spec.activation, check=False)
        d_b1 = d_b1 if needs[15] else None
    del d_h
    d_w1 = d_z.t().mm(y_gemm) if needs[14] else None
    d_y = _add_product(d_res, d_z, w_1)                 # + the residual's gradient, in the GEMM
    del d_z, d_res

    # LN1, the output projection, attention, the packed QKV projection.
    d_res, d_projected, d_ln1_w, d_ln1_b, d_b_o = _layernorm_backward(
        spec, has_b_o and needs[11], d_y, projected, rows, ln1_w, mean1, rstd1, seeds[1], has_ln1_b, sums)
    if sums is not None:
        sums.finish(y.dtype)          # the add-norms' dtype
        d_ln2_w, d_ln2_b, d_b2, d_b1, d_ln1_w, d_ln1_b, d_b_o = map(
            sums.take, (d_ln2_w, d_ln2_b, d_b2, d_b1, d_ln1_w, d_ln1_b, d_b_o))
    d_projected = as_dtype(d_projected, gemm_dtype)
    d_w_o = d_projected.t().mm(context_rows) if needs[10] else None
    d_context = d_projected.mm(w_o).view(x_norm.shape)
    del d_projected, d_y
    d_qkv = _attention_backward(d_context, qkv, context, key_mask, spec.num_heads, p, seeds[0],
                                lses).reshape(-1, 3 * hidden)
    del d_context
    thirds = (hidden,) * 3         # split_with_sizes: Tensor.split's Python wrapper costs ~2.5 us more
    d_w_qkv = (as_dtype(d_qkv.t().mm(rows_gemm), ctx.qkv_dtype).split_with_sizes(thirds) if any(needs[4:7])
               else (None,) * 3)
    # Summed into the Parameters' dtype (under autocast fp32: one launch, no cast after it).
    d_b_qkv = (d_qkv.sum(0, dtype=ctx.qkv_dtype).split_with_sizes(thirds) if has_b_qkv and any(needs[7:10])
               else (None,) * 3)
    d_x = _add_product(d_res, d_qkv, w_qkv).view(x_norm.shape) if needs[3] else None
    return (None, None, None, d_x, *d_w_qkv, *d_b_qkv, d_w_o, d_b_o,
            d_ln1_w if needs[12] else None, d_ln1_b if has_ln1_b and needs[13] else None,
            d_w1, d_b1, d_w2, d_b2,
            d_ln2_w if needs[18] else None, d_ln2_b if has_ln2_b and needs[19] else None)


def _add_product(c, a, b):
    """c + a @ b, in one GEMM where the dtypes allow (the residual's gradient folded in); under
    autocast c is in the add-norm's dtype (fp32 on CUDA) and the product in autocast's: added
    into c in place, in c's dtype (one launch where a cast and an add were two). c is an
    add-norm backward's fresh d_residual, which nothing else reads."""
    if c.dtype == a.dtype:
        return torch.addmm(c, a, b)
    return c.add_(a.mm(b))


def encoder_layer(spec, x, key_mask, params, packed=(None, None), recompute=False):
    """The layer's output for x: (B, L, H) with ``key_mask`` a KeyMask or None, or skip_padding's
    (N, H) packed valid tokens with ``key_mask`` their ops.Unpadding. ``params``: W_q, W_k, W_v,
    b_q, b_k, b_v, W_o, b_o, LN1 weight and bias, W_1, b_1, W_2, b_2, LN2 weight and bias
    (biases may be None).
    ``packed``: the QKV weight and bias as views of the Parameters' memory where they lie back
    to back (else None: concatenated here). One autograd node where autograd records, else
    the launchers alone. ``recompute``: that node keeps only the layer's input and runs the
    forward again in its backward (_RecomputedEncoderLayer)."""
    if records_grad(x, *params):
        return thin_apply(_RecomputedEncoderLayer if recompute else _EncoderLayer, spec, key_mask, packed, x, *params)
    return _layer_forward(spec, key_mask, packed, x, params)
