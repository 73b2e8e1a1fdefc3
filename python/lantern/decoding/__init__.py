"""Decoding loops: autoregressive sampling (``ar``) and speculative / LANTERN decoding (``spec``)."""
from .ar import generate_ar, sample_next
from .spec import SpecConfig, SpecStats, generate_spec

__all__ = ["generate_ar", "sample_next", "generate_spec", "SpecConfig", "SpecStats"]
