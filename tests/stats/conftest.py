import pytest

from .harness import BACKENDS, backend_verify


@pytest.fixture(params=BACKENDS)
def verify_backend(request):
    """lantern.ops.verify under ``lantern.fused(name)``, for every backend in harness.BACKENDS (skipped where
    the backend is unavailable, e.g. triton not installed)."""
    import lantern

    lantern._backend._load_backends()
    why = lantern._backend._why_unavailable(request.param)
    if why is not None:
        pytest.skip(f"backend {request.param!r} is unavailable: {why}")
    return backend_verify(request.param)
