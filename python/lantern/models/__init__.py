"""LlamaGen models: the GPT (c2i / t2i) with a static KV cache and tree-attention forward, and the VQ
tokenizer; loaders for the official checkpoints."""
from .gpt import GPT_CONFIGS, GPTConfig, Transformer, build_gpt, double_for_cfg, guided_logits
from .loading import load_gpt, load_vq, read_state_dict
from .vq import VQ_CONFIGS, VQConfig, VQModel, build_vq, to_uint8

__all__ = [
    "GPT_CONFIGS", "GPTConfig", "Transformer", "build_gpt", "double_for_cfg", "guided_logits",
    "load_gpt", "load_vq", "read_state_dict",
    "VQ_CONFIGS", "VQConfig", "VQModel", "build_vq", "to_uint8",
]
