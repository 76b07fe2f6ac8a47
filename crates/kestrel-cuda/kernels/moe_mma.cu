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

// ---------------------------------------------------------------------------------------
// Experts in 32-value block formats (Q8_0, Q4_0, IQ4_NL, MXFP4: gpt-oss's experts as
// published), with gpt-oss's epilogue: the same grouping (moe_mma_group), the places'
// inputs quantized per 32 values as ggml's Q8_0 (`moe_mma_quantize32`, mmq's layout), then
// per tile of one expert's places mmq's int8 block products (m16n8k32 per 32-value block,
// its integer sums scaled into f32 by the weight's and the token's block scales; MXFP4's
// e2m1 levels doubled are the integers -12..12 and its E8M0 scale a power of two, so each
// block's product is exact): gate and up with their biases and the (clamped) activation
// (`moe_mq_gate_up_*`), the activations quantized again, down plus its bias times the
// pair's routing weight (`moe_mq_down_*`), then moe_combine.

// Place q's values (as moe_mma_quantize) rounded as ggml's quantize_row_q8_0 (127 / amax,
// nearest even, the scale kept as its f16) into mmq's layout for npad rows: xq[q][c] and
// xds[kb][q] = {d, d·Σq}. Block (place, 8 blocks of 32) of 256 threads, a warp a block.
extern "C" __global__ void __launch_bounds__(256) moe_mma_quantize32(const float* x, int cols,
                                                                     int k, const int* order,
                                                                     const int* info, int npad,
                                                                     i8* q, float* xds) {
    pdl_enter();
    const int r = blockIdx.x, kb = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= info[1] || kb >= cols / 32) return;  // whole warps
    const int src = order ? order[r] : r;
    const int c = kb * 32 + lane;
    const float v = src < 0 ? 0.0f : x[(size_t)(order ? src / k : src) * cols + c];
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    const int qi = max(-127, min(127, __float2int_rn(__fmul_rn(v, id))));
    int s = qi;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    q[(size_t)r * cols + c] = (i8)qi;
    if (lane == 0) {
        const float d = h2f(f2h(__fdiv_rn(amax, 127.0f)));
        xds[2 * ((size_t)kb * npad + r)] = d;
        xds[2 * ((size_t)kb * npad + r) + 1] = d * (float)s;
    }
}

// MXFP4 (MX) and IQ4_NL rows as the GPU stores them (16 quant bytes a block, then the
// scales: one E8M0 byte / an f16 a block): MqBlocks32's Q4_0 walk, each lane's nibbles
// (low for c < 2, else high, of bytes 8 (c & 1) ..) turned into their int8 levels by lut16;
// no offset.
template <bool MX> struct MqCode32 {
    template <int J, bool UP>
    static __device__ __forceinline__ void step(const u8* const (&rw)[4], int st, int nt, int kbs,
                                                const MqX& x, float (&acc)[J][4],
                                                float (&acc_up)[J][4]) {
        constexpr int NR = UP ? 4 : 2;
        const int off = 8 * (x.c & 1);
        const bool high = x.c >= 2;
        const u32 t0 = MX ? MXFP4_T0 : IQ4NL_T0, t1 = MX ? MXFP4_T1 : IQ4NL_T1;
        const u32 t2 = MX ? MXFP4_T2 : IQ4NL_T2, t3 = MX ? MXFP4_T3 : IQ4NL_T3;
        const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int kb0 = st * 8 + 4 * half;
            uint2 q[4][NR];
            float d[4][4];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const int rr = r < NR ? r : 0;
                    const int blk = min(kb0 + i, kbs - 1);
                    if (r < NR) q[i][rr] = *(const uint2*)(rw[rr] + (size_t)blk * 16 + off);
                    d[i][r] = MX ? e8m0_half(rw[rr][(size_t)kbs * 16 + blk])
                                 : h2f(*(const u16*)(rw[rr] + (size_t)kbs * 16 + 2 * blk));
                }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (kb0 + i < kbs) {
                    u32 a[4][2];
#pragma unroll
                    for (int r = 0; r < 4; r++) {
                        const int rr = r < NR ? r : 0;
                        u32 lo, hi;
                        lut16(q[i][rr].x, t0, t1, t2, t3, lo, hi);
                        a[r][0] = high ? hi : lo;
                        lut16(q[i][rr].y, t0, t1, t2, t3, lo, hi);
                        a[r][1] = high ? hi : lo;
                    }
                    mq_block<J, UP>(a, d[i], zero, kb0 + i, nt, x, acc, acc_up);
                }
            }
        }
    }
};

// The tiling of moe_mq_*: a block of MQE_RG row groups of 16 rows (gate/up: the same rows
// of both), MQE_KP warps a group splitting the row length in 256-value steps (warp part p
// takes steps p, p + MQE_KP, ...), their sums added in part order.
#define MQE_RG 4
#define MQE_KP 2
#define MQE_THREADS (MQE_RG * MQE_KP * 32)
#define MQE_ROWS (16 * MQE_RG)

// One tile's product over MQE_ROWS rows (block (row tile, tile)): the tile's places q0 ..
// q0 + count of expert e (UP: out[q][r] = moe_act(gate_e[r] · x_q + bg_e[r], up_e[r] · x_q
// + bu_e[r]); else out[q][r] = (down_e[r] · a_q + bd_e[r]) · wts[order[q]]). The tile's
// 8-token groups past its count are skipped; places past it in the last group are padding
// (zero, their columns dropped).
template <int J, bool UP>
__device__ __forceinline__ void moe_mq_body(const i8* xq, const float* xds, int npad,
                                            const int* info, int k, int rows, const u8* w0,
                                            long long rb0, int ty, const u8* w1, long long rb1,
                                            const float* b0, const float* b1, int act,
                                            float alpha, float limit, const int* order,
                                            const float* wts, float* out) {
    const int ti = blockIdx.y;
    if (ti >= info[0]) return;  // the whole block
    const int* tl = info + 2 + 3 * ti;
    const long long e = tl[0];
    const int q0 = tl[1], cnt = tl[2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int rg = warp % MQE_RG, kp = warp / MQE_RG;
    const int r0 = blockIdx.x * MQE_ROWS + 16 * rg;
    // Rows past the matrix's end read its last row; their results are dropped.
    const int ra = min(r0 + g, rows - 1), rb = min(r0 + g + 8, rows - 1);
    const u8* wa = w0 + e * rows * rb0;
    const u8* wb = UP ? w1 + e * rows * rb1 : wa;
    const u8* rw[4] = {wa + (size_t)ra * rb0, wa + (size_t)rb * rb0,
                       UP ? wb + (size_t)ra * rb1 : nullptr, UP ? wb + (size_t)rb * rb1 : nullptr};
    const MqX xx{xq + (size_t)q0 * k, xds + 2 * (size_t)q0, k, npad, g, c};
    const int nt = (cnt + 7) >> 3;
    float acc[J][4], acc_up[J][4];
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = acc_up[j][i] = 0.0f;
    const int steps = (k + 255) >> 8, kbs = k >> 5;
    for (int st = kp; st < steps; st += MQE_KP) {
        switch (ty) {
        case T_Q8_0: Mq<T_Q8_0>::step<J, UP>(rw, st, nt, kbs, xx, acc, acc_up); break;
        case T_Q4_0: Mq<T_Q4_0>::step<J, UP>(rw, st, nt, kbs, xx, acc, acc_up); break;
        case T_IQ4_NL: MqCode32<false>::step<J, UP>(rw, st, nt, kbs, xx, acc, acc_up); break;
        case T_MXFP4: MqCode32<true>::step<J, UP>(rw, st, nt, kbs, xx, acc, acc_up); break;
        default: break;
        }
    }
    // The parts' sums meet in part 0, added in part order.
    __shared__ float red[MQE_KP - 1][MQE_RG][(UP ? 2 : 1) * J * 4][32];
    if (kp > 0) {
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                red[kp - 1][rg][4 * j + i][lane] = acc[j][i];
                if (UP) red[kp - 1][rg][UP ? 4 * (J + j) + i : 0][lane] = acc_up[j][i];
            }
    }
    __syncthreads();
    if (kp > 0) return;
#pragma unroll
    for (int p = 0; p < MQE_KP - 1; p++)
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                acc[j][i] += red[p][rg][4 * j + i][lane];
                if (UP) acc_up[j][i] += red[p][rg][UP ? 4 * (J + j) + i : 0][lane];
            }
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + g + (i >= 2 ? 8 : 0), tok = 8 * j + 2 * c + (i & 1);
            if (r >= rows || tok >= cnt) continue;
            const int q = q0 + tok;
            const float bias = b0 ? b0[e * rows + r] : 0.0f;
            if (UP) {
                const float bu = b1 ? b1[e * rows + r] : 0.0f;
                out[(size_t)q * rows + r] = moe_act(__fadd_rn(acc[j][i], bias),
                                                    __fadd_rn(acc_up[j][i], bu), act, alpha, limit);
            } else {
                out[(size_t)q * rows + r] = __fmul_rn(__fadd_rn(acc[j][i], bias), wts[order[q]]);
            }
        }
}

// Gate/up: grid (ceil(ff / MQE_ROWS), worst-case tiles).
#define MOE_MQ_GATE_UP(NAME, J)                                                                \
    extern "C" __global__ void __launch_bounds__(MQE_THREADS, J > 2 ? 1 : 2)                   \
        NAME(const i8* xq, const float* xds, int npad, const int* info, int d, int ff,         \
             const u8* wg, long long rbg, const u8* wu, long long rbu, int ty, const float* bg, \
             const float* bu, int act, float alpha, float limit, float* a) {                   \
        pdl_enter();                                                                           \
        moe_mq_body<J, true>(xq, xds, npad, info, d, ff, wg, rbg, ty, wu, rbu, bg, bu, act,    \
                             alpha, limit, nullptr, nullptr, a);                               \
    }
// Down: grid (ceil(d / MQE_ROWS), worst-case tiles).
#define MOE_MQ_DOWN(NAME, J)                                                                   \
    extern "C" __global__ void __launch_bounds__(MQE_THREADS, J > 2 ? 1 : 2)                   \
        NAME(const i8* aq, const float* ads, int npad, const int* info, int ff, int d,         \
             const u8* wd, long long rbd, int ty, const float* bd, const int* order,           \
             const float* wts, float* ys) {                                                    \
        pdl_enter();                                                                           \
        moe_mq_body<J, false>(aq, ads, npad, info, ff, d, wd, rbd, ty, nullptr, 0, bd,         \
                              nullptr, 0, 0.0f, 0.0f, order, wts, ys);                         \
    }
MOE_MQ_GATE_UP(moe_mq_gate_up_t16, 2)
MOE_MQ_GATE_UP(moe_mq_gate_up_t32, 4)
MOE_MQ_DOWN(moe_mq_down_t16, 2)
MOE_MQ_DOWN(moe_mq_down_t32, 4)

// ---------------------------------------------------------------------------------------
// gpt-oss's MXFP4 (and IQ4_NL) experts in prompt-sized steps (`moe_mqs_*`, staged): the
// same grouping with tiles of MQS_TOK places, the same per-32 int8 block products and
// epilogues as moe_mq_*, but each step of 256 values of the block's weight rows (raw
// nibbles and scales) and of its tile's activations (quants and {d, d·Σq}) goes through
// shared memory once, by cp.async, double-buffered, for all 8 warps: warp (wr, wt) takes
// output rows 16 wr .. of both its row groups (gate/up: the same rows of gate and of up;
// down: rows 16 wr .. and 64 + 16 wr ..) against places 32 wt .. 32 wt + 31, 4 tensor-core
// tiles of 8 (moe_mq_* kept one tile of rows per warp, read every weight and activation
// straight from global memory, and ran one 8-warp block an SM: latency-bound). A lane
// takes bytes 4c .. 4c + 3 of each weight block, whose low and high nibbles are values
// 4c .. and 16 + 4c .. (mma's own k order: one lut16 gives both halves of its fragment),
// and the activations of the same k. Sums run over the row's blocks in order, so a
// place's result depends only on its own column.
#define MQS_TOK 64
#define MQS_AROWS 128
#define MQS_AROW 144  // 8 blocks of 16 quant bytes, 16 of padding: conflict-free rows
#define MQS_XROW 272  // 256 activation bytes, 16 of padding: conflict-free 4-byte reads
#define MQS_A_BYTES (MQS_AROWS * MQS_AROW)
#define MQS_AS_BYTES (MQS_AROWS * 16)  // a row's scales of a step: 8 (E8M0) or 16 (f16) bytes
#define MQS_X_BYTES (MQS_TOK * MQS_XROW)
#define MQS_XS_BYTES (8 * MQS_TOK * 8)  // {d, d·Σq} of 8 blocks × the tile's places
#define MQS_STAGE_BYTES (MQS_A_BYTES + MQS_AS_BYTES + MQS_X_BYTES + MQS_XS_BYTES)
#define MQS_SMEM (2 * MQS_STAGE_BYTES)

// c = A·B of one 16×32 tile of weights and one 32×8 tile of activations in mma's own k
// order (a0, a1: k 4c .. 4c + 3 of rows g, g + 8; a2, a3: k 16 + 4c ..; b0, b1: the same k
// of token g), the sums biased by 1.5·2^23 as float bits (the accumulators start at
// 0x4B400000), so that mqs_f32 turns them into f32 with one add instead of an I2F
// (conversions run at 16 a clock an SM, an eighth of the f32 rate): exact for |sum| < 2^22
// (a 32-value block's sum here is at most 32 · 127 · 127).
__device__ __forceinline__ void mqs_mma(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                        u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0x4B400000));
}
__device__ __forceinline__ float mqs_f32(int biased) {
    return __int_as_float(biased) - 12582912.0f;
}

__device__ __forceinline__ void cp_async8(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 8 : 0)
                 : "memory");
}

// Output rows row0 .. of the block (UP: 64 of gate and up; else 128 of down) for the tile's
// places q0 .. q0 + cnt of expert e (places past cnt are the run's zero padding: read,
// their columns dropped; 8-place groups past it skipped).
template <bool MX, bool UP>
__device__ __forceinline__ void moe_mqs_body(const i8* xq, const float* xds, int npad,
                                             const int* info, int k, int rows, const u8* w0,
                                             long long rb0, const u8* w1, long long rb1,
                                             const float* b0, const float* b1, int act,
                                             float alpha, float limit, const int* order,
                                             const float* wts, float* out, u8* smem) {
    const int ti = blockIdx.y;
    if (ti >= info[0]) return;  // the whole block
    const int* tl = info + 2 + 3 * ti;
    const long long e = tl[0];
    const int q0 = tl[1], cnt = tl[2];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int wr = warp & 3, wt = warp >> 2;
    constexpr int OUT_ROWS = UP ? 64 : 128;
    const int row0 = blockIdx.x * OUT_ROWS;
    const int kbs = k >> 5, steps = (kbs + 7) >> 3;
    constexpr int SB = MX ? 1 : 2;  // scale bytes a block

    // The staged weight rows this thread copies: (tid >> 3) + 32 m, its 16-byte chunk
    // tid & 7 of each; threads with chunk < 4 also copy the scales of row m = chunk.
    const int ch = tid & 7;
    const u8* arow[4];
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const int i = (tid >> 3) + 32 * m;
        const bool second = UP && i >= 64;
        const int r = min(row0 + (UP ? (i & 63) : i), rows - 1);
        arow[m] = second ? w1 + (e * rows + r) * rb1 : w0 + (e * rows + r) * rb0;
    }
    const u32 base = smem_u32(smem);
    auto load = [&](int buf, int st) {
        const u32 sa = base + buf * MQS_STAGE_BYTES;
        const u32 sas = sa + MQS_A_BYTES, sx = sas + MQS_AS_BYTES, sxs = sx + MQS_X_BYTES;
        const int kb = st * 8 + ch;
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const int i = (tid >> 3) + 32 * m;
            cp_async16(sa + i * MQS_AROW + ch * 16, arow[m] + (size_t)min(kb, kbs - 1) * 16,
                       kb < kbs);
        }
        if (ch < 4) {
            const int i = (tid >> 3) + 32 * ch;
            const u8* src = arow[0];
#pragma unroll
            for (int m = 1; m < 4; m++)
                if (ch == m) src = arow[m];
            src += (size_t)kbs * 16 + st * 8 * SB;
            if (MX) cp_async8(sas + i * 16, src, true);
            else cp_async16(sas + i * 16, src, true);
        }
        // Activations: place (tid >> 4) + 16 m, 16-byte chunk tid & 15.
        const int xc = tid & 15;
        const bool xok = st * 8 + (xc >> 1) < kbs;
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const int p = (tid >> 4) + 16 * m;
            const i8* src = xq + (size_t)(q0 + p) * k + (xok ? st * 256 + xc * 16 : 0);
            cp_async16(sx + p * MQS_XROW + xc * 16, src, xok);
        }
        // Scales: block tid >> 5 of the step, places 2 (tid & 31) and the next.
        const int xb = st * 8 + (tid >> 5);
        const float* src = xds + 2 * ((size_t)min(xb, kbs - 1) * npad + q0 + 2 * (tid & 31));
        cp_async16(sxs + ((tid >> 5) * MQS_TOK + 2 * (tid & 31)) * 8, src, xb < kbs);
        cp_async_commit();
    };

    float acc[2][4][4];
#pragma unroll
    for (int p = 0; p < 2; p++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[p][j][i] = 0.0f;
    // 8-place groups of the warp's 32 places holding a real place.
    const int nt = min(4, max(0, (cnt - 32 * wt + 7) >> 3));
    const u32 t0 = MX ? MXFP4_T0 : IQ4NL_T0, t1 = MX ? MXFP4_T1 : IQ4NL_T1;
    const u32 t2 = MX ? MXFP4_T2 : IQ4NL_T2, t3 = MX ? MXFP4_T3 : IQ4NL_T3;

    load(0, 0);
    for (int st = 0; st < steps; st++) {
        if (st + 1 < steps) load((st + 1) & 1, st + 1);
        else cp_async_commit();  // an empty group keeps the wait counts uniform
        cp_async_wait_prev();
        __syncthreads();
        const u8* sa = smem + (st & 1) * MQS_STAGE_BYTES;
        const u8* sas = sa + MQS_A_BYTES;
        const u8* sx = sas + MQS_AS_BYTES;
        const float* sxs = reinterpret_cast<const float*>(sx + MQS_X_BYTES);
        const int nkb = min(8, kbs - st * 8);
        if (nt > 0) {
#pragma unroll
            for (int kb = 0; kb < 8; kb++) {
                if (kb >= nkb) break;
                // Bytes 4c .. 4c + 3 of a row's block: low nibbles values 4c .., high ones
                // 16 + 4c .. (the block's layout), mma's k order as they come.
                u32 a[2][2][2];  // [row group][row g, g + 8][k 4c .., 16 + 4c ..]
                float fs[2][2];
#pragma unroll
                for (int p = 0; p < 2; p++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int i = 64 * p + 16 * wr + g + 8 * h;
                        const u32 q = *(const u32*)(sa + i * MQS_AROW + kb * 16 + 4 * c);
                        lut16(q, t0, t1, t2, t3, a[p][h][0], a[p][h][1]);
                        fs[p][h] = MX ? e8m0_half(sas[i * 16 + kb])
                                      : h2f(*(const u16*)(sas + i * 16 + 2 * kb));
                    }
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (j < nt) {
                        const int pl = 32 * wt + 8 * j;
                        const u8* xr = sx + (pl + g) * MQS_XROW + kb * 32 + 4 * c;
                        const u32 b0 = *(const u32*)xr, b1 = *(const u32*)(xr + 16);
                        const float4 ds = *(const float4*)(sxs + 2 * (kb * MQS_TOK + pl + 2 * c));
#pragma unroll
                        for (int p = 0; p < 2; p++) {
                            int cc[4];
                            mqs_mma(cc, a[p][0][0], a[p][1][0], a[p][0][1], a[p][1][1], b0, b1);
                            acc[p][j][0] += fs[p][0] * ds.x * mqs_f32(cc[0]);
                            acc[p][j][1] += fs[p][0] * ds.z * mqs_f32(cc[1]);
                            acc[p][j][2] += fs[p][1] * ds.x * mqs_f32(cc[2]);
                            acc[p][j][3] += fs[p][1] * ds.z * mqs_f32(cc[3]);
                        }
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
    cp_async_wait_all();

#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int tok = 32 * wt + 8 * j + 2 * c + (i & 1);
            if (tok >= cnt) continue;
            const int q = q0 + tok;
            const int rr = 16 * wr + g + (i >= 2 ? 8 : 0);
            if (UP) {
                const int r = row0 + rr;
                if (r >= rows) continue;
                const float bg = b0 ? b0[e * rows + r] : 0.0f;
                const float bu = b1 ? b1[e * rows + r] : 0.0f;
                out[(size_t)q * rows + r] = moe_act(__fadd_rn(acc[0][j][i], bg),
                                                    __fadd_rn(acc[1][j][i], bu), act, alpha, limit);
            } else {
                const float w = wts[order[q]];
#pragma unroll
                for (int p = 0; p < 2; p++) {
                    const int r = row0 + 64 * p + rr;
                    if (r >= rows) continue;
                    const float bias = b0 ? b0[e * rows + r] : 0.0f;
                    out[(size_t)q * rows + r] = __fmul_rn(__fadd_rn(acc[p][j][i], bias), w);
                }
            }
        }
}

// Gate/up: grid (ceil(ff / 64), worst-case tiles of MQS_TOK), 256 threads, MQS_SMEM bytes
// of dynamic shared memory; the arguments of moe_mq_gate_up_* (ty: T_MXFP4 or T_IQ4_NL).
extern "C" __global__ void __launch_bounds__(256, 2)
    moe_mqs_gate_up(const i8* xq, const float* xds, int npad, const int* info, int d, int ff,
                    const u8* wg, long long rbg, const u8* wu, long long rbu, int ty,
                    const float* bg, const float* bu, int act, float alpha, float limit,
                    float* a) {
    extern __shared__ __align__(16) u8 mqs_smem[];
    pdl_enter();
    if (ty == T_MXFP4)
        moe_mqs_body<true, true>(xq, xds, npad, info, d, ff, wg, rbg, wu, rbu, bg, bu, act,
                                 alpha, limit, nullptr, nullptr, a, mqs_smem);
    else
        moe_mqs_body<false, true>(xq, xds, npad, info, d, ff, wg, rbg, wu, rbu, bg, bu, act,
                                  alpha, limit, nullptr, nullptr, a, mqs_smem);
}
// Down: grid (ceil(d / 128), worst-case tiles of MQS_TOK); the arguments of moe_mq_down_*.
extern "C" __global__ void __launch_bounds__(256, 2)
    moe_mqs_down(const i8* aq, const float* ads, int npad, const int* info, int ff, int d,
                 const u8* wd, long long rbd, int ty, const float* bd, const int* order,
                 const float* wts, float* ys) {
    extern __shared__ __align__(16) u8 mqs_smem[];
    pdl_enter();
    if (ty == T_MXFP4)
        moe_mqs_body<true, false>(aq, ads, npad, info, ff, d, wd, rbd, nullptr, 0, bd, nullptr,
                                  0, 0.0f, 0.0f, order, wts, ys, mqs_smem);
    else
        moe_mqs_body<false, false>(aq, ads, npad, info, ff, d, wd, rbd, nullptr, 0, bd, nullptr,
                                   0, 0.0f, 0.0f, order, wts, ys, mqs_smem);
}
