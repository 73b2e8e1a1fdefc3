"""LlamaGen models: the GPT (c2i / t2i) with a static KV cache and tree-attention forward, and the VQ
tokenizer; MAR with its diffusion head and the KL autoencoder; loaders for the official checkpoints."""
from .gpt import GPT_CONFIGS, GPTConfig, Transformer, build_gpt, double_for_cfg
from .loading import decode_dtype, load_gpt, load_vq, read_state_dict
from .mar import MAR, MAR_CONFIGS, MARConfig, build_mar
from .mar_loading import load_mar, load_vae
from .vae import VAE_CONFIGS, AutoencoderKL, VAEConfig, build_vae
from .vq import VQ_CONFIGS, VQConfig, VQModel, build_vq, to_uint8

__all__ = [
    "GPT_CONFIGS", "GPTConfig", "Transformer", "build_gpt", "double_for_cfg",
    "decode_dtype", "load_gpt", "load_vq", "read_state_dict",
    "VQ_CONFIGS", "VQConfig", "VQModel", "build_vq", "to_uint8",
    "MAR", "MAR_CONFIGS", "MARConfig", "build_mar", "load_mar",
    "VAE_CONFIGS", "AutoencoderKL", "VAEConfig", "build_vae", "load_vae",
]
