#!/usr/bin/env python3
"""Memory bandwidth by a simple copy (numpy releases the GIL, so T threads copy T
separate 256 MiB buffers at once). Prints the best of 5 in GB/s, counting the bytes
read plus the bytes written, and the read rate alone (half of it)."""
import sys
import threading
import time

import numpy as np

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
n = 256 * 1024 * 1024 // 4
src = [np.ones(n, dtype=np.float32) for _ in range(threads)]
dst = [np.zeros(n, dtype=np.float32) for _ in range(threads)]
best = 0.0
for _ in range(5):
    ts = [threading.Thread(target=np.copyto, args=(dst[i], src[i])) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    best = max(best, 2 * threads * n * 4 / dt / 1e9)
print(f"{threads} threads: copy {best:.1f} GB/s (read+write), read share {best / 2:.1f} GB/s")
