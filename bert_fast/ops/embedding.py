"""embedding_sum: token + segment + position embeddings in one call.

Padded form: ``tokens``/``segments`` are (B, L) and position j of every row reads
``pos_weight[0, j]``. Unpadded form (skip_padding): ``tokens``/``segments`` are (N,) packed
valid tokens and ``positions`` (N,) says which row of the position table each one reads.
"""

import torch
from torch.nn import functional as F


def embedding_sum(tokens, segments, token_weight, segment_weight, pos_weight, *,
                  positions=None, learn_pos_embedding=False):
    # The reference reads the position table through .data, so by default no gradient
    # reaches it; learn_pos_embedding=True is the explicit opt-in.
    pos_table = pos_weight[0] if learn_pos_embedding else pos_weight.detach()[0]
    if positions is None:
        pos = pos_table[: tokens.shape[-1]]
    else:
        pos = pos_table.index_select(0, positions)
    # Accumulate in place: the embedding lookups' backward does not need their outputs,
    # so this saves two full-size temporaries without touching autograd.
    out = F.embedding(tokens, token_weight)
    out.add_(F.embedding(segments, segment_weight))
    out.add_(pos)
    return out
