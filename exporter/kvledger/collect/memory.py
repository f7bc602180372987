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


#: glibc's mallopt parameter for the number of malloc arenas
_M_ARENA_MAX = -8


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Let glibc keep at most ``arenas`` heaps: by default every thread that allocates
    gets its own (up to 8 per core), and each poll thread's arena keeps the pages of the
    documents it parsed, so RSS grows with the number of engines polled at once. True
    where glibc took it; elsewhere it does nothing."""
    with _lock:
        lib = _glibc()
        if lib is None or not hasattr(lib, "mallopt"):
            return False
        return bool(lib.mallopt(ctypes.c_int(_M_ARENA_MAX), ctypes.c_int(arenas)))
