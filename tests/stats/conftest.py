import pytest

import backends

from .harness import BACKENDS, backend_verify


@pytest.fixture(params=backends.params(BACKENDS))
def verify_backend(request):
    """lantern.ops.verify under ``lantern.fused(name)``, for every backend in harness.BACKENDS: cuda (and
    triton with a GPU) marked gpu, with the full DRAWS; each skipped, with the reason, where it is
    unavailable (no CUDA device, lantern._C without CUDA kernels, triton not installed)."""
    return backend_verify(request.param)
