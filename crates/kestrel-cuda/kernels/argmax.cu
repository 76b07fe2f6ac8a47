// out[r] = the index of the largest value of row r (lowest index among ties; NaN never
// wins; 0 when the whole row is NaN): greedy sampling without reading logits back.
// One block of ARGMAX_THREADS per row.
#define ARGMAX_THREADS 256
#define ARGMAX_NONE 0xffffffffu
__device__ __forceinline__ void argmax_merge(float& v, u32& i, float ov, u32 oi) {
    if (oi == ARGMAX_NONE) return;
    if (i == ARGMAX_NONE || ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}
// Every thread's (v, i) merged across the block (argmax_merge: a total order, so the order
// of merging does not matter); every thread gets the result. sv / si: shared arrays of
// blockDim.x / 32 entries.
__device__ __forceinline__ void block_argmax(float& v, u32& i, float* sv, u32* si) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const u32 oi = __shfl_xor_sync(0xffffffffu, i, o);
        argmax_merge(v, i, ov, oi);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) argmax_merge(v, i, sv[w], si[w]);
}

// The block's (largest value, its lowest index) of `width` values at `row` (ARGMAX_NONE
// when all are NaN), in every thread.
__device__ __forceinline__ void row_argmax(const float* row, int width, float& v, u32& idx) {
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ u32 si[ARGMAX_THREADS / 32];
    v = NEG_INF;
    idx = ARGMAX_NONE;
    for (int j = threadIdx.x; j < width; j += ARGMAX_THREADS) {
        const float y = row[j];
        // Ascending j per thread: a later equal value never replaces an earlier one.
        if (y == y && (idx == ARGMAX_NONE || y > v)) {
            v = y;
            idx = (u32)j;
        }
    }
    block_argmax(v, idx, sv, si);
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_rows(const float* x, u32* out, int cols) {
    pdl_enter();
    float v;
    u32 idx;
    row_argmax(x + (size_t)blockIdx.x * cols, cols, v, idx);
    if (threadIdx.x == 0) out[blockIdx.x] = idx == ARGMAX_NONE ? 0u : idx;
}

// The greedy id of rows whose vocabulary is split into shares (tensor parallelism's LM
// head: each GPU holds a share's logits). argmax_share: best[2r] = the largest of row r's
// `width` values (rows `pitch` apart), best[2r + 1] = its index plus `base` (ARGMAX_NONE
// when every value is NaN), as argmax_rows picks it. argmax_shares: out[r] = the best of
// `shares` such pairs (share q's at best[2 (q n + r)], as an all-gather of the shares'
// pairs lays them out), merged by argmax_merge, so the id equals argmax_rows' over the
// whole row. One block per row; argmax_shares takes one warp.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_share(const float* x, float* best, int pitch, int width, u32 base) {
    pdl_enter();
    float v;
    u32 idx;
    row_argmax(x + (size_t)blockIdx.x * pitch, width, v, idx);
    if (threadIdx.x == 0) {
        best[2 * blockIdx.x] = v;
        reinterpret_cast<u32*>(best)[2 * blockIdx.x + 1] = idx == ARGMAX_NONE ? idx : base + idx;
    }
}

extern "C" __global__ void __launch_bounds__(32)
argmax_shares(const float* best, u32* out, int n, int shares) {
    pdl_enter();
    const u32* ids = reinterpret_cast<const u32*>(best);
    float v = NEG_INF;
    u32 idx = ARGMAX_NONE;
    for (int q = threadIdx.x; q < shares; q += 32) {
        const size_t at = 2 * ((size_t)q * n + blockIdx.x);
        argmax_merge(v, idx, best[at], ids[at + 1]);
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const u32 oi = __shfl_xor_sync(0xffffffffu, idx, o);
        argmax_merge(v, idx, ov, oi);
    }
    if (threadIdx.x == 0) out[blockIdx.x] = idx == ARGMAX_NONE ? 0u : idx;
}
