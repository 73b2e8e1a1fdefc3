"""The ``backend`` fixture: every op test runs on reference, cpu, cuda and triton (tests/backends.py says
which are usable here, and skips the others with the reason), and ``device``, where that backend's tensors
live. A test narrows the list with ``@pytest.mark.parametrize("backend", backends.params([...]),
indirect=True)``."""
import pytest

import backends
import lantern


@pytest.fixture(params=backends.params())
def backend(request):
    """The backend's name; the public ops run on it (``lantern.fused(name)``) for the whole test, so a
    reference result must be asked for explicitly (``with lantern.fused("reference")``)."""
    with lantern.fused(request.param):
        yield request.param


@pytest.fixture
def device(backend):
    """torch.device of the backend's tensors: CPU for reference and cpu; CUDA for cuda, and for triton when
    a GPU exists (else triton runs on CPU tensors under the interpreter)."""
    return backends.device_for(backend)
