"""bert_fast: a fast drop-in BERT encoder for PyTorch."""

from . import ops, reference
from .convert import optimize
from .cuda_graph import GraphedEncoder, capture_encoder
from .extension import build_extension
from .modules import (FastAddNorm, FastBERTEncoder, FastBERTModel, FastEncoderBlock,
                      FastMultiHeadAttention, FastPositionWiseFFN)

__version__ = "0.1.0"

__all__ = ["FastBERTEncoder", "FastBERTModel", "FastEncoderBlock", "FastMultiHeadAttention",
           "FastAddNorm", "FastPositionWiseFFN", "optimize", "capture_encoder", "GraphedEncoder",
           "build_extension", "ops", "reference"]
