"""lantern: relaxed speculative decoding (LANTERN) for visual autoregressive image models."""
from ._backend import (active_backend, disable_fused, enable_fused, fused, fused_ops, run_self_checks,
                       self_check_report)
from . import models, ops
from .decoding import generate
from .sampling import sample

__version__ = "0.1.0"

__all__ = ["ops", "models", "generate", "sample", "enable_fused", "disable_fused", "fused", "fused_ops",
           "active_backend", "run_self_checks", "self_check_report", "__version__"]
