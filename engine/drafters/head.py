"""The feature-fed draft head (EAGLE style) as a drafter: the model drafter with a feature feed.

A head is a one-layer Llama (`ModelConfig.feature_fed`) whose input at a position fuses a token's
embedding with the feature of the position before it (drafters/feeds.py's FeatureFeed): the target
sends the features of every position it kept (its prompt, then each round's last token and accepted
drafts), each paired with the token that followed it.
"""

from __future__ import annotations

from specpool.engine.drafters.model import ModelDrafter
from specpool.engine.plan import TreeShape
from specpool.engine.runtime.model import Llama


class HeadDrafter(ModelDrafter):
    def __init__(self, model: Llama, max_sequences: int, max_len: int, sparse_top_k: bool = True,
                 tree: TreeShape | None = None):
        if not model.config.feature_fed:
            raise ValueError("HeadDrafter needs a feature-fed model (a draft head checkpoint)")
        super().__init__(model, max_sequences, max_len, sparse_top_k, tree)


def build(sources) -> HeadDrafter | None:
    """The registry's head drafter (drafters/registry.py); a growing tree takes cache room past a sequence."""
    if sources.head is None:
        return None
    return HeadDrafter(sources.head, sources.max_sequences, sources.max_len + sources.tree_shape.fed_room,
                       tree=sources.tree_shape if sources.trees else None)
