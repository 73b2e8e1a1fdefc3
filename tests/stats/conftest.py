import pytest

from .harness import BACKENDS, backend_verify


@pytest.fixture(params=BACKENDS)
def verify_backend(request):
    """lantern.ops.verify under ``lantern.fused(name)``, for every backend in harness.BACKENDS."""
    return backend_verify(request.param)
