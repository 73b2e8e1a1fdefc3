"""The PyTorch reference implementation of every op: the readable definition the fused backends are
checked against. Each op module (lantern.ops.<op>_op) names its reference in its backend table."""
from . import compact_kv, continuous_verify, latent_neighbours, philox, process_logits, tree, tree_attention, verify  # noqa: F401
