"""The hot-path ops, one per file. Each is called by the modules with plain tensors."""

from .add_layernorm import add_layernorm
from .attention import (KeyMask, key_mask, multi_head_attention, packed_self_attention, prepare_key_mask,
                        unpadded_self_attention)
from .bias_act import ACTIVATIONS, bias_act, linear_act
from .embedding import embedding_sum
from .encoder_layer import LayerSpec, encoder_layer
from .padding import Unpadding, pad, unpad, unpadding_for

__all__ = ["add_layernorm", "multi_head_attention", "KeyMask", "key_mask", "prepare_key_mask", "packed_self_attention",
           "unpadded_self_attention",
           "ACTIVATIONS", "bias_act", "linear_act", "embedding_sum", "LayerSpec", "encoder_layer", "Unpadding", "pad", "unpad", "unpadding_for"]
