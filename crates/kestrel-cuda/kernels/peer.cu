// Kernels over other GPUs' memory (reached through peer access, or the same GPU's):
// tensor parallelism's one-shot all-reduce and the layer split's copies between stages.

// n values from src (this GPU) to dst (this GPU or a peer's, written over NVLink): the
// layer split's activations at a stage boundary. A kernel rather than a memory copy, so
// that it is captured in the step's graph like the others (a copy between devices is not).
extern "C" __global__ void __launch_bounds__(256)
copy_peer(const float* src, float* dst, long long n) {
    pdl_enter();
    const long long stride = (long long)gridDim.x * 256;
    const long long n4 = n / 4;
    const float4* s4 = (const float4*)src;
    float4* d4 = (float4*)dst;
    for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < n4; i += stride) d4[i] = s4[i];
    for (long long i = n4 * 4 + (long long)blockIdx.x * 256 + threadIdx.x; i < n; i += stride)
        dst[i] = src[i];
}

// One-shot all-reduce over peer-to-peer memory (tensor parallelism; vLLM's custom
// all-reduce without multicast, in push mode). Every rank runs the kernel on its own values
// at the same point of its step, with the same grid. Each block takes one slice of the
// message and stores it straight into every peer's exchange buffer over NVLink (its rank's
// slot there), then raises its flag in each peer's memory (release at system scope); a
// block then waits on its own GPU's flags until every rank's slice has arrived and sums the
// slots locally, in rank order (the same bits on every rank, and NCCL's with two ranks).
// NVLink is crossed once, by posted stores, where a pull (store locally, meet, read the
// peers' buffers) waits for the round trips of remote reads.
//
// table (device memory, u64 addresses): [ranks exchange buffers, ranks flag arrays]. A
// rank's exchange buffer holds 2 halves of `ranks` slots of `cap` values: call e writes half
// e & 1, so a rank writing call e + 2's values cannot disturb a peer still reading call
// e's (it starts call e + 2 only once its call e + 1 kernel has seen every peer's call e + 1
// values, which each peer sends only after its call e kernel has finished). A rank's flag
// array: [AR_MAX_RANKS][AR_MAX_BLOCKS] the epochs at which the ranks' blocks delivered,
// then its call counter and a count of finished blocks. Every block of a call reads the
// counter before it delivers; the last block to finish advances it (no block can finish
// before every block has delivered, so before every block has read it). All start at
// zero. A wait not met within 20 s traps (a peer that never came: an error, not a hang).
#define AR_MAX_RANKS 8
#define AR_MAX_BLOCKS 64
#define AR_THREADS 512

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ float4 ld_relaxed_sys4(const float* p) {
    float4 v;
    asm volatile("ld.relaxed.sys.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

__device__ __forceinline__ float ld_relaxed_sys(const float* p) {
    float v;
    asm volatile("ld.relaxed.sys.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// This rank's view of a call: its exchange buffer's half for the call (slot q of rank q's
// values at q * cap), its flags, the epoch.
struct ArCall {
    float* const* exch;
    u32* const* flags;
    float* mine;  // this rank's half for this call (slot 0)
    u32* my_flags;
    u32 e;
    long long half;  // offset of the call's half in every rank's buffer
};

__device__ __forceinline__ ArCall ar_begin(const unsigned long long* table, int rank, int ranks,
                                           int cap) {
    ArCall c;
    c.exch = (float* const*)table;
    c.flags = (u32* const*)(table + ranks);
    c.my_flags = c.flags[rank];
    c.e = *(volatile u32*)(c.my_flags + AR_MAX_RANKS * AR_MAX_BLOCKS) + 1;
    c.half = (long long)(c.e & 1) * ranks * cap;
    c.mine = c.exch[rank] + c.half;
    return c;
}

// Block b's slice of n values [lo, hi), whole groups of 4 (x and the buffers are 16-byte
// aligned).
__device__ __forceinline__ void ar_slice(long long n, int b, int nb, long long& lo, long long& hi) {
    const long long quads = (n + 3) / 4, per = (quads + nb - 1) / nb;
    lo = min(n, (long long)b * per * 4);
    hi = min(n, (long long)(b + 1) * per * 4);
}

// Stores this block's slice of x into rank q's slot `rank` of every rank q (this rank's own
// slot too when `self_too`), then raises the block's flag on every rank.
__device__ __forceinline__ void ar_deliver(const ArCall& c, const float* x, int rank, int ranks,
                                           int cap, long long lo, long long hi, bool self_too) {
    const long long at = c.half + (long long)rank * cap;
    for (long long i = lo + 4 * threadIdx.x; i < hi; i += 4 * AR_THREADS) {
        if (i + 4 <= hi) {
            const float4 v = *(const float4*)(x + i);
            for (int q = 0; q < ranks; q++)
                if (q != rank || self_too) *(float4*)(c.exch[q] + at + i) = v;
        } else {
            for (long long j = i; j < hi; j++)
                for (int q = 0; q < ranks; q++)
                    if (q != rank || self_too) c.exch[q][at + j] = x[j];
        }
    }
    __syncthreads();
    const int q = threadIdx.x;
    if (q < ranks && (q != rank || self_too)) {
        __threadfence_system();
        st_release_sys(c.flags[q] + rank * AR_MAX_BLOCKS + blockIdx.x, c.e);
    }
}

// Waits until blocks [b0, b0 + count) of every rank (but this one unless `self_too`) have
// delivered this call's values here.
__device__ __forceinline__ void ar_wait(const ArCall& c, int rank, int ranks, int b0, int count,
                                        bool self_too) {
    for (int i = threadIdx.x; i < ranks * count; i += blockDim.x) {
        const int q = i / count, bb = b0 + i % count;
        if (q == rank && !self_too) continue;
        const u32* f = c.my_flags + q * AR_MAX_BLOCKS + bb;
        const unsigned long long start = global_ns();
        while ((int)(ld_acquire_sys(f) - c.e) < 0) {
            if (global_ns() - start > 20000000000ull) __trap();
        }
    }
    __syncthreads();
}

// The last block of the call to get here advances the call counter.
__device__ __forceinline__ void ar_end(const ArCall& c) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* counter = c.my_flags + AR_MAX_RANKS * AR_MAX_BLOCKS;
        __threadfence();
        if (atomicAdd(counter + 1, 1u) == gridDim.x - 1) {
            counter[1] = 0;
            counter[0] = c.e;
            __threadfence();
        }
    }
}

// x (n values) = Σ over the ranks of their x, in place.
extern "C" __global__ void __launch_bounds__(AR_THREADS)
all_reduce_oneshot(float* x, const unsigned long long* table, int rank, int ranks, int n,
                   int cap) {
    pdl_enter();
    const ArCall c = ar_begin(table, rank, ranks, cap);
    long long lo, hi;
    ar_slice(n, blockIdx.x, gridDim.x, lo, hi);
    ar_deliver(c, x, rank, ranks, cap, lo, hi, false);
    ar_wait(c, rank, ranks, blockIdx.x, 1, false);
    for (long long i = lo + 4 * threadIdx.x; i < hi; i += 4 * AR_THREADS) {
        if (i + 4 <= hi) {
            float4 s = rank == 0 ? *(const float4*)(x + i) : ld_relaxed_sys4(c.mine + i);
            for (int q = 1; q < ranks; q++) {
                const float4 v = q == rank ? *(const float4*)(x + i)
                                           : ld_relaxed_sys4(c.mine + (long long)q * cap + i);
                s.x += v.x;
                s.y += v.y;
                s.z += v.z;
                s.w += v.w;
            }
            *(float4*)(x + i) = s;
        } else {
            for (long long j = i; j < hi; j++) {
                float s = rank == 0 ? x[j] : ld_relaxed_sys(c.mine + j);
                for (int q = 1; q < ranks; q++)
                    s += q == rank ? x[j] : ld_relaxed_sys(c.mine + (long long)q * cap + j);
                x[j] = s;
            }
        }
    }
    ar_end(c);
}

// Value j of the sums: every rank's slot here, in rank order.
__device__ __forceinline__ float ar_sum1(const float* mine, int ranks, int cap, long long j) {
    float s = ld_relaxed_sys(mine + j);
    for (int q = 1; q < ranks; q++) s += ld_relaxed_sys(mine + (long long)q * cap + j);
    return s;
}

// Values j .. j + 3 of the sums (j a multiple of 4).
__device__ __forceinline__ float4 ar_sum4(const float* mine, int ranks, int cap, long long j) {
    float4 s = ld_relaxed_sys4(mine + j);
    for (int q = 1; q < ranks; q++) {
        const float4 v = ld_relaxed_sys4(mine + (long long)q * cap + j);
        s.x += v.x;
        s.y += v.y;
        s.z += v.z;
        s.w += v.w;
    }
    return s;
}

// Σ of the squares of a row's sums (cols a multiple of 4, the row 16-byte aligned), AR_RUN
// groups of 4 a thread at a time: each rank's loads of a run are issued together, one
// round trip to L2 a rank instead of one a group.
#define AR_RUN 4
__device__ __forceinline__ float ar_row_squares4(const float* mine, int ranks, int cap,
                                                 long long rb, int cols) {
    float ss = 0.0f;
    for (int j0 = 4 * threadIdx.x; j0 < cols; j0 += 4 * AR_THREADS * AR_RUN) {
        float4 s[AR_RUN];
#pragma unroll
        for (int k = 0; k < AR_RUN; k++) {
            const int j = j0 + k * 4 * AR_THREADS;
            s[k] = j < cols ? ld_relaxed_sys4(mine + rb + j) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        for (int q = 1; q < ranks; q++) {
            float4 v[AR_RUN];
#pragma unroll
            for (int k = 0; k < AR_RUN; k++) {
                const int j = j0 + k * 4 * AR_THREADS;
                v[k] = j < cols ? ld_relaxed_sys4(mine + (long long)q * cap + rb + j)
                                : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < AR_RUN; k++) {
                s[k].x += v[k].x;
                s[k].y += v[k].y;
                s[k].z += v[k].z;
                s[k].w += v[k].w;
            }
        }
#pragma unroll
        for (int k = 0; k < AR_RUN; k++)
            ss += s[k].x * s[k].x + s[k].y * s[k].y + s[k].z * s[k].z + s[k].w * s[k].w;
    }
    return ss;
}

extern "C" __global__ void __launch_bounds__(AR_THREADS)
all_reduce_norm(float* x, const unsigned long long* table, int rank, int ranks, int rows,
                int cols, int cap, const float* w, float eps, float* out, int mode, u16* h,
                i8* q8, float* q8d, int chunks) {
    pdl_enter();
    const ArCall c = ar_begin(table, rank, ranks, cap);
    const long long n = (long long)rows * cols;
    long long lo, hi;
    ar_slice(n, blockIdx.x, gridDim.x, lo, hi);
    ar_deliver(c, x, rank, ranks, cap, lo, hi, true);
    ar_wait(c, rank, ranks, 0, gridDim.x, true);
    if (mode == 0) {
        for (long long i = lo + 4 * threadIdx.x; i < hi; i += 4 * AR_THREADS) {
            if (i + 4 <= hi) {
                *(float4*)(x + i) = ar_sum4(c.mine, ranks, cap, i);
            } else {
                for (long long j = i; j < hi; j++) x[j] = ar_sum1(c.mine, ranks, cap, j);
            }
        }
        ar_end(c);
        return;
    }
    const int width = ((cols + chunks - 1) / chunks + 31) / 32 * 32;
    const bool quads = (cols & 3) == 0;
    for (int u = blockIdx.x; u < rows * chunks; u += gridDim.x) {
        const int row = u / chunks, part = u - row * chunks;
        const long long rb = (long long)row * cols;
        float ss = 0.0f;
        if (quads) {
            ss = ar_row_squares4(c.mine, ranks, cap, rb, cols);
        } else {
            for (int j = threadIdx.x; j < cols; j += AR_THREADS) {
                const float s = ar_sum1(c.mine, ranks, cap, rb + j);
                ss += s * s;
            }
        }
        ss = block_sum(ss);
        const float scale = 1.0f / sqrtf(ss / (float)cols + eps);
        const int j_lo = part * width, j_hi = min(cols, j_lo + width);
        if (quads && mode != 3) {
            // 4 values a thread (the chunk's bounds are multiples of 4).
            for (int j = j_lo + 4 * threadIdx.x; j < j_hi; j += 4 * AR_THREADS) {
                const float4 s = ar_sum4(c.mine, ranks, cap, rb + j);
                const float4 g = *(const float4*)(w + j);
                const float4 v = make_float4(s.x * scale * g.x, s.y * scale * g.y,
                                             s.z * scale * g.z, s.w * scale * g.w);
                *(float4*)(x + rb + j) = s;
                *(float4*)(out + rb + j) = v;
                if (mode == 2) {
                    const uint2 hv = make_uint2((u32)f2h(v.x) | ((u32)f2h(v.y) << 16),
                                                (u32)f2h(v.z) | ((u32)f2h(v.w) << 16));
                    *(uint2*)(h + rb + j) = hv;
                }
            }
            continue;
        }
        for (int base = j_lo; base < j_hi; base += AR_THREADS) {
            const int j = base + threadIdx.x;
            const bool on = j < j_hi;
            const float s = on ? ar_sum1(c.mine, ranks, cap, rb + j) : 0.0f;
            const float v = on ? s * scale * w[j] : 0.0f;
            if (on) {
                x[rb + j] = s;
                out[rb + j] = v;
                if (mode == 2) h[rb + j] = f2h(v);
            }
            if (mode == 3) {
                // Whole warps: chunks and rows are whole 32-value blocks.
                float step;
                const int qi = warp_q8(v, step);
                if (on) {
                    q8[rb + j] = (i8)qi;
                    if ((threadIdx.x & 31) == 0) q8d[(rb + j) >> 5] = step;
                }
            }
        }
    }
    ar_end(c);
}
