"""Decoding loops: autoregressive sampling (``ar``); speculative / LANTERN decoding arrives next."""
from .ar import generate_ar, sample_next

__all__ = ["generate_ar", "sample_next"]
