// ---------------------------------------------------------------------------------------
// Batched decode on the tensor cores: steps of 2..64 tokens (sequences decoding together,
// short prompt chunks). The activations are quantized to 8 bits per block of 32 values
// (quantize_x_mmq: the rounding of quantize_x_q8), the weight blocks are read once per step
// in their GGUF layout, expanded to int8 in registers and multiplied with int8 mma.sync
// (m16n8k32, int32 sums); each 32-value block's integer sums are then scaled into f32
// accumulators (llama.cpp's MMQ does the same).
//
// Tiling: a block of MQ_WARPS warps owns 16 rows of one matrix (gated launches: the same
// 16 rows of gate and of up) for all the step's tokens. Its warps split the row length in
// steps of 256 values (warp w takes steps w, w + MQ_WARPS, ...) and sum their partial
// results in shared memory, in a fixed order. In a warp, lane (g = lane / 4, c = lane % 4)
// holds rows g and g + 8 and, of every 32-value block, values 8c .. 8c + 7 of those rows and
// of token g of each 8-token tile. That permutes the mma's k order (k = 4c + i holds value
// 8c + i, k = 16 + 4c + i holds value 8c + 4 + i): the same dot product, with every
// operand in one 8-byte load.

#define MQ_WARPS 8

// Activations of an mmq launch: xq[t][k] int8 for npad token rows (rows >= n zero) and
// xds[kb][t] = {d, d·Σq} per 32-value block kb, token-minor (a lane's two tokens of the
// accumulator fragment are one 16-byte load). A warp's values v (one a lane) are block kb
// of token t; `q_at` is this lane's byte. The whole warp calls it.
__device__ __forceinline__ void mmq_store_q8(float v, i8* q_at, float* xds, int kb, int t,
                                             int npad) {
    float scale;
    const int qi = warp_q8(v, scale);
    int sum = qi;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    *q_at = (i8)qi;
    if ((threadIdx.x & 31) == 0) {
        xds[2 * ((size_t)kb * npad + t)] = scale;
        xds[2 * ((size_t)kb * npad + t) + 1] = scale * (float)sum;
    }
}

// One warp per block of 32 values.
extern "C" __global__ void quantize_x_mmq(const float* x, int k, int n, int npad, i8* q,
                                          float* xds) {
    pdl_enter();
    const int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const int kbs = k >> 5;
    if (b >= npad * kbs) return;
    const int t = b / kbs, kb = b - t * kbs;
    const size_t at = (size_t)t * k + kb * 32 + lane;
    mmq_store_q8(t < n ? x[at] : 0.0f, q + at, xds, kb, t, npad);
}

// rms_norm of n rows (as `rms_norm`) that also leaves them quantized as quantize_x_mmq
// would (npad rows, rows >= n zero): the mmq launch that follows skips its own quantization.
// Grid (ceil(cols / blockDim.x), npad); each block sums the squares of its token's whole row
// and writes blockDim.x values of it; cols a multiple of 32.
extern "C" __global__ void rms_norm_mmq(const float* x, const float* w, float* out, int cols,
                                        float eps, int n, int npad, i8* q, float* xds) {
    pdl_enter();
    const int t = blockIdx.y;
    const float* xr = x + (size_t)t * cols;
    const float scale = t < n ? rms_scale(xr, cols, eps) : 0.0f;  // t: uniform in the block
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;  // whole warps (cols a multiple of 32)
    float v = 0.0f;
    if (t < n) {
        v = xr[j] * scale * w[j];
        out[(size_t)t * cols + j] = v;
    }
    mmq_store_q8(v, q + (size_t)t * cols + j, xds, j >> 5, t, npad);
}

// c = A·B for one 16×32 tile of weights (a0, a2: row g; a1, a3: row g + 8) and one 32×8
// tile of activations (b: token g).
__device__ __forceinline__ void mq_mma(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, uint2 b) {
    c[0] = c[1] = c[2] = c[3] = 0;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y));
}

// Bytes of 0..63 minus 32, as signed bytes (no borrow between the bytes).
__device__ __forceinline__ u32 sub32_bytes(u32 v) {
    return ((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
}

// A lane's view of the quantized activations.
struct MqX {
    const i8* q;
    const float* ds;
    int k, npad, g, c;
    // B fragment of 8-token tile j for 32-value block kb: token 8j + g, values 8c .. 8c + 7.
    __device__ __forceinline__ uint2 b(int j, int kb) const {
        return *(const uint2*)(q + (size_t)(j * 8 + g) * k + kb * 32 + c * 8);
    }
    // {d, d·Σq} of tokens 8j + 2c and 8j + 2c + 1 (the lane's accumulator columns).
    __device__ __forceinline__ float4 scales(int j, int kb) const {
        return *(const float4*)(ds + 2 * ((size_t)kb * npad + j * 8 + 2 * c));
    }
};

// acc += fs·d_t·C − fm·(d_t·Σq_t) for the fragment's rows (g: fs0/fm0; g + 8: fs1/fm1) and
// its two tokens.
__device__ __forceinline__ void mq_acc(float (&a)[4], const int (&cc)[4], float fs0, float fm0,
                                       float fs1, float fm1, float4 ds) {
    a[0] += fs0 * ds.x * (float)cc[0] - fm0 * ds.y;
    a[1] += fs0 * ds.z * (float)cc[1] - fm0 * ds.w;
    a[2] += fs1 * ds.x * (float)cc[2] - fm1 * ds.y;
    a[3] += fs1 * ds.z * (float)cc[3] - fm1 * ds.w;
}

// One 32-value block kb of the rows held in a[r][0..1] (r = 0, 1: rows g, g + 8 of the
// first matrix; 2, 3: of up) against every active token tile.
template <int J, bool UP>
__device__ __forceinline__ void mq_block(const u32 (&a)[4][2], const float (&fs)[4],
                                         const float (&fm)[4], int kb, int nt, const MqX& x,
                                         float (&acc)[J][4], float (&acc_up)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; j++) {
        if (j < nt) {
            const uint2 b = x.b(j, kb);
            const float4 ds = x.scales(j, kb);
            int cc[4];
            mq_mma(cc, a[0][0], a[1][0], a[0][1], a[1][1], b);
            mq_acc(acc[j], cc, fs[0], fm[0], fs[1], fm[1], ds);
            if (UP) {
                mq_mma(cc, a[2][0], a[3][0], a[2][1], a[3][1], b);
                mq_acc(acc_up[j], cc, fs[2], fm[2], fs[3], fm[3], ds);
            }
        }
    }
}

// A lane's bytes of the 256-value step `st` of rows rw[0..NR): lane c = lane % 4 takes values
// 8c .. 8c + 7 of every 32-value block (the int8 and the f16 kernels read them alike).
// Q4_K (144-byte blocks, 16-byte aligned): the block header and, of each 32-byte quant chunk
// ch, bytes 8c .. 8c + 7 (sub-block 2ch in the low nibbles, 2ch + 1 in the high ones).
template <int NR> struct Q4kStep {
    uint4 h[NR];
    uint2 q[NR][4];
    __device__ __forceinline__ void load(const u8* const* rw, int st, int c) {
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const u8* b = rw[r] + (size_t)st * 144;
            h[r] = *(const uint4*)b;
#pragma unroll
            for (int ch = 0; ch < 4; ch++) q[r][ch] = *(const uint2*)(b + 16 + 32 * ch + 8 * c);
        }
    }
};
// Q6_K (Q6K_GPU_BYTES-byte blocks, 16-byte aligned): of each half hf, bytes 8c.. of the two
// 32-byte low-bit chunks and of the 32-byte high-bit chunk; the 16 scales and d.
template <int NR> struct Q6kStep {
    uint2 ql[NR][2][2], qh[NR][2];
    u32 sw[NR][4];
    float d[NR];
    __device__ __forceinline__ void load(const u8* const* rw, int st, int c) {
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const u8* b = rw[r] + (size_t)st * Q6K_GPU_BYTES;
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
#pragma unroll
                for (int p = 0; p < 2; p++)
                    ql[r][hf][p] = *(const uint2*)(b + 64 * hf + 32 * p + 8 * c);
                qh[r][hf] = *(const uint2*)(b + 128 + 32 * hf + 8 * c);
            }
            const uint4 s = *(const uint4*)(b + 192);
            sw[r][0] = s.x;
            sw[r][1] = s.y;
            sw[r][2] = s.z;
            sw[r][3] = s.w;
            d[r] = h2f(*(const u16*)(b + 208));
        }
    }
};

// Per format: the 256-value step `st` of rows rw[0..NR) (NR = 2, or 4 with up).
template <int TY> struct Mq;

// Q4_K (144-byte blocks, 16-byte aligned): a lane reads the block header and, of each
// 32-byte quant chunk ch, bytes 8c .. 8c + 7: values 8c.. of sub-block 2ch (low nibbles) and
// of 2ch + 1 (high nibbles).
template <> struct Mq<T_Q4_K> {
    template <int J, bool UP>
    static __device__ __forceinline__ void step(const u8* const (&rw)[4], int st, int nt, int,
                                                const MqX& x, float (&acc)[J][4],
                                                float (&acc_up)[J][4]) {
        constexpr int NR = UP ? 4 : 2;
        Q4kStep<NR> raw;
        raw.load(rw, st, x.c);
#pragma unroll
        for (int ch = 0; ch < 4; ch++) {
            float fs[2][4], fm[2][4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int rr = r < NR ? r : 0;
                const float d = h2f((u16)(raw.h[rr].x & 0xFFFF));
                const float dmin = h2f((u16)(raw.h[rr].x >> 16));
                int sc[2], mn[2];
                q4k_scale_min_pair(raw.h[rr], ch, sc, mn);
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    fs[i][r] = d * (float)sc[i];
                    fm[i][r] = dmin * (float)mn[i];
                }
            }
#pragma unroll
            for (int i = 0; i < 2; i++) {
                u32 a[4][2];
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const int rr = r < NR ? r : 0;
                    a[r][0] = (raw.q[rr][ch].x >> (4 * i)) & 0x0F0F0F0Fu;
                    a[r][1] = (raw.q[rr][ch].y >> (4 * i)) & 0x0F0F0F0Fu;
                }
                mq_block<J, UP>(a, fs[i], fm[i], st * 8 + 2 * ch + i, nt, x, acc, acc_up);
            }
        }
    }
};

// Q6_K (Q6K_GPU_BYTES-byte blocks): 32-value block s of a step is quarter s % 4 of
// half s / 4; a lane's values 8c.. take one of the block's two 16-value scales (c < 2: the
// first), so each block is two mma with the other half of the lanes' weights zeroed.
template <> struct Mq<T_Q6_K> {
    template <int J, bool UP>
    static __device__ __forceinline__ void step(const u8* const (&rw)[4], int st, int nt, int,
                                                const MqX& x, float (&acc)[J][4],
                                                float (&acc_up)[J][4]) {
        constexpr int NR = UP ? 4 : 2;
        Q6kStep<NR> raw;
        raw.load(rw, st, x.c);
        const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const bool low = x.c < 2;
#pragma unroll
        for (int s = 0; s < 8; s++) {
            const int hf = s >> 2, qq = s & 3, kb = st * 8 + s;
            u32 v[NR][2];
            int sc[NR][2];
#pragma unroll
            for (int r = 0; r < NR; r++) {
                const uint2 l = raw.ql[r][hf][qq & 1], hb = raw.qh[r][hf];
                const int sl = 4 * (qq >> 1), sh = 2 * qq;
                v[r][0] = sub32_bytes(((l.x >> sl) & 0x0F0F0F0Fu) | (((hb.x >> sh) & 0x03030303u) << 4));
                v[r][1] = sub32_bytes(((l.y >> sl) & 0x0F0F0F0Fu) | (((hb.y >> sh) & 0x03030303u) << 4));
                const int si = 8 * hf + 2 * qq;  // even: both scales in one word
                const u32 w = raw.sw[r][si >> 2] >> (8 * (si & 3));
                sc[r][0] = (int)(signed char)(w & 0xFF);
                sc[r][1] = (int)(signed char)((w >> 8) & 0xFF);
            }
#pragma unroll
            for (int j = 0; j < J; j++) {
                if (j < nt) {
                    const uint2 b = x.b(j, kb);
                    const float4 ds = x.scales(j, kb);
#pragma unroll
                    for (int m = 0; m < (UP ? 2 : 1); m++) {
                        const int r0 = 2 * m, r1 = 2 * m + 1;
                        int lo[4], hi[4];
                        mq_mma(lo, low ? v[r0][0] : 0u, low ? v[r1][0] : 0u,
                               low ? v[r0][1] : 0u, low ? v[r1][1] : 0u, b);
                        mq_mma(hi, low ? 0u : v[r0][0], low ? 0u : v[r1][0],
                               low ? 0u : v[r0][1], low ? 0u : v[r1][1], b);
                        int cc[4];
                        cc[0] = sc[r0][0] * lo[0] + sc[r0][1] * hi[0];
                        cc[1] = sc[r0][0] * lo[1] + sc[r0][1] * hi[1];
                        cc[2] = sc[r1][0] * lo[2] + sc[r1][1] * hi[2];
                        cc[3] = sc[r1][0] * lo[3] + sc[r1][1] * hi[3];
                        mq_acc(m == 0 ? acc[j] : acc_up[j], cc, raw.d[r0], zero[0], raw.d[r1], zero[1],
                               ds);
                    }
                }
            }
        }
    }
};

// Q8_0 (32 quant bytes a block) and Q4_0 (16), rows as the GPU stores them (quants, then
// the f16 scales): eight 32-value blocks per step, in two halves of four (loads first);
// blocks past the row's end (k a multiple of 32 only) are skipped. Q8_0: lane c's values
// 8c .. 8c + 7 are quant bytes 8c ..; Q4_0 (NIBBLES): the low (c < 2) or high nibbles of
// quant bytes 8 (c & 1) .., their −8 offset taken off through the activation sums.
template <int BYTES, bool NIBBLES> struct MqBlocks32 {
    template <int J, bool UP>
    static __device__ __forceinline__ void step(const u8* const (&rw)[4], int st, int nt, int kbs,
                                                const MqX& x, float (&acc)[J][4],
                                                float (&acc_up)[J][4]) {
        constexpr int NR = UP ? 4 : 2;
        const int off = 8 * (NIBBLES ? (x.c & 1) : x.c), shift = NIBBLES ? 4 * (x.c >> 1) : 0;
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
                    if (r < NR) q[i][rr] = *(const uint2*)(rw[rr] + (size_t)blk * BYTES + off);
                    d[i][r] = h2f(*(const u16*)(rw[rr] + (size_t)kbs * BYTES + 2 * blk));
                }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (kb0 + i < kbs) {
                    u32 a[4][2];
                    float fm[4];
#pragma unroll
                    for (int r = 0; r < 4; r++) {
                        const int rr = r < NR ? r : 0;
                        a[r][0] = NIBBLES ? (q[i][rr].x >> shift) & 0x0F0F0F0Fu : q[i][rr].x;
                        a[r][1] = NIBBLES ? (q[i][rr].y >> shift) & 0x0F0F0F0Fu : q[i][rr].y;
                        fm[r] = NIBBLES ? 8.0f * d[i][r] : 0.0f;
                    }
                    mq_block<J, UP>(a, d[i], fm, kb0 + i, nt, x, acc, acc_up);
                }
            }
        }
    }
};
template <> struct Mq<T_Q8_0> : MqBlocks32<32, false> {};
template <> struct Mq<T_Q4_0> : MqBlocks32<16, true> {};

// A warp's steps of the row length for format TY.
template <int TY, int J, bool UP>
__device__ __forceinline__ void mq_rows(const u8* const (&rw)[4], int warp, int steps, int nt,
                                        int kbs, const MqX& x, float (&acc)[J][4],
                                        float (&acc_up)[J][4]) {
    for (int st = warp; st < steps; st += MQ_WARPS)
        Mq<TY>::template step<J, UP>(rw, st, nt, kbs, x, acc, acc_up);
}

template <int J, bool UP>
__device__ __forceinline__ void mq_rows_any(int ty, const u8* const (&rw)[4], int warp,
                                            int steps, int nt, int kbs, const MqX& x,
                                            float (&acc)[J][4], float (&acc_up)[J][4]) {
    switch (ty) {
    case T_Q4_K: mq_rows<T_Q4_K, J, UP>(rw, warp, steps, nt, kbs, x, acc, acc_up); return;
    case T_Q6_K: mq_rows<T_Q6_K, J, UP>(rw, warp, steps, nt, kbs, x, acc, acc_up); return;
    case T_Q8_0: mq_rows<T_Q8_0, J, UP>(rw, warp, steps, nt, kbs, x, acc, acc_up); return;
    case T_Q4_0: mq_rows<T_Q4_0, J, UP>(rw, warp, steps, nt, kbs, x, acc, acc_up); return;
    default: return;
    }
}

// A warp's 16 rows from r0 (maybe past the end) for the n tokens: act(gate) * up into out0
// (UP), else plus the bias into the segment's output.
template <int J, bool UP>
__device__ __forceinline__ void mq_store(const float (&acc)[J][4], const float (&acc_up)[J][4],
                                         const GvRows& t, int r0, int n, int act, float* out0,
                                         int ld0, int tok0 = 0) {
    const int lane = threadIdx.x & 31, g = lane >> 2;
    const int nr = t.rows - r0;
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = g + (e >= 2 ? 8 : 0), tok = tok0 + 8 * j + 2 * (lane & 3) + (e & 1);
            if (r < nr && tok < n) {
                const int row = r0 + r;
                if (UP) {
                    out0[(size_t)tok * ld0 + row] = gv_act(acc[j][e], act) * acc_up[j][e];
                } else {
                    // Plain launches: act != 0 adds into the output (the residual).
                    float* o = t.out + (size_t)tok * t.ld + row;
                    const float v = acc[j][e] + (t.bias ? t.bias[row] : 0.0f);
                    *o = act ? *o + v : v;
                }
            }
        }
}

// out_s[t][r] = W_s[r]·x[t] (+ bias) for n tokens (2 ≤ n ≤ 8J) with the GEMV launches'
// parameters (rpb unused; UP: a gated launch, act(gate·x) * (up·x) into out0, gate and up of
// one format and row length, the host checks). Grid: one block per 16 rows
// (Σ ceil(rows_s / 16)).
template <int J, bool UP>
__device__ __forceinline__ void mmq_body(const i8* xq, const float* xds, int npad, GEMV_PARAMS) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    GvRows t;
    if (!gv_pick_rows<16>(blockIdx.x, total, gated, w0, rb0, ty0, rows0, out0, ld0, bias0, w1,
                          rb1, ty1, rows1, out1, ld1, bias1, w2, rb2, ty2, out2, ld2, bias2, t))
        return;
    (void)x;
    (void)rpb;
    const int nr = min(16, t.rows - t.r0);
    const int g = lane >> 2;
    const MqX xx{xq, xds, k, npad, g, lane & 3};
    const int nt = (n + 7) >> 3;
    // Rows past the matrix's end read its last row; their results are dropped.
    const int ra = t.r0 + min(g, nr - 1), rb = t.r0 + min(g + 8, nr - 1);
    const u8* rw[4] = {t.w + (size_t)ra * t.rb, t.w + (size_t)rb * t.rb,
                       UP ? w1 + (size_t)ra * rb1 : nullptr,
                       UP ? w1 + (size_t)rb * rb1 : nullptr};
    float acc[J][4], acc_up[J][4];
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = acc_up[j][e] = 0.0f;
    const int steps = (k + 255) >> 8, kbs = k >> 5;
    mq_rows_any<J, UP>(t.ty, rw, warp, steps, nt, kbs, xx, acc, acc_up);

    // The warps' partial sums meet in warp 0, halving the warps each round (fixed order;
    // lane-minor: no bank conflicts).
    __shared__ float red[MQ_WARPS / 2][(UP ? 2 : 1) * J * 4][32];
#pragma unroll
    for (int half = MQ_WARPS / 2; half > 0; half >>= 1) {
        if (warp >= half && warp < 2 * half) {
#pragma unroll
            for (int j = 0; j < J; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    red[warp - half][4 * j + e][lane] = acc[j][e];
                    if (UP) red[warp - half][UP ? 4 * (J + j) + e : 0][lane] = acc_up[j][e];
                }
        }
        __syncthreads();
        if (warp < half) {
#pragma unroll
            for (int j = 0; j < J; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    acc[j][e] += red[warp][4 * j + e][lane];
                    if (UP) acc_up[j][e] += red[warp][UP ? 4 * (J + j) + e : 0][lane];
                }
        }
        __syncthreads();
    }
    if (warp == 0) mq_store<J, UP>(acc, acc_up, t, t.r0, n, act, out0, ld0);
}

// Steps of up to 8 tokens (J = 1; the template takes more, and tiles of 16 to 64 tokens
// were measured: the staged kernels below and cuBLAS won there); plain and gated (`_gated`:
// gate and up) launches apart, so that the plain kernels keep fewer registers; at least
// BLOCKS blocks per SM (a register cap).
#define MMQ_KERNEL(NAME, J, UP, BLOCKS)                                                        \
    extern "C" __global__ void __launch_bounds__(MQ_WARPS * 32, BLOCKS)                        \
        NAME(const i8* xq, const float* xds, int npad, GEMV_PARAMS) {                          \
        pdl_enter();                                                                           \
        mmq_body<J, UP>(xq, xds, npad, GEMV_ARGS);                                             \
    }
MMQ_KERNEL(mmq_t8, 1, false, 3)
MMQ_KERNEL(mmq_t8_gated, 1, true, 2)

// ---------------------------------------------------------------------------------------
// Steps of up to 8 tokens on K-quant weights (mmk_t8*): the int8 mma of mmq_t8 with the
// activations quantized per 256 values (one step per token and super-block, as the CPU's
// Q8_K), so that each super-block's products stay integers: the 32-value blocks' sums are
// scaled by the weights' 6- or 8-bit scales in integer arithmetic and converted to f32 once
// per super-block instead of once per 32-value block. The weights' offsets (Q4_K's minimums,
// Q6_K's 32) come off through one more mma per super-block against the activations'
// 16-value group sums. About a third of mmq_t8's instructions per weight byte, which ncu
// showed to be issue- and latency-bound (1.1–1.7 instructions per cycle a SM, 1.0–1.3 TB/s).
//
// Activations (quantize_x_mmk / rms_norm_mmk), for npad token rows (rows >= n zero): xq[t][k]
// int8 as for mmq; per 256-value block kb and token t the step xk[kb * npad + t] and, at
// xb[(kb * npad + t) * 32], the sums s of the 16 groups of 16 values split as s = 128 hi + lo
// (lo in 0..127: bytes 0..15; hi: bytes 16..31), so that both are int8 mma operands.
//
// Tiling as mmq_t8: a block of MK_WARPS warps owns 16 rows (gated: of gate and of up), its
// warps split the row length in 256-value steps; lane (g, c) holds rows g and g + 8 and
// values 8c .. 8c + 7 of every 32-value block (the same k permutation as mmq).

#define MK_WARPS 8  // of quantize_x_mmk's block (256 threads)

// Group grp's sum s of super-block `at` (= kb * npad + t) as its two int8 halves.
__device__ __forceinline__ void mmk_store_sum(i8* xb, size_t at, int grp, int s) {
    xb[at * 32 + grp] = (i8)(s & 127);
    xb[at * 32 + 16 + grp] = (i8)(s >> 7);
}

// The whole block (256 threads, one value each: the 256-value block kb of token t) calls it.
__device__ __forceinline__ void mmk_store_q8(float v, i8* q_at, float* xk, i8* xb, int kb, int t,
                                             int npad) {
    __shared__ float wmax[MK_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) wmax[warp] = amax;
    __syncthreads();
    amax = wmax[0];
#pragma unroll
    for (int w = 1; w < MK_WARPS; w++) amax = fmaxf(amax, wmax[w]);
    const float step = amax / 127.0f;
    const int qi = q8_round(v, step);
    *q_at = (i8)qi;
    int s = qi;
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const size_t at = (size_t)kb * npad + t;
    if ((lane & 15) == 0) mmk_store_sum(xb, at, 2 * warp + (lane >> 4), s);
    if (threadIdx.x == 0) xk[at] = step;
}

// One block of 256 threads per (256-value block, token row); k a multiple of 256.
extern "C" __global__ void __launch_bounds__(256) quantize_x_mmk(const float* x, int k, int n,
                                                                 int npad, i8* q, float* xk,
                                                                 i8* xb) {
    pdl_enter();
    const int kb = blockIdx.x, t = blockIdx.y;
    const size_t at = (size_t)t * k + kb * 256 + threadIdx.x;
    mmk_store_q8(t < n ? x[at] : 0.0f, q + at, xk, xb, kb, t, npad);
}

// rms_norm of n rows that also leaves them quantized as quantize_x_mmk would: one block per
// token row (grid (1, npad)), 64 threads per 256 values (4 each, float4), blockDim.x a
// multiple of 64 up to 1024 (longer rows in several passes); cols a multiple of 256. One
// read of the row for the sum of squares and one for the output (from L1), two barriers a
// pass.
extern "C" __global__ void __launch_bounds__(1024) rms_norm_mmk(const float* x, const float* w,
                                                                float* out, int cols, float eps,
                                                                int n, int npad, i8* q, float* xk,
                                                                i8* xb) {
    pdl_enter();
    const int t = blockIdx.y, nt = blockDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xr = x + (size_t)t * cols;
    const float scale = t < n ? rms_scale(xr, cols, eps) : 0.0f;  // t: uniform in the block
    __shared__ float wmax[32];
    for (int j0 = 0; j0 < cols; j0 += 4 * nt) {
        const int j = j0 + 4 * threadIdx.x;
        const bool on = j < cols;  // whole 256-value blocks (pairs of warps)
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (on && t < n) {
            const float4 a = *(const float4*)(xr + j), g = *(const float4*)(w + j);
            v = make_float4(a.x * scale * g.x, a.y * scale * g.y, a.z * scale * g.z,
                            a.w * scale * g.w);
            *(float4*)(out + (size_t)t * cols + j) = v;
        }
        float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
        for (int o = 16; o > 0; o >>= 1)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if (lane == 0) wmax[warp] = amax;
        __syncthreads();
        amax = fmaxf(wmax[warp], wmax[warp ^ 1]);  // the 256 values' two warps
        __syncthreads();
        const float step = amax / 127.0f;
        const float vs[4] = {v.x, v.y, v.z, v.w};
        u32 packed = 0;
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int qi = q8_round(vs[i], step);
            packed |= ((u32)qi & 0xFFu) << (8 * i);
            s += qi;
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (on) {
            *(u32*)(q + (size_t)t * cols + j) = packed;
            const size_t at = (size_t)(j >> 8) * npad + t;
            if ((threadIdx.x & 3) == 0) mmk_store_sum(xb, at, (j & 255) >> 4, s);
            if ((j & 255) == 0) xk[at] = step;
        }
    }
}

// c = A·B, unsigned 8-bit weights (a0, a2: row g; a1, a3: row g + 8), signed activations.
__device__ __forceinline__ void mk_mma_u8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                          u32 b1) {
    c[0] = c[1] = c[2] = c[3] = 0;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mk_mma_s8(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    c[0] = c[1] = c[2] = c[3] = 0;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(0u), "r"(0u), "r"(b0), "r"(0u));
}

// Σ_groups w[row][grp] · sums[tok][grp] over a super-block's 16 groups for the lane's 4
// accumulator entries: wg0 / wg1 are groups 4c .. 4c + 3 of rows g / g + 8 as bytes (SIGNED:
// Q6_K's scales; else unsigned below 128), blo / bhi the lane's token-g words of the sums.
__device__ __forceinline__ void mk_group_dot(int (&m)[4], u32 wg0, u32 wg1, u32 blo, u32 bhi) {
    int lo[4], hi[4];
    mk_mma_s8(lo, wg0, wg1, blo);
    mk_mma_s8(hi, wg0, wg1, bhi);
#pragma unroll
    for (int e = 0; e < 4; e++) m[e] = lo[e] + 128 * hi[e];
}

// The activations of a step st as a lane reads them, one 8-token tile (j = 0) from global
// memory. Every activation source of Mk::step has these members, for tile j: b (the B
// fragment of 32-value block blk), dx (the steps of tokens 2c, 2c + 1), blo / bhi (token
// g's group sums, groups 4c .. 4c + 3).
struct MkX {
    const i8* xs;  // token g's values of the step, at the lane's 8c
    float2 d;      // steps of tokens 2c, 2c + 1
    u32 lo, hi;    // token g's group sums, groups 4c .. 4c + 3
    __device__ __forceinline__ void load(const i8* xq, const float* xk, const i8* xb, int k,
                                         int npad, int st, int g, int c) {
        xs = xq + (size_t)g * k + st * 256 + 8 * c;
        const size_t kt = (size_t)st * npad;
        d = *(const float2*)(xk + kt + 2 * c);
        lo = *(const u32*)(xb + (kt + g) * 32 + 4 * c);
        hi = *(const u32*)(xb + (kt + g) * 32 + 16 + 4 * c);
    }
    __device__ __forceinline__ uint2 b(int, int blk) const {
        return *(const uint2*)(xs + 32 * blk);
    }
    __device__ __forceinline__ float2 dx(int) const { return d; }
    __device__ __forceinline__ u32 blo(int) const { return lo; }
    __device__ __forceinline__ u32 bhi(int) const { return hi; }
};

// Byte i of w as a signed / unsigned int.
__device__ __forceinline__ int byte_s(u32 w, int i) { return (int)(signed char)(w >> (8 * i)); }
__device__ __forceinline__ int byte_u(u32 w, int i) { return (int)((w >> (8 * i)) & 0xFF); }

// is += one 32-value sub-block's products (weights a0..a3 as mk_mma_u8 takes them,
// activations b), scaled by the rows' sub-block scales s0 (row g) and s1 (row g + 8).
__device__ __forceinline__ void mk_blk(int (&is)[4], u32 a0, u32 a1, u32 a2, u32 a3, uint2 b,
                                       int s0, int s1) {
    int cc[4];
    mk_mma_u8(cc, a0, a1, a2, a3, b.x, b.y);
    is[0] += s0 * cc[0];
    is[1] += s0 * cc[1];
    is[2] += s1 * cc[2];
    is[3] += s1 * cc[3];
}

// A lane's 6-bit Q6_K quants of a 32-value run: low nibbles l (shifted by sl), high bit
// pairs hb (shifted by sh).
__device__ __forceinline__ uint2 q6k_run(uint2 l, uint2 hb, int sl, int sh) {
    return make_uint2(((l.x >> sl) & 0x0F0F0F0Fu) | (((hb.x >> sh) & 0x03030303u) << 4),
                      ((l.y >> sl) & 0x0F0F0F0Fu) | (((hb.y >> sh) & 0x03030303u) << 4));
}

// is += a Q6_K run's products (v: rows g, g + 8) with activations b: its two 16-value
// groups (lanes c < 2: the first) as two mma with the other lanes' activations zeroed,
// scaled by the groups' signed scales (ga / gb: row g's first / second, ha / hb: row g + 8's).
__device__ __forceinline__ void q6k_run_mma(int (&is)[4], const uint2 (&v)[2], uint2 b, bool low,
                                            int ga, int gb, int ha, int hb) {
    int lo[4], hi[4];
    mk_mma_u8(lo, v[0].x, v[1].x, v[0].y, v[1].y, low ? b.x : 0u, low ? b.y : 0u);
    mk_mma_u8(hi, v[0].x, v[1].x, v[0].y, v[1].y, low ? 0u : b.x, low ? 0u : b.y);
    is[0] += ga * lo[0] + gb * hi[0];
    is[1] += ga * lo[1] + gb * hi[1];
    is[2] += ha * lo[2] + hb * hi[2];
    is[3] += ha * lo[3] + hb * hi[3];
}

template <int TY, bool UP> struct Mk;

// Q4_K: value = d·sc·q − dmin·mn per 32-value block (6-bit sc, mn).
template <bool UP> struct Mk<T_Q4_K, UP> {
    static constexpr int NR = UP ? 4 : 2;
    using Raw = Q4kStep<NR>;
    template <int J, class X>
    static __device__ __forceinline__ void step(const Raw& raw, const X& x, int c,
                                                float (&acc)[NR / 2][J][4]) {
        u32 sc[NR][2], mg[NR];
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const u32 s03 = raw.h[r].y, s47 = raw.h[r].z, s811 = raw.h[r].w;
            sc[r][0] = s03 & 0x3F3F3F3Fu;
            sc[r][1] = (s811 & 0x0F0F0F0Fu) | ((s03 >> 2) & 0x30303030u);
            const u32 mn = c < 2 ? s47 & 0x3F3F3F3Fu
                                 : ((s811 >> 4) & 0x0F0F0F0Fu) | ((s47 >> 2) & 0x30303030u);
            // Groups 4c .. 4c + 3 are the 32-value blocks 2c, 2c, 2c + 1, 2c + 1.
            mg[r] = __byte_perm(mn, 0, (c & 1) ? 0x3322 : 0x1100);
        }
        int is[NR / 2][J][4] = {};  // integer sums of the super-block, per matrix and tile
#pragma unroll
        for (int ch = 0; ch < 4; ch++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int blk = 2 * ch + i;
#pragma unroll
                for (int m = 0; m < NR / 2; m++) {
                    const int r0 = 2 * m, r1 = 2 * m + 1;
                    const u32 a0 = (raw.q[r0][ch].x >> (4 * i)) & 0x0F0F0F0Fu;
                    const u32 a1 = (raw.q[r1][ch].x >> (4 * i)) & 0x0F0F0F0Fu;
                    const u32 a2 = (raw.q[r0][ch].y >> (4 * i)) & 0x0F0F0F0Fu;
                    const u32 a3 = (raw.q[r1][ch].y >> (4 * i)) & 0x0F0F0F0Fu;
                    const int s0 = byte_u(sc[r0][blk >> 2], blk & 3);
                    const int s1 = byte_u(sc[r1][blk >> 2], blk & 3);
#pragma unroll
                    for (int j = 0; j < J; j++) mk_blk(is[m][j], a0, a1, a2, a3, x.b(j, blk), s0, s1);
                }
            }
#pragma unroll
        for (int m = 0; m < NR / 2; m++) {
            const int r0 = 2 * m, r1 = 2 * m + 1;
            const float d0 = h2f((u16)(raw.h[r0].x & 0xFFFF)), n0 = h2f((u16)(raw.h[r0].x >> 16));
            const float d1 = h2f((u16)(raw.h[r1].x & 0xFFFF)), n1 = h2f((u16)(raw.h[r1].x >> 16));
#pragma unroll
            for (int j = 0; j < J; j++) {
                int ms[4];
                mk_group_dot(ms, mg[r0], mg[r1], x.blo(j), x.bhi(j));
                const float2 dx = x.dx(j);
                acc[m][j][0] += dx.x * (d0 * (float)is[m][j][0] - n0 * (float)ms[0]);
                acc[m][j][1] += dx.y * (d0 * (float)is[m][j][1] - n0 * (float)ms[1]);
                acc[m][j][2] += dx.x * (d1 * (float)is[m][j][2] - n1 * (float)ms[2]);
                acc[m][j][3] += dx.y * (d1 * (float)is[m][j][3] - n1 * (float)ms[3]);
            }
        }
    }
};

// Q6_K: value = d·sc·(q − 32) per 16-value group (8-bit signed sc, q in 0..63). A 32-value
// block holds two groups; lanes c < 2 hold the first, so each block is two mma with the
// other lanes' activations zeroed. The −32 comes off through the group sums.
template <bool UP> struct Mk<T_Q6_K, UP> {
    static constexpr int NR = UP ? 4 : 2;
    using Raw = Q6kStep<NR>;
    template <int J, class X>
    static __device__ __forceinline__ void step(const Raw& raw, const X& x, int c,
                                                float (&acc)[NR / 2][J][4]) {
        const bool low = c < 2;
        int is[NR / 2][J][4] = {};  // integer sums of the super-block, per matrix and tile
#pragma unroll
        for (int s = 0; s < 8; s++) {
            const int hf = s >> 2, qq = s & 3;
            const int si = 8 * hf + 2 * qq;  // even: both groups' scales in one word
#pragma unroll
            for (int m = 0; m < NR / 2; m++) {
                const int r0 = 2 * m, r1 = 2 * m + 1;
                const int sl = 4 * (qq >> 1), sh = 2 * qq;
                const uint2 v[2] = {q6k_run(raw.ql[r0][hf][qq & 1], raw.qh[r0][hf], sl, sh),
                                    q6k_run(raw.ql[r1][hf][qq & 1], raw.qh[r1][hf], sl, sh)};
                const u32 w0 = raw.sw[r0][si >> 2], w1 = raw.sw[r1][si >> 2];
                const int a0 = byte_s(w0, si & 3), b0 = byte_s(w0, (si & 3) + 1);
                const int a1 = byte_s(w1, si & 3), b1 = byte_s(w1, (si & 3) + 1);
#pragma unroll
                for (int j = 0; j < J; j++) q6k_run_mma(is[m][j], v, x.b(j, s), low, a0, b0, a1, b1);
            }
        }
#pragma unroll
        for (int m = 0; m < NR / 2; m++) {
            const int r0 = 2 * m, r1 = 2 * m + 1;
#pragma unroll
            for (int j = 0; j < J; j++) {
                int ms[4];
                mk_group_dot(ms, raw.sw[r0][c], raw.sw[r1][c], x.blo(j), x.bhi(j));
                const float2 dx = x.dx(j);
                acc[m][j][0] += dx.x * raw.d[r0] * (float)(is[m][j][0] - 32 * ms[0]);
                acc[m][j][1] += dx.y * raw.d[r0] * (float)(is[m][j][1] - 32 * ms[1]);
                acc[m][j][2] += dx.x * raw.d[r1] * (float)(is[m][j][2] - 32 * ms[2]);
                acc[m][j][3] += dx.y * raw.d[r1] * (float)(is[m][j][3] - 32 * ms[3]);
            }
        }
    }
};

// A warp's steps st = warp, warp + MK_WARPS, ... of rows rw; PIPE: the next step's weights
// are loaded before the current one is multiplied (twice the weight registers).
template <int TY, bool UP, bool PIPE>
__device__ __forceinline__ void mk_rows(const u8* const (&rw)[4], int warp, int steps,
                                        const i8* xq, const float* xk, const i8* xb, int k,
                                        int npad, int g, int c, float (&acc)[2][1][4]) {
    typedef Mk<TY, UP> M;
    // One tile; without up only the first matrix's accumulators.
    float(&a)[M::NR / 2][1][4] = reinterpret_cast<float(&)[M::NR / 2][1][4]>(acc);
    typename M::Raw raw;
    int st = warp;
    if (st >= steps) return;
    raw.load(rw, st, c);
    for (; st < steps; st += MK_WARPS) {
        MkX x;
        x.load(xq, xk, xb, k, npad, st, g, c);
        if (PIPE) {
            typename M::Raw next;
            if (st + MK_WARPS < steps) next.load(rw, st + MK_WARPS, c);
            M::template step<1>(raw, x, c, a);
            raw = next;
        } else {
            M::template step<1>(raw, x, c, a);
            if (st + MK_WARPS < steps) raw.load(rw, st + MK_WARPS, c);
        }
    }
}

// out_s[t][r] = W_s[r]·x[t] (+ bias) for n ≤ 8 tokens, Q4_K and Q6_K weights, k a multiple
// of 256 (the host checks); parameters and grid as mmq_t8, MK_WARPS warps a block.
template <int TY, bool UP, bool PIPE>
__device__ __forceinline__ void mmk_body(const GvRows& t, const i8* xq, const float* xk,
                                         const i8* xb, int npad, GEMV_PARAMS) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    (void)x;
    (void)rpb;
    const int nr = min(16, t.rows - t.r0);
    const int g = lane >> 2, c = lane & 3;
    // Rows past the matrix's end read its last row; their results are dropped.
    const int ra = t.r0 + min(g, nr - 1), rb = t.r0 + min(g + 8, nr - 1);
    const u8* rw[4] = {t.w + (size_t)ra * t.rb, t.w + (size_t)rb * t.rb,
                       UP ? w1 + (size_t)ra * rb1 : nullptr,
                       UP ? w1 + (size_t)rb * rb1 : nullptr};
    float acc[2][1][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[m][0][e] = 0.0f;
    mk_rows<TY, UP, PIPE>(rw, warp, k >> 8, xq, xk, xb, k, npad, g, c, acc);

    // The warps' partial sums meet in warp 0 (as mmq_body: fixed order, lane-minor).
    __shared__ float red[MK_WARPS / 2][8][32];
#pragma unroll
    for (int half = MK_WARPS / 2; half > 0; half >>= 1) {
        if (warp >= half && warp < 2 * half)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                red[warp - half][e][lane] = acc[0][0][e];
                if (UP) red[warp - half][4 + e][lane] = acc[1][0][e];
            }
        __syncthreads();
        if (warp < half)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                acc[0][0][e] += red[warp][e][lane];
                if (UP) acc[1][0][e] += red[warp][4 + e][lane];
            }
        __syncthreads();
    }
    if (warp == 0) {
        float a[1][4], a_up[1][4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            a[0][e] = acc[0][0][e];
            a_up[0][e] = acc[1][0][e];
        }
        mq_store<1, UP>(a, a_up, t, t.r0, n, act, out0, ld0);
    }
}

// `_pipe`: the next step's weights in flight during the
// current one's products. 8 warps, 2 blocks a SM: at 3, the two formats' bodies in one
// kernel spill, and on the H100 kernels of one format at 3 blocks a SM, 32-row tiles of 16
// warps, and blocks of 4 warps (4 a SM) all measured slower end to end.
#define MMK_KERNEL(NAME, TY, UP, PIPE)                                                         \
    extern "C" __global__ void __launch_bounds__(MK_WARPS * 32, 2)                             \
        NAME(const i8* xq, const float* xk, const i8* xb, int npad, GEMV_PARAMS) {             \
        pdl_enter();                                                                           \
        GvRows t;                                                                              \
        if (!gv_pick_rows<16>(blockIdx.x, total, gated, w0, rb0, ty0, rows0, out0, ld0, bias0, \
                              w1, rb1, ty1, rows1, out1, ld1, bias1, w2, rb2, ty2, out2, ld2,  \
                              bias2, t))                                                       \
            return;                                                                            \
        if (TY == T_Q4_K || (TY < 0 && t.ty == T_Q4_K))                                        \
            mmk_body<T_Q4_K, UP, PIPE>(t, xq, xk, xb, npad, GEMV_ARGS);                        \
        else                                                                                   \
            mmk_body<T_Q6_K, UP, PIPE>(t, xq, xk, xb, npad, GEMV_ARGS);                        \
    }
// TY < 0: the block's format picks the body (plain launches may mix formats: Q, K, V);
// gated launches have one format (the host checks), and a kernel per format keeps the other
// body's registers out (the two-format gated kernel spilled 116 bytes).
MMK_KERNEL(mmk_t8_pipe, -1, false, true)
MMK_KERNEL(mmk_t8_gated_q4k, T_Q4_K, true, false)
MMK_KERNEL(mmk_t8_gated_q6k, T_Q6_K, true, false)

// ---------------------------------------------------------------------------------------
// The tiling of the staged kernels (`mms_*` below): a block of MH_WARPS row groups owns
// MH_ROWS rows, 16 a group (gated launches: the first half of the groups take MH_ROWS / 2
// rows of gate, the others the same rows of up), and walks the row length in 256-value
// steps. Narrow matrices split the row length across `splits` blocks; their partial sums
// meet in `work`, added in split order by the block that finishes last (a per-tile arrival
// counter, reset by that block): the result does not depend on which block finishes first.
// (The f16 kernels `mmh_*` that first used this tiling lost to `mms_*` and were deleted.)

#define MH_WARPS 4
#define MH_ROWS (16 * MH_WARPS)

// f16 pair arithmetic (mmw.cu expands its 4-bit weights with these).
__device__ __forceinline__ u32 h2_sub(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// With splits, a block's partial sums go to `work` (work[block][e][thread], coalesced)
// and the tile's last block to arrive adds every split's partials in split order; false
// for the other blocks (they are done).
template <int J, int T>
__device__ __forceinline__ bool mq_split_sum(float (&acc)[J][4], int splits, float* work,
                                             u32* count, int tile) {
    __shared__ int ms_last;
    if (splits <= 1) return true;
    constexpr int PER = J * 4;
    float* mine = work + (size_t)blockIdx.x * PER * T + threadIdx.x;
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) __stcg(mine + (4 * j + e) * T, acc[j][e]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) ms_last = atomicAdd(count + tile, 1u) == (u32)(splits - 1);
    __syncthreads();
    if (!ms_last) return false;
    __threadfence();
    const float* first = work + (size_t)tile * splits * PER * T + threadIdx.x;
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float a = 0.0f;
            for (int s = 0; s < splits; s++) a += __ldcg(first + ((size_t)s * PER + 4 * j + e) * T);
            acc[j][e] = a;
        }
    if (threadIdx.x == 0) count[tile] = 0;
    return true;
}

// A warp's 16 rows r0 .. r0 + 15 of a matrix (w, rows of `rbytes` bytes, `rows` rows; rows
// past the end read the last one), and this lane's two of them (g and g + 8).
struct WarpRows {
    const u8* const (&lane)[2];
    const u8* w;
    long long rbytes;
    int r0, rows;
    __device__ __forceinline__ const u8* row(int i) const {
        return w + (size_t)min(r0 + i, rows - 1) * rbytes;
    }
};

// out_s[t][r] = W_s[r]·x[t] (+ bias) for n tokens with the GEMV launches' parameters, each
// warp's 16 rows multiplied by `rows` (the family: its activations and their stage in shared
// memory); UP: a gated launch, act(gate·x) * (up·x) into out0 (gate and up of one format and
// row length, the host checks). k a multiple of 256. Grid: (Σ ceil(rows_s / MH_ROWS), gated:
// ceil(rows / (MH_ROWS / 2))) × splits blocks, block b taking tile b / splits and the split
// b % splits of the steps. MH_WARPS · TS warps a block: warp w takes rows 16 (w % MH_WARPS)
// of the tile and the token tiles J / TS · (w / MH_WARPS) onwards (its token part `th`).
template <int J, bool UP, int TS, class Rows>
__device__ __forceinline__ void tile_body(const Rows& rows, u8* sx, int splits, float* work,
                                          u32* count, GEMV_PARAMS) {
    constexpr int TILE_ROWS = UP ? MH_ROWS / 2 : MH_ROWS, JW = J / TS;
    const int tile = blockIdx.x / splits, split = blockIdx.x - tile * splits;
    GvRows t;
    if (!gv_pick_rows<TILE_ROWS>(tile, total, gated, w0, rb0, ty0, rows0, out0, ld0, bias0, w1,
                                 rb1, ty1, rows1, out1, ld1, bias1, w2, rb2, ty2, out2, ld2,
                                 bias2, t))
        return;  // the whole block: the tile is the block's
    (void)x;
    (void)rpb;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int rg = warp % MH_WARPS, th = warp / MH_WARPS;
    const int up = UP ? rg / (MH_WARPS / 2) : 0, wr = UP ? rg % (MH_WARPS / 2) : rg;
    const int r0 = t.r0 + 16 * wr;  // this warp's first row (may be past the end)
    const u8* w = up ? w1 : t.w;
    const long long rbytes = up ? rb1 : t.rb;
    // Rows past the matrix's end read its last row; their results are dropped.
    const int ra = min(r0 + g, t.rows - 1), rb = min(r0 + g + 8, t.rows - 1);
    const u8* rw[2] = {w + (size_t)ra * rbytes, w + (size_t)rb * rbytes};
    float acc[JW][4];
#pragma unroll
    for (int j = 0; j < JW; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.0f;
    const int steps = k >> 8, per = (steps + splits - 1) / splits;
    const int s0 = split * per, s1 = min(steps, s0 + per);
    rows(t.ty, WarpRows{rw, w, rbytes, r0, t.rows}, th, s0, s1, sx, acc);
    if (!mq_split_sum<JW, MH_WARPS * TS * 32>(acc, splits, work, count, tile)) return;
    const int tok0 = 8 * JW * th;
    if (!UP) {
        mq_store<JW, false>(acc, acc, t, r0, n, act, out0, ld0, tok0);
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
            for (int e = 0; e < 4; e++) ex[slot][4 * j + e][lane] = acc[j][e];
    }
    __syncthreads();
    if (up) return;
    float acc_up[JW][4];
#pragma unroll
    for (int j = 0; j < JW; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc_up[j][e] = ex[slot][4 * j + e][lane];
    mq_store<JW, true>(acc, acc_up, t, r0, n, act, out0, ld0, tok0);
}

// ---------------------------------------------------------------------------------------
// Steps of 9..32 tokens on int8 activations in mmk_t8's layout (`mms_*`; the template takes
// tiles of 64 tokens too, which lost to cuBLAS): the tiling above (MH_WARPS row groups of 16
// rows, splits of the row length), the int8 super-block
// products of mmk_t8 (integer sums per super-block, MsStep) on 8-token tiles. Both operands
// go through shared memory by cp.async, MS_STAGES steps deep: each step's activations of all
// tokens (values, group sums, steps) once for the block, each row group's 16 weight rows by
// its warps. Step i + MS_STAGES - 1 is copied while step i is multiplied; one barrier a
// step. How it got here (H100, `bench --profile` at 64 tokens, gate/up of Llama-3-8B):
// weights prefetched into registers one step ahead stalled on them (ncu: ~30% of the
// stalls at their first use; 218 registers, 8 warps a SM) and the step, unrolled over 8
// tiles, was 1,100 (Q4_K) / 2,100 (Q6_K) instructions with ~25% instruction-fetch stalls;
// staging the weights too, two warps per row group (half the tokens each) and the copies'
// addresses worked out once took it to ~540 instructions a Q4_K step and 102 -> 88 µs
// (750 GB/s). It is issue-bound now (ncu: 44% of issue slots busy, stalls spread over
// selection, math, barrier and short scoreboard).

#define MS_STAGES 3
// Token parts: a block has MS_TS warps per 16-row group, each taking 8J / MS_TS tokens of
// the step (twice the warps of the deleted f16 mmh_* for the same operands in shared
// memory).
#define MS_TS 2
#define MS_THREADS (MH_WARPS * MS_TS * 32)
// Bytes per weight row of a stage: Q6_K's 224 (56 words ≡ 24 mod 32 banks), Q4_K's 144
// at a stride of 160 (≡ 8): the 8-byte loads of a half-warp (rows g .. g + 3) fall in
// distinct banks.
#define MS_WROW 224
// Bytes per token row of a stage's activations: the 256 values, then the 16 group sums' 32
// bytes (288 ≡ 32 mod 128: the 8-byte B loads of a half-warp, tokens g .. g + 3, fall in
// distinct banks), after them the tokens' steps (floats).
#define MS_XROW 288

template <int J> struct MsStage {
    static constexpr int W = MH_ROWS * MS_WROW;             // weights of the block's rows
    static constexpr int BYTES = W + 8 * J * (MS_XROW + 4);  // + the activations
};

// A lane's view of a stage's activations: tile j's token g at this lane's values 8c of
// block blk.
struct MkS {
    const u8* xs;     // token g's row at 8c
    const u8* sums;   // token g's group sums at 4c
    const float* dk;  // the steps of tokens 2c, 2c + 1
    __device__ __forceinline__ uint2 b(int j, int blk) const {
        return *(const uint2*)(xs + j * 8 * MS_XROW + 32 * blk);
    }
    __device__ __forceinline__ float2 dx(int j) const { return *(const float2*)(dk + 8 * j); }
    __device__ __forceinline__ u32 blo(int j) const {
        return *(const u32*)(sums + j * 8 * MS_XROW);
    }
    __device__ __forceinline__ u32 bhi(int j) const {
        return *(const u32*)(sums + j * 8 * MS_XROW + 16);
    }
};

// The cp.async copies of a step into a stage (16-byte chunks), their addresses worked out
// once: the NT tokens' activations (values, group sums, steps) by the whole block, the 16
// weight rows of a row group by its MS_TS warps (a Q4_K row is 9 chunks, a Q6_K row 14).
template <int TY, int NT> struct MsCopy {
    static constexpr int CH = TY == T_Q4_K ? 9 : 14, BB = TY == T_Q4_K ? 144 : Q6K_GPU_BYTES;
    static constexpr int STRIDE = TY == T_Q4_K ? 160 : MS_WROW;
    static constexpr int WM = (16 * CH + 32 * MS_TS - 1) / (32 * MS_TS);  // weight chunks a lane
    static constexpr int XM = NT * 16 / MS_THREADS;  // value chunks a thread (NT >= 16)
    const u8* w;
    u32 woff[WM];  // byte offsets into w of this lane's weight chunks of step 0 (~0u: none)
    u32 wdst[WM];
    const i8* xs;    // this thread's first value chunk of step 0, then every 16 tokens
    long long xstride;
    u32 xdst;
    const i8* bs;    // its group-sum chunk of step 0 (threads < 2 NT)
    const float* ks; // its chunk of the steps of step 0 (threads < NT / 4)
    int npad;

    __device__ __forceinline__ MsCopy(const WarpRows& wr, const i8* xq, const float* xk,
                                      const i8* xb, int k, int np) {
        const int warp = threadIdx.x >> 5, rg = warp % MH_WARPS, th = warp / MH_WARPS;
        const int l = (threadIdx.x & 31) + 32 * th;
        w = wr.w;
        const u32 wbase = rg * 16 * MS_WROW;
#pragma unroll
        for (int m = 0; m < WM; m++) {
            const int i = l + 32 * MS_TS * m, r = i / CH, part = i - r * CH;
            const bool on = i < 16 * CH;
            woff[m] = on ? (u32)((size_t)min(wr.r0 + r, wr.rows - 1) * wr.rbytes + part * 16) : ~0u;
            wdst[m] = wbase + r * STRIDE + part * 16;
        }
        const int t = threadIdx.x;
        xs = xq + (size_t)(t >> 4) * k + (t & 15) * 16;
        xstride = (long long)16 * k;
        xdst = MsStage<NT / 8>::W + (t >> 4) * MS_XROW + (t & 15) * 16;
        bs = xb + (size_t)t * 16;
        ks = xk + 4 * t;
        npad = np;
    }

    // Step st into the stage at shared address `stage` (not committed).
    __device__ __forceinline__ void issue(u32 stage, int st) const {
#pragma unroll
        for (int m = 0; m < WM; m++)
            if (woff[m] != ~0u)
                cp_async16(stage + wdst[m], w + woff[m] + (size_t)st * BB, true);
        const i8* x = xs + (size_t)st * 256;
#pragma unroll
        for (int m = 0; m < XM; m++)
            cp_async16(stage + xdst + m * 16 * MS_XROW, x + m * xstride, true);
        const int t = threadIdx.x;
        const size_t kt = (size_t)st * npad;
        constexpr u32 A = MsStage<NT / 8>::W;
        if (t < 2 * NT)
            cp_async16(stage + A + (t >> 1) * MS_XROW + 256 + (t & 1) * 16, bs + kt * 32, true);
        if (t < NT / 4) cp_async16(stage + A + NT * MS_XROW + 16 * t, ks + kt, true);
    }
};

// One step of a warp's rows g / g + 8 (row0 / row1: their blocks in the stage) with the
// staged activations x, into acc: Mk<TY>::step's arithmetic, each sub-block's weights read
// from shared memory where it is multiplied (no register copy of the whole step).
template <int TY> struct MsStep;

template <> struct MsStep<T_Q4_K> {
    template <int J>
    static __device__ __forceinline__ void step(const u8* row0, const u8* row1, const MkS& x,
                                                int c, float (&acc)[J][4]) {
        const uint4 h0 = *(const uint4*)row0, h1 = *(const uint4*)row1;
        const uint4 h[2] = {h0, h1};
        u32 sc[2][2], mg[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const u32 s03 = h[r].y, s47 = h[r].z, s811 = h[r].w;
            sc[r][0] = s03 & 0x3F3F3F3Fu;
            sc[r][1] = (s811 & 0x0F0F0F0Fu) | ((s03 >> 2) & 0x30303030u);
            const u32 mn = c < 2 ? s47 & 0x3F3F3F3Fu
                                 : ((s811 >> 4) & 0x0F0F0F0Fu) | ((s47 >> 2) & 0x30303030u);
            mg[r] = __byte_perm(mn, 0, (c & 1) ? 0x3322 : 0x1100);
        }
        int is[J][4] = {};
#pragma unroll
        for (int blk = 0; blk < 8; blk++) {
            const int off = 16 + 32 * (blk >> 1) + 8 * c, sh = 4 * (blk & 1);
            const uint2 q0 = *(const uint2*)(row0 + off), q1 = *(const uint2*)(row1 + off);
            const u32 a0 = (q0.x >> sh) & 0x0F0F0F0Fu, a1 = (q1.x >> sh) & 0x0F0F0F0Fu;
            const u32 a2 = (q0.y >> sh) & 0x0F0F0F0Fu, a3 = (q1.y >> sh) & 0x0F0F0F0Fu;
            const int bs = 8 * (blk & 3);
            const int s0 = (int)(((blk < 4 ? sc[0][0] : sc[0][1]) >> bs) & 0xFF);
            const int s1 = (int)(((blk < 4 ? sc[1][0] : sc[1][1]) >> bs) & 0xFF);
#pragma unroll
            for (int j = 0; j < J; j++) mk_blk(is[j], a0, a1, a2, a3, x.b(j, blk), s0, s1);
        }
        const float d0 = h2f((u16)(h0.x & 0xFFFF)), n0 = h2f((u16)(h0.x >> 16));
        const float d1 = h2f((u16)(h1.x & 0xFFFF)), n1 = h2f((u16)(h1.x >> 16));
#pragma unroll
        for (int j = 0; j < J; j++) {
            int ms[4];
            mk_group_dot(ms, mg[0], mg[1], x.blo(j), x.bhi(j));
            const float2 dx = x.dx(j);
            acc[j][0] += dx.x * (d0 * (float)is[j][0] - n0 * (float)ms[0]);
            acc[j][1] += dx.y * (d0 * (float)is[j][1] - n0 * (float)ms[1]);
            acc[j][2] += dx.x * (d1 * (float)is[j][2] - n1 * (float)ms[2]);
            acc[j][3] += dx.y * (d1 * (float)is[j][3] - n1 * (float)ms[3]);
        }
    }
};

template <> struct MsStep<T_Q6_K> {
    template <int J>
    static __device__ __forceinline__ void step(const u8* row0, const u8* row1, const MkS& x,
                                                int c, float (&acc)[J][4]) {
        const bool low = c < 2;
        int is[J][4] = {};
#pragma unroll
        for (int s = 0; s < 8; s++) {
            const int hf = s >> 2, qq = s & 3;
            const int lo_off = 64 * hf + 32 * (qq & 1) + 8 * c, hi_off = 128 + 32 * hf + 8 * c;
            const int sl = 4 * (qq >> 1), sh = 2 * qq;
            uint2 v[2];
            int sa[2], sb[2];
            const u8* rows[2] = {row0, row1};
#pragma unroll
            for (int i = 0; i < 2; i++) {
                v[i] = q6k_run(*(const uint2*)(rows[i] + lo_off), *(const uint2*)(rows[i] + hi_off),
                               sl, sh);
                // Both 16-value groups' scales of this 32-value run (bytes 2s, 2s + 1).
                const u32 sw = *(const unsigned short*)(rows[i] + 192 + 2 * s);
                sa[i] = (int)(signed char)(sw & 0xFF);
                sb[i] = (int)(signed char)(sw >> 8);
            }
#pragma unroll
            for (int j = 0; j < J; j++)
                q6k_run_mma(is[j], v, x.b(j, s), low, sa[0], sb[0], sa[1], sb[1]);
        }
        const u32 g0 = *(const u32*)(row0 + 192 + 4 * c), g1 = *(const u32*)(row1 + 192 + 4 * c);
        const float d0 = h2f(*(const u16*)(row0 + 208)), d1 = h2f(*(const u16*)(row1 + 208));
#pragma unroll
        for (int j = 0; j < J; j++) {
            int ms[4];
            mk_group_dot(ms, g0, g1, x.blo(j), x.bhi(j));
            const float2 dx = x.dx(j);
            acc[j][0] += dx.x * d0 * (float)(is[j][0] - 32 * ms[0]);
            acc[j][1] += dx.y * d0 * (float)(is[j][1] - 32 * ms[1]);
            acc[j][2] += dx.x * d1 * (float)(is[j][2] - 32 * ms[2]);
            acc[j][3] += dx.y * d1 * (float)(is[j][3] - 32 * ms[3]);
        }
    }
};

// Steps [s0, s1) of format TY for this warp's rows (the whole block calls it).
// th: the warp's token part (tiles JW · th onwards).
template <int TY, int J>
__device__ __forceinline__ void ms_rows(const WarpRows& wr, int th, int s0, int s1, int k,
                                        int npad, const i8* xq, const float* xk, const i8* xb,
                                        u8* sx, float (&acc)[J / MS_TS][4]) {
    constexpr int NT = 8 * J, STAGE = MsStage<J>::BYTES, JW = J / MS_TS;
    constexpr int STRIDE = TY == T_Q4_K ? 160 : MS_WROW;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int rg = warp % MH_WARPS, t0 = 8 * JW * th;
    const MsCopy<TY, NT> copy(wr, xq, xk, xb, k, npad);
    const u32 sx32 = smem_u32(sx);
    // The blocks start at different steps of their range (the i-th step taken is
    // s0 + (i + rot) % n): launched together, they would otherwise all read the same
    // 256-value column of the matrix at once.
    const int n = s1 - s0, rot = n > 0 ? (int)(blockIdx.x * 7u % (unsigned)n) : 0;
    auto step_of = [&](int i) { return s0 + (i + rot < n ? i + rot : i + rot - n); };
#pragma unroll
    for (int p = 0; p < MS_STAGES - 1; p++) {
        if (p < n) copy.issue(sx32 + p * STAGE, step_of(p));
        cp_async_commit();
    }
    int slot = 0;  // i % MS_STAGES
    for (int i = 0; i < n; i++) {
        static_assert(MS_STAGES == 3, "the wait below leaves MS_STAGES - 2 groups in flight");
        cp_async_wait_prev();
        __syncthreads();  // step i landed for every thread; the stage of i - 1 is free
        const int ahead = i + MS_STAGES - 1;
        const int aslot = slot == 0 ? MS_STAGES - 1 : slot - 1;
        if (ahead < n) copy.issue(sx32 + aslot * STAGE, step_of(ahead));
        cp_async_commit();
        const u8* stage = sx + slot * STAGE;
        const u8* w = stage + rg * 16 * MS_WROW;  // this warp's rows (MsCopy)
        const u8* sa = stage + MsStage<J>::W;
        const MkS xs{sa + (t0 + g) * MS_XROW + 8 * c, sa + (t0 + g) * MS_XROW + 256 + 4 * c,
                     (const float*)(sa + NT * MS_XROW) + t0 + 2 * c};
        MsStep<TY>::template step<JW>(w + g * STRIDE, w + (g + 8) * STRIDE, xs, c, acc);
        slot = slot == MS_STAGES - 1 ? 0 : slot + 1;
    }
    cp_async_wait_all();  // nothing left in flight (empty groups)
}

template <int J> struct MsRows {
    const i8* xq;
    const float* xk;
    const i8* xb;
    int k, npad;
    __device__ __forceinline__ void operator()(int ty, const WarpRows& wr, int th, int s0, int s1,
                                               u8* sx, float (&acc)[J / MS_TS][4]) const {
        switch (ty) {
        case T_Q4_K: ms_rows<T_Q4_K, J>(wr, th, s0, s1, k, npad, xq, xk, xb, sx, acc); break;
        case T_Q6_K: ms_rows<T_Q6_K, J>(wr, th, s0, s1, k, npad, xq, xk, xb, sx, acc); break;
        default: break;
        }
    }
};

// Activations: quantize_x_mmk / rms_norm_mmk for npad = 8J token rows. Dynamic shared
// memory: MS_STAGES · MsStage<J>::BYTES (the host's dynamic_smem).
#define MMS_KERNEL(NAME, J, UP)                                                                \
    extern "C" __global__ void __launch_bounds__(MS_THREADS, J > 4 ? 2 : 3)                    \
        NAME(const i8* xq, const float* xk, const i8* xb, int npad, int splits, float* work,   \
             u32* count, GEMV_PARAMS) {                                                        \
        extern __shared__ __align__(16) u8 ms_smem[];                                          \
        pdl_enter();                                                                           \
        tile_body<J, UP, MS_TS>(MsRows<J>{xq, xk, xb, k, npad}, ms_smem, splits, work, count,  \
                                GEMV_ARGS);                                                    \
    }
MMS_KERNEL(mms_t16, 2, false)
MMS_KERNEL(mms_t32, 4, false)
MMS_KERNEL(mms_t16_gated, 2, true)
MMS_KERNEL(mms_t32_gated, 4, true)
