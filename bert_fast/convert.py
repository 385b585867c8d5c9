"""optimize(model): swap reference-style BERT encoders and encoder blocks for fast ones.

Recognition is by structure plus class name, so the book's classes (the d2l package, a
notebook copy) are swapped as well as ours. The fast modules adopt the original
submodules, so every Parameter is the very same object (an optimizer built before the swap
keeps working). A variant we cannot run exactly is left as it is, with a warning naming it.
"""

import contextlib
import sys
import warnings

import torch
from torch import nn

from .backend import resolve_backend
from .checks import check_flag
from .cuda_graph import clear_cuda_graphs
from .modules import FastAddNorm, FastBERTEncoder, FastEncoderBlock, FastMultiHeadAttention, FastPositionWiseFFN, _hook_dicts


class _Unsupported(ValueError):
    """A model variant the fast modules cannot run exactly (optimize() warns and skips it)."""


def _require(condition, why):
    if not condition:
        raise _Unsupported(why)


def _activation_of(module):
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.GELU):
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    raise _Unsupported(f"FFN activation {type(module).__name__} (supported: ReLU, GELU)")


def _looks_like_block(module):
    return all(hasattr(module, name) for name in ("attention", "addnorm1", "ffn", "addnorm2"))


def _looks_like_encoder(module):
    return all(hasattr(module, name) for name in
               ("token_embedding", "segment_embedding", "pos_embedding", "blks"))


def _block_config(blk):
    """Constructor arguments of a reference-style EncoderBlock, or _Unsupported."""
    _require(type(blk).__name__ == "EncoderBlock", f"class name {type(blk).__name__!r}")
    attn, ffn = blk.attention, blk.ffn
    linears = [getattr(attn, n, None) for n in ("W_q", "W_k", "W_v", "W_o")]
    _require(all(isinstance(m, nn.Linear) for m in linears), "attention without W_q/W_k/W_v/W_o Linear layers")
    W_q, W_k, W_v, W_o = linears
    inner_dropout = getattr(getattr(attn, "attention", None), "dropout", None)
    _require(isinstance(inner_dropout, nn.Dropout), "attention without attention.dropout")
    _require(isinstance(getattr(attn, "num_heads", None), int), "attention without num_heads")
    _require(attn.num_heads > 0 and W_o.out_features % attn.num_heads == 0,
             f"num_heads {attn.num_heads} (must be a positive divisor of num_hiddens {W_o.out_features})")
    for addnorm in (blk.addnorm1, blk.addnorm2):
        _require(isinstance(getattr(addnorm, "ln", None), nn.LayerNorm), "AddNorm without ln LayerNorm")
        _require(isinstance(getattr(addnorm, "dropout", None), nn.Dropout), "AddNorm without dropout")
    _require(all(isinstance(getattr(ffn, n, None), nn.Linear) for n in ("dense1", "dense2")),
             "FFN without dense1/dense2 Linear layers")
    num_hiddens = W_o.out_features
    dropouts = {inner_dropout.p, blk.addnorm1.dropout.p, blk.addnorm2.dropout.p}
    _require(len(dropouts) == 1, f"different dropout rates {sorted(dropouts)}")
    _require(0 <= min(dropouts) and max(dropouts) < 1, f"dropout {max(dropouts)} (must be in [0, 1))")
    _require(all((m.bias is None) == (W_q.bias is None) for m in linears), "mixed bias settings")
    for ln in (blk.addnorm1.ln, blk.addnorm2.ln):
        _require(tuple(ln.normalized_shape) == (num_hiddens,),
                 f"norm_shape {list(ln.normalized_shape)} (only [num_hiddens] = [{num_hiddens}])")
    _require(blk.addnorm1.ln.eps == blk.addnorm2.ln.eps == 1e-5, "LayerNorm eps other than 1e-5")
    _require_no_dropped_hooks(blk)
    return dict(key_size=W_k.in_features, query_size=W_q.in_features, value_size=W_v.in_features,
                num_hiddens=num_hiddens, norm_shape=[num_hiddens],
                ffn_num_input=ffn.dense1.in_features, ffn_num_hiddens=ffn.dense1.out_features,
                num_heads=attn.num_heads, dropout=dropouts.pop(), use_bias=W_q.bias is not None,
                activation=_activation_of(getattr(ffn, "relu", None)))


# What nn.Module keeps its hooks in (those of torch >= 2.11; a missing one is skipped).
_HOOK_ATTRIBUTES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
                    "_is_full_backward_hook")


def _carried_and_adopted(blk):
    """The modules of reference block ``blk`` whose hooks the fast block keeps: the ones it
    replaces by fast modules taking the same arguments (the block, attention, AddNorms, FFN:
    their hooks are carried over), and the ones it adopts (Linears, the FFN's activation,
    LayerNorms, AddNorm dropouts: the same objects)."""
    attention, ffn, addnorms = blk.attention, blk.ffn, (blk.addnorm1, blk.addnorm2)
    activation = getattr(ffn, "relu", None)     # (not a module, or absent: _block_config refuses it)
    adopted = (attention.W_q, attention.W_k, attention.W_v, attention.W_o, ffn.dense1, ffn.dense2,
               *(a.ln for a in addnorms), *(a.dropout for a in addnorms),
               *((activation,) if isinstance(activation, nn.Module) else ()))
    return (blk, attention, ffn, *addnorms), adopted


def _require_no_dropped_hooks(blk):
    """A hook on a module of ``blk`` that the fast block has no counterpart of (the attention's
    DotProductAttention, whose weights the fast attention never materialises),
    or a forward set on a module the fast block replaces (accelerate's hooks do that), would be
    lost: such a block is left as it is."""
    carried, adopted = _carried_and_adopted(blk)
    carried = {id(m) for m in carried}
    adopted = {id(m) for module in adopted for m in module.modules()}
    for name, module in blk.named_modules():
        if id(module) in adopted:
            continue
        if "forward" in module.__dict__:
            raise _Unsupported(f"a forward set on the instance {name or 'block'}")
        if id(module) not in carried and any(_hook_dicts(module)):
            raise _Unsupported(f"a hook on {name}, a module the fast block does not have")


def _carry_hooks(old, new):
    """Give ``new``, the fast module replacing ``old`` (same forward arguments), old's hooks:
    the same dicts, so the hooks' handles still remove them."""
    for name in _HOOK_ATTRIBUTES:
        if name in old.__dict__:
            new.__dict__[name] = old.__dict__[name]


def _adopt_block(fast, blk):
    """Give ``fast`` the submodules (and so the Parameters) and the hooks of reference block ``blk``."""
    for name in ("W_q", "W_k", "W_v", "W_o"):
        setattr(fast.attention, name, getattr(blk.attention, name))
    fast.addnorm1.ln, fast.addnorm2.ln = blk.addnorm1.ln, blk.addnorm2.ln
    fast.addnorm1.dropout, fast.addnorm2.dropout = blk.addnorm1.dropout, blk.addnorm2.dropout
    fast.ffn.dense1, fast.ffn.relu, fast.ffn.dense2 = blk.ffn.dense1, blk.ffn.relu, blk.ffn.dense2
    for old, new in zip(_carried_and_adopted(blk)[0], (fast, fast.attention, fast.ffn, fast.addnorm1, fast.addnorm2)):
        _carry_hooks(old, new)
    # The adopted W_q/W_k/W_v move into one buffer (same Parameter objects, same values).
    fast.attention.pack_qkv_()
    fast.train(blk.training)
    return fast


@contextlib.contextmanager
def _constructor_errors_unsupported():
    """A configuration the fast constructors refuse (ValueError/TypeError) is a variant
    optimize() skips with a warning, like the ones _block_config recognises."""
    try:
        yield
    except _Unsupported:
        raise
    except (ValueError, TypeError) as why:
        raise _Unsupported(f"configuration: {why}") from why


def _convert_block(blk, backend):
    config = _block_config(blk)
    _require(config["ffn_num_input"] == config["num_hiddens"] == config["query_size"]
             == config["key_size"] == config["value_size"], "projection sizes differ from num_hiddens")
    kwargs = dict(activation=config.pop("activation"), backend=backend)
    with torch.device("meta"), _constructor_errors_unsupported():
        fast = FastEncoderBlock(*config.values(), **kwargs)
    return _adopt_block(fast, blk)


def _convert_encoder(enc, backend, skip_padding, cuda_graphs):
    _require(type(enc).__name__ == "BERTEncoder", f"class name {type(enc).__name__!r}")
    _require("forward" not in enc.__dict__, "a forward set on the encoder instance")
    _require(isinstance(enc.token_embedding, nn.Embedding) and isinstance(enc.segment_embedding, nn.Embedding),
             "token/segment embeddings that are not nn.Embedding")
    _require(enc.segment_embedding.num_embeddings == 2, "segment table without exactly 2 rows")
    pos = enc.pos_embedding
    _require(isinstance(pos, torch.Tensor) and pos.dim() == 3 and pos.shape[0] == 1,
             "pos_embedding not of shape (1, max_len, H)")
    _require(isinstance(enc.blks, nn.Sequential) and len(enc.blks) > 0, "blks not a non-empty nn.Sequential")
    configs = [_block_config(blk) for blk in enc.blks]
    _require(all(c == configs[0] for c in configs), "blocks with different configurations")
    c = configs[0]
    _require(c["use_bias"], "attention without biases (BERTEncoder always uses them)")
    vocab_size, num_hiddens = enc.token_embedding.weight.shape
    _require(c["num_hiddens"] == num_hiddens == pos.shape[2], "embedding width differs from the blocks'")
    with torch.device("meta"), _constructor_errors_unsupported():
        fast = FastBERTEncoder(vocab_size, num_hiddens, c["norm_shape"], c["ffn_num_input"],
                               c["ffn_num_hiddens"], c["num_heads"], len(enc.blks), c["dropout"],
                               max_len=pos.shape[1], key_size=c["key_size"],
                               query_size=c["query_size"], value_size=c["value_size"],
                               activation=c["activation"], skip_padding=skip_padding,
                               backend=backend, cuda_graphs=cuda_graphs)
    fast.token_embedding, fast.segment_embedding = enc.token_embedding, enc.segment_embedding
    fast.pos_embedding = pos
    _carry_hooks(enc, fast)
    for fast_blk, blk in zip(fast.blks, enc.blks):
        _adopt_block(fast_blk, blk)
    fast.train(enc.training)
    return fast


def _reconfigure(fast, backend, skip_padding, cuda_graphs):
    """Give a fast module that is in the model already (built directly, or by an earlier
    optimize()) this call's options, as a swapped one gets them (and as a Hugging Face
    model optimized again does): the last optimize() says how it runs. Graphs captured under
    other options are dropped (they would only hold memory until evicted)."""
    for sub in fast.modules():
        if isinstance(sub, (FastMultiHeadAttention, FastAddNorm, FastPositionWiseFFN)):
            sub.backend = backend
    if isinstance(fast, FastBERTEncoder):
        options = (backend, bool(skip_padding), bool(cuda_graphs))
        if (fast.backend, bool(fast.skip_padding), bool(fast.cuda_graphs)) != options:
            clear_cuda_graphs(fast)
        fast.backend, fast.skip_padding, fast.cuda_graphs = options


# Our modules, which optimize() gives its options (a block's parts may be used on their own).
_FAST = (FastBERTEncoder, FastEncoderBlock, FastMultiHeadAttention, FastAddNorm, FastPositionWiseFFN)


def _hf_bert(module):
    """bert_fast.hf when ``module`` is a transformers BertModel (or a subclass), else None.
    Imports nothing unless transformers is loaded already (a BertModel cannot exist otherwise)."""
    if "transformers" not in sys.modules or not any(
            cls.__name__ == "BertModel" and cls.__module__.startswith("transformers.") for cls in type(module).__mro__):
        return None
    from . import hf
    return hf


def _fsdp_hint(why):
    """FSDP's wrapped classes (FSDPBertModel, FSDPEncoderBlock...) are not the ones optimize()
    swaps: say in which order to call them."""
    return "; call optimize() before fully_shard / FSDP wraps the model" if "FSDP" in str(why) else ""


def _convert_hf(hf, module, backend, encoder_options, path):
    skip_padding, cuda_graphs = encoder_options
    name = f"{path or 'model'} ({type(module).__name__})"
    try:
        hf.convert(module, backend, skip_padding, cuda_graphs)
    except hf.Unsupported as why:
        warnings.warn(f"bert_fast.optimize: {name} is a Hugging Face BertModel but was left untouched: "
                      f"unsupported {why}{_fsdp_hint(why)}", stacklevel=4)
    return module


def _swap(module, backend, encoder_options, path, done=None):
    """Return the replacement for ``module`` (or ``module`` itself, its children swapped).
    ``done``: id -> replacement of the modules already visited: each module is visited once
    (a module reachable twice gets the same replacement; a cycle ends)."""
    done = {} if done is None else done
    if id(module) in done:
        return done[id(module)]
    done[id(module)] = module       # while its children are visited: a cycle back to it stops here
    hf = _hf_bert(module)
    if hf is not None:              # converted in place (bert_fast.hf), children included
        return _convert_hf(hf, module, backend, encoder_options, path)
    if isinstance(module, _FAST):
        _reconfigure(module, backend, *encoder_options)
        return module
    for converter, looks_like, kind in ((_convert_encoder, _looks_like_encoder, "BERTEncoder"),
                                        (_convert_block, _looks_like_block, "EncoderBlock")):
        if not looks_like(module):
            continue
        try:
            args = (backend, *encoder_options) if converter is _convert_encoder else (backend,)
            done[id(module)] = converter(module, *args)
            return done[id(module)]
        except _Unsupported as why:
            warnings.warn(f"bert_fast.optimize: {path or 'model'} ({type(module).__name__}) looks like "
                          f"a reference-style {kind} but was left untouched: unsupported {why}{_fsdp_hint(why)}",
                          stacklevel=3)
    for name, child in module.named_children():
        new = _swap(child, backend, encoder_options, f"{path}.{name}" if path else name, done)
        if new is not child:
            setattr(module, name, new)
    return module


def optimize(model, backend=None, *, skip_padding=False, cuda_graphs=False):
    """Swap every reference-style BERTEncoder / EncoderBlock in ``model`` for a fast one, and
    give every Hugging Face ``BertModel`` in it the fast path in place (bert_fast.hf).

    Parameters are shared, not copied: the fast modules hold the very same Parameter objects
    (W_q, W_k and W_v of each block move into one buffer in place, see
    FastMultiHeadAttention.pack_qkv_; their values and the state_dict are unchanged).
    ``skip_padding`` and ``cuda_graphs`` apply to swapped encoders (see FastBERTEncoder).
    Fast modules already in ``model`` (built directly or by an earlier optimize()) take this
    call's ``backend``, ``skip_padding`` and ``cuda_graphs``: the last call says how they run.
    Returns the model, or the fast module if ``model`` itself was swapped.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() expects an nn.Module, got {type(model).__name__}")
    options = (check_flag("skip_padding", skip_padding), check_flag("cuda_graphs", cuda_graphs))
    result = _swap(model, resolve_backend(backend), options, "")
    if not any(isinstance(m, _FAST) or _hf_bert(m) or _looks_like_encoder(m) or _looks_like_block(m)
               for m in result.modules()):
        # Nothing made fast nor left untouched with a warning: say so (as Liger-Kernel does of a
        # model type it has no kernels for). RoBERTa's family, ELECTRA, DistilBERT and ALBERT
        # look like BERT but are other classes.
        warnings.warn(f"bert_fast.optimize: found nothing to make fast in {type(model).__name__} (it swaps the "
                      "book's BERTEncoder / EncoderBlock and transformers' BertModel, not other classes); "
                      "the model computes as before", stacklevel=2)
    return result
