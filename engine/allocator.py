"""glibc's allocator tuned for a training process: freed multi-MB buffers stay in the heap.

Called by each process's set-up, before it starts threads: the CLI's processes (poseidon_cli's
package), pycaffe scripts (``import caffe``) and the transport's endpoint. Not at the import of
the array module: a library's import should not change its host process's allocator.
"""
from __future__ import annotations


_allocator_tuned = False


def tune_allocator() -> None:
    """Keep freed multi-MB buffers in the heap instead of returning them to the kernel.

    Every layer makes large temporaries each iteration, and libzmq's I/O thread allocates each
    received message; with glibc's defaults each one is a fresh mmap whose pages fault in again
    (LeNet fwd+bwd 42 -> 25 ms measured; a 64 MB message stream on loopback ran at 0.37 of a
    raw TCP stream, 0.88 with this). A raised mmap threshold is not enough: a thread's own
    arena is at most 64 MB, so anything larger is mmapped anyway. Hence one arena (the brk
    heap, shared by every thread) and no mmap at all. Must run before other threads allocate;
    idempotent; a no-op off glibc. Equivalent to MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_ MALLOC_TOP_PAD_.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return
    _allocator_tuned = True
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_top_pad, m_mmap_max, m_arena_max = -1, -2, -4, -8
    libc.mallopt(m_arena_max, 1)
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 1 << 30)
    libc.mallopt(m_top_pad, 64 << 20)
