"""Hugging Face BERT on bert_fast's ops: what ``bert_fast.optimize()`` does to a transformers
``BertModel`` (alone, inside a ``BertFor*`` head, or inside anything that holds one, such as a
sentence-transformers ``Transformer``).

The swap changes the class of the BertModel, of its BertEmbeddings and of each BertLayer, in
place, to the subclasses below. Nothing is copied or rebuilt: every submodule, Parameter, buffer
and hook stays the same object, so the state_dict (keys and values), an optimizer made before
the swap, ``.to()`` and ``load_state_dict`` all carry over, and the HF code of the base classes
is still there for what the fast path does not do. ``restore(model)`` swaps the classes back.

The fast forward (FastBertModel.forward), for the calls encoders get (input_ids, a 2-D 0/1
attention_mask, token_type_ids, position_ids, output_hidden_states, return_dict):

  embeddings  ops.embedding_layernorm (token + token type + position rows and the LayerNorm in
              one pass on CUDA), then the embeddings' dropout.
  mask        the 2-D attention_mask (nonzero = attend, as HF reads it) becomes 1-D valid_lens,
              prepared once for all layers (ops.prepare_key_mask). A prefix mask (what a
              tokenizer pads) is used as it is. Any other mask: each sequence is permuted so its
              attended tokens come first (a stable sort, so their order is kept), the layers run
              on that order with the prefix lengths, and the output is permuted back. That is
              exact: attention is invariant to the order of its keys, every other op of a layer
              works per token, and the positions were added by the embeddings before the
              permutation. On CPU tensors the mask is inspected on the host (free) and only a
              non-prefix mask is permuted; on other devices the permutation always runs (the
              identity for a prefix mask) rather than syncing with the host to decide.
  layers      on the triton and cuda backends, each layer in one call, ops.encoder_layer (one
              autograd node in training, autocast included; bert_fast.modules.fused_layer, as
              FastEncoderBlock), where the layer's dropout rates are equal (HF's default) and
              its linears are plain nn.Linear, skip_padding's packed tokens included. Otherwise (and
              on the torch backend) per op: one QKV GEMM on the packed projection (W_q/W_k/W_v kept
              back to back, as FastMultiHeadAttention does), ops.packed_self_attention,
              ops.add_layernorm, ops.linear_act (GELU erf, GELU tanh or ReLU from the config),
              ops.add_layernorm. LayerNorm eps and dropout rates read from the modules.
  pooler      HF's own module.

CUDA graphs (``optimize(model, cuda_graphs=True)``): inference calls without position_ids and
hidden states replay a graph per shape bucket (bert_fast.cuda_graph.graphed, with _GraphedCalls
below: the inputs padded to the bucket, the attention mask as a bool buffer whose padding is
masked, the pooler inside the graph); the rest runs the fused path eagerly.

Differences from HF: a sequence whose attention_mask is all zeros attends uniformly to all of
its keys (the book's rule, and what HF's eager attention gives; HF's sdpa path gives another
value there). Its attention output, the mean of the values, does not depend on the queries and
keys, and no gradient reaches them from it; HF's eager attention sends them one (its mask adds
the dtype's minimum to the scores, which rounds them away in the forward but not in autograd).
With ``skip_padding=True`` only attended tokens are computed and the output is
zeros at the others (HF computes values there), as in FastBERTEncoder.

Hooks: the fast path calls the embeddings, their dropout, the layers and the pooler as HF does,
and reads the other modules' Parameters. A hook on one of those others (the embeddings' tables
or LayerNorm: HF's embeddings forward; anything inside the encoder but the layers themselves, or
a global module hook: HF's forward), or a module replaced since optimize() by one the fast path
cannot compute, runs HF's code, checked on every call (_Submodules). A hook on a layer runs on
the fast path, where the layer's input is laid out as the fast path lays it out: for a mask
with holes each sequence's attended tokens first, with skip_padding the packed (N, H) tokens.

Gradient checkpointing (HF's activation_checkpointing_enable or gradient_checkpointing_enable,
Trainer's gradient_checkpointing=True) runs on the fast path, each layer's forward again in the
backward with the first run's dropout masks. Where HF asks for torch.utils.checkpoint with no
option but use_reentrant (and preserve_rng_state), the fused layers checkpoint themselves
(ops.encoder_layer's recompute: one node that keeps the layer's input and reuses its dropout
seeds), without torch.utils.checkpoint's hooks on every saved tensor (_recomputes_itself);
otherwise, and for layers run one op at a time, HF's checkpoint function runs as HF calls it
(its recompute draws the same masks: torch.utils.checkpoint restores the generators). HF's
set-up also hooks the word embeddings (_is_input_grads_hook); FastBertEmbeddings does what that
hook does and stays fused.

Anything else (inputs_embeds, output_attentions, head_mask, past_key_values, cross-attention
inputs, 3-D/4-D masks, unknown keyword arguments) runs HF's own forward on the same modules,
with one HFFallbackWarning per model and reason. Models the
fast path cannot express (decoder or cross-attention configs, relative position embeddings,
activations other than GELU/ReLU, subclasses of the HF classes, ...) are left untouched with a
warning by optimize(), as is every model under a transformers older than 4.57.
"""

import operator
import warnings
import weakref
from functools import partial
from itertools import chain, repeat

import torch
import transformers
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
from transformers.models.bert.modeling_bert import BertAttention, BertEmbeddings, BertIntermediate, BertLayer, \
    BertModel, BertOutput, BertSelfOutput

from . import ops
from .backend import _GLOBAL_HOOKS, backend_of, graph_backend_for, resolve_backend
from .cuda_graph import _Bucket, _Calls, _is_ids, _sliced, bucket_batch, bucket_seqlen, bucket_tokens, \
    clear_cuda_graphs, graphed
from .ops._triton import values_on_host
from .modules import _ACTIVATION_FUNCTIONS, _KeepsQKVPacked, _hook_dicts, _linear, _pack_back_to_back_, \
    _dropout_rate, _drop_packing, _parameters_read, _QKVPacking, _table_read, fused_layer, packed_qkv
from .ops.embedding_layernorm import embedding_layernorm


class HFFallbackWarning(UserWarning):
    """An optimized HF model ran a call on HF's own code (once per model and reason)."""


class Unsupported(ValueError):
    """A model optimize() cannot run exactly; it warns with this message and leaves the model as is."""


def _require(condition, why):
    if not condition:
        raise Unsupported(why)


# ----------------------------------------------------------------------------------------------
# What the fast path accepts (checked once, by optimize())
# ----------------------------------------------------------------------------------------------

_TANH_GELUS = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation")


def _activation_of(fn):
    """The ops' activation name for a BertIntermediate's ``intermediate_act_fn``."""
    name = type(fn).__name__
    if isinstance(fn, nn.ReLU):
        return "relu"
    if isinstance(fn, nn.GELU):
        return "gelu" if fn.approximate == "none" else "gelu_tanh"
    if name == "GELUActivation":      # HF's "gelu" and "gelu_python": both the erf form
        return "gelu"
    if name in _TANH_GELUS:           # HF's tanh approximations ("gelu_new", "gelu_pytorch_tanh", ...)
        return "gelu_tanh"
    raise Unsupported(f"activation {name} (supported: GELU, its tanh approximation, ReLU)")


def _check_embedding_table(name, emb, hidden):
    _require(type(emb) is nn.Embedding, f"{name} is {type(emb).__name__}, not nn.Embedding")
    _require(emb.embedding_dim == hidden, f"{name} width {emb.embedding_dim} differs from hidden_size {hidden}")
    # (A table's padding_idx, max_norm...: FastBertEmbeddings calls it then, on each call.)


def _check_layer_norm(name, ln, hidden):
    _require(type(ln) is nn.LayerNorm and tuple(ln.normalized_shape) == (hidden,),
             f"{name} is not a LayerNorm over the {hidden} hidden features")


def _check_embeddings(emb, hidden, swapped):
    _require(isinstance(emb, FastBertEmbeddings) if swapped else type(emb) in (BertEmbeddings, FastBertEmbeddings),
             f"embeddings of class {type(emb).__name__}")
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        _check_embedding_table(name, getattr(emb, name, None), hidden)
    # nn.Identity: a LayerNorm / dropout taken out (the benchmark's HF peer, which computes the
    # book's encoder, does that); HF's embeddings forward then runs, the layers are fused.
    if type(getattr(emb, "LayerNorm", None)) is not nn.Identity:
        _check_layer_norm("embeddings.LayerNorm", getattr(emb, "LayerNorm", None), hidden)
    _require(isinstance(getattr(emb, "dropout", None), (nn.Dropout, nn.Identity)), "embeddings without a Dropout")
    _require(getattr(emb, "position_embedding_type", "absolute") == "absolute",
             f"position_embedding_type {getattr(emb, 'position_embedding_type', None)!r} (only 'absolute')")


# transformers 5 has one self-attention class (the attention function picked by the config's
# attn_implementation); transformers 4 has one per implementation over the same Parameters: the
# eager BertSelfAttention and its subclass BertSdpaSelfAttention (sdpa, the default). The fast
# path reads their Parameters only. transformers 4 is taken from its last release, 4.57, the
# one tested (CI runs test_hf.py on it); earlier 4.x releases are left untouched.
_HF_SELF_ATTENTION = ("BertSelfAttention", "BertSdpaSelfAttention")
TRANSFORMERS_VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])
OLDEST_TRANSFORMERS = (4, 57)


def _is_hf_self_attention(module):
    return type(module).__name__ in _HF_SELF_ATTENTION and type(module).__module__.startswith("transformers.")


def _attention_dropout(attn):
    """The rate of the attention weights' dropout as ``attn``'s own forward applies it now:
    transformers 5 (``dropout=0.0 if not self.training else self.dropout.p``) and 4's sdpa class
    (``self.dropout_prob if self.training``) by the attention module's mode, 4's eager class by
    its nn.Dropout's (``self.dropout(attention_probs)``)."""
    if TRANSFORMERS_VERSION >= (5, 0):
        return attn.dropout.p if attn.training else 0.0
    if type(attn).__name__ == "BertSdpaSelfAttention":
        return attn.dropout_prob if attn.training else 0.0
    return _dropout_rate(attn.dropout)


def _check_layer(layer, index, hidden, swapped):
    where = f"encoder.layer.{index}"
    _require(isinstance(layer, FastBertLayer) if swapped else type(layer) in (BertLayer, FastBertLayer),
             f"{where} of class {type(layer).__name__}")
    _require(not getattr(layer, "add_cross_attention", False) and not getattr(layer, "is_decoder", False),
             f"{where}: decoder / cross-attention layer")
    _require(not getattr(layer.attention, "is_cross_attention", False), f"{where}: cross-attention")
    # The fast layer computes what these HF modules' forwards compute: a subclass with a forward
    # of its own (an adapter) is not that. (FSDP2's subclasses keep the forward.)
    for name, cls in (("attention", BertAttention), ("attention.output", BertSelfOutput),
                      ("intermediate", BertIntermediate), ("output", BertOutput)):
        module = layer.get_submodule(name)
        _require(type(module).forward is cls.forward, f"{where}.{name} of class {type(module).__name__} "
                 f"(its own forward; only {cls.__name__}'s is fused)")
    attn = layer.attention.self
    _require(_is_hf_self_attention(attn), f"{where}.attention.self of class {type(attn).__name__}")
    _require(getattr(attn, "position_embedding_type", "absolute") == "absolute",
             f"{where}: position_embedding_type {getattr(attn, 'position_embedding_type', None)!r}")
    _require(not getattr(attn, "is_causal", False), f"{where}: causal self-attention")
    heads = attn.num_attention_heads
    _require(heads * attn.attention_head_size == hidden, f"{where}: {heads} heads of size "
             f"{attn.attention_head_size} do not make hidden_size {hidden}")
    scaling = getattr(attn, "scaling", attn.attention_head_size ** -0.5)
    _require(abs(scaling - attn.attention_head_size ** -0.5) < 1e-12,
             f"{where}: attention scaling {scaling} (ours is 1/sqrt(head size))")
    for name in ("query", "key", "value"):
        proj = getattr(attn, name)
        _require(getattr(proj, "out_features", hidden) == hidden, f"{where}.{name} does not produce {hidden} features")
    if hasattr(attn, "dropout_prob"):    # transformers 4's sdpa class: its rate, not its nn.Dropout's
        _require(0 <= attn.dropout_prob < 1, f"{where}.attention.self's sdpa dropout with p {attn.dropout_prob} "
                 "(the kernels take [0, 1))")
    for name, dropout in (("attention.self.dropout", attn.dropout), ("attention.output.dropout",
                          layer.attention.output.dropout), ("output.dropout", layer.output.dropout)):
        _require(type(dropout) is nn.Dropout, f"{where}.{name} is {type(dropout).__name__}, not nn.Dropout")
        _require(0 <= dropout.p < 1, f"{where}.{name} with p {dropout.p} (the kernels take [0, 1))")
    _check_layer_norm(f"{where}.attention.output.LayerNorm", layer.attention.output.LayerNorm, hidden)
    _check_layer_norm(f"{where}.output.LayerNorm", layer.output.LayerNorm, hidden)
    _activation_of(layer.intermediate.intermediate_act_fn)


def check_supported(model, swapped=False):
    """Raise Unsupported (saying why) unless the fast path computes ``model`` (a BertModel) exactly.
    ``swapped``: the model is optimize()'s already (re-checked when its submodules change); its
    classes may be subclasses of ours (FSDP2's fully_shard makes them)."""
    _require(TRANSFORMERS_VERSION >= OLDEST_TRANSFORMERS, f"transformers {transformers.__version__} (the fast "
             "path takes transformers 4.57 and 5.x: upgrade transformers to use it)")
    _require(swapped or type(model) in (BertModel, FastBertModel), f"class {type(model).__name__} (a subclass may "
             "have its own forward; only transformers' BertModel itself is swapped)")
    _require("forward" not in model.__dict__, "a forward set on the instance (accelerate's cpu_offload and "
             "dispatch_model set one), which would run instead of the fast one")
    config = model.config
    _require(not getattr(config, "is_decoder", False), "config.is_decoder (causal self-attention)")
    _require(not getattr(config, "add_cross_attention", False), "config.add_cross_attention")
    position_type = getattr(config, "position_embedding_type", "absolute")
    _require(position_type == "absolute", f"position_embedding_type {position_type!r} (only 'absolute')")
    hidden = config.hidden_size
    _check_embeddings(model.embeddings, hidden, swapped)
    layers = getattr(model.encoder, "layer", None)
    _require(isinstance(layers, nn.ModuleList) and len(layers) > 0, "encoder without a layer ModuleList")
    for i, layer in enumerate(layers):
        _check_layer(layer, i, hidden, swapped)


# ----------------------------------------------------------------------------------------------
# What the fast path must see again on every call: hooks, and submodules replaced since optimize()
# ----------------------------------------------------------------------------------------------

def _is_output_capture(hook):
    """transformers installs forward hooks of its own, for good, on the first call that asks for
    hidden states or attentions (``output_capturing_hook``, in transformers.utils.output_capturing
    since 5.x, in .generic before); they record only inside HF's forward, which such calls run."""
    return (getattr(hook, "__qualname__", "").endswith("output_capturing_hook")
            and getattr(hook, "__module__", "").startswith("transformers."))


def _is_input_grads_hook(hook):
    """transformers' enable_input_require_grads hook (``make_inputs_require_grads``), which its
    gradient checkpointing and adapter (PEFT) set-ups put on the word embeddings: it makes the
    lookup's output require grad, so that a reentrant checkpoint passes gradients on to the
    layers when the embeddings are frozen. FastBertEmbeddings does the same to its output."""
    return (getattr(hook, "__qualname__", "").endswith("make_inputs_require_grads")
            and getattr(hook, "__module__", "").startswith("transformers."))


def _has_user_hooks(module):
    """Whether ``module`` has a hook (forward, pre-forward, backward) other than transformers'
    output-capturing ones."""
    return not all(map(_is_output_capture, chain.from_iterable(hooks.values() for hooks in _hook_dicts(module))))


class _Submodules:
    """A FastBertModel's modules as the fast path last checked them.

    The fast path calls few of them (the embeddings and their dropout, the layers, the pooler)
    and reads the others' Parameters. So each call re-reads (~25 us for 12 layers on the CPU
    VM: lists of the modules' children and classes and their hook dicts, no walk of the tree)
    whether a module was put in, taken out or given another class anywhere since the last check
    (then check_supported runs again: what it refuses, such as another norm, attention module or
    an adapter's forward, runs HF's forward), and whether a module inside the encoder other than
    the layers has a hook, or one of them a forward set on the instance (HF's forward then, so
    it runs and sees what it would see in HF; hooks on the layers run on the fast path, and
    FSDP2 puts its own there). The embeddings' tables and LayerNorm are FastBertEmbeddings' to
    check: a hook there runs HF's embeddings, the layers stay fused."""

    __slots__ = ("child_dicts", "children", "classes", "checked_values", "value_holders", "encoder_modules",
                 "instance_dicts", "hooked", "hook_dicts", "hook_keys", "hook_reason", "unsupported")

    def __init__(self, model):
        # Only the modules with children: one put under a leaf changes nothing the fast path reads.
        self.child_dicts = [m._modules for m in (model, *model.embeddings.modules(), *model.encoder.modules())
                            if m._modules]
        self.children, self.classes = self.current()
        # What check_supported reads of the attentions and dropouts that is not a module (a head
        # count, a scaling, a rate set later): a change re-checks as a replaced module does
        # (~3 us for 12 layers; a table's options are FastBertEmbeddings' to see, on each call).
        self.value_holders = [m for m in self.children
                              if isinstance(m, nn.Dropout) or _is_hf_self_attention(m)]
        self.checked_values = self.values()
        self.encoder_modules = list(model.encoder.named_modules(prefix="encoder"))
        self.instance_dicts = [m.__dict__ for _, m in self.encoder_modules]
        layers = set(map(id, model.encoder.layer))
        self.hooked = [(name, m) for name, m in self.encoder_modules if id(m) not in layers]
        self.hook_dicts = [d for _, m in self.hooked for d in _hook_dicts(m)]
        self.hook_keys, self.hook_reason = [], None
        try:
            check_supported(model, swapped=True)
            self.unsupported = None
        except (Unsupported, AttributeError, TypeError) as why:     # (a module without what HF's has)
            self.unsupported = str(why)

    def current(self):
        children = list(chain.from_iterable(map(dict.values, self.child_dicts)))
        return children, list(map(type, children))

    def values(self):
        return [(m.__dict__.get("num_attention_heads"), m.__dict__.get("attention_head_size"),
                 m.__dict__.get("scaling"), m.__dict__.get("p"), m.__dict__.get("dropout_prob"))
                for m in self.value_holders]

    def changed(self):
        children, classes = self.current()
        return children != self.children or classes != self.classes or self.values() != self.checked_values

    def fallback_reason(self):
        """Why HF's forward must run (as the last check found the modules), or None."""
        if self.unsupported is not None:
            return f"a submodule changed since optimize(): {self.unsupported}"
        if any(map(operator.contains, self.instance_dicts, repeat("forward"))):
            return next(f"a forward set on {name}" for name, m in self.encoder_modules if "forward" in m.__dict__)
        if not any(self.hook_dicts):
            return None
        # Hooks somewhere (transformers' own stay for good): looked at again when one is added or
        # removed, which changes the handles' ids (unique, increasing).
        keys = list(map(tuple, filter(None, self.hook_dicts)))
        if keys != self.hook_keys:
            self.hook_keys = keys
            self.hook_reason = next((f"a hook on {name}" for name, module in self.hooked
                                     if _has_user_hooks(module)), None)
        return self.hook_reason


def _submodules_reason(model):
    """_Submodules' fallback reason for ``model``, checked again where a module changed since
    the last call."""
    known = model.__dict__.get("_bert_fast_submodules")
    if known is None or known.changed():
        known = _Submodules(model)
        model.__dict__["_bert_fast_submodules"] = known
    return known.fallback_reason()


# The FastBertModels (by id) whose check a torch.compile trace may make: optimize(), unpickling
# (deepcopy too) and every eager call register them.
_MODELS = weakref.WeakValueDictionary()


@torch.compiler.assume_constant_result
def _traced_submodules_reason(model_id):
    """_submodules_reason while torch.compile traces: the answer the trace gets is a constant
    (what Dynamo does with hooks itself: added after the compilation, they are not seen), so
    nothing guards the ~800 hook dicts (that made every compiled call of BERT-base ~0.3 ms
    slower). By id: torch 2.11's assume_constant_result takes constants, not modules."""
    model = _MODELS.get(model_id)
    return None if model is None else _submodules_reason(model)


# ----------------------------------------------------------------------------------------------
# The fast modules: subclasses of HF's, given to the existing objects by optimize()
# ----------------------------------------------------------------------------------------------

class FastBertEmbeddings(BertEmbeddings):
    """BertEmbeddings through ops.embedding_layernorm (the HF math; a nonzero cache length,
    inputs_embeds and a LayerNorm replaced by nn.Identity take HF's forward)."""

    bert_fast_backend = "auto"

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, *args, **kwargs):
        # After inputs_embeds: the cache's length (past_key_values_length; cache_length since
        # transformers 5.24), an offset of the positions that only a decoder's cache makes nonzero.
        sub = self._modules
        word, positions, types, ln = (sub["word_embeddings"], sub["position_embeddings"],
                                      sub["token_type_embeddings"], sub["LayerNorm"])
        # The three tables and the LayerNorm are read, not called: HF's forward for what that
        # would change (another class put there since optimize(), a hook, a global module hook).
        if (input_ids is None or inputs_embeds is not None or any(args) or any(kwargs.values())
                or not (_table_read(word, padding_idx_applied=True, forward_hook_done=self._input_grads_hook_done())
                        and _table_read(positions) and _table_read(types) and _parameters_read(ln, nn.LayerNorm))):
            return super().forward(input_ids, token_type_ids, position_ids, inputs_embeds, *args, **kwargs)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        batch, seqlen = input_ids.shape
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        elif token_type_ids.shape != input_ids.shape:
            token_type_ids = token_type_ids.expand(batch, seqlen)
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids is not None and position_ids.dim() == 2 and position_ids.shape[1] == 1 < seqlen:
            position_ids = position_ids.expand(position_ids.shape[0], seqlen)    # (B, 1): HF broadcasts it
        if position_ids is None and seqlen > positions.num_embeddings:
            raise ValueError(f"sequence length {seqlen} exceeds max_position_embeddings {positions.num_embeddings}")
        out = embedding_layernorm(input_ids, token_type_ids, word.weight, types.weight, positions.weight,
                                  ln.weight, ln.bias, ln.eps,
                                  positions=position_ids, padding_idx=word.padding_idx,
                                  backend=backend_of(self.bert_fast_backend, input_ids))
        if word._forward_hooks and torch.is_grad_enabled() and not out.requires_grad:
            # (only _is_input_grads_hook's passed _table_read) what it does: the output of a
            # frozen lookup requires grad; HF's sum and LayerNorm then make this one require it.
            out.requires_grad_(True)
        return sub["dropout"](out)

    @staticmethod
    def _input_grads_hook_done():
        """What the forward takes on itself of the word embeddings' hooks: _is_input_grads_hook's,
        in eager (Dynamo cannot read a hook's name: under torch.compile it traces HF's forward,
        hook included)."""
        return None if torch.compiler.is_compiling() else _is_input_grads_hook


class FusedAttentionMask:
    """What FastBertModel hands its layers instead of HF's 4-D mask: the key mask prepared once
    (ops.KeyMask, or None for no masking) and, with skip_padding, the unpadding. A layer given
    one runs the fused path; given anything else, HF's forward. ``recompute``: the layer
    checkpoints itself (FastBertModel._encode's _recomputed_call)."""

    __slots__ = ("key_mask", "unpadding", "valid_lens", "recompute")

    def __init__(self, key_mask, unpadding=None, valid_lens=None, recompute=False):
        self.key_mask, self.unpadding, self.valid_lens, self.recompute = key_mask, unpadding, valid_lens, recompute

    def recomputing(self, recompute=True):
        return FusedAttentionMask(self.key_mask, self.unpadding, self.valid_lens, recompute)


class FastBertLayer(_KeepsQKVPacked, BertLayer):
    """BertLayer with a fused forward, taken when FastBertModel passes a FusedAttentionMask (HF
    callers get HF's forward: its mask, cache and cross-attention arguments mean HF code)."""

    bert_fast_backend = "auto"
    _qkv_packing = None       # pack_qkv_'s (modules._QKVPacking): the fused layer reads it in place

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        if isinstance(attention_mask, FusedAttentionMask):
            return self.fused_forward(hidden_states, attention_mask)
        return super().forward(hidden_states, attention_mask, *args, **kwargs)

    @torch.no_grad()
    def pack_qkv_(self):
        """Keep query/key/value's weights (and biases) back to back in one buffer, in place, so
        inference reads the packed projection without concatenating it (see
        FastMultiHeadAttention.pack_qkv_: same Parameter objects, same state_dict)."""
        attn = self.attention.self
        linears = [attn.query, attn.key, attn.value]
        if not all(type(m) is nn.Linear for m in linears):
            return self          # e.g. LoRA wrappers: projected one by one
        for name in ("weight", "bias"):
            params = [getattr(m, name) for m in linears]
            _pack_back_to_back_(params)
        weights, biases = tuple(m.weight for m in linears), tuple(m.bias for m in linears if m.bias is not None)
        self._qkv_packing = _QKVPacking.of(weights + biases) if len(biases) in (0, 3) else None
        return self

    def _qkv(self, X):
        """The (…, 3H) packed Q/K/V projection of X."""
        attn = self.attention.self
        linears = (attn.query, attn.key, attn.value)
        # (Pruning takes "weight" or "bias" out of _parameters: such a Linear is called.)
        if not all(type(m) is nn.Linear and "weight" in m._parameters and "bias" in m._parameters for m in linears):
            _drop_packing(self)
            return torch.cat([_linear(m, X) for m in linears], dim=-1)
        return F.linear(X, *packed_qkv(self, linears))

    def fused_forward(self, X, mask):
        """The layer on (B, L, H) hidden states (or (N, H) packed ones with skip_padding):
        ops.encoder_layer where it applies (one autograd node in training, as FastEncoderBlock),
        else one op at a time."""
        backend = backend_of(self.bert_fast_backend, X)
        attention, intermediate, output = self.attention, self.intermediate, self.output
        attn, attn_out = attention.self, attention.output
        # Each dropout in the mode HF's code reads: the attention weights' as their attention
        # module's forward does (_attention_dropout), the hidden states' their nn.Dropout's own.
        attn_dropout = _attention_dropout(attn)
        drop1, drop2 = attn_out.dropout, output.dropout
        # Hooks inside a layer send FastBertModel's calls to HF's forward (_Submodules).
        if (backend != "torch" and X.dim() == (3 if mask.unpadding is None else 2) and not torch.compiler.is_compiling()
                and not torch._C._get_tracing_state()):
            if attn_dropout == _dropout_rate(drop1) == _dropout_rate(drop2):
                attended = mask.key_mask if mask.unpadding is None else mask.unpadding
                fused = fused_layer(X, attended, backend, attn.num_attention_heads, float(attn_dropout),
                                    _activation_of(intermediate.intermediate_act_fn),
                                    (attn.query, attn.key, attn.value, attn_out.dense, intermediate.dense,
                                     output.dense), (attn_out.LayerNorm, output.LayerNorm), self, mask.recompute)
                if fused is not None:
                    return fused
        if mask.recompute:      # one op at a time, under HF's checkpoint function as HF's wrapper runs it
            return self._gradient_checkpointing_func(self.fused_forward, X, mask.recomputing(False))
        # Each intermediate unnamed or deleted once read: without autograd, a local holding it to
        # the end of the layer raised the peak (the QKV projection at the FFN: 14 MB for HF's 11).
        if mask.unpadding is None:
            context = ops.packed_self_attention(self._qkv(X), attn.num_attention_heads, mask.key_mask,
                                                attn_dropout, backend=backend)
        else:
            context = ops.unpadded_self_attention(self._qkv(X), attn.num_attention_heads, mask.unpadding,
                                                  mask.valid_lens, attn_dropout, backend=backend)
        ln = attn_out.LayerNorm
        Y = ops.add_layernorm(_linear(attn_out.dense, context), X, ln.weight, ln.bias, ln.eps,
                              drop1.p, drop1.training, backend=backend)
        del context
        activation = _activation_of(intermediate.intermediate_act_fn)
        dense = intermediate.dense
        if type(dense) is nn.Linear:
            hidden = ops.linear_act(Y, dense.weight, dense.bias, activation, backend=backend)
        else:
            hidden = _ACTIVATION_FUNCTIONS[activation](dense(Y))
        hidden = _linear(output.dense, hidden)
        ln = output.LayerNorm
        return ops.add_layernorm(hidden, Y, ln.weight, ln.bias, ln.eps, drop2.p, drop2.training, backend=backend)


# Keyword arguments of BertModel.forward the fast path takes when they have these values
# (None = HF's default); any other value of one of them, or any other argument, runs HF's forward.
_NEUTRAL = {"inputs_embeds": (None,), "head_mask": (None,), "encoder_hidden_states": (None,),
            "encoder_attention_mask": (None,), "past_key_values": (None,), "output_attentions": (None, False),
            "output_hidden_states": (None, False, True)}    # transformers 5 also takes a selection of layers
# use_cache: HF ignores it for encoders (not decoders: optimize() refuses those).
# num_items_in_batch: a loss argument (TransformersKwargs) that Trainer adds to every call of a
# head whose forward takes **kwargs, which passes it on to BertModel; the encoder ignores it.
_HANDLED = ("return_dict", "use_cache", "num_items_in_batch")


def _recomputes_itself(layer):
    """Whether ``layer``'s gradient checkpointing (set by HF on the layer: its flag and function)
    is what the fused layer does itself (ops.encoder_layer's ``recompute``): in eager training,
    with HF's function torch.utils.checkpoint.checkpoint given at most use_reentrant and
    preserve_rng_state, what activation_checkpointing_enable / gradient_checkpointing_enable
    make without offload or other options. Both checkpoints recompute the layer in the backward
    with the forward's dropout masks (the fused layer reuses its seeds, whatever
    preserve_rng_state says); the fused layer's spares torch.utils.checkpoint's per-tensor hooks
    (host time: docs/host-time.md). The reentrant checkpoint passes no gradient to the layer's
    Parameters when its input needs none; the fused layer's does, as the non-reentrant one."""
    func = layer.__dict__.get("_gradient_checkpointing_func")
    return (type(func) is partial and func.func is checkpoint and not func.args
            and func.keywords.keys() <= {"use_reentrant", "preserve_rng_state"}
            and layer.training and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not torch._C._get_tracing_state())


def _recomputed_call(layer, X, mask):
    """``layer(X, mask)`` with HF's checkpointing off for the call (the flag its wrapper reads,
    set back after): the layer gets ``mask.recompute`` and checkpoints itself (fused_forward)."""
    layer.gradient_checkpointing = False
    try:
        return layer(X, mask)
    finally:
        layer.gradient_checkpointing = True


def _prefix_lengths_on_host(keep):
    """For a CPU (B, L) bool mask: (valid_lens, is_prefix, all_attend), read on the host."""
    valid_lens = keep.sum(dim=-1)
    seqlen = keep.shape[-1]
    prefix = bool(torch.equal(keep, torch.arange(seqlen)[None, :] < valid_lens[:, None]))
    return valid_lens, prefix, bool((valid_lens == seqlen).all())


def _readable_on_host(tensor):
    """Whether reading ``tensor`` on the host is free (an eager CPU tensor: no device sync) and
    safe to branch on (not while torch.compile, jit.trace or make_fx trace: ops.values_on_host)."""
    return values_on_host(tensor)


def _output_settings(config, kwargs):
    """(output_hidden_states, return_dict) of a call as the installed transformers' BertModel
    reads them: transformers 5 (its capture_outputs) takes a keyword given, even None, over the
    config, and returns a tuple only for return_dict False; transformers 4 reads the config
    where a keyword is None, and its ``use_return_dict`` (False under config.torchscript)."""
    if TRANSFORMERS_VERSION >= (5, 0):
        return (bool(kwargs.get("output_hidden_states", getattr(config, "output_hidden_states", False))),
                kwargs.get("return_dict", getattr(config, "return_dict", True)) is not False)
    hidden, return_dict = kwargs.get("output_hidden_states"), kwargs.get("return_dict")
    return (bool(config.output_hidden_states if hidden is None else hidden),
            bool(config.use_return_dict if return_dict is None else return_dict))


class FastBertModel(BertModel):
    """transformers' BertModel with bert_fast's forward (see the module docstring).

    ``bert_fast_backend`` and ``bert_fast_skip_padding`` (attributes, set by optimize()) choose
    the ops' backend and whether only attended tokens are computed.
    """

    bert_fast_backend = "auto"
    bert_fast_skip_padding = False
    bert_fast_cuda_graphs = False

    def _fallback_reason(self, args, kwargs, attention_mask):
        if any(a is not None for a in args):
            return "positional arguments after position_ids"
        for name, value in kwargs.items():
            if name in _NEUTRAL:
                if not any(value is v for v in _NEUTRAL[name]):
                    return f"{name}={type(value).__name__ if isinstance(value, torch.Tensor) else value!r}"
            elif name not in _HANDLED and value is not None:
                return f"argument {name!r}"
        if getattr(self.config, "is_decoder", False):     # (optimize() refuses it; set since: HF reads it per call)
            return "config.is_decoder (causal self-attention)"
        if kwargs.get("output_attentions") is None and getattr(self.config, "output_attentions", False):
            return "config.output_attentions"
        if "output_hidden_states" not in kwargs:
            selection = getattr(self.config, "output_hidden_states", False)
            if not (selection is None or isinstance(selection, bool)):
                return f"config.output_hidden_states={selection!r}"
        if attention_mask is not None and attention_mask.dim() != 2:
            return f"a {attention_mask.dim()}-D attention_mask (only 2-D key padding masks are fused)"
        if any(_GLOBAL_HOOKS):
            return "global module hooks (the fast path calls few of the modules)"
        if torch.compiler.is_compiling():
            return _traced_submodules_reason(id(self))
        _MODELS[id(self)] = self
        return _submodules_reason(self)

    def _warn_fallback(self, reason):
        if torch.compiler.is_compiling():
            return      # (Dynamo cannot trace warnings.warn: fullgraph=True would fail on a fallback)
        warned = self.__dict__.setdefault("_bert_fast_warned", set())
        if reason not in warned:
            warned.add(reason)
            warnings.warn(f"bert_fast: this optimized {type(self).__name__} runs HF's own forward for calls with "
                          f"{reason} (the fused path does not support it); results are HF's", HFFallbackWarning,
                          stacklevel=3)

    def _warn_hooked_layers(self, layout):
        """Once per model: hooks on the layers (which run on the fast path) see its layout, not
        HF's (B, L) positions, for a call whose mask is not a prefix or with skip_padding. (Hook
        dicts read first: ~5 us a call of 12 layers, where _has_user_hooks on each took ~13.)"""
        warned = self.__dict__.setdefault("_bert_fast_warned", set())
        layers = self.encoder.layer
        if "layout" in warned or not any(layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks
                                         or layer._backward_pre_hooks for layer in layers):
            return
        hooked = next((i for i, layer in enumerate(layers) if _has_user_hooks(layer)), None)
        if hooked is not None:
            warned.add("layout")
            warnings.warn(f"bert_fast: a hook on encoder.layer[{hooked}] sees the fast path's layout for this call "
                          f"({layout}), not HF's positions; pass a right-padded (prefix) attention_mask without "
                          f"skip_padding, or bert_fast.hf.restore(model), for HF's layout", UserWarning, stacklevel=4)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, *args, **kwargs):
        reason = self._fallback_reason(args, kwargs, attention_mask)
        if reason is None and input_ids is None:
            reason = "no input_ids"
        if (reason is None and attention_mask is not None and isinstance(input_ids, torch.Tensor)
                and attention_mask.shape != input_ids.shape and input_ids.dim() == attention_mask.dim() == 2
                and all(m in (1, n) for m, n in zip(attention_mask.shape, input_ids.shape))):
            # (B, 1), (1, L): HF broadcasts them, so HF's answer (other shapes: the fast path's error).
            # (One reason for every shape: the warned set and the warning registry stay small.)
            reason = "an attention_mask that HF broadcasts over input_ids (shape (B, 1) or (1, L))"
        if reason is not None:
            self._warn_fallback(reason)
            return super().forward(input_ids, attention_mask, token_type_ids, position_ids, *args, **kwargs)
        return self._fast_forward(input_ids, attention_mask, token_type_ids, position_ids,
                                  *_output_settings(self.config, kwargs))

    def _fast_forward(self, input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states,
                      return_dict):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a (batch, seq_len) tensor, got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}")
        batch, seqlen = input_ids.shape
        if batch == 0 or seqlen == 0:    # (HF: "cannot reshape tensor of 0 elements"; the CPU flash attention: SIGFPE)
            raise ValueError(f"input_ids must hold at least one sequence of at least one token, got shape "
                             f"{(batch, seqlen)}")
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, seqlen):
            raise ValueError(f"attention_mask must have the shape of input_ids {(batch, seqlen)}, "
                             f"got {tuple(attention_mask.shape)}")

        if self.bert_fast_cuda_graphs and position_ids is None and not output_hidden_states:
            sequence_output, pooled_output = graphed(_GraphedCalls(self), (input_ids, token_type_ids, attention_mask))
            all_hidden = None
        else:
            sequence_output, pooled_output, all_hidden = self._encode(
                input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states)
        out = BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output, pooler_output=pooled_output,
            hidden_states=tuple(all_hidden) if output_hidden_states else None)
        return out if return_dict else out.to_tuple()

    def _encode(self, input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states,
                num_tokens=None):
        """(last hidden state, pooler output, hidden states or None) of the fast path.
        ``num_tokens`` (skip_padding): a static bound on the attended tokens instead of their
        count read on the host (what a CUDA graph captures; see ops.unpadding_for)."""
        seqlen = input_ids.shape[1]
        X = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
        all_hidden = [X] if output_hidden_states else None
        valid_lens, order = self._lengths_and_order(attention_mask, X.device)
        if order is not None:       # attended tokens first: the mask becomes a prefix (valid_lens)
            X = X.gather(1, order[..., None].expand(X.shape))
        backend = backend_of(self.bert_fast_backend, X)
        unpadding = None
        if self.bert_fast_skip_padding and valid_lens is not None:
            unpadding = ops.unpadding_for(valid_lens, seqlen, num_tokens)
            mask = FusedAttentionMask(None, unpadding, valid_lens)
            X = ops.unpad(X, unpadding)
        else:
            mask = FusedAttentionMask(ops.prepare_key_mask(valid_lens, seqlen, backend, X.dtype))
        if (order is not None or unpadding is not None) and not torch.compiler.is_compiling():
            self._warn_hooked_layers("attended tokens first" if unpadding is None else "skip_padding's packed tokens")

        def restore_layout(states):
            if unpadding is not None:
                states = ops.pad(states, unpadding)
            if order is not None:
                states = torch.empty_like(states).scatter_(1, order[..., None].expand(states.shape), states)
            return states

        recomputing = None
        for layer in self.encoder.layer:
            # Through __call__: hooks, and gradient checkpointing as HF asks for it, the fused
            # layers (not the torch backend's) checkpointing themselves where HF would call
            # torch.utils.checkpoint.
            if layer.__dict__.get("gradient_checkpointing") and backend != "torch" and _recomputes_itself(layer):
                recomputing = recomputing or mask.recomputing()
                X = _recomputed_call(layer, X, recomputing)
            else:
                X = layer(X, mask)
            if output_hidden_states:
                all_hidden.append(restore_layout(X))
        sequence_output = all_hidden[-1] if output_hidden_states else restore_layout(X)
        pooled_output = self.pooler(sequence_output) if self.pooler is not None else None
        return sequence_output, pooled_output, all_hidden

    def _lengths_and_order(self, attention_mask, device):
        """(valid_lens (B,) or None, order (B, L) or None): see "mask" in the module docstring."""
        if attention_mask is None:
            return None, None
        keep = attention_mask.to(device=device) != 0
        if _readable_on_host(keep):
            valid_lens, prefix, all_attend = _prefix_lengths_on_host(keep)
            if all_attend:
                return None, None
            if prefix:
                return valid_lens, None
        else:
            valid_lens = keep.sum(dim=-1)
        # Stable: attended tokens keep their order, and so do the others.
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
        return valid_lens, order

    def __getstate__(self):
        # A pickled model (torch.save of the whole module, deepcopy) is checked anew when loaded.
        state = super().__getstate__()
        state.pop("_bert_fast_submodules", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        _MODELS[id(self)] = self

    def save_pretrained(self, *args, **kwargs):
        # HF writes the class name into config.architectures: save as the BertModel it is.
        self.__class__ = BertModel
        try:
            return BertModel.save_pretrained(self, *args, **kwargs)
        finally:
            self.__class__ = FastBertModel


class _GraphedCalls(_Calls):
    """cuda_graph.graphed()'s view of a FastBertModel (``optimize(model, cuda_graphs=True)``):
    inputs (input_ids, token_type_ids, attention_mask), the fast path's (last hidden state,
    pooler output). The mask buffer is bool (nonzero = attend, as HF reads it); padded
    positions and batch rows are masked, so a prefix mask stays a prefix and a general one
    keeps its attended tokens (the padding sorts after them); None token types are zeros and a
    None mask is all ones, as the eager fast path reads them."""

    lengths_name = "attention_mask"

    def eager(self, inputs, **static):
        input_ids, token_type_ids, attention_mask = inputs
        return self.module._encode(input_ids, attention_mask, token_type_ids, None, False, **static)[:2]

    def understood(self, inputs):
        input_ids, token_type_ids, attention_mask = inputs
        if not (_is_ids(input_ids) and input_ids.numel() > 0):
            return False
        if token_type_ids is not None and not (_is_ids(token_type_ids) and token_type_ids.shape == input_ids.shape
                                               and token_type_ids.device == input_ids.device):
            return False
        return attention_mask is None or (isinstance(attention_mask, torch.Tensor)
                                          and attention_mask.shape == input_ids.shape
                                          and attention_mask.device == input_ids.device
                                          and not attention_mask.is_complex())

    def _max_len(self):
        return self.module.embeddings.position_embeddings.num_embeddings

    def graphable(self, inputs):
        positions = self.module.embeddings.position_embeddings.weight
        return inputs[0].shape[1] <= self._max_len() and positions.device == inputs[0].device

    def plan(self, inputs):
        input_ids, _, attention_mask = inputs
        batch, seqlen = input_ids.shape
        padded_batch, padded_seqlen = bucket_batch(batch), bucket_seqlen(seqlen, self._max_len())
        num_tokens = None          # skip_padding with a mask: counted by stage()
        if self.module.bert_fast_skip_padding and attention_mask is None:
            num_tokens = bucket_tokens(batch * seqlen, padded_batch * padded_seqlen)
        return _Bucket(padded_batch, padded_seqlen, num_tokens, (padded_batch, padded_seqlen), torch.bool)

    def reads(self, bucket, inputs):
        input_ids, _, attention_mask = inputs
        skip_padding = self.module.bert_fast_skip_padding
        return (False, skip_padding and attention_mask is not None,
                not skip_padding and attention_mask is not None and bucket.seqlen > input_ids.shape[1])

    def settings(self, device):
        model = self.module
        return (model.embeddings.word_embeddings.weight.dtype, graph_backend_for(model.bert_fast_backend, device),
                bool(model.bert_fast_skip_padding))

    def fill_args(self, bucket, inputs):
        return True, False

    def result(self, output, batch, seqlen):
        sequence_output, pooled_output = output
        return _sliced(sequence_output, batch, seqlen), None if pooled_output is None else _sliced(pooled_output, batch)


# ----------------------------------------------------------------------------------------------
# The swap
# ----------------------------------------------------------------------------------------------

def is_bert_model(module):
    return isinstance(module, BertModel)


def convert(model, backend=None, skip_padding=False, cuda_graphs=False):
    """Give ``model`` (a transformers BertModel) the fast classes in place; returns it.
    Raises Unsupported when it cannot run exactly (nothing is changed then)."""
    check_supported(model)
    backend = resolve_backend(backend)
    options = (backend, bool(skip_padding), bool(cuda_graphs))
    if type(model) is FastBertModel and options != (
            model.bert_fast_backend, model.bert_fast_skip_padding, model.bert_fast_cuda_graphs):
        clear_cuda_graphs(model)     # optimized again with other options: its graphs would only hold memory
    model.embeddings.__class__ = FastBertEmbeddings
    model.embeddings.bert_fast_backend = backend
    for layer in model.encoder.layer:
        layer.__class__ = FastBertLayer
        layer.bert_fast_backend = backend
        layer.pack_qkv_()
    model.__class__ = FastBertModel
    _forget_checks(model)
    _MODELS[id(model)] = model
    _register_output_capture(model)
    model.bert_fast_backend, model.bert_fast_skip_padding, model.bert_fast_cuda_graphs = options
    return model


def _forget_checks(model):
    """Drop what FastBertModel remembers of its checks (its modules, the fallbacks it warned
    about): a model optimized again is checked, and warns, anew."""
    model.__dict__.pop("_bert_fast_submodules", None)
    model.__dict__.pop("_bert_fast_warned", None)


def _register_output_capture(model):
    """transformers 5 finds what output_attentions/output_hidden_states record (hooks on
    BertSelfAttention, BertLayer) in a registry keyed by the model's class name, filled when a
    model is constructed: add FastBertModel's entry, or HF's forward (our fallback) would
    return attentions=None. The key is str() of the model's class on every transformers 5 (a
    plain dict on 5.17, a dict whose item assignment takes the model on 5.24): dict's own
    assignment with that key suits both."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:      # transformers 4: outputs are collected by the forward itself
        return
    dict.__setitem__(_CAN_RECORD_REGISTRY, str(model.__class__), model._can_record_outputs)


def restore(model):
    """Undo optimize() on every FastBertModel in ``model`` (the HF classes back; same objects;
    CUDA graphs dropped; query/key/value's weights and biases each in memory of its own again,
    as HF made them: savers that take views of one buffer for tied weights, such as
    accelerate's safetensors ``save_model``/``save_state``, then save every key)."""
    clear_cuda_graphs(model)
    for module in model.modules():
        if type(module) is FastBertModel:
            _forget_checks(module)
            module.__class__ = BertModel
        elif type(module) is FastBertEmbeddings:
            module.__class__ = BertEmbeddings
        elif type(module) is FastBertLayer:
            _drop_packing(module)
            attn = module.attention.self
            with torch.no_grad():
                for linear in (attn.query, attn.key, attn.value):
                    for name, param in linear.named_parameters(recurse=False):
                        if param._base is not None or param.untyped_storage().nbytes() != param.nbytes:
                            param.data = param.data.clone()
            module.__class__ = BertLayer
    return model
