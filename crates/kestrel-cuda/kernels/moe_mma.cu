// Mixture-of-experts blocks of multi-token steps on the tensor cores (src/moe_mma.rs): the
// (token, slot) pairs `moe_route` chose, grouped by expert on the device, then per expert
// the staged int8 products of mmq.cu's `mms_*` (MsRows: weights and activations through
// shared memory by cp.async, Q4_K / Q6_K super-blocks multiplied with int8 mma) over its
// rows of the stacked `ffn_*_exps` matrices, for the tokens routed to it.
//
//   moe_mma_group     pos[p] (pair -> place), order[q] (place -> pair, -1: padding) and the
//                     tiles (expert, first place, count) of up to T places each; each
//                     expert's run of places starts at a multiple of T (T: the tile's tokens)
//   moe_mma_quantize  the places' inputs gathered (order) and quantized as quantize_x_mmk
//                     does (per 256 values, one step a token), or a matrix's rows as they are
//   moe_mms_gate_up_* act(gate · x) * (up · x) of a tile's places, one expert's rows
//   moe_mms_down_*    wts[pair] · (down · a) of a tile's places
// then moe_combine (moe.cu) adds each token's k weighted outputs in slot order.
//
// Every grid is sized for the worst case of the step's size (tiles past the count exit),
// so the launches record and replay as graphs; nothing goes through the host. A token's
// result does not depend on the rest of the step: its activations are quantized on their
// own, its mma column is its own, and a row's steps are summed in an order fixed by the
// row tile (ms_rows's rotation by blockIdx.x, the row tile here).

// Groups the np pairs by expert (one block): places of expert e are [start_e, start_e +
// cnt_e), start_e a multiple of T; pos[p], order[q] (q < cap; -1 where no pair), info[0] =
// the tiles, info[1] = the places used (the last run's end), then (e, first, count) of each
// tile, expert by expert.
extern "C" __global__ void __launch_bounds__(1024) moe_mma_group(const int* ids, int np,
                                                                 int n_expert, int T, int cap,
                                                                 int* pos, int* order,
                                                                 int* info) {
    pdl_enter();
    __shared__ int cnt[MOE_MAX_EXPERT], start[MOE_MAX_EXPERT], tstart[MOE_MAX_EXPERT];
    __shared__ int fill[MOE_MAX_EXPERT];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) { cnt[e] = 0; fill[e] = 0; }
    for (int q = threadIdx.x; q < cap; q += blockDim.x) order[q] = -1;
    __syncthreads();
    for (int p = threadIdx.x; p < np; p += blockDim.x) atomicAdd(&cnt[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0, ts = 0;
        for (int e = 0; e < n_expert; e++) {
            const int nt = (cnt[e] + T - 1) / T;
            start[e] = s;
            tstart[e] = ts;
            s += nt * T;
            ts += nt;
        }
        info[0] = ts;
        info[1] = s;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        const int e = ids[p];
        const int at = start[e] + atomicAdd(&fill[e], 1);
        pos[p] = at;
        order[at] = p;
    }
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        const int nt = (cnt[e] + T - 1) / T;
        for (int i = 0; i < nt; i++) {
            int* tl = info + 2 + 3 * (tstart[e] + i);
            tl[0] = e;
            tl[1] = start[e] + i * T;
            tl[2] = min(T, cnt[e] - i * T);
        }
    }
}

// Place q's values (x row order[q] / k, or zero for padding; without order: x row q) as
// quantize_x_mmk leaves them for npad rows. Block (place q, 256-value block kb) of 256
// threads; places past info[1] exit (the grid covers the worst case).
extern "C" __global__ void __launch_bounds__(256) moe_mma_quantize(const float* x, int cols,
                                                                   int k, const int* order,
                                                                   const int* info, int npad,
                                                                   i8* q, float* xk, i8* xb) {
    pdl_enter();
    const int r = blockIdx.x, kb = blockIdx.y;
    if (r >= info[1]) return;
    const int src = order ? order[r] : r;
    const int c = kb * 256 + threadIdx.x;
    const float v = src < 0 ? 0.0f : x[(size_t)(order ? src / k : src) * cols + c];
    mmk_store_q8(v, q + (size_t)r * cols + c, xk, xb, kb, r, npad);
}

// One tile's product over one block of rows (block (row tile, tile)): the tile's places
// q0 .. q0 + count of expert e against rows r of W_e (rows of `rows`, k values each; UP:
// gate and up, 32 rows a block, act(gate) * up into out[q][r]; else 64 rows a block,
// wts[order[q]] · (W_e[r] · x_q) into out[q][r]). The tile's 8J places are read whole
// (places past its count are its run's padding: their columns are dropped).
template <int J, bool UP>
__device__ __forceinline__ void moe_mms_body(const i8* xq, const float* xk, const i8* xb,
                                             int npad, const int* info, int k, int rows,
                                             const u8* w0, long long rb0, int ty,
                                             const u8* w1, long long rb1, int act,
                                             const int* order, const float* wts, float* out,
                                             u8* sx) {
    constexpr int TILE_ROWS = UP ? MH_ROWS / 2 : MH_ROWS, JW = J / MS_TS;
    const int ti = blockIdx.y;
    if (ti >= info[0]) return;  // the whole block
    const int* tl = info + 2 + 3 * ti;
    const long long e = tl[0];
    const int q0 = tl[1], cnt = tl[2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int rg = warp % MH_WARPS, th = warp / MH_WARPS;
    const int up = UP ? rg / (MH_WARPS / 2) : 0, wr = UP ? rg % (MH_WARPS / 2) : rg;
    const int r0 = blockIdx.x * TILE_ROWS + 16 * wr;
    const long long rbytes = up ? rb1 : rb0;
    const u8* w = (up ? w1 : w0) + e * rows * rbytes;
    // Rows past the matrix's end read its last row; their results are dropped.
    const int ra = min(r0 + g, rows - 1), rb = min(r0 + g + 8, rows - 1);
    const u8* rw[2] = {w + (size_t)ra * rbytes, w + (size_t)rb * rbytes};
    float acc[JW][4];
#pragma unroll
    for (int j = 0; j < JW; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.0f;
    MsRows<J>{xq + (size_t)q0 * k, xk + q0, xb + (size_t)q0 * 32, k, npad}(
        ty, WarpRows{rw, w, rbytes, r0, rows}, th, 0, k >> 8, sx, acc);
    const int tok0 = 8 * JW * th;
    if (!UP) {
#pragma unroll
        for (int j = 0; j < JW; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = r0 + g + (i >= 2 ? 8 : 0);
                const int tok = tok0 + 8 * j + 2 * (lane & 3) + (i & 1);
                if (r < rows && tok < cnt) {
                    const int q = q0 + tok;
                    out[(size_t)q * rows + r] = __fmul_rn(acc[j][i], wts[order[q]]);
                }
            }
        return;
    }
    // Up's warps hand their sums to gate's through shared memory (the stage is free).
    float(*ex)[JW * 4][32] = reinterpret_cast<float(*)[JW * 4][32]>(sx);
    const int slot = th * (MH_WARPS / 2) + wr;
    __syncthreads();
    if (up) {
#pragma unroll
        for (int j = 0; j < JW; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) ex[slot][4 * j + i][lane] = acc[j][i];
    }
    __syncthreads();
    if (up) return;
    float acc_up[JW][4];
#pragma unroll
    for (int j = 0; j < JW; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc_up[j][i] = ex[slot][4 * j + i][lane];
    GvRows t;
    t.rows = rows;
    mq_store<JW, true>(acc, acc_up, t, r0, cnt, act, out + (size_t)q0 * rows, rows, tok0);
}

// Gate/up: grid (ceil(ff / 32), worst-case tiles); dynamic shared memory as mms_t16 / t32.
#define MOE_MMS_GATE_UP(NAME, J)                                                               \
    extern "C" __global__ void __launch_bounds__(MS_THREADS, J > 4 ? 2 : 3)                    \
        NAME(const i8* xq, const float* xk, const i8* xb, int npad, const int* info, int d,     \
             int ff, const u8* wg, long long rbg, const u8* wu, long long rbu, int ty, int act, \
             float* a) {                                                                       \
        extern __shared__ __align__(16) u8 ms_smem[];                                          \
        pdl_enter();                                                                           \
        moe_mms_body<J, true>(xq, xk, xb, npad, info, d, ff, wg, rbg, ty, wu, rbu, act,        \
                              nullptr, nullptr, a, ms_smem);                                   \
    }
// Down: grid (ceil(d / 64), worst-case tiles).
#define MOE_MMS_DOWN(NAME, J)                                                                  \
    extern "C" __global__ void __launch_bounds__(MS_THREADS, J > 4 ? 2 : 3)                    \
        NAME(const i8* aq, const float* ak, const i8* ab, int npad, const int* info, int ff,    \
             int d, const u8* wd, long long rbd, int ty, const int* order, const float* wts,   \
             float* ys) {                                                                      \
        extern __shared__ __align__(16) u8 ms_smem[];                                          \
        pdl_enter();                                                                           \
        moe_mms_body<J, false>(aq, ak, ab, npad, info, ff, d, wd, rbd, ty, nullptr, 0, 0,      \
                               order, wts, ys, ms_smem);                                       \
    }
MOE_MMS_GATE_UP(moe_mms_gate_up_t16, 2)
MOE_MMS_GATE_UP(moe_mms_gate_up_t32, 4)
MOE_MMS_DOWN(moe_mms_down_t16, 2)
MOE_MMS_DOWN(moe_mms_down_t32, 4)
