"""The LANTERN authors' published LlamaGen checkpoints in lantern's classes: their Hugging Face-converted LlamaGen
T2I models (a ``LlamaForCausalLM``-style state dict) into lantern's GPT, and their EAGLE drafters into lantern's
``EagleDrafter`` with ``layout="eagle1"``. Key names and shapes are those of their model code (LANTERN's
``models/kv_variants/modeling_llamagen_kv.py`` and ``models/drafters/cnets_llamagen.py``); no transformers
needed. Anything else raises a ValueError naming the missing, unexpected and misshapen keys.

Their layers are LlamaGen's blocks with Hugging Face names: q / k / v projections applied with LlamaGen's
interleaved 2D RoPE (no permutation of the rows), so ``wqkv`` is the concatenation of q_proj, k_proj, v_proj.
Their drafter is EAGLE's original head: fc over [token embedding; target hidden state], decoder layers whose
first has no input RMSNorm, no final norm, the target's frozen head; its ``embed_tokens`` is a copy of the
target's token embedding (lantern's drafter reads the target's own, so the copy must equal it).
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Dict, Mapping, Optional

import torch

from ..models.drafter import EagleDrafter
from ..models.gpt import GPT_CONFIGS, Transformer
from ..models.loading import check_state_dict, read_state_dict

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_BLOCK = {  # their name inside a decoder layer -> lantern's (q / k / v are concatenated into wqkv)
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_GPT = {  # their top-level names -> lantern's
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.cls_embedding.cap_proj.fc1.weight": "cls_embedding.cap_proj.fc1.weight",
    "model.cls_embedding.cap_proj.fc2.weight": "cls_embedding.cap_proj.fc2.weight",
    "model.cls_embedding.uncond_embedding": "cls_embedding.uncond_embedding",
    "model.cls_embedding.embedding_table.weight": "cls_embedding.embedding_table.weight",
}
_DRAFTER = {"fc.weight": "fc.weight", "fc.bias": "fc.bias"}


def _convert(state: Mapping[str, torch.Tensor], top: Dict[str, str], what: str) -> Dict[str, torch.Tensor]:
    """Their names -> lantern's; ValueError naming every key it does not know (nothing is dropped silently)."""
    out, unknown, qkv = {}, [], {}
    for key, value in state.items():
        layer = _LAYER.match(key)
        if key in top:
            out[top[key]] = value
        elif layer and layer.group(2) in _BLOCK:
            out[f"layers.{layer.group(1)}.{_BLOCK[layer.group(2)]}"] = value
        elif layer and layer.group(2) in _QKV:
            qkv.setdefault(int(layer.group(1)), {})[layer.group(2)] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{what}: keys that are not the LANTERN authors' layout ({len(unknown)}): {sorted(unknown)}")
    for i, parts in sorted(qkv.items()):
        missing = [name for name in _QKV if name not in parts]
        if missing:
            raise ValueError(f"{what}: layer {i} lacks {missing}")
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat([parts[name] for name in _QKV])
    return out


def load_llamagen_hf(path_or_state_dict, name: str = "GPT-XL", model_type: str = "t2i", *,
                     device="cpu", dtype: Optional[torch.dtype] = None, **overrides) -> Transformer:
    """Their HF-converted LlamaGen (``model.layers.N.self_attn.q_proj.weight``, ``model.cls_embedding...``,
    ``lm_head.weight``) -> lantern's GPT ``name`` (GPT_CONFIGS; overrides replace GPTConfig fields, e.g.
    block_size=1024 for their 512-pixel T2I model), loaded strictly. dtype None keeps the checkpoint's."""
    state = _convert(read_state_dict(path_or_state_dict), _GPT, "LlamaGen (HF-converted) checkpoint")
    if name not in GPT_CONFIGS:
        raise ValueError(f"unknown GPT config {name!r}; choose from {sorted(GPT_CONFIGS)}")
    config = replace(GPT_CONFIGS[name], model_type=model_type, **overrides)
    with torch.device("meta"):
        model = Transformer(config)
    check_state_dict(model, state, f"LlamaGen {name} {model_type}")
    model.load_state_dict({k: v.to(device=device, dtype=dtype or v.dtype) for k, v in state.items()},
                          strict=True, assign=True)
    model.reset_rope(torch.device(device))
    return model.eval()


def load_lantern_drafter(path_or_state_dict, target: Transformer, *, norm_eps: float = 1e-6,
                         dtype: Optional[torch.dtype] = None, attend_condition: Optional[bool] = None) -> EagleDrafter:
    """Their EAGLE drafter (``fc.weight`` [D, 2D], ``fc.bias``, ``layers.N.self_attn...``, ``embed_tokens.weight``)
    -> ``EagleDrafter(layout="eagle1")`` bound to ``target`` (lantern's GPT of the same width), loaded strictly.
    norm_eps: their config's rms_norm_eps (1e-6 in their LlamaGen configs). Their ``embed_tokens`` must equal the
    target's token embedding (the drafter reads the target's). attend_condition (default: a t2i target): the
    drafter sees the target's hidden states over the caption as a prefix, as their T2I loop feeds it
    (``EagleDrafter``'s attend_condition)."""
    raw = dict(read_state_dict(path_or_state_dict))
    embedding = raw.pop("embed_tokens.weight", None)
    state = _convert(raw, _DRAFTER, "LANTERN drafter checkpoint")
    layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    if not layers or layers != list(range(len(layers))):
        raise ValueError(f"LANTERN drafter checkpoint: decoder layers must be numbered 0..n-1, got {layers}")
    target_embedding = target.tok_embeddings.weight
    if embedding is not None:
        if tuple(embedding.shape) != tuple(target_embedding.shape):
            raise ValueError(f"the drafter's embed_tokens {list(embedding.shape)} is not the target's token "
                             f"embedding {list(target_embedding.shape)}: another target's drafter")
        if not torch.equal(embedding.to(target_embedding.device, target_embedding.dtype), target_embedding.detach()):
            raise ValueError("the drafter's embed_tokens differs from the target's token embedding: the drafter was "
                             "trained for another checkpoint")
    config = replace(target.config, norm_eps=norm_eps)
    device = target_embedding.device
    with torch.device("meta"):
        if attend_condition is None:
            attend_condition = target.config.model_type == "t2i"
        drafter = EagleDrafter(config, n_layer=len(layers), layout="eagle1", attend_condition=attend_condition)
    check_state_dict(drafter, state, f"EAGLE drafter ({len(layers)} layers, eagle1 layout)")
    drafter.load_state_dict({k: v.to(device=device, dtype=dtype or v.dtype) for k, v in state.items()},
                            strict=True, assign=True)
    drafter.freqs_cis = _drafter_rope(drafter, device)
    return drafter.bind(target).eval()


def _drafter_rope(drafter: EagleDrafter, device) -> torch.Tensor:
    from ..models.gpt import precompute_freqs_cis_2d

    cfg = drafter.config
    return precompute_freqs_cis_2d(cfg.grid_size, cfg.head_dim, cfg.rope_base, 0).to(device)
