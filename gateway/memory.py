"""Memory the gateway frees goes back to the operating system. glibc serves an allocation at or over its mmap
threshold from a mapping of its own, unmapped when freed, but raises the threshold to the size of each such block
freed (up to 32 MiB): after the first large request body, bodies and TLS buffers come from the heap instead, whose
freed pages stay with the process (32 concurrent 15 MB uploads left ~400 MiB behind). A fixed threshold stops that.
Small blocks freed in the middle of a heap (a connection storm's SSL objects) are returned by `trim` after it."""
import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's starting value, kept from then on


def _glibc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


LIBC = _glibc()  # None where the C library is not glibc: it keeps its own policy


def keep_large_blocks_mapped() -> bool:
    """Fix glibc's mmap threshold; False where that is not possible."""
    return bool(LIBC and LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim() -> None:
    """Hand the free pages of every heap back (malloc_trim(0)): a few milliseconds, for after a storm ends."""
    if LIBC:
        LIBC.malloc_trim(0)
