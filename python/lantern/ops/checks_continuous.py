"""Names kept for callers outside lantern.ops (decoding/cspd.py): continuous_verify's checks live in
``continuous_verify_op``."""
from .continuous_verify_op import check_settings  # noqa: F401
