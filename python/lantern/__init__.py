"""lantern: relaxed speculative decoding (LANTERN) for visual autoregressive image models."""
from ._backend import active_backend, disable_fused, enable_fused, fused, fused_ops
from . import models, ops
from .decoding import generate

__version__ = "0.1.0"

__all__ = ["ops", "models", "generate", "enable_fused", "disable_fused", "fused", "fused_ops", "active_backend", "__version__"]
