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

// One-shot all-reduce of decode-sized messages over peer-to-peer memory (tensor
// parallelism; vLLM's custom all-reduce, without multicast). Every rank runs this kernel
// on its own values at the same point of its step. Each block takes one slice: it copies
// its rank's values into the rank's exchange buffer, meets the other ranks' same block at a
// barrier of flags written into each other's memory, sums every rank's exchange buffer in
// rank order (the same bits on every rank) into its values, and meets them again, so no
// rank writes its exchange buffer (next call) while another still reads it.
//
// table (device memory, u64 addresses): [ranks exchange buffers, ranks flag arrays]. A
// rank's flag array: [AR_MAX_BLOCKS][2 phases][AR_MAX_RANKS] written by the ranks, then
// [AR_MAX_BLOCKS] of its own epoch (how many calls each block has finished). All start at zero.
#define AR_MAX_RANKS 8
#define AR_MAX_BLOCKS 16
#define AR_THREADS 512

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ float ld_relaxed_sys(const float* p) {
    float v;
    asm volatile("ld.relaxed.sys.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Block `b`'s barrier of `phase` at epoch `e`: thread q < ranks tells rank q that this rank
// arrived, then waits until rank q has told this one.
__device__ __forceinline__ void ar_barrier(u32* const* flags, int rank, int ranks, int b,
                                           int phase, u32 e) {
    __syncthreads();
    const int q = threadIdx.x;
    if (q < ranks) {
        const int at = (b * 2 + phase) * AR_MAX_RANKS;
        __threadfence_system();
        st_release_sys(flags[q] + at + rank, e);
        while (ld_acquire_sys(flags[rank] + at + q) != e) {
        }
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(AR_THREADS)
all_reduce_oneshot(float* x, const unsigned long long* table, int rank, int ranks, int n) {
    pdl_enter();
    float* const* exch = (float* const*)table;
    u32* const* flags = (u32* const*)(table + ranks);
    const int b = blockIdx.x, nb = gridDim.x;
    u32* epoch_at = flags[rank] + AR_MAX_BLOCKS * 2 * AR_MAX_RANKS + b;
    const u32 e = *epoch_at + 1;
    const int per = (n + nb - 1) / nb;
    const int lo = b * per, hi = min(n, lo + per);
    float* own = exch[rank];
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) own[i] = x[i];
    ar_barrier(flags, rank, ranks, b, 0, e);
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float s = ld_relaxed_sys(exch[0] + i);
        for (int q = 1; q < ranks; q++) s += ld_relaxed_sys(exch[q] + i);
        x[i] = s;
    }
    ar_barrier(flags, rank, ranks, b, 1, e);
    if (threadIdx.x == 0) *epoch_at = e;
}
