"""lantern: relaxed speculative decoding (LANTERN) for visual autoregressive image models."""
from . import models, ops
from ._backend import active_backend, disable_fused, enable_fused, fused, fused_ops, run_self_checks, self_check_report
from ._version import __version__
from .decoding import generate
from .sampling import sample


def build_info() -> str:
    """One line: how lantern._C was built (with or without CUDA kernels, for which architectures), or why it
    cannot be imported. ``make install`` prints it (pip shows a build's output only with -v)."""
    from .ops import extension  # imports lantern._C: not at ``import lantern``

    return extension.build_info()


__all__ = ["ops", "models", "generate", "sample", "enable_fused", "disable_fused", "fused", "fused_ops",
           "active_backend", "run_self_checks", "self_check_report", "build_info", "__version__"]
