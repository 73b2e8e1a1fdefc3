"""ancestor_mask (SPEC §6): the packed tree mask tree_attention takes, from a tree's parent array."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import checks as c
from . import library
from .reference.tree import ancestor_mask as reference

# parents int64 [B, T] -> int32 [B, T, ceil(T/32)]
SCHEMA = "(Tensor parents) -> Tensor"


def fake(parents):
    B, T = parents.shape
    return parents.new_empty((B, T, (T + 31) // 32), dtype=torch.int32)


OP = library.Op("ancestor_mask", SCHEMA, fake, backends={
    "reference": reference,                      # ops/reference/tree.py (no fused kernel)
})


def ancestor_mask(parents: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """§6: int32 ``[B, T, ceil(T/32)]``; bit j of node i is set iff j is i or an ancestor of i."""
    c.check_parents(parents, "parents")
    return _backend.dispatch("ancestor_mask", parents.device, backend)(parents)
