"""The PyTorch reference implementation of every op: the readable definition the fused backends are
checked against. Each op module (lantern.ops.<op>_op) names its reference in its backend table."""
from . import (  # noqa: F401
    compact_kv,
    continuous_verify,
    draft_sample,
    latent_neighbours,
    philox,
    process_logits,
    tree,
    tree_attention,
    verify,
)
