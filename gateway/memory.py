"""Memory the gateway frees goes back to the operating system. glibc serves an allocation at or over its mmap
threshold from a mapping of its own, unmapped when freed, but raises the threshold to the size of each such block
freed (up to 32 MiB): after the first large request body, bodies and TLS buffers come from the heap instead, whose
freed pages stay with the process (32 concurrent 15 MB uploads left ~400 MiB behind). A fixed threshold stops that."""
import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's starting value, kept from then on


def keep_large_blocks_mapped() -> bool:
    """Fix glibc's mmap threshold; False where the C library is not glibc (it keeps its own policy)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
