"""bert_fast: a fast drop-in BERT encoder for PyTorch."""

from . import ops, reference
from .convert import optimize
from .cuda_graph import CudaGraphFallbackWarning, GraphedEncoder, capture_encoder, clear_cuda_graphs, cuda_graph_stats
from .extension import build_extension
from .modules import (FastAddNorm, FastBERTEncoder, FastBERTModel, FastEncoderBlock,
                      FastMultiHeadAttention, FastPositionWiseFFN)
from .ops._autograd import register_ops

__version__ = "0.1.0"

__all__ = ["FastBERTEncoder", "FastBERTModel", "FastEncoderBlock", "FastMultiHeadAttention",
           "FastAddNorm", "FastPositionWiseFFN", "optimize", "capture_encoder", "GraphedEncoder",
           "clear_cuda_graphs", "cuda_graph_stats", "CudaGraphFallbackWarning", "build_extension", "ops",
           "reference", "register_ops"]
