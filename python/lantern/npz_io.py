"""Reading arrays from untrusted .npz files: each member's header (shape, dtype) is checked against the bytes the
zip holds, and against what the caller expects, before anything is allocated from it.

``np.load`` allocates the array its header declares before reading a byte of it, so a 200-byte file can ask for
terabytes; a truncated or garbage file raises zipfile.BadZipFile, which is neither OSError nor ValueError. Here
every failure is an ``NpzError`` whose message names the file and what is wrong with it."""
from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Tuple

import numpy as np

# deflate expands at most ~1032x: a member that claims more than this per compressed byte is lying
MAX_DEFLATE_RATIO = 1100
_READ_CHUNK = 1 << 24  # bytes per read into the allocated array

Header = Tuple[Tuple[int, ...], np.dtype]


class NpzError(ValueError):
    """An .npz that cannot be read as the caller expects; the message names the file."""


def open_npz(path) -> zipfile.ZipFile:
    """The zip of ``path``; NpzError naming it for a missing, unreadable, truncated or non-zip file."""
    path = Path(path)
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        raise NpzError(f"{path} is not a readable .npz (truncated or not a zip file: {e})") from e
    except OSError as e:
        raise NpzError(f"{path} cannot be read ({e.strerror or e})") from e


def member_names(zf: zipfile.ZipFile) -> list:
    """The arrays of an open .npz (``np.load(...).files``)."""
    return [name[:-4] for name in zf.namelist() if name.endswith(".npy")]


def read_member(zf: zipfile.ZipFile, name: str, check: Optional[Callable[[Header], Optional[str]]] = None,
                header_only: bool = False):
    """Array ``name`` of an open .npz. ``check((shape, dtype))`` returns a complaint (str) or None; it runs on the
    header, before any allocation. -> the array, or its (shape, dtype) with ``header_only``. NpzError naming the
    file and the member for a missing member, an object array, a header that does not match the member's size, a
    complaint of ``check``, or data that fails to read (short, or a CRC mismatch)."""
    where = f"{zf.filename}: {name}"
    try:
        info = zf.getinfo(name + ".npy")
    except KeyError:
        raise NpzError(f"{zf.filename} has no array {name!r} (it holds {member_names(zf)})") from None
    try:
        with zf.open(info) as member:
            shape, dtype, order = _header(member, where)
            _check_sizes(info, member.tell(), shape, dtype, where)
            complaint = check((shape, dtype)) if check else None
            if complaint:
                raise NpzError(f"{where} {complaint}")
            if header_only:
                return shape, dtype
            return _read_data(member, shape, dtype, order, where)
    except NpzError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, RuntimeError) as e:
        # RuntimeError: an encrypted member; BadZipFile: a bad CRC or a damaged local header
        raise NpzError(f"{where} cannot be read ({type(e).__name__}: {e})") from e


def read_arrays(path, checks: Dict[str, Callable[[Header], Optional[str]]], exact: bool = True) -> dict:
    """The arrays named by ``checks`` of the .npz at ``path`` (each header checked first, see read_member);
    ``exact``: the file must hold those arrays and no other."""
    with open_npz(path) as zf:
        if exact and (sorted(zf.namelist()) != sorted(name + ".npy" for name in checks)):
            raise NpzError(f"{path} must hold the arrays {sorted(checks)} only, it holds {zf.namelist()}")
        return {name: read_member(zf, name, check) for name, check in checks.items()}


def _header(member, where: str):
    """(shape, dtype, order) of the .npy at the member's start."""
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
    else:
        raise NpzError(f"{where} has an .npy version {version} that is not read here")
    if dtype.hasobject:
        raise NpzError(f"{where} holds Python objects (pickled); only plain arrays are read")
    return tuple(int(d) for d in shape), dtype, "F" if fortran else "C"


def _check_sizes(info: zipfile.ZipInfo, header_bytes: int, shape, dtype, where: str) -> None:
    """The member's uncompressed size must be its header plus the array's bytes, and a compressed member must
    not claim more than deflate can expand to."""
    nbytes = math.prod(shape) * dtype.itemsize
    if info.file_size != header_bytes + nbytes:
        raise NpzError(f"{where} declares {dtype} {list(shape)} ({nbytes} bytes) but the member holds "
                       f"{info.file_size - header_bytes} bytes of data")
    if info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_DEFLATE_RATIO * info.compress_size + 1024:
        raise NpzError(f"{where} claims {info.file_size} bytes from {info.compress_size} compressed bytes")


def _read_data(member, shape, dtype, order: str, where: str) -> np.ndarray:
    out = np.empty(shape, dtype=dtype, order=order)
    view = memoryview(out.reshape(-1, order="A").view(np.uint8)) if out.size else memoryview(b"")
    done = 0
    while done < len(view):
        got = member.readinto(view[done: done + _READ_CHUNK])
        if not got:
            raise NpzError(f"{where}: the data ends after {done} of {len(view)} bytes")
        done += got
    if member.read(1):  # also reads to the end, where zipfile checks the CRC
        raise NpzError(f"{where} holds more bytes than its header declares")
    return out


def images_check(channels: int = 3, size: Optional[Iterable[int]] = None, count: Optional[int] = None):
    """A read_member check for uint8 images [N, H, W, channels], every dimension >= 1 (H, W = ``size``, N =
    ``count`` when given)."""
    size = None if size is None else tuple(size)
    wanted = f"uint8 [{'N' if count is None else count}, {'H, W' if size is None else ', '.join(map(str, size))}, " \
             f"{channels}]"

    def check(header: Header) -> Optional[str]:
        shape, dtype = header
        fits = dtype == np.uint8 and len(shape) == 4 and shape[-1] == channels and min(shape) >= 1 and \
            (size is None or shape[1:3] == size) and (count is None or shape[0] == count)
        return None if fits else f"must be {wanted} images, got {dtype} {list(shape)}"

    return check
