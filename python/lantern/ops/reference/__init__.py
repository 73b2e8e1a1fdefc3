"""The PyTorch reference implementation of every op: the readable definition the fused backends are
checked against. Importing this package registers each op as the "reference" backend."""
from . import (philox, process_logits, verify, latent_neighbours, tree, tree_attention, compact_kv,  # noqa: F401
               continuous_verify)
