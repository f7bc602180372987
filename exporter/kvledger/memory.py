"""Giving freed heap memory back to the operating system.

After a large response or document is dropped, glibc keeps the freed heap pages for
reuse (and raises its mmap threshold after freeing a large mmapped block), so the
daemon's RSS would stay at its peak. ``release_freed_memory()`` asks glibc to return
them (``malloc_trim(0)``); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_lock = threading.Lock()
_libc: ctypes.CDLL | None = None
_looked = False


def _glibc() -> ctypes.CDLL | None:
    global _libc, _looked
    if not _looked:
        _looked = True
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            if lib is not None and hasattr(lib, "malloc_trim"):
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                lib.malloc_trim.restype = ctypes.c_int
                _libc = lib
        except OSError:
            _libc = None
    return _libc


def release_freed_memory() -> bool:
    """Return free heap pages to the OS; True where glibc did it."""
    with _lock:
        lib = _glibc()
        if lib is None:
            return False
        lib.malloc_trim(0)
        return True
