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
// all-reduce, without multicast). Every rank runs this kernel on its own values at the same
// point of its step, with the same grid. Each block takes one slice: it copies its rank's
// values into its rank's exchange buffer, meets the other ranks' same block at a barrier of
// flags written into each other's memory, then sums every rank's values in rank order (the
// same bits on every rank; its own from x) into x. The exchange buffers are double: call e
// writes half e & 1, so a rank writing its buffer for call e + 1 cannot disturb a peer still
// reading call e's, and one barrier a call suffices (a rank reaches call e + 2's write only
// after call e + 1's barrier, which every peer passes only once done with call e).
//
// table (device memory, u64 addresses): [ranks exchange buffers of 2 × cap values, ranks
// flag arrays]. A rank's flag array: [AR_MAX_BLOCKS][AR_MAX_RANKS] the epochs the ranks
// reached (written by them), then [AR_MAX_BLOCKS] its own epoch (how many calls each block
// has finished). All start at zero. A barrier not met within 20 s traps (a peer that never
// came: an error rather than a hang).
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

// Block `b`'s barrier at epoch `e`: thread q < ranks tells rank q that this rank arrived,
// then waits until rank q has arrived too (at e or, already, later).
__device__ __forceinline__ void ar_barrier(u32* const* flags, int rank, int ranks, int b, u32 e) {
    __syncthreads();
    const int q = threadIdx.x;
    if (q < ranks) {
        const int at = b * AR_MAX_RANKS;
        __threadfence_system();
        st_release_sys(flags[q] + at + rank, e);
        const unsigned long long start = global_ns();
        while ((int)(ld_acquire_sys(flags[rank] + at + q) - e) < 0) {
            if (global_ns() - start > 20000000000ull) __trap();
        }
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(AR_THREADS)
all_reduce_oneshot(float* x, const unsigned long long* table, int rank, int ranks, int n,
                   int cap) {
    pdl_enter();
    float* const* exch = (float* const*)table;
    u32* const* flags = (u32* const*)(table + ranks);
    const int b = blockIdx.x, nb = gridDim.x;
    u32* epoch_at = flags[rank] + AR_MAX_BLOCKS * AR_MAX_RANKS + b;
    const u32 e = *epoch_at + 1;
    const long long half = (long long)(e & 1) * cap;
    // This block's slice, in whole groups of 4 values (x and the buffers are 16-byte aligned).
    const int quads = (n + 3) / 4, per = (quads + nb - 1) / nb;
    const int lo = min(n, b * per * 4), hi = min(n, (b + 1) * per * 4);
    float* own = exch[rank] + half;
    for (int i = lo + 4 * threadIdx.x; i < hi; i += 4 * AR_THREADS) {
        if (i + 4 <= hi) {
            *(float4*)(own + i) = *(const float4*)(x + i);
        } else {
            for (int j = i; j < hi; j++) own[j] = x[j];
        }
    }
    ar_barrier(flags, rank, ranks, b, e);
    for (int i = lo + 4 * threadIdx.x; i < hi; i += 4 * AR_THREADS) {
        if (i + 4 <= hi) {
            float4 s = rank == 0 ? *(const float4*)(x + i) : ld_relaxed_sys4(exch[0] + half + i);
            for (int q = 1; q < ranks; q++) {
                const float4 v =
                    q == rank ? *(const float4*)(x + i) : ld_relaxed_sys4(exch[q] + half + i);
                s.x += v.x;
                s.y += v.y;
                s.z += v.z;
                s.w += v.w;
            }
            *(float4*)(x + i) = s;
        } else {
            for (int j = i; j < hi; j++) {
                float s = rank == 0 ? x[j] : ld_relaxed_sys(exch[0] + half + j);
                for (int q = 1; q < ranks; q++)
                    s += q == rank ? x[j] : ld_relaxed_sys(exch[q] + half + j);
                x[j] = s;
            }
        }
    }
    if (threadIdx.x == 0) *epoch_at = e;
}
