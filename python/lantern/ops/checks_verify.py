"""Names kept for callers outside lantern.ops (decoding/options.py): the settings checks
live in ``checks``, verify's own in ``verify_op``."""
from .checks import check_counter as _check_counter  # noqa: F401
from .checks import check_sampling_settings as _check_sampling_settings  # noqa: F401
from .verify_op import _NEIGHBOUR_TABLES  # noqa: F401
