"""Public ops, one module per op (``<op>_op.py``: the public function, its argument checks, its schema, its fake
and its backend table; docs/dispatch.md). Each op checks its arguments (so every backend raises the same errors),
then runs the implementation of its ``backend=`` argument, by default the backend ``lantern.enable_fused`` /
``lantern.fused`` chose. Semantics: docs/SPEC.md."""
from __future__ import annotations

from .. import _backend

# the submodules, as attributes of lantern.ops
from . import checks as checks
from . import library as library
from .ancestor_mask_op import ancestor_mask
from .build_tree_op import build_tree
from .compact_kv_op import compact_kv
from .continuous_verify_op import continuous_verify
from .draft_sample_op import draft_sample
from .latent_neighbours_op import latent_neighbours
from .philox_uniform_op import philox_uniform
from .process_logits_op import process_logits
from .reference.continuous_verify import ContinuousVerifyResult
from .reference.draft_sample import DraftSample
from .reference.verify import VerifyResult
from .tree_attention_op import tree_attention
from .verify_op import verify

__all__ = [
    "VerifyResult",
    "process_logits",
    "latent_neighbours",
    "verify",
    "philox_uniform",
    "ancestor_mask",
    "build_tree",
    "tree_attention",
    "compact_kv",
    "ContinuousVerifyResult",
    "continuous_verify",
    "DraftSample",
    "draft_sample",
]


def _self_check_module():
    from . import self_check

    return self_check


def _fused_modules():
    from . import extension, triton_backend  # lantern._C and triton: imported on first use

    return extension, triton_backend


_backend.install_op_layer(reference_op=lambda name: library.OPS[name].reference_op, self_check=_self_check_module,
                          fused_modules=_fused_modules)
