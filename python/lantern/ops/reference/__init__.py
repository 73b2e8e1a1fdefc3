"""The PyTorch reference implementation of every op: the readable definition the fused backends are
checked against. Each op module (lantern.ops.<op>_op) names its reference in its backend table."""
from . import (philox, process_logits, verify, latent_neighbours, tree, tree_attention, compact_kv,  # noqa: F401
               continuous_verify)
