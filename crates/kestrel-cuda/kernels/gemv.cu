// Matrix-vector products for decode (a few tokens): each weight byte is read once for all
// the step's tokens (up to GV_MAX_T). The lanes of a row read consecutive chunks of the
// row's blocks (coalesced), expand them in registers and dot them with the activations
// (read through L1), then the row's lanes are summed with warp shuffles.
//
// One launch can cover up to three matrices that share the input x (Q, K and V; gate and
// up), each with its own block format, output and optional bias; the format switch is
// uniform across a warp.

#define GV_MAX_T 8
#define GV_THREADS 128

// A byte (0..255) of m as a float minus `offset`: the byte goes into the low mantissa bits
// of 2^23, so the conversion is one byte-permute and one subtraction (exact).
__device__ __forceinline__ float byte_f(u32 m, int j, float magic) {
    return __int_as_float(__byte_perm(m, 0x4B000000u, 0x7540 | j)) - magic;
}
#define MAGIC_0 8388608.0f    // 2^23: unsigned bytes
#define MAGIC_8 8388616.0f    // 2^23 + 8: Q4_0 nibbles
#define MAGIC_16 8388624.0f   // 2^23 + 16: Q5_0 values
#define MAGIC_32 8388640.0f   // 2^23 + 32: Q6_K values
#define MAGIC_128 8388736.0f  // 2^23 + 128: signed bytes xor 0x80

// Dot of `cnt` (multiple of 4) expanded weights with x[0..cnt) of each token, accumulated.
template <int CNT>
__device__ __forceinline__ void dot_tokens(const float* w, const float* x, int k, int n,
                                           float scale, float* acc) {
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++) {
        if (t < n) {
            const float4* xv = (const float4*)(x + (size_t)t * k);
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < CNT / 4; i++) {
                const float4 v = xv[i];
                s = fmaf(w[4 * i], v.x, s);
                s = fmaf(w[4 * i + 1], v.y, s);
                s = fmaf(w[4 * i + 2], v.z, s);
                s = fmaf(w[4 * i + 3], v.w, s);
            }
            acc[t] = fmaf(scale, s, acc[t]);
        }
    }
}

// Scales and minimums (6-bit packed in header bytes 4..15 = h.y, h.z, h.w) of sub-blocks
// 2c and 2c + 1 of a Q4_K block whose first 16 bytes are `h`.
__device__ __forceinline__ void q4k_scale_min_pair(const uint4& h, int c, int* sc, int* mn) {
    const u32 s03 = h.y, s47 = h.z, s811 = h.w;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int j = 2 * c + i;
        if (c < 2) {
            sc[i] = (s03 >> (8 * j)) & 63;
            mn[i] = (s47 >> (8 * j)) & 63;
        } else {
            const int a = j - 4;
            sc[i] = ((s811 >> (8 * a)) & 0xF) | (((s03 >> (8 * a + 6)) & 3) << 4);
            mn[i] = ((s811 >> (8 * a + 4)) & 0xF) | (((s47 >> (8 * a + 6)) & 3) << 4);
        }
    }
}

// Per format: values per unit (one lane's share per step), units per row, and the unit.
template <int TY> struct Fmt;

// Q4_K: a unit is 16 bytes of a block's quants: 16 values of sub-block 2c (low nibbles)
// and 16 of sub-block 2c+1 (high nibbles); 8 units per 144-byte block.
template <> struct Fmt<T_Q4_K> {
    struct Raw {
        uint4 h, q;
    };
    static __device__ __forceinline__ int units(int k) { return k / 32; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        const int blk = u >> 3, v = u & 7, c = v >> 1, l0 = (v & 1) * 16;
        const u8* b = row + (size_t)blk * 144;
        Raw r;
        r.h = *(const uint4*)b;
        r.q = *(const uint4*)(b + 16 + 32 * c + l0);
        return r;
    }
    static __device__ __forceinline__ void calc(const Raw& raw, int u, const float* x, int k,
                                                int n, float* acc) {
        const int blk = u >> 3, v = u & 7, c = v >> 1, l0 = (v & 1) * 16;
        const uint4 h = raw.h, q = raw.q;
        const float d = h2f((u16)(h.x & 0xFFFF)), dmin = h2f((u16)(h.x >> 16));
        int sci[2], mni[2];
        q4k_scale_min_pair(h, c, sci, mni);
        const float sc0 = (float)sci[0], mn0 = (float)mni[0], sc1 = (float)sci[1],
                    mn1 = (float)mni[1];
        const u32 qw[4] = {q.x, q.y, q.z, q.w};
        float lo[16], hi[16];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 l = qw[i] & 0x0F0F0F0Fu, hh = (qw[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                lo[4 * i + j] = byte_f(l, j, MAGIC_0);
                hi[4 * i + j] = byte_f(hh, j, MAGIC_0);
            }
        }
        const int base = blk * 256 + 64 * c + l0;
        const float ds0 = d * sc0, dm0 = dmin * mn0, ds1 = d * sc1, dm1 = dmin * mn1;
#pragma unroll
        for (int t = 0; t < GV_MAX_T; t++) {
            if (t < n) {
                const float4* xa = (const float4*)(x + (size_t)t * k + base);
                const float4* xb = (const float4*)(x + (size_t)t * k + base + 32);
                float sa = 0.0f, sb = 0.0f, xsa = 0.0f, xsb = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float4 a = xa[i], bb = xb[i];
                    sa = fmaf(lo[4 * i], a.x, sa);
                    sa = fmaf(lo[4 * i + 1], a.y, sa);
                    sa = fmaf(lo[4 * i + 2], a.z, sa);
                    sa = fmaf(lo[4 * i + 3], a.w, sa);
                    xsa += (a.x + a.y) + (a.z + a.w);
                    sb = fmaf(hi[4 * i], bb.x, sb);
                    sb = fmaf(hi[4 * i + 1], bb.y, sb);
                    sb = fmaf(hi[4 * i + 2], bb.z, sb);
                    sb = fmaf(hi[4 * i + 3], bb.w, sb);
                    xsb += (bb.x + bb.y) + (bb.z + bb.w);
                }
                acc[t] += (ds0 * sa - dm0 * xsa) + (ds1 * sb - dm1 * xsb);
            }
        }
    }
};

// Q6_K: a unit is 8 positions l0..l0+7 of one 128-value half: 32 values in four groups
// of 8 (each with its own scale); 8 units per block (Q6K_GPU_BYTES: 16-byte aligned).
template <> struct Fmt<T_Q6_K> {
    struct Raw {
        u32 qa[2], qb[2], hw[2];
        int sc[4];
        u16 d;
    };
    static __device__ __forceinline__ int units(int k) { return k / 32; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        const int blk = u >> 3, v = u & 7, hf = v >> 2, l0 = (v & 3) * 8;
        const u8* b = row + (size_t)blk * Q6K_GPU_BYTES;
        const u8* ql = b + 64 * hf + l0;
        const u8* qh = b + 128 + 32 * hf + l0;
        const i8* sc = (const i8*)(b + 192) + 8 * hf + (l0 >> 4);
        Raw r;
        const uint2 a = *(const uint2*)ql, bb = *(const uint2*)(ql + 32), h = *(const uint2*)qh;
        r.qa[0] = a.x;
        r.qa[1] = a.y;
        r.qb[0] = bb.x;
        r.qb[1] = bb.y;
        r.hw[0] = h.x;
        r.hw[1] = h.y;
#pragma unroll
        for (int j = 0; j < 4; j++) r.sc[j] = sc[2 * j];
        r.d = *(const u16*)(b + 208);
        return r;
    }
    static __device__ __forceinline__ void calc(const Raw& raw, int u, const float* x, int k,
                                                int n, float* acc) {
        const int blk = u >> 3, v = u & 7, hf = v >> 2, l0 = (v & 3) * 8;
        const float d = h2f(raw.d);
        const float s0 = d * (float)raw.sc[0], s1 = d * (float)raw.sc[1],
                    s2 = d * (float)raw.sc[2], s3 = d * (float)raw.sc[3];
        float g[4][8];
#pragma unroll
        for (int w = 0; w < 2; w++) {
            const u32 qa = raw.qa[w], qb = raw.qb[w], hw = raw.hw[w];
            const u32 q0 = (qa & 0x0F0F0F0Fu) | ((hw << 4) & 0x30303030u);
            const u32 q1 = (qb & 0x0F0F0F0Fu) | ((hw << 2) & 0x30303030u);
            const u32 q2 = ((qa >> 4) & 0x0F0F0F0Fu) | (hw & 0x30303030u);
            const u32 q3 = ((qb >> 4) & 0x0F0F0F0Fu) | ((hw >> 2) & 0x30303030u);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                g[0][4 * w + j] = byte_f(q0, j, MAGIC_32);
                g[1][4 * w + j] = byte_f(q1, j, MAGIC_32);
                g[2][4 * w + j] = byte_f(q2, j, MAGIC_32);
                g[3][4 * w + j] = byte_f(q3, j, MAGIC_32);
            }
        }
        const float* xr = x + blk * 256 + 128 * hf + l0;
        dot_tokens<8>(g[0], xr, k, n, s0, acc);
        dot_tokens<8>(g[1], xr + 32, k, n, s1, acc);
        dot_tokens<8>(g[2], xr + 64, k, n, s2, acc);
        dot_tokens<8>(g[3], xr + 96, k, n, s3, acc);
    }
};

// Q8_0: a unit is half a block (16 values). Rows as the GPU stores them (Q8_0 / Q4_0,
// `upload_matrix`): the quants of all nb blocks of the row, then their nb f16 scales.
template <> struct Fmt<T_Q8_0> {
    struct Raw {
        u32 q[4];
        u16 d;
    };
    static __device__ __forceinline__ int units(int k) { return k / 16; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        const int blk = u >> 1, hf = u & 1;
        Raw r;
        r.d = *(const u16*)(row + (size_t)nb * 32 + 2 * blk);
        const uint4 q = *(const uint4*)(row + (size_t)blk * 32 + 16 * hf);
        r.q[0] = q.x;
        r.q[1] = q.y;
        r.q[2] = q.z;
        r.q[3] = q.w;
        return r;
    }
    static __device__ __forceinline__ void calc(const Raw& raw, int u, const float* x, int k,
                                                int n, float* acc) {
        const int blk = u >> 1, hf = u & 1;
        const float d = h2f(raw.d);
        float w[16];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 q = raw.q[i] ^ 0x80808080u;
#pragma unroll
            for (int j = 0; j < 4; j++) w[4 * i + j] = byte_f(q, j, MAGIC_128);
        }
        dot_tokens<16>(w, x + blk * 32 + 16 * hf, k, n, d, acc);
    }
};

// Q4_0: a unit is 8 quant bytes of a block (rows as for Q8_0): values 8h..8h+7 (low nibbles) and
// 16+8h..16+8h+7 (high nibbles).
template <> struct Fmt<T_Q4_0> {
    struct Raw {
        u32 q[2];
        u16 d;
    };
    static __device__ __forceinline__ int units(int k) { return k / 16; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        const int blk = u >> 1, hf = u & 1;
        Raw r;
        r.d = *(const u16*)(row + (size_t)nb * 16 + 2 * blk);
        const uint2 q = *(const uint2*)(row + (size_t)blk * 16 + 8 * hf);
        r.q[0] = q.x;
        r.q[1] = q.y;
        return r;
    }
    static __device__ __forceinline__ void calc(const Raw& raw, int u, const float* x, int k,
                                                int n, float* acc) {
        const int blk = u >> 1, hf = u & 1;
        const float d = h2f(raw.d);
        float lo[8], hi[8];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const u32 q = raw.q[i];
            const u32 l = q & 0x0F0F0F0Fu, h = (q >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                lo[4 * i + j] = byte_f(l, j, MAGIC_8);
                hi[4 * i + j] = byte_f(h, j, MAGIC_8);
            }
        }
        const float* xr = x + blk * 32 + 8 * hf;
        dot_tokens<8>(lo, xr, k, n, d, acc);
        dot_tokens<8>(hi, xr + 16, k, n, d, acc);
    }
};

// Q5_0: as Q4_0, with the fifth bits from the block's 32-bit qh.
template <> struct Fmt<T_Q5_0> {
    struct Raw {
        u32 q[2], qh;
        u16 d;
    };
    static __device__ __forceinline__ int units(int k) { return k / 16; }
    // Rows as the GPU stores them: the nb blocks' 16 quant bytes, then their 32-bit qh, then
    // their f16 scales.
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        const int blk = u >> 1, hf = u & 1;
        Raw r;
        r.d = *(const u16*)(row + (size_t)nb * 20 + 2 * blk);
        r.qh = *(const u32*)(row + (size_t)nb * 16 + 4 * blk);
        const uint2 q = *(const uint2*)(row + (size_t)blk * 16 + 8 * hf);
        r.q[0] = q.x;
        r.q[1] = q.y;
        return r;
    }
    static __device__ __forceinline__ void calc(const Raw& raw, int u, const float* x, int k,
                                                int n, float* acc) {
        const int blk = u >> 1, hf = u & 1;
        const float d = h2f(raw.d);
        const u32 qh = raw.qh;
        float lo[8], hi[8];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const u32 q = raw.q[i];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int e = 8 * hf + 4 * i + j;
                const u32 byte = (q >> (8 * j)) & 0xFF;
                const u32 vl = (byte & 0xF) | (((qh >> e) & 1) << 4);
                const u32 vh = (byte >> 4) | (((qh >> (e + 16)) & 1) << 4);
                lo[4 * i + j] = __int_as_float(0x4B000000u | vl) - MAGIC_16;
                hi[4 * i + j] = __int_as_float(0x4B000000u | vh) - MAGIC_16;
            }
        }
        const float* xr = x + blk * 32 + 8 * hf;
        dot_tokens<8>(lo, xr, k, n, d, acc);
        dot_tokens<8>(hi, xr + 16, k, n, d, acc);
    }
};

// IQ4_NL, IQ4_XS, MXFP4: as Q4_0, a unit is 8 quant bytes of a 32-value group (values
// 8h..8h+7 in the low nibbles, 16+8h..16+8h+7 in the high ones), each nibble a level of
// the format's table (lut16) times the group's scale. Rows as the GPU stores them (see
// dequant32): all quants first, then the scales (IQ4_XS: the blocks' 8-byte headers).
template <int TY> struct Lut4 {
    static __device__ __forceinline__ void levels(u32 q, u32& lo, u32& hi) {
        if (TY == T_MXFP4) lut16(q, MXFP4_T0, MXFP4_T1, MXFP4_T2, MXFP4_T3, lo, hi);
        else lut16(q, IQ4NL_T0, IQ4NL_T1, IQ4NL_T2, IQ4NL_T3, lo, hi);
    }
    // The scale of 32-value group g of a row of nb groups.
    static __device__ __forceinline__ float scale(const u8* row, int g, int nb) {
        if (TY == T_MXFP4) return e8m0_half(row[(size_t)nb * 16 + g]);
        if (TY == T_IQ4_NL) return h2f(*(const u16*)(row + (size_t)nb * 16 + 2 * g));
        return iq4xs_scale(*(const uint2*)(row + (size_t)nb * 16 + 8 * (g >> 3)), g & 7);
    }
    // Level byte j of a word of lut16 as a float (exact).
    static __device__ __forceinline__ float level_f(u32 w, int j) {
        return byte_f(w ^ 0x80808080u, j, MAGIC_128);
    }
    struct Raw {
        u32 q[2];
        float d;
    };
    static __device__ __forceinline__ int units(int k) { return k / 16; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        const int g = u >> 1, hf = u & 1;
        Raw r;
        r.d = scale(row, g, nb);
        const uint2 q = *(const uint2*)(row + (size_t)g * 16 + 8 * hf);
        r.q[0] = q.x;
        r.q[1] = q.y;
        return r;
    }
    static __device__ __forceinline__ void calc(const Raw& raw, int u, const float* x, int k,
                                                int n, float* acc) {
        float lo[8], hi[8];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 l, h;
            levels(raw.q[i], l, h);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                lo[4 * i + j] = level_f(l, j);
                hi[4 * i + j] = level_f(h, j);
            }
        }
        const float* xr = x + (u >> 1) * 32 + 8 * (u & 1);
        dot_tokens<8>(lo, xr, k, n, raw.d, acc);
        dot_tokens<8>(hi, xr + 16, k, n, raw.d, acc);
    }
};
template <> struct Fmt<T_IQ4_NL> : Lut4<T_IQ4_NL> {};
template <> struct Fmt<T_IQ4_XS> : Lut4<T_IQ4_XS> {};
template <> struct Fmt<T_MXFP4> : Lut4<T_MXFP4> {};

// F16 / BF16: a unit is 16 bytes (8 values); F32: 16 bytes (4 values).
template <> struct Fmt<T_F16> {
    typedef uint4 Raw;
    static __device__ __forceinline__ int units(int k) { return k / 8; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        return *(const uint4*)(row + (size_t)u * 16);
    }
    static __device__ __forceinline__ void calc(const Raw& raw, int u, const float* x, int k,
                                                int n, float* acc) {
        const uint4 q = raw;
        const u32 qw[4] = {q.x, q.y, q.z, q.w};
        float w[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[2 * i] = h2f((u16)(qw[i] & 0xFFFF));
            w[2 * i + 1] = h2f((u16)(qw[i] >> 16));
        }
        dot_tokens<8>(w, x + u * 8, k, n, 1.0f, acc);
    }
};

template <> struct Fmt<T_BF16> {
    typedef uint4 Raw;
    static __device__ __forceinline__ int units(int k) { return k / 8; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        return *(const uint4*)(row + (size_t)u * 16);
    }
    static __device__ __forceinline__ void calc(const Raw& raw, int u, const float* x, int k,
                                                int n, float* acc) {
        const uint4 q = raw;
        const u32 qw[4] = {q.x, q.y, q.z, q.w};
        float w[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[2 * i] = __int_as_float(qw[i] << 16);
            w[2 * i + 1] = __int_as_float(qw[i] & 0xFFFF0000u);
        }
        dot_tokens<8>(w, x + u * 8, k, n, 1.0f, acc);
    }
};

template <> struct Fmt<T_F32> {
    typedef float4 Raw;
    static __device__ __forceinline__ int units(int k) { return k / 4; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        return *(const float4*)(row + (size_t)u * 16);
    }
    static __device__ __forceinline__ void calc(const Raw& raw, int u, const float* x, int k,
                                                int n, float* acc) {
        const float4 q = raw;
        const float w[4] = {q.x, q.y, q.z, q.w};
        dot_tokens<4>(w, x + u * 4, k, n, 1.0f, acc);
    }
};

// This lane's share of the dot products of one row with the n tokens of x. Two units'
// loads are issued before either is expanded, so more bytes are in flight per lane.
template <int TY>
__device__ __forceinline__ void row_dot(const u8* row, const float* x, int k, int n, int li,
                                        int nl, float* acc) {
    typedef Fmt<TY> F;
    const int units = F::units(k);
    for (int u = li; u < units; u += 2 * nl) {
        const bool two = u + nl < units;
        const typename F::Raw a = F::load(row, u, k >> 5);
        typename F::Raw b;
        if (two) b = F::load(row, u + nl, k >> 5);
        F::calc(a, u, x, k, n, acc);
        if (two) F::calc(b, u + nl, x, k, n, acc);
    }
}

// The same for two rows of one format (gate and up): all four units' loads first.
template <int TY>
__device__ __forceinline__ void row_dot2(const u8* r0, const u8* r1, const float* x, int k,
                                         int n, int li, int nl, float* acc0, float* acc1) {
    typedef Fmt<TY> F;
    const int units = F::units(k);
    for (int u = li; u < units; u += 2 * nl) {
        const bool two = u + nl < units;
        const typename F::Raw a0 = F::load(r0, u, k >> 5);
        const typename F::Raw a1 = F::load(r1, u, k >> 5);
        typename F::Raw b0, b1;
        if (two) {
            b0 = F::load(r0, u + nl, k >> 5);
            b1 = F::load(r1, u + nl, k >> 5);
        }
        F::calc(a0, u, x, k, n, acc0);
        F::calc(a1, u, x, k, n, acc1);
        if (two) {
            F::calc(b0, u + nl, x, k, n, acc0);
            F::calc(b1, u + nl, x, k, n, acc1);
        }
    }
}

// Returns false for a format row_dot2 does not cover.
__device__ __forceinline__ bool row_dot2_any(int ty, const u8* r0, const u8* r1, const float* x,
                                             int k, int n, int li, int nl, float* acc0,
                                             float* acc1) {
    switch (ty) {
    case T_Q4_K: row_dot2<T_Q4_K>(r0, r1, x, k, n, li, nl, acc0, acc1); return true;
    case T_Q6_K: row_dot2<T_Q6_K>(r0, r1, x, k, n, li, nl, acc0, acc1); return true;
    case T_Q8_0: row_dot2<T_Q8_0>(r0, r1, x, k, n, li, nl, acc0, acc1); return true;
    case T_Q4_0: row_dot2<T_Q4_0>(r0, r1, x, k, n, li, nl, acc0, acc1); return true;
    case T_IQ4_NL: row_dot2<T_IQ4_NL>(r0, r1, x, k, n, li, nl, acc0, acc1); return true;
    case T_IQ4_XS: row_dot2<T_IQ4_XS>(r0, r1, x, k, n, li, nl, acc0, acc1); return true;
    case T_MXFP4: row_dot2<T_MXFP4>(r0, r1, x, k, n, li, nl, acc0, acc1); return true;
    case T_F16: row_dot2<T_F16>(r0, r1, x, k, n, li, nl, acc0, acc1); return true;
    default: return false;
    }
}

__device__ __forceinline__ void row_dot_any(int ty, const u8* row, const float* x, int k, int n,
                                            int li, int nl, float* acc) {
    switch (ty) {
    case T_Q4_K: row_dot<T_Q4_K>(row, x, k, n, li, nl, acc); break;
    case T_Q6_K: row_dot<T_Q6_K>(row, x, k, n, li, nl, acc); break;
    case T_Q8_0: row_dot<T_Q8_0>(row, x, k, n, li, nl, acc); break;
    case T_Q4_0: row_dot<T_Q4_0>(row, x, k, n, li, nl, acc); break;
    case T_Q5_0: row_dot<T_Q5_0>(row, x, k, n, li, nl, acc); break;
    case T_IQ4_NL: row_dot<T_IQ4_NL>(row, x, k, n, li, nl, acc); break;
    case T_IQ4_XS: row_dot<T_IQ4_XS>(row, x, k, n, li, nl, acc); break;
    case T_MXFP4: row_dot<T_MXFP4>(row, x, k, n, li, nl, acc); break;
    case T_F16: row_dot<T_F16>(row, x, k, n, li, nl, acc); break;
    case T_BF16: row_dot<T_BF16>(row, x, k, n, li, nl, acc); break;
    case T_F32: row_dot<T_F32>(row, x, k, n, li, nl, acc); break;
    default: break;
    }
}

// Sums acc over the warps of a row (wpr of them); the result is valid in the row's first
// warp. `red` holds GV_THREADS/32 × GV_MAX_T floats.
__device__ __forceinline__ void row_reduce(float* acc, int n, int wpr, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++)
        if (t < n) acc[t] = warp_sum(acc[t]);
    if (wpr == 1) return;
    if (lane == 0)
#pragma unroll
        for (int t = 0; t < GV_MAX_T; t++) red[warp * GV_MAX_T + t] = acc[t];
    __syncthreads();
    if (warp % wpr == 0)
        for (int w = 1; w < wpr; w++)
#pragma unroll
            for (int t = 0; t < GV_MAX_T; t++) acc[t] += red[(warp + w) * GV_MAX_T + t];
}

__device__ __forceinline__ float gv_act(float g, int act) {
    if (act == 0) return g / (1.0f + expf(-g));
    const float sqrt_2_over_pi = 0.7978846f, coef_a = 0.044715f;
    return 0.5f * g * (1.0f + tanhf(sqrt_2_over_pi * g * (1.0f + coef_a * g * g)));
}

// out_s[t][r] = dot(W_s[r], x[t]) (+ bias_s[r]) for the rows of up to three matrices laid
// end to end (rows0 + rows1 + rows2 = total). With gated != 0 there are two matrices of
// rows0 rows (gate, up) and out0[t][r] = act(gate·x) * (up·x), act 0 = SiLU, 1 = GELU.
// Each block has GV_THREADS threads and handles rpb rows (1, 2 or 4), 4/rpb warps per row.
// out rows have ld_s floats.
// The body of gemv (2..8 tokens of the formats and paths the other kernels do not take).
__device__ __forceinline__ void
gemv_body(const float* x, int k, int n, int rpb, int total, int gated, int act,
     const u8* w0, long long rb0, int ty0, int rows0, float* out0, int ld0, const float* bias0,
     const u8* w1, long long rb1, int ty1, int rows1, float* out1, int ld1, const float* bias1,
     const u8* w2, long long rb2, int ty2, float* out2, int ld2, const float* bias2, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wpr = (GV_THREADS / 32) / rpb;
    const int r = blockIdx.x * rpb + warp / wpr;
    const int li = (warp % wpr) * 32 + lane, nl = wpr * 32;
    const bool active = r < total;

    // Which matrix this row belongs to.
    const u8* w = w0;
    long long rb = rb0;
    int ty = ty0, lr = r, ld = ld0;
    float* out = out0;
    const float* bias = bias0;
    if (!gated && r >= rows0) {
        if (r < rows0 + rows1) {
            w = w1; rb = rb1; ty = ty1; lr = r - rows0; out = out1; ld = ld1; bias = bias1;
        } else {
            w = w2; rb = rb2; ty = ty2; lr = r - rows0 - rows1; out = out2; ld = ld2;
            bias = bias2;
        }
    }

    float acc[GV_MAX_T];
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++) acc[t] = 0.0f;
    if (gated) {
        float up[GV_MAX_T];
#pragma unroll
        for (int t = 0; t < GV_MAX_T; t++) up[t] = 0.0f;
        if (active) {
            const u8* rg = w0 + (size_t)r * rb0;
            const u8* ru = w1 + (size_t)r * rb1;
            if (ty0 != ty1 || !row_dot2_any(ty0, rg, ru, x, k, n, li, nl, acc, up)) {
                row_dot_any(ty0, rg, x, k, n, li, nl, acc);
                row_dot_any(ty1, ru, x, k, n, li, nl, up);
            }
        }
        row_reduce(acc, n, wpr, red);
        if (wpr > 1) __syncthreads();  // red is reused
        row_reduce(up, n, wpr, red);
        if (active && li == 0)
#pragma unroll
            for (int t = 0; t < GV_MAX_T; t++)
                if (t < n) out0[(size_t)t * ld0 + r] = gv_act(acc[t], act) * up[t];
        return;
    }
    if (active) row_dot_any(ty, w + (size_t)lr * rb, x, k, n, li, nl, acc);
    row_reduce(acc, n, wpr, red);
    if (active && li == 0) {
        const float b = bias ? bias[lr] : 0.0f;
#pragma unroll
        for (int t = 0; t < GV_MAX_T; t++)
            if (t < n) out[(size_t)t * ld + lr] = acc[t] + b;
    }
}

#define GEMV_PARAMS                                                                            \
    const float *x, int k, int n, int rpb, int total, int gated, int act, const u8 *w0,         \
        long long rb0, int ty0, int rows0, float *out0, int ld0, const float *bias0,            \
        const u8 *w1, long long rb1, int ty1, int rows1, float *out1, int ld1,                  \
        const float *bias1, const u8 *w2, long long rb2, int ty2, float *out2, int ld2,         \
        const float *bias2

// Up to GV_MAX_T tokens.
extern "C" __global__ void __launch_bounds__(GV_THREADS) gemv(GEMV_PARAMS) {
    pdl_enter();
    __shared__ float red[(GV_THREADS / 32) * GV_MAX_T];
    gemv_body(x, k, n, rpb, total, gated, act, w0, rb0, ty0, rows0, out0, ld0, bias0, w1, rb1,
              ty1, rows1, out1, ld1, bias1, w2, rb2, ty2, out2, ld2, bias2, red);
}

// ---------------------------------------------------------------------------------------
// Single-token GEMV (decode of one sequence), the hot path of generation. Each warp owns
// GD_R whole rows of one matrix: its lanes stride over the rows' units, issuing the loads
// of GD_U units × GD_R rows before any math (bytes in flight hide DRAM latency), and each
// unit's activations are read once into registers and reused for the GD_R rows. A row's
// sum is a warp shuffle reduction: no shared memory, no block barrier.

#define GD_WARPS 4

// Activations of unit u (the values Fmt<TY>::calc reads for one token) into registers.
template <int TY> struct Unit1;

template <> struct Unit1<T_Q4_K> {
    // 32 activations, then the sums of each half (the minimum's term), shared by the rows.
    enum { XN = 34 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
        const int blk = u >> 3, v = u & 7, c = v >> 1, l0 = (v & 1) * 16;
        const float4* a = (const float4*)(x + blk * 256 + 64 * c + l0);
        const float4* b = (const float4*)(x + blk * 256 + 64 * c + l0 + 32);
        float xsa = 0.0f, xsb = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float4 p = a[i], q = b[i];
            xv[4 * i] = p.x; xv[4 * i + 1] = p.y; xv[4 * i + 2] = p.z; xv[4 * i + 3] = p.w;
            xv[16 + 4 * i] = q.x; xv[16 + 4 * i + 1] = q.y;
            xv[16 + 4 * i + 2] = q.z; xv[16 + 4 * i + 3] = q.w;
            xsa += (p.x + p.y) + (p.z + p.w);
            xsb += (q.x + q.y) + (q.z + q.w);
        }
        xv[32] = xsa;
        xv[33] = xsb;
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q4_K>::Raw& raw, int u,
                                                const float* xv) {
        const int v = u & 7, c = v >> 1;
        const uint4 h = raw.h, q = raw.q;
        const float d = h2f((u16)(h.x & 0xFFFF)), dmin = h2f((u16)(h.x >> 16));
        int sci[2], mni[2];
        q4k_scale_min_pair(h, c, sci, mni);
        const float sc0 = (float)sci[0], mn0 = (float)mni[0], sc1 = (float)sci[1],
                    mn1 = (float)mni[1];
        const u32 qw[4] = {q.x, q.y, q.z, q.w};
        float sa = 0.0f, sb = 0.0f;
        const float xsa = xv[32], xsb = xv[33];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 l = qw[i] & 0x0F0F0F0Fu, hh = (qw[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                sa = fmaf(byte_f(l, j, MAGIC_0), xv[4 * i + j], sa);
                sb = fmaf(byte_f(hh, j, MAGIC_0), xv[16 + 4 * i + j], sb);
            }
        }
        return (d * sc0 * sa - dmin * mn0 * xsa) + (d * sc1 * sb - dmin * mn1 * xsb);
    }
};

template <> struct Unit1<T_Q6_K> {
    enum { XN = 32 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
        const int blk = u >> 3, v = u & 7, hf = v >> 2, l0 = (v & 3) * 8;
        const float* xr = x + blk * 256 + 128 * hf + l0;
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const float4 p = *(const float4*)(xr + 32 * g), q = *(const float4*)(xr + 32 * g + 4);
            xv[8 * g] = p.x; xv[8 * g + 1] = p.y; xv[8 * g + 2] = p.z; xv[8 * g + 3] = p.w;
            xv[8 * g + 4] = q.x; xv[8 * g + 5] = q.y; xv[8 * g + 6] = q.z; xv[8 * g + 7] = q.w;
        }
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q6_K>::Raw& raw, int u,
                                                const float* xv) {
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < 2; w++) {
            const u32 qa = raw.qa[w], qb = raw.qb[w], hw = raw.hw[w];
            const u32 q4[4] = {(qa & 0x0F0F0F0Fu) | ((hw << 4) & 0x30303030u),
                               (qb & 0x0F0F0F0Fu) | ((hw << 2) & 0x30303030u),
                               ((qa >> 4) & 0x0F0F0F0Fu) | (hw & 0x30303030u),
                               ((qb >> 4) & 0x0F0F0F0Fu) | ((hw >> 2) & 0x30303030u)};
#pragma unroll
            for (int g = 0; g < 4; g++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    s[g] = fmaf(byte_f(q4[g], j, MAGIC_32), xv[8 * g + 4 * w + j], s[g]);
        }
        return h2f(raw.d) * ((float)raw.sc[0] * s[0] + (float)raw.sc[1] * s[1] +
                             (float)raw.sc[2] * s[2] + (float)raw.sc[3] * s[3]);
    }
};

template <> struct Unit1<T_Q8_0> {
    enum { XN = 16 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
        const float4* p = (const float4*)(x + (u >> 1) * 32 + 16 * (u & 1));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float4 a = p[i];
            xv[4 * i] = a.x; xv[4 * i + 1] = a.y; xv[4 * i + 2] = a.z; xv[4 * i + 3] = a.w;
        }
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q8_0>::Raw& raw, int u,
                                                const float* xv) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 q = raw.q[i] ^ 0x80808080u;
#pragma unroll
            for (int j = 0; j < 4; j++) s = fmaf(byte_f(q, j, MAGIC_128), xv[4 * i + j], s);
        }
        return h2f(raw.d) * s;
    }
};

// Q4_0 and Q5_0: values 8h..8h+7 and 16+8h..16+8h+7 of a 32-value block.
__device__ __forceinline__ void load_x_half_pairs(const float* x, int u, float* xv) {
    const float* xr = x + (u >> 1) * 32 + 8 * (u & 1);
#pragma unroll
    for (int g = 0; g < 2; g++) {
        const float4 p = *(const float4*)(xr + 16 * g), q = *(const float4*)(xr + 16 * g + 4);
        xv[8 * g] = p.x; xv[8 * g + 1] = p.y; xv[8 * g + 2] = p.z; xv[8 * g + 3] = p.w;
        xv[8 * g + 4] = q.x; xv[8 * g + 5] = q.y; xv[8 * g + 6] = q.z; xv[8 * g + 7] = q.w;
    }
}

template <> struct Unit1<T_Q4_0> {
    enum { XN = 16 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
        load_x_half_pairs(x, u, xv);
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q4_0>::Raw& raw, int u,
                                                const float* xv) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const u32 l = raw.q[i] & 0x0F0F0F0Fu, h = (raw.q[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                s = fmaf(byte_f(l, j, MAGIC_8), xv[4 * i + j], s);
                s = fmaf(byte_f(h, j, MAGIC_8), xv[8 + 4 * i + j], s);
            }
        }
        return h2f(raw.d) * s;
    }
};

template <> struct Unit1<T_Q5_0> {
    enum { XN = 16 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
        load_x_half_pairs(x, u, xv);
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q5_0>::Raw& raw, int u,
                                                const float* xv) {
        const int hf = u & 1;
        const u32 qh = raw.qh;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const u32 q = raw.q[i];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int e = 8 * hf + 4 * i + j;
                const u32 byte = (q >> (8 * j)) & 0xFF;
                const u32 vl = (byte & 0xF) | (((qh >> e) & 1) << 4);
                const u32 vh = (byte >> 4) | (((qh >> (e + 16)) & 1) << 4);
                s = fmaf(__int_as_float(0x4B000000u | vl) - MAGIC_16, xv[4 * i + j], s);
                s = fmaf(__int_as_float(0x4B000000u | vh) - MAGIC_16, xv[8 + 4 * i + j], s);
            }
        }
        return h2f(raw.d) * s;
    }
};

// IQ4_NL, IQ4_XS, MXFP4 (Lut4's units).
template <int TY> struct Unit1Lut4 {
    enum { XN = 16 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
        load_x_half_pairs(x, u, xv);
    }
    static __device__ __forceinline__ float dot(const typename Lut4<TY>::Raw& raw, int,
                                                const float* xv) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 l, h;
            Lut4<TY>::levels(raw.q[i], l, h);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                s = fmaf(Lut4<TY>::level_f(l, j), xv[4 * i + j], s);
                s = fmaf(Lut4<TY>::level_f(h, j), xv[8 + 4 * i + j], s);
            }
        }
        return raw.d * s;
    }
};
template <> struct Unit1<T_IQ4_NL> : Unit1Lut4<T_IQ4_NL> {};
template <> struct Unit1<T_IQ4_XS> : Unit1Lut4<T_IQ4_XS> {};
template <> struct Unit1<T_MXFP4> : Unit1Lut4<T_MXFP4> {};

template <> struct Unit1<T_F16> {
    enum { XN = 8 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
        const float4 p = *(const float4*)(x + u * 8), q = *(const float4*)(x + u * 8 + 4);
        xv[0] = p.x; xv[1] = p.y; xv[2] = p.z; xv[3] = p.w;
        xv[4] = q.x; xv[5] = q.y; xv[6] = q.z; xv[7] = q.w;
    }
    static __device__ __forceinline__ float dot(const uint4& raw, int, const float* xv) {
        const u32 qw[4] = {raw.x, raw.y, raw.z, raw.w};
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s = fmaf(h2f((u16)(qw[i] & 0xFFFF)), xv[2 * i], s);
            s = fmaf(h2f((u16)(qw[i] >> 16)), xv[2 * i + 1], s);
        }
        return s;
    }
};

// F16 / BF16 rows of a multiple of 16 values for the single-token gemv_dec: units of 32
// bytes (16 values, two 16-byte loads), twice the bytes in flight per lane of the 16-byte
// unit, dotted in two FMA chains (kernel-internal ids, as T_Q4_K_W).
#define T_F16_W 113
#define T_BF16_W 117
template <> struct Fmt<T_F16_W> {
    struct Raw {
        uint4 a, b;
    };
    static __device__ __forceinline__ int units(int k) { return k / 16; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int) {
        const uint4* p = (const uint4*)(row + (size_t)u * 32);
        return {p[0], p[1]};
    }
};
template <> struct Fmt<T_BF16_W> : Fmt<T_F16_W> {};

// The value in the low / high half of w (F16, or with BF the top bits of an f32).
template <bool BF> __device__ __forceinline__ float half_lo(u32 w) {
    return BF ? __int_as_float(w << 16) : h2f((u16)(w & 0xFFFF));
}
template <bool BF> __device__ __forceinline__ float half_hi(u32 w) {
    return BF ? __int_as_float(w & 0xFFFF0000u) : h2f((u16)(w >> 16));
}
template <bool BF> struct Unit1Half16 {
    enum { XN = 16 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float4 p = *(const float4*)(x + u * 16 + 4 * i);
            xv[4 * i] = p.x; xv[4 * i + 1] = p.y; xv[4 * i + 2] = p.z; xv[4 * i + 3] = p.w;
        }
    }
    static __device__ __forceinline__ float dot(const Fmt<T_F16_W>::Raw& raw, int,
                                                const float* xv) {
        const u32 qw[8] = {raw.a.x, raw.a.y, raw.a.z, raw.a.w, raw.b.x, raw.b.y, raw.b.z, raw.b.w};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s0 = fmaf(half_lo<BF>(qw[i]), xv[2 * i], s0);
            s0 = fmaf(half_hi<BF>(qw[i]), xv[2 * i + 1], s0);
            s1 = fmaf(half_lo<BF>(qw[4 + i]), xv[8 + 2 * i], s1);
            s1 = fmaf(half_hi<BF>(qw[4 + i]), xv[8 + 2 * i + 1], s1);
        }
        return s0 + s1;
    }
};
template <> struct Unit1<T_F16_W> : Unit1Half16<false> {};
template <> struct Unit1<T_BF16_W> : Unit1Half16<true> {};

template <> struct Unit1<T_BF16> {
    enum { XN = 8 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
        Unit1<T_F16>::load_x(x, u, xv);
    }
    static __device__ __forceinline__ float dot(const uint4& raw, int, const float* xv) {
        const u32 qw[4] = {raw.x, raw.y, raw.z, raw.w};
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s = fmaf(__int_as_float(qw[i] << 16), xv[2 * i], s);
            s = fmaf(__int_as_float(qw[i] & 0xFFFF0000u), xv[2 * i + 1], s);
        }
        return s;
    }
};

template <> struct Unit1<T_F32> {
    enum { XN = 4 };
    static __device__ __forceinline__ void load_x(const float* x, int u, float* xv) {
        const float4 p = *(const float4*)(x + u * 4);
        xv[0] = p.x; xv[1] = p.y; xv[2] = p.z; xv[3] = p.w;
    }
    static __device__ __forceinline__ float dot(const float4& raw, int, const float* xv) {
        return fmaf(raw.x, xv[0], fmaf(raw.y, xv[1], fmaf(raw.z, xv[2], raw.w * xv[3])));
    }
};

// Loads units u0 + 32 j (j < NU, those below `units`) of `nr` rows `rb` bytes apart, and
// with UP the same units of the up rows: all loads of a step issued before any math.
template <int TY, bool UP, int GD_R, int NU>
__device__ __forceinline__ void load_units(
    const u8* w, const u8* up, long long rb, int nr, int u0, int units, int nb,
    typename Fmt<TY>::Raw (&raw)[NU][GD_R],
    typename Fmt<TY>::Raw (&raw_up)[UP ? NU : 1][UP ? GD_R : 1]) {
    typedef Fmt<TY> F;
#pragma unroll
    for (int j = 0; j < NU; j++) {
        const int u = u0 + 32 * j;
        if (u < units)
#pragma unroll
            for (int i = 0; i < GD_R; i++)
                if (i < nr) {
                    raw[j][i] = F::load(w + i * rb, u, nb);
                    if (UP) raw_up[UP ? j : 0][UP ? i : 0] = F::load(up + i * rb, u, nb);
                }
    }
}

// This lane's share of `nr` (<= GD_R) rows' dot products with x (rows `rb` bytes apart).
// With `up` set the same rows of a second matrix are summed into acc_up too (gate/up).
template <int TY, bool UP, int GD_R, int GD_U>
__device__ __forceinline__ void rows_dot1(const u8* w, const u8* up, long long rb, int nr,
                                          const float* x, int k, int lane, float* acc,
                                          float* acc_up) {
    typedef Fmt<TY> F;
    typedef Unit1<TY> U1;
    // Gate/up launches hold twice the rows' bytes per unit: half the units in flight.
    constexpr int NU = UP ? 1 : GD_U;
    const int units = F::units(k);
    for (int u0 = lane; u0 < units; u0 += 32 * NU) {
        typename F::Raw raw[NU][GD_R], raw_up[UP ? NU : 1][UP ? GD_R : 1];
        load_units<TY, UP, GD_R, NU>(w, up, rb, nr, u0, units, k >> 5, raw, raw_up);
#pragma unroll
        for (int j = 0; j < NU; j++) {
            const int u = u0 + 32 * j;
            if (u < units) {
                float xv[U1::XN];
                U1::load_x(x, u, xv);
#pragma unroll
                for (int i = 0; i < GD_R; i++)
                    if (i < nr) {
                        acc[i] += U1::dot(raw[j][i], u, xv);
                        if (UP) acc_up[i] += U1::dot(raw_up[UP ? j : 0][UP ? i : 0], u, xv);
                    }
            }
        }
    }
}

#define ROWS_DOT1_CASE(T)                                                                      \
    case T:                                                                                    \
        if (up) rows_dot1<T, true, GD_R, GD_U>(w, up, rb, nr, x, k, lane, acc, acc_up);        \
        else rows_dot1<T, false, GD_R, GD_U>(w, up, rb, nr, x, k, lane, acc, acc_up);          \
        return true;

// F16 / BF16 (T): rows of a multiple of 16 values in 32-byte units (TW).
#define ROWS_DOT1_HALF_CASE(T, TW)                                                             \
    case T:                                                                                    \
        if (k % 16 == 0) {                                                                     \
            if (up) rows_dot1<TW, true, GD_R, GD_U>(w, up, rb, nr, x, k, lane, acc, acc_up);   \
            else rows_dot1<TW, false, GD_R, GD_U>(w, up, rb, nr, x, k, lane, acc, acc_up);     \
            return true;                                                                       \
        }                                                                                      \
        if (up) rows_dot1<T, true, GD_R, GD_U>(w, up, rb, nr, x, k, lane, acc, acc_up);        \
        else rows_dot1<T, false, GD_R, GD_U>(w, up, rb, nr, x, k, lane, acc, acc_up);          \
        return true;

// `up` null: plain rows; otherwise gate (w) and up rows of the same format together.
template <int GD_R, int GD_U>
__device__ __forceinline__ bool rows_dot1_any(int ty, const u8* w, const u8* up, long long rb,
                                              int nr, const float* x, int k, int lane,
                                              float* acc, float* acc_up) {
    switch (ty) {
    ROWS_DOT1_CASE(T_Q4_K)
    ROWS_DOT1_CASE(T_Q6_K)
    ROWS_DOT1_CASE(T_Q8_0)
    ROWS_DOT1_CASE(T_Q4_0)
    ROWS_DOT1_CASE(T_Q5_0)
    ROWS_DOT1_CASE(T_IQ4_NL)
    ROWS_DOT1_CASE(T_IQ4_XS)
    ROWS_DOT1_CASE(T_MXFP4)
    ROWS_DOT1_HALF_CASE(T_F16, T_F16_W)
    ROWS_DOT1_HALF_CASE(T_BF16, T_BF16_W)
    ROWS_DOT1_CASE(T_F32)
    default: return false;
    }
}

// The matrix and first row of the GD_R rows that work item `gw` (a warp of a gemv_dec /
// gemv_q8 launch, a block of an mmq launch) owns: matrix 0's rows first, then matrix 1's,
// then matrix 2's (gated launches: gate's rows, read together with up's). False for items
// past the last row.
struct GvRows {
    const u8* w;
    long long rb;
    int ty, rows, r0, ld;
    float* out;
    const float* bias;
};

template <int GD_R>
__device__ __forceinline__ bool gv_pick_rows(int gw, int total, int gated, const u8* w0, long long rb0,
                                             int ty0, int rows0, float* out0, int ld0,
                                             const float* bias0, const u8* w1, long long rb1,
                                             int ty1, int rows1, float* out1, int ld1,
                                             const float* bias1, const u8* w2, long long rb2,
                                             int ty2, float* out2, int ld2,
                                             const float* bias2, GvRows& g) {
    const int rows2 = gated ? 0 : total - rows0 - rows1;
    const int wa0 = (rows0 + GD_R - 1) / GD_R;
    const int wa1 = gated ? 0 : (rows1 + GD_R - 1) / GD_R;
    const int wa2 = gated ? 0 : (rows2 + GD_R - 1) / GD_R;
    if (gw < wa0) {
        g = {w0, rb0, ty0, rows0, gw * GD_R, ld0, out0, bias0};
    } else if (gw < wa0 + wa1) {
        g = {w1, rb1, ty1, rows1, (gw - wa0) * GD_R, ld1, out1, bias1};
    } else if (gw < wa0 + wa1 + wa2) {
        g = {w2, rb2, ty2, rows2, (gw - wa0 - wa1) * GD_R, ld2, out2, bias2};
    } else {
        return false;
    }
    return true;
}


// ---------------------------------------------------------------------------------------
// Single-token GEMV on 8-bit activations: x is first quantized in blocks of 32 values
// (quantize_x_q8: d = max|x| / 127, q = round(x / d)), then each weight unit is dotted with
// the int8 activations by dp4a (4 multiply-adds per instruction) and scaled once per
// group. Same warp layout as gemv_dec; about a quarter of its instructions per weight and
// a quarter of its activation traffic. llama.cpp's GPU decode does the same (Q8_1).

__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ int dp4a_ss(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// One warp per 32-value block of x (k a multiple of 32).
extern "C" __global__ void quantize_x_q8(const float* x, int k, i8* q, float* d) {
    pdl_enter();
    const int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (b * 32 >= k) return;
    float scale;
    q[b * 32 + lane] = (i8)warp_q8(x[b * 32 + lane], scale);
    if (lane == 0) d[b] = scale;
}

// Activations of a unit as int8 words, their block scales and sums (shared by the rows).
template <int TY> struct Unit8;

// Q4_K unit: 16 values of sub-block 2c (low nibbles) and 16 of 2c+1 (high nibbles).
template <> struct Unit8<T_Q4_K> {
    struct X {
        int a[4], b[4];
        float da, db;
        int sa, sb;
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const int blk = u >> 3, v = u & 7, c = v >> 1, l0 = (v & 1) * 16;
        const int base = blk * 256 + 64 * c + l0;
        const int4 p = *(const int4*)(xq + base), r = *(const int4*)(xq + base + 32);
        X x;
        x.a[0] = p.x; x.a[1] = p.y; x.a[2] = p.z; x.a[3] = p.w;
        x.b[0] = r.x; x.b[1] = r.y; x.b[2] = r.z; x.b[3] = r.w;
        x.da = xd[blk * 8 + 2 * c];
        x.db = xd[blk * 8 + 2 * c + 1];
        x.sa = x.sb = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            x.sa = dp4a_ss(0x01010101, x.a[i], x.sa);
            x.sb = dp4a_ss(0x01010101, x.b[i], x.sb);
        }
        return x;
    }
    // The unit's weights decoded (nibble words, scales and minimums, d and dmin): what
    // dot needs of them, made once for all tokens of a multi-token launch (rows_dot8_t).
    struct W {
        u32 lo[4], hi[4];
        float d, dmin;
        int sc0, mn0, sc1, mn1;
    };
    static __device__ __forceinline__ W prep(const Fmt<T_Q4_K>::Raw& raw, int u) {
        const int v = u & 7, c = v >> 1;
        const uint4 h = raw.h, q = raw.q;
        W w;
        w.d = h2f((u16)(h.x & 0xFFFF));
        w.dmin = h2f((u16)(h.x >> 16));
        int sc[2], mn[2];
        q4k_scale_min_pair(h, c, sc, mn);
        w.sc0 = sc[0]; w.mn0 = mn[0]; w.sc1 = sc[1]; w.mn1 = mn[1];
        const u32 qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.lo[i] = qw[i] & 0x0F0F0F0Fu;
            w.hi[i] = (qw[i] >> 4) & 0x0F0F0F0Fu;
        }
        return w;
    }
    static __device__ __forceinline__ float dotp(const W& w, const X& x) {
        int ia = 0, ib = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ia = dp4a_us(w.lo[i], x.a[i], ia);
            ib = dp4a_us(w.hi[i], x.b[i], ib);
        }
        return x.da * (w.d * (float)(w.sc0 * ia) - w.dmin * (float)(w.mn0 * x.sa)) +
               x.db * (w.d * (float)(w.sc1 * ib) - w.dmin * (float)(w.mn1 * x.sb));
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q4_K>::Raw& raw, int u, const X& x) {
        return dotp(prep(raw, u), x);
    }
};

// Q4_K for the single-token gemv_q8 (a kernel-internal format id, never sent by the host):
// a unit is a whole sub-block pair c of a block, 32 quant bytes = 64 values, so a lane
// decodes a block header once per 64 values instead of once per 32 (4 units a block). A
// lane's c = u & 3 = lane & 3 stays the same over its loop.
#define T_Q4_K_W 112
template <> struct Fmt<T_Q4_K_W> {
    struct Raw {
        uint4 h, q0, q1;
    };
    static __device__ __forceinline__ int units(int k) { return k / 64; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int) {
        // b: the unit's quants; the block's 16 header bytes are 16 + 32 (u & 3) before them
        // (addressed from b, which measured shorter loops than from the block's start).
        const u8* b = row + (size_t)(u >> 2) * 144 + 16 + 32 * (u & 3);
        Raw r;
        r.h = *(const uint4*)(b - 16 - 32 * (u & 3));
        r.q0 = *(const uint4*)b;
        r.q1 = *(const uint4*)(b + 16);
        return r;
    }
};

template <> struct Unit8<T_Q4_K_W> {
    struct X {
        int a[8], b[8];
        float da, db;
        int sa, sb;
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const int base = (u >> 2) * 256 + 64 * (u & 3);
        X x;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int4 p = *(const int4*)(xq + base + 16 * i);
            const int4 r = *(const int4*)(xq + base + 32 + 16 * i);
            x.a[4 * i] = p.x; x.a[4 * i + 1] = p.y; x.a[4 * i + 2] = p.z; x.a[4 * i + 3] = p.w;
            x.b[4 * i] = r.x; x.b[4 * i + 1] = r.y; x.b[4 * i + 2] = r.z; x.b[4 * i + 3] = r.w;
        }
        const float2 dd = *(const float2*)(xd + 2 * u);
        x.da = dd.x;
        x.db = dd.y * 0.0625f;  // dot's high-nibble sums come out 16 times too large
        x.sa = x.sb = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            x.sa = dp4a_ss(0x01010101, x.a[i], x.sa);
            x.sb = dp4a_ss(0x01010101, x.b[i], x.sb);
        }
        x.sb *= 16;
        return x;
    }
    // Scales and minimums of sub-blocks 2c, 2c + 1 two at a time (bytes 0 and 1 of sc01 /
    // mn01), without branching on c: for c < 2 they are bytes 2c, 2c + 1 of header words
    // y (scales) and z (minimums), 6 bits each; for c >= 2 the low 4 bits come from word w's
    // nibbles and the top 2 from bits 6..7 of y's (scales) or z's (minimums) bytes.
    // The high nibbles are dotted in place (q & 0xF0: 16 times the value, one instruction
    // less than shifting them down); load_x scaled db and sb to match, so the result is
    // bit for bit the one with shifted nibbles (the factors are powers of two, the integer
    // sums stay below 2^24).
    // The unit's weights decoded (as Unit8<T_Q4_K>::W).
    struct W {
        u32 lo[8], hi[8];
        float d, dmin;
        int sc0, mn0, sc1, mn1;
    };
    static __device__ __forceinline__ W prep(const Fmt<T_Q4_K_W>::Raw& raw, int u) {
        const int c = u & 3, sh = 16 * (c & 1);
        const bool lo = c < 2;
        const uint4 h = raw.h;
        const u32 top = lo ? 0u : 0x30303030u;
        const u32 sc01 = (((lo ? h.y : h.w) >> sh) & (lo ? 0x3F3Fu : 0x0F0Fu)) |
                         ((h.y >> (sh + 2)) & top);
        const u32 mn01 = (((lo ? h.z : h.w >> 4) >> sh) & (lo ? 0x3F3Fu : 0x0F0Fu)) |
                         ((h.z >> (sh + 2)) & top);
        const u32 q[8] = {raw.q0.x, raw.q0.y, raw.q0.z, raw.q0.w,
                          raw.q1.x, raw.q1.y, raw.q1.z, raw.q1.w};
        W w;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            w.lo[i] = q[i] & 0x0F0F0F0Fu;
            w.hi[i] = q[i] & 0xF0F0F0F0u;
        }
        w.d = h2f((u16)(h.x & 0xFFFF));
        w.dmin = h2f((u16)(h.x >> 16));
        w.sc0 = sc01 & 0xFF; w.sc1 = (sc01 >> 8) & 0xFF;
        w.mn0 = mn01 & 0xFF; w.mn1 = (mn01 >> 8) & 0xFF;
        return w;
    }
    static __device__ __forceinline__ float dotp(const W& w, const X& x) {
        int ia = 0, ib = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            ia = dp4a_us(w.lo[i], x.a[i], ia);
            ib = dp4a_us(w.hi[i], x.b[i], ib);
        }
        return x.da * (w.d * (float)(w.sc0 * ia) - w.dmin * (float)(w.mn0 * x.sa)) +
               x.db * (w.d * (float)(w.sc1 * ib) - w.dmin * (float)(w.mn1 * x.sb));
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q4_K_W>::Raw& raw, int u,
                                                const X& x) {
        return dotp(prep(raw, u), x);
    }
};

// Q6_K unit: 4 groups of 8 values, at +0, +32, +64, +96 from the unit's first position.
template <> struct Unit8<T_Q6_K> {
    struct X {
        int w[4][2];
        float dg[4];
        int sg[4];
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const int blk = u >> 3, v = u & 7, hf = v >> 2, l0 = (v & 3) * 8;
        const int base = blk * 256 + 128 * hf + l0;
        X x;
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const int2 p = *(const int2*)(xq + base + 32 * g);
            x.w[g][0] = p.x;
            x.w[g][1] = p.y;
            x.dg[g] = xd[(base >> 5) + g];
            x.sg[g] = dp4a_ss(0x01010101, p.y, dp4a_ss(0x01010101, p.x, 0));
        }
        return x;
    }
    // The unit's weights decoded (6-bit values of each group, scales, d): made once for all
    // tokens of a multi-token launch (rows_dot8_t).
    struct W {
        u32 q[4][2];
        int sc[4];
        float d;
    };
    static __device__ __forceinline__ W prep(const Fmt<T_Q6_K>::Raw& raw, int) {
        W v;
#pragma unroll
        for (int w = 0; w < 2; w++) {
            const u32 qa = raw.qa[w], qb = raw.qb[w], hw = raw.hw[w];
            v.q[0][w] = (qa & 0x0F0F0F0Fu) | ((hw << 4) & 0x30303030u);
            v.q[1][w] = (qb & 0x0F0F0F0Fu) | ((hw << 2) & 0x30303030u);
            v.q[2][w] = ((qa >> 4) & 0x0F0F0F0Fu) | (hw & 0x30303030u);
            v.q[3][w] = ((qb >> 4) & 0x0F0F0F0Fu) | ((hw >> 2) & 0x30303030u);
        }
#pragma unroll
        for (int g = 0; g < 4; g++) v.sc[g] = raw.sc[g];
        v.d = h2f(raw.d);
        return v;
    }
    static __device__ __forceinline__ float dotp(const W& v, const X& x) {
        int s[4] = {0, 0, 0, 0};
#pragma unroll
        for (int w = 0; w < 2; w++)
#pragma unroll
            for (int g = 0; g < 4; g++) s[g] = dp4a_us(v.q[g][w], x.w[g][w], s[g]);
        float acc = 0.0f;
#pragma unroll
        for (int g = 0; g < 4; g++)
            acc += x.dg[g] * (float)(v.sc[g] * (s[g] - 32 * x.sg[g]));
        return v.d * acc;
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q6_K>::Raw& raw, int u, const X& x) {
        return dotp(prep(raw, u), x);
    }
};

// Q6_K for the single-token gemv_q8 (kernel-internal id, as T_Q4_K_W): a unit is 16
// positions l0..l0+15 (l0 = 0 or 16) of one 128-value half, 64 values in four groups of 16
// (one scale each), so the 16-byte loads carry whole words of ql / qh and a lane decodes
// the block's scales and d once per 64 values (4 units a block).
#define T_Q6_K_W 114
template <> struct Fmt<T_Q6_K_W> {
    struct Raw {
        uint4 qa, qb, hw;
        u32 sc;  // the unit's four int8 scales (groups 0..3)
        u16 d;
    };
    static __device__ __forceinline__ int units(int k) { return k / 64; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int) {
        const int hf = (u >> 1) & 1, is = u & 1;
        const u8* b = row + (size_t)(u >> 2) * Q6K_GPU_BYTES;
        const u8* ql = b + 64 * hf + 16 * is;
        Raw r;
        r.qa = *(const uint4*)ql;
        r.qb = *(const uint4*)(ql + 32);
        r.hw = *(const uint4*)(b + 128 + 32 * hf + 16 * is);
        // scales 8 hf + is + 2 g: every other byte of the half's eight
        const uint2 sc = *(const uint2*)(b + 192 + 8 * hf);
        r.sc = __byte_perm(sc.x, sc.y, is ? 0x7531 : 0x6420);
        r.d = *(const u16*)(b + 208);
        return r;
    }
};

template <> struct Unit8<T_Q6_K_W> {
    struct X {
        int w[4][4];
        float dg[4];
        int sg32[4];  // 32 × the sum of each group's 16 activations (the values' offset)
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const int blk = u >> 2, hf = (u >> 1) & 1, l0 = (u & 1) * 16;
        const int base = blk * 256 + 128 * hf + l0;
        X x;
        const float4 dg = *(const float4*)(xd + 8 * blk + 4 * hf);
        x.dg[0] = dg.x; x.dg[1] = dg.y; x.dg[2] = dg.z; x.dg[3] = dg.w;
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const int4 p = *(const int4*)(xq + base + 32 * g);
            x.w[g][0] = p.x; x.w[g][1] = p.y; x.w[g][2] = p.z; x.w[g][3] = p.w;
            int sg = 0;
#pragma unroll
            for (int i = 0; i < 4; i++) sg = dp4a_ss(0x01010101, x.w[g][i], sg);
            x.sg32[g] = 32 * sg;
        }
        return x;
    }
    // The unit's weights decoded (as Unit8<T_Q6_K>::W).
    struct W {
        u32 q[4][4];
        int sc[4];
        float d;
    };
    static __device__ __forceinline__ W prep(const Fmt<T_Q6_K_W>::Raw& raw, int) {
        const u32 qa[4] = {raw.qa.x, raw.qa.y, raw.qa.z, raw.qa.w};
        const u32 qb[4] = {raw.qb.x, raw.qb.y, raw.qb.z, raw.qb.w};
        const u32 hw[4] = {raw.hw.x, raw.hw.y, raw.hw.z, raw.hw.w};
        W v;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            v.q[0][w] = (qa[w] & 0x0F0F0F0Fu) | ((hw[w] << 4) & 0x30303030u);
            v.q[1][w] = (qb[w] & 0x0F0F0F0Fu) | ((hw[w] << 2) & 0x30303030u);
            v.q[2][w] = ((qa[w] >> 4) & 0x0F0F0F0Fu) | (hw[w] & 0x30303030u);
            v.q[3][w] = ((qb[w] >> 4) & 0x0F0F0F0Fu) | ((hw[w] >> 2) & 0x30303030u);
        }
#pragma unroll
        for (int g = 0; g < 4; g++) v.sc[g] = (int)(raw.sc << (24 - 8 * g)) >> 24;
        v.d = h2f(raw.d);
        return v;
    }
    static __device__ __forceinline__ float dotp(const W& v, const X& x) {
        int s[4] = {0, 0, 0, 0};
#pragma unroll
        for (int w = 0; w < 4; w++)
#pragma unroll
            for (int g = 0; g < 4; g++) s[g] = dp4a_us(v.q[g][w], x.w[g][w], s[g]);
        float acc = 0.0f;
#pragma unroll
        for (int g = 0; g < 4; g++) acc += x.dg[g] * (float)(v.sc[g] * (s[g] - x.sg32[g]));
        return v.d * acc;
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q6_K_W>::Raw& raw, int u, const X& x) {
        return dotp(prep(raw, u), x);
    }
};

// Q8_0 unit: half a block (16 values).
template <> struct Unit8<T_Q8_0> {
    struct X {
        int w[4];
        float d;
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const int4 p = *(const int4*)(xq + (u >> 1) * 32 + 16 * (u & 1));
        X x;
        x.w[0] = p.x; x.w[1] = p.y; x.w[2] = p.z; x.w[3] = p.w;
        x.d = xd[u >> 1];
        return x;
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q8_0>::Raw& raw, int, const X& x) {
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) s = dp4a_ss((int)raw.q[i], x.w[i], s);
        return h2f(raw.d) * x.d * (float)s;
    }
};

// Q4_0 units' two sums over N words: the nibble dot (low nibbles against lo[i], high against
// hi[i], unsigned) and the sum of the 8N activation bytes (for the nibbles' offset of 8).
template <int N>
__device__ __forceinline__ int q4_nibble_dot(const u32* q, const int* lo, const int* hi) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < N; i++) {
        s = dp4a_us(q[i] & 0x0F0F0F0Fu, lo[i], s);
        s = dp4a_us((q[i] >> 4) & 0x0F0F0F0Fu, hi[i], s);
    }
    return s;
}
template <int N> __device__ __forceinline__ int byte_sum(const int* lo, const int* hi) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < N; i++) {
        s = dp4a_ss(0x01010101, lo[i], s);
        s = dp4a_ss(0x01010101, hi[i], s);
    }
    return s;
}

// Q4_0 unit: values 8h..8h+7 (low nibbles) and 16+8h..16+8h+7 (high nibbles), minus 8.
template <> struct Unit8<T_Q4_0> {
    struct X {
        int lo[2], hi[2];
        float d;
        int s;
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const i8* xr = xq + (u >> 1) * 32 + 8 * (u & 1);
        const int2 p = *(const int2*)xr, r = *(const int2*)(xr + 16);
        X x;
        x.lo[0] = p.x; x.lo[1] = p.y; x.hi[0] = r.x; x.hi[1] = r.y;
        x.d = xd[u >> 1];
        x.s = byte_sum<2>(x.lo, x.hi);
        return x;
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q4_0>::Raw& raw, int, const X& x) {
        const int s = q4_nibble_dot<2>(raw.q, x.lo, x.hi);
        return h2f(raw.d) * x.d * (float)(s - 8 * x.s);
    }
};

// IQ4_NL, IQ4_XS, MXFP4 (Lut4's units): the levels are signed bytes, dotted as they are.
template <int TY> struct Unit8Lut4 {
    struct X {
        int lo[2], hi[2];
        float d;
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const i8* xr = xq + (u >> 1) * 32 + 8 * (u & 1);
        const int2 p = *(const int2*)xr, r = *(const int2*)(xr + 16);
        return {{p.x, p.y}, {r.x, r.y}, xd[u >> 1]};
    }
    static __device__ __forceinline__ float dot(const typename Lut4<TY>::Raw& raw, int,
                                                const X& x) {
        int s = 0;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 l, h;
            Lut4<TY>::levels(raw.q[i], l, h);
            s = dp4a_ss((int)l, x.lo[i], s);
            s = dp4a_ss((int)h, x.hi[i], s);
        }
        return raw.d * x.d * (float)s;
    }
};
template <> struct Unit8<T_IQ4_NL> : Unit8Lut4<T_IQ4_NL> {};
template <> struct Unit8<T_IQ4_XS> : Unit8Lut4<T_IQ4_XS> {};
template <> struct Unit8<T_MXFP4> : Unit8Lut4<T_MXFP4> {};

// The same formats for the single-token gemv_q8* (kernel-internal ids, as T_Q4_0_W): a unit
// is a whole 32-value group (16 quant bytes and its scale), twice the bytes in flight per
// lane of Lut4's half-group units.
#define T_IQ4_NL_W 120
#define T_IQ4_XS_W 123
#define T_MXFP4_W 139
template <int TY> struct Lut4W {
    struct Raw {
        uint4 q;
        float d;
    };
    static __device__ __forceinline__ int units(int k) { return k / 32; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        return {*(const uint4*)(row + (size_t)u * 16), Lut4<TY>::scale(row, u, nb)};
    }
};
template <int TY> struct Unit8Lut4W {
    struct X {
        int lo[4], hi[4];
        float d;
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const int4 p = *(const int4*)(xq + u * 32), r = *(const int4*)(xq + u * 32 + 16);
        return {{p.x, p.y, p.z, p.w}, {r.x, r.y, r.z, r.w}, xd[u]};
    }
    static __device__ __forceinline__ float dot(const typename Lut4W<TY>::Raw& raw, int,
                                                const X& x) {
        const u32 q[4] = {raw.q.x, raw.q.y, raw.q.z, raw.q.w};
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 l, h;
            Lut4<TY>::levels(q[i], l, h);
            s = dp4a_ss((int)l, x.lo[i], s);
            s = dp4a_ss((int)h, x.hi[i], s);
        }
        return raw.d * x.d * (float)s;
    }
};
template <> struct Fmt<T_IQ4_NL_W> : Lut4W<T_IQ4_NL> {};
template <> struct Fmt<T_IQ4_XS_W> : Lut4W<T_IQ4_XS> {};
template <> struct Fmt<T_MXFP4_W> : Lut4W<T_MXFP4> {};
template <> struct Unit8<T_IQ4_NL_W> : Unit8Lut4W<T_IQ4_NL> {};
template <> struct Unit8<T_IQ4_XS_W> : Unit8Lut4W<T_IQ4_XS> {};
template <> struct Unit8<T_MXFP4_W> : Unit8Lut4W<T_MXFP4> {};

// Q8_0 and Q4_0 for the single-token gemv_q8*: a unit is a whole 32-value block (32 / 16
// quant bytes and the block's scale), twice the bytes in flight per lane of the half-block
// units (kernel-internal ids, as T_Q4_K_W).
#define T_Q8_0_W 115
#define T_Q4_0_W 116
template <> struct Fmt<T_Q8_0_W> {
    struct Raw {
        uint4 a, b;
        u16 d;
    };
    static __device__ __forceinline__ int units(int k) { return k / 32; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        const uint4* q = (const uint4*)(row + (size_t)u * 32);
        return {q[0], q[1], *(const u16*)(row + (size_t)nb * 32 + 2 * u)};
    }
};
template <> struct Unit8<T_Q8_0_W> {
    struct X {
        int w[8];
        float d;
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const int4 p = *(const int4*)(xq + u * 32), r = *(const int4*)(xq + u * 32 + 16);
        return {{p.x, p.y, p.z, p.w, r.x, r.y, r.z, r.w}, xd[u]};
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q8_0_W>::Raw& raw, int, const X& x) {
        const u32 q[8] = {raw.a.x, raw.a.y, raw.a.z, raw.a.w, raw.b.x, raw.b.y, raw.b.z, raw.b.w};
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) s = dp4a_ss((int)q[i], x.w[i], s);
        return h2f(raw.d) * x.d * (float)s;
    }
};
// Q4_0 block: low nibbles are values 0..15, high nibbles 16..31, minus 8.
template <> struct Fmt<T_Q4_0_W> {
    struct Raw {
        uint4 q;
        u16 d;
    };
    static __device__ __forceinline__ int units(int k) { return k / 32; }
    static __device__ __forceinline__ Raw load(const u8* row, int u, int nb) {
        return {*(const uint4*)(row + (size_t)u * 16), *(const u16*)(row + (size_t)nb * 16 + 2 * u)};
    }
};
template <> struct Unit8<T_Q4_0_W> {
    struct X {
        int lo[4], hi[4];
        float d;
        int s;
    };
    static __device__ __forceinline__ X load_x(const i8* xq, const float* xd, int u) {
        const int4 p = *(const int4*)(xq + u * 32), r = *(const int4*)(xq + u * 32 + 16);
        X x = {{p.x, p.y, p.z, p.w}, {r.x, r.y, r.z, r.w}, xd[u], 0};
        x.s = byte_sum<4>(x.lo, x.hi);
        return x;
    }
    static __device__ __forceinline__ float dot(const Fmt<T_Q4_0_W>::Raw& raw, int, const X& x) {
        const u32 q[4] = {raw.q.x, raw.q.y, raw.q.z, raw.q.w};
        const int s = q4_nibble_dot<4>(q, x.lo, x.hi);
        return h2f(raw.d) * x.d * (float)(s - 8 * x.s);
    }
};

// `waited` false: the kernel has not waited on the previous one yet (pdl_enter): it does
// after sending its first weight loads, which the previous kernel never writes, so that they
// overlap that kernel's tail (the activations are read after the wait).
template <int TY, bool UP, int GD_R, int GD_U>
__device__ __forceinline__ void rows_dot8(const u8* w, const u8* up, long long rb, int nr,
                                          const i8* xq, const float* xd, int k, int lane,
                                          float* acc, float* acc_up, bool& waited) {
    typedef Fmt<TY> F;
    typedef Unit8<TY> U8;
    constexpr int NU = UP ? 1 : GD_U;
    const int units = F::units(k);
    for (int u0 = lane; u0 < units; u0 += 32 * NU) {
        typename F::Raw raw[NU][GD_R], raw_up[UP ? NU : 1][UP ? GD_R : 1];
        load_units<TY, UP, GD_R, NU>(w, up, rb, nr, u0, units, k >> 5, raw, raw_up);
        if (!waited) {
            pdl_enter();
            waited = true;
        }
#pragma unroll
        for (int j = 0; j < NU; j++) {
            const int u = u0 + 32 * j;
            if (u < units) {
                const typename U8::X xv = U8::load_x(xq, xd, u);
#pragma unroll
                for (int i = 0; i < GD_R; i++)
                    if (i < nr) {
                        acc[i] += U8::dot(raw[j][i], u, xv);
                        if (UP) acc_up[i] += U8::dot(raw_up[UP ? j : 0][UP ? i : 0], u, xv);
                    }
            }
        }
    }
}

// rows_dot8 of format TY, with or without up rows (`up` null: plain rows).
template <int TY, int GD_R, int GD_U>
__device__ __forceinline__ void rows_dot8_up(const u8* w, const u8* up, long long rb, int nr,
                                             const i8* xq, const float* xd, int k, int lane,
                                             float* acc, float* acc_up, bool& waited) {
    if (up) rows_dot8<TY, true, GD_R, GD_U>(w, up, rb, nr, xq, xd, k, lane, acc, acc_up, waited);
    else rows_dot8<TY, false, GD_R, GD_U>(w, up, rb, nr, xq, xd, k, lane, acc, acc_up, waited);
}

// The single-token units by format (the wide ones above); KQ false: Q8_0 / Q4_0 only (the
// gemv_q8_b* kernels, which fit 5 blocks an SM).
template <int GD_R, int GD_U, bool KQ>
__device__ __forceinline__ void rows_dot8_any(int ty, const u8* w, const u8* up, long long rb,
                                              int nr, const i8* xq, const float* xd, int k,
                                              int lane, float* acc, float* acc_up, bool& waited) {
#define ROWS_DOT8_ARGS w, up, rb, nr, xq, xd, k, lane, acc, acc_up, waited
    switch (ty) {
    case T_Q4_K:
        if constexpr (KQ) rows_dot8_up<T_Q4_K_W, GD_R, GD_U>(ROWS_DOT8_ARGS);
        return;
    case T_Q6_K:
        if constexpr (KQ) rows_dot8_up<T_Q6_K_W, GD_R, GD_U>(ROWS_DOT8_ARGS);
        return;
    case T_Q8_0: rows_dot8_up<T_Q8_0_W, GD_R, GD_U>(ROWS_DOT8_ARGS); return;
    case T_Q4_0: rows_dot8_up<T_Q4_0_W, GD_R, GD_U>(ROWS_DOT8_ARGS); return;
    case T_IQ4_NL:
        if constexpr (KQ) rows_dot8_up<T_IQ4_NL_W, GD_R, GD_U>(ROWS_DOT8_ARGS);
        return;
    case T_IQ4_XS:
        if constexpr (KQ) rows_dot8_up<T_IQ4_XS_W, GD_R, GD_U>(ROWS_DOT8_ARGS);
        return;
    case T_MXFP4:
        if constexpr (KQ) rows_dot8_up<T_MXFP4_W, GD_R, GD_U>(ROWS_DOT8_ARGS);
        return;
    default: return;
    }
#undef ROWS_DOT8_ARGS
}

// The end of a single-token warp's rows r0 .. r0 + nr: its lanes' partial sums added, then
// lane 0 stores act(gate) * up (gated) or the row plus bias, added into out when act != 0
// (plain launches: the residual).
template <int GD_R>
__device__ __forceinline__ void gv_store_rows(float* acc, float* acc_up, int nr, int r0,
                                              int gated, int act, float* out0, float* out,
                                              const float* bias, int lane) {
#pragma unroll
    for (int i = 0; i < GD_R; i++) {
        acc[i] = warp_sum(acc[i]);
        if (gated) acc_up[i] = warp_sum(acc_up[i]);
    }
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < GD_R; i++)
            if (i < nr) {
                const int r = r0 + i;
                if (gated)
                    out0[r] = gv_act(acc[i], act) * acc_up[i];
                else if (act)
                    out[r] += acc[i] + (bias ? bias[r] : 0.0f);
                else
                    out[r] = acc[i] + (bias ? bias[r] : 0.0f);
            }
}

// The body of gemv_dec (Q8 false: f32 activations x) and gemv_q8 (Q8 true: activations
// quantized to xq / xd by quantize_x_q8 or rms_norm_q8; formats Q4_K, Q6_K, Q8_0, Q4_0
// only, the host checks). Same parameters as gemv (n and rpb ignored; for plain launches
// act != 0 means add into the outputs instead of overwriting them). Warps are assigned
// GD_R rows of one matrix at a time (gv_pick_rows). Grid: ceil(total warps / GD_WARPS)
// blocks of GD_WARPS warps, where total warps = Σ ceil(rows_s / GD_R).
// With Q8 the body waits on the previous kernel itself (pdl_enter, after its first weight
// loads: rows_dot8); the f32 kernels (gemv_dec*) wait before calling it.
template <int GD_R, int GD_U, bool Q8, bool KQ = true>
__device__ __forceinline__ void gemv_rows_body(const i8* xq, const float* xd, GEMV_PARAMS) {
    const int lane = threadIdx.x & 31;
    GvRows g;
    const int gw = blockIdx.x * GD_WARPS + (threadIdx.x >> 5);
    bool waited = !Q8;
    if (!gv_pick_rows<GD_R>(gw, total, gated, w0, rb0, ty0, rows0, out0, ld0, bias0, w1, rb1, ty1,
                            rows1, out1, ld1, bias1, w2, rb2, ty2, out2, ld2, bias2, g)) {
        if (!waited) pdl_enter();
        return;
    }
    const u8* w = g.w;
    const long long rb = g.rb;
    const int ty = g.ty, rows = g.rows, r0 = g.r0, ld = g.ld;
    float* out = g.out;
    const float* bias = g.bias;
    (void)ld;

    const int nr = min(GD_R, rows - r0);
    float acc[GD_R], acc_up[GD_R];
#pragma unroll
    for (int i = 0; i < GD_R; i++) acc[i] = acc_up[i] = 0.0f;
    const u8* wr = w + (size_t)r0 * rb;
    // `up` null: plain rows; otherwise the same rows of up, read together.
    auto rows_dot = [&](int t, const u8* rows_w, const u8* up, long long stride, float* a,
                        float* a_up) {
        if constexpr (Q8)
            rows_dot8_any<GD_R, GD_U, KQ>(t, rows_w, up, stride, nr, xq, xd, k, lane, a, a_up,
                                          waited);
        else
            rows_dot1_any<GD_R, GD_U>(t, rows_w, up, stride, nr, x, k, lane, a, a_up);
    };
    if (gated && ty0 == ty1 && rb0 == rb1) {
        rows_dot(ty, wr, w1 + (size_t)r0 * rb1, rb, acc, acc_up);
    } else {
        rows_dot(ty, wr, nullptr, rb, acc, acc_up);
        if (gated) rows_dot(ty1, w1 + (size_t)r0 * rb1, nullptr, rb1, acc_up, nullptr);
    }
    if (!waited) pdl_enter();  // lanes without units: before the stores
    gv_store_rows<GD_R>(acc, acc_up, nr, r0, gated, act, out0, out, bias, lane);
}

#define GEMV_ARGS                                                                              \
    x, k, n, rpb, total, gated, act, w0, rb0, ty0, rows0, out0, ld0, bias0, w1, rb1, ty1,      \
        rows1, out1, ld1, bias1, w2, rb2, ty2, out2, ld2, bias2

// By rows per warp: one for rows of up to 2,048 values, two for longer ones (see `gemv`).
extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 4) gemv_dec(GEMV_PARAMS) {
    pdl_enter();
    gemv_rows_body<2, 2, false>(nullptr, nullptr, GEMV_ARGS);
}
extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 4) gemv_dec_r1(GEMV_PARAMS) {
    pdl_enter();
    gemv_rows_body<1, 4, false>(nullptr, nullptr, GEMV_ARGS);
}

// 4 blocks per SM (at most 128 registers): the 64-value Q4_K / Q6_K units hold four rows'
// units in flight without spilling (at 5 blocks, 96 registers, they spilled).
extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 4)
gemv_q8(const i8* xq, const float* xd, GEMV_PARAMS) {
    gemv_rows_body<2, 2, true>(xq, xd, GEMV_ARGS);
}
extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 4)
gemv_q8_r1(const i8* xq, const float* xd, GEMV_PARAMS) {
    gemv_rows_body<1, 4, true>(xq, xd, GEMV_ARGS);
}
// Launches of Q8_0 / Q4_0 matrices only: 5 blocks per SM (96 registers, no spills).
extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 5)
gemv_q8_b(const i8* xq, const float* xd, GEMV_PARAMS) {
    gemv_rows_body<2, 2, true, false>(xq, xd, GEMV_ARGS);
}
extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 5)
gemv_q8_b_r1(const i8* xq, const float* xd, GEMV_PARAMS) {
    gemv_rows_body<1, 4, true, false>(xq, xd, GEMV_ARGS);
}

// gemv_q8 for 2..T tokens (batched decode): each weight unit is loaded once and dotted with
// every token's 8-bit activations (rows of k int8 values and k/32 scales, token after
// token). acc[R][T] per lane; out rows have ld floats. Plain launches with act != 0 add
// into the outputs as gv_store_rows does (verification steps' residual adds).
// A unit's weights as the token loop below reads them: decoded once (Unit8::W by
// Unit8::prep, dotted by Unit8::dotp: the formats whose dot is dotp of prep, so every token's
// sum is the single-token kernels' bit for bit), or the raw unit for formats without one.
template <typename...> struct gv_voider {
    typedef void type;
};
template <typename U8, typename Raw, typename = void> struct UnitW {
    struct W {
        Raw raw;
        int u;
    };
    static __device__ __forceinline__ W prep(const Raw& raw, int u) { return {raw, u}; }
    template <typename X> static __device__ __forceinline__ float dot(const W& w, const X& x) {
        return U8::dot(w.raw, w.u, x);
    }
};
template <typename U8, typename Raw>
struct UnitW<U8, Raw, typename gv_voider<typename U8::W>::type> {
    typedef typename U8::W W;
    static __device__ __forceinline__ W prep(const Raw& raw, int u) { return U8::prep(raw, u); }
    template <typename X> static __device__ __forceinline__ float dot(const W& w, const X& x) {
        return U8::dotp(w, x);
    }
};

template <bool B, typename A, typename C> struct gv_if {
    typedef A type;
};
template <typename A, typename C> struct gv_if<false, A, C> {
    typedef C type;
};

// Units decoded once at one row a warp (the verification kernels); at two (the batched
// decode's gemv_q8_t*), 8 tokens' accumulators and two rows' decoded units spilled, so those
// keep the raw units and decode them in each token's dot.
template <int TY, bool UP, int GD_R, int T>
__device__ __forceinline__ void rows_dot8_t(const u8* w, const u8* up, long long rb, int nr,
                                            const i8* xq, const float* xd, int k, int n,
                                            int lane, float (*acc)[T], float (*acc_up)[T]) {
    typedef Fmt<TY> F;
    typedef Unit8<TY> U8;
    typedef typename gv_if<GD_R == 1, UnitW<U8, typename F::Raw>,
                           UnitW<U8, typename F::Raw, int>>::type UW;
    const int units = F::units(k);
    for (int u = lane; u < units; u += 32) {
        // Each row's unit decoded once for all the tokens (one row a warp), or kept raw.
        typename UW::W wd[GD_R], wd_up[UP ? GD_R : 1];
#pragma unroll
        for (int i = 0; i < GD_R; i++)
            if (i < nr) {
                wd[i] = UW::prep(F::load(w + i * rb, u, k >> 5), u);
                if (UP) wd_up[UP ? i : 0] = UW::prep(F::load(up + i * rb, u, k >> 5), u);
            }
#pragma unroll
        for (int t = 0; t < T; t++) {
            if (t < n) {
                const typename U8::X xv =
                    U8::load_x(xq + (size_t)t * k, xd + (size_t)t * (k / 32), u);
#pragma unroll
                for (int i = 0; i < GD_R; i++)
                    if (i < nr) {
                        acc[i][t] += UW::dot(wd[i], xv);
                        if (UP) acc_up[i][t] += UW::dot(wd_up[UP ? i : 0], xv);
                    }
            }
        }
    }
}

#define ROWS_DOT8T_CASE(TYP)                                                                   \
    case TYP:                                                                                  \
        if (up)                                                                                \
            rows_dot8_t<TYP, true, GD_R, T>(w, up, rb, nr, xq, xd, k, n, lane, acc, acc_up);   \
        else                                                                                   \
            rows_dot8_t<TYP, false, GD_R, T>(w, up, rb, nr, xq, xd, k, n, lane, acc, acc_up);  \
        return;

template <int GD_R, int T>
__device__ __forceinline__ void rows_dot8_t_any(int ty, const u8* w, const u8* up, long long rb,
                                                int nr, const i8* xq, const float* xd, int k,
                                                int n, int lane, float (*acc)[T],
                                                float (*acc_up)[T]) {
    switch (ty) {
    ROWS_DOT8T_CASE(T_Q4_K)
    ROWS_DOT8T_CASE(T_Q6_K)
    ROWS_DOT8T_CASE(T_Q8_0)
    ROWS_DOT8T_CASE(T_Q4_0)
    ROWS_DOT8T_CASE(T_IQ4_NL)
    ROWS_DOT8T_CASE(T_IQ4_XS)
    ROWS_DOT8T_CASE(T_MXFP4)
    default: return;
    }
}

// The single-token kernels' wide units (gemv_q8, gemv_q8_r1, gemv_q8_b*) of format ty, plain
// rows only (`up` unused): a lane takes units lane, lane + 32, ... of each row in that order,
// as they do (gemv_v*'s gated launches whose gate and up differ in format).
template <int GD_R, int T>
__device__ __forceinline__ void rows_dot8_tw_any(int ty, const u8* w, long long rb, int nr,
                                                 const i8* xq, const float* xd, int k, int n,
                                                 int lane, float (*acc)[T]) {
#define ROWS_DOT8TW_CASE(TYP, WIDE)                                                            \
    case TYP:                                                                                  \
        rows_dot8_t<WIDE, false, GD_R, T>(w, nullptr, rb, nr, xq, xd, k, n, lane, acc, acc);   \
        return;
    switch (ty) {
    ROWS_DOT8TW_CASE(T_Q4_K, T_Q4_K_W)
    ROWS_DOT8TW_CASE(T_Q6_K, T_Q6_K_W)
    ROWS_DOT8TW_CASE(T_Q8_0, T_Q8_0_W)
    ROWS_DOT8TW_CASE(T_Q4_0, T_Q4_0_W)
    ROWS_DOT8TW_CASE(T_IQ4_NL, T_IQ4_NL_W)
    ROWS_DOT8TW_CASE(T_IQ4_XS, T_IQ4_XS_W)
    ROWS_DOT8TW_CASE(T_MXFP4, T_MXFP4_W)
    default: return;
    }
#undef ROWS_DOT8TW_CASE
}

// gemv_dec's units for 2..T tokens (verification steps of formats on f32 activations): a
// lane takes units lane, lane + 32, ... of each row in that order, as gemv_dec / gemv_dec_r1
// do, each loaded once and dotted with every token's activations (x: rows of k floats), so
// every token's sums are gemv_dec's bit for bit.
template <int TY, bool UP, int GD_R, int T>
__device__ __forceinline__ void rows_dot1_t(const u8* w, const u8* up, long long rb, int nr,
                                            const float* x, int k, int n, int lane,
                                            float (*acc)[T], float (*acc_up)[T]) {
    typedef Fmt<TY> F;
    typedef Unit1<TY> U1;
    const int units = F::units(k);
    for (int u = lane; u < units; u += 32) {
        typename F::Raw raw[GD_R], raw_up[UP ? GD_R : 1];
#pragma unroll
        for (int i = 0; i < GD_R; i++)
            if (i < nr) {
                raw[i] = F::load(w + i * rb, u, k >> 5);
                if (UP) raw_up[UP ? i : 0] = F::load(up + i * rb, u, k >> 5);
            }
#pragma unroll
        for (int t = 0; t < T; t++) {
            if (t < n) {
                float xv[U1::XN];
                U1::load_x(x + (size_t)t * k, u, xv);
#pragma unroll
                for (int i = 0; i < GD_R; i++)
                    if (i < nr) {
                        acc[i][t] += U1::dot(raw[i], u, xv);
                        if (UP) acc_up[i][t] += U1::dot(raw_up[UP ? i : 0], u, xv);
                    }
            }
        }
    }
}

// rows_dot1_any's choice of units (F16 / BF16 rows of a multiple of 16 values: the 32-byte
// ones) for rows_dot1_t.
template <int GD_R, int T>
__device__ __forceinline__ void rows_dot1_t_any(int ty, const u8* w, const u8* up, long long rb,
                                                int nr, const float* x, int k, int n, int lane,
                                                float (*acc)[T], float (*acc_up)[T]) {
#define ROWS_DOT1T_CALL(TYP)                                                                   \
    do {                                                                                       \
        if (up) rows_dot1_t<TYP, true, GD_R, T>(w, up, rb, nr, x, k, n, lane, acc, acc_up);    \
        else rows_dot1_t<TYP, false, GD_R, T>(w, up, rb, nr, x, k, n, lane, acc, acc_up);      \
    } while (0)
    switch (ty) {
    case T_Q4_K: ROWS_DOT1T_CALL(T_Q4_K); return;
    case T_Q6_K: ROWS_DOT1T_CALL(T_Q6_K); return;
    case T_Q8_0: ROWS_DOT1T_CALL(T_Q8_0); return;
    case T_Q4_0: ROWS_DOT1T_CALL(T_Q4_0); return;
    case T_Q5_0: ROWS_DOT1T_CALL(T_Q5_0); return;
    case T_IQ4_NL: ROWS_DOT1T_CALL(T_IQ4_NL); return;
    case T_IQ4_XS: ROWS_DOT1T_CALL(T_IQ4_XS); return;
    case T_MXFP4: ROWS_DOT1T_CALL(T_MXFP4); return;
    case T_F16:
        if (k % 16 == 0) ROWS_DOT1T_CALL(T_F16_W);
        else ROWS_DOT1T_CALL(T_F16);
        return;
    case T_BF16:
        if (k % 16 == 0) ROWS_DOT1T_CALL(T_BF16_W);
        else ROWS_DOT1T_CALL(T_BF16);
        return;
    case T_F32: ROWS_DOT1T_CALL(T_F32); return;
    default: return;
    }
#undef ROWS_DOT1T_CALL
}

// The batched decode's plain units (rows_dot8_t_any), or with F32 gemv_dec's units on f32
// activations x (rows_dot1_t_any; xq and xd unused).
template <int GD_R, int T, bool F32 = false>
__device__ __forceinline__ void gemv_q8_t_body(const i8* xq, const float* xd, GEMV_PARAMS) {
    const int lane = threadIdx.x & 31;
    GvRows g;
    const int gw = blockIdx.x * GD_WARPS + (threadIdx.x >> 5);
    if (!gv_pick_rows<GD_R>(gw, total, gated, w0, rb0, ty0, rows0, out0, ld0, bias0, w1, rb1, ty1,
                            rows1, out1, ld1, bias1, w2, rb2, ty2, out2, ld2, bias2, g))
        return;
    const u8* w = g.w;
    const long long rb = g.rb;
    const int ty = g.ty, rows = g.rows, r0 = g.r0, ld = g.ld;
    float* out = g.out;
    const float* bias = g.bias;
    (void)ld;
    const int nr = min(GD_R, rows - r0);
    float acc[GD_R][T], acc_up[GD_R][T];
#pragma unroll
    for (int i = 0; i < GD_R; i++)
#pragma unroll
        for (int t = 0; t < T; t++) acc[i][t] = acc_up[i][t] = 0.0f;
    const u8* wr = w + (size_t)r0 * rb;
    auto dot = [&](int t, const u8* rows_w, const u8* up, long long stride, float (*a)[T],
                   float (*a_up)[T]) {
        if constexpr (F32)
            rows_dot1_t_any<GD_R, T>(t, rows_w, up, stride, nr, x, k, n, lane, a, a_up);
        else
            rows_dot8_t_any<GD_R, T>(t, rows_w, up, stride, nr, xq, xd, k, n, lane, a, a_up);
    };
    if (gated && ty0 == ty1 && rb0 == rb1) {
        dot(ty, wr, w1 + (size_t)r0 * rb1, rb, acc, acc_up);
    } else {
        dot(ty, wr, nullptr, rb, acc, acc_up);
        if (gated) dot(ty1, w1 + (size_t)r0 * rb1, nullptr, rb1, acc_up, acc_up);
    }
#pragma unroll
    for (int i = 0; i < GD_R; i++)
#pragma unroll
        for (int t = 0; t < T; t++) {
            acc[i][t] = warp_sum(acc[i][t]);
            if (gated) acc_up[i][t] = warp_sum(acc_up[i][t]);
        }
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < GD_R; i++)
            if (i < nr) {
                const int r = r0 + i;
#pragma unroll
                for (int t = 0; t < T; t++)
                    if (t < n) {
                        if (gated)
                            out0[(size_t)t * ld0 + r] = gv_act(acc[i][t], act) * acc_up[i][t];
                        else if (act)
                            out[(size_t)t * ld + r] += acc[i][t] + (bias ? bias[r] : 0.0f);
                        else
                            out[(size_t)t * ld + r] = acc[i][t] + (bias ? bias[r] : 0.0f);
                    }
            }
}

extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 4)
gemv_q8_t4(const i8* xq, const float* xd, GEMV_PARAMS) {
    pdl_enter();
    gemv_q8_t_body<2, 4>(xq, xd, GEMV_ARGS);
}
extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 4)
gemv_q8_t8(const i8* xq, const float* xd, GEMV_PARAMS) {
    pdl_enter();
    gemv_q8_t_body<2, 8>(xq, xd, GEMV_ARGS);
}
// Speculative verification of launches whose single-token kernel is gemv_dec / gemv_dec_r1
// (f32 activations): their units, one row a warp, every token's row from one load of them.
extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 4) gemv_dec_t4(GEMV_PARAMS) {
    pdl_enter();
    gemv_q8_t_body<1, 4, true>(nullptr, nullptr, GEMV_ARGS);
}
extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 4) gemv_dec_t8(GEMV_PARAMS) {
    pdl_enter();
    gemv_q8_t_body<1, 8, true>(nullptr, nullptr, GEMV_ARGS);
}
// ---------------------------------------------------------------------------------------
// Single-token GEMV with each warp streaming its rows through its own slice of shared
// memory (`gemv_ws_r1`): gemv_q8's units and dot products, but the weights of the next
// WS_STAGES - 1 steps (a step: 32 units of each of the warp's rows) are already on their
// way by cp.async, which holds no registers while in flight. No barrier beyond
// __syncwarp: warps never wait on each other. Q4_K and Q6_K rows (a step is 4 whole
// blocks, contiguous: 576 / 896 bytes a row); gated launches only for Q4_K (gate and up
// rows of a warp read together).
// Measured (H100, ncu): ~1.65x gemv_q8's instructions and no more DRAM throughput on
// Llama-3-8B's launches (gate/up 56% vs 62%), so twice the bytes in flight did not help
// there; it does for Qwen2.5-1.5B's one-row launches (tg128 +3-6%), which are its use.

#define WS_STAGES 4
#define WS_SLOT 2304  // bytes a stage holds per warp: 2 Q6_K steps or 4 Q4_K steps

template <int TY> struct WsStep;
template <> struct WsStep<T_Q4_K> { static constexpr int BLK = 144; };
template <> struct WsStep<T_Q6_K> { static constexpr int BLK = Q6K_GPU_BYTES; };

// This warp's share of nr (≤ GD_R) rows rb bytes apart (and with UP the same rows of up):
// acc[i] (acc_up[i]) += row i · x. `slots`: this warp's WS_STAGES slots of WS_SLOT bytes.
template <int TY, bool UP, int GD_R>
__device__ __forceinline__ void ws_rows(const u8* w, const u8* up, long long rb, int nr,
                                        const i8* xq, const float* xd, int k, int lane,
                                        u8* slots, float* acc, float* acc_up) {
    typedef Fmt<TY> F;
    typedef Unit8<TY> U8;
    constexpr int STEP = 4 * WsStep<TY>::BLK;  // bytes of 32 units of a row
    const int units = F::units(k), nb = k >> 5;
    const int steps = (units + 31) >> 5;
    const int streams = UP ? 2 * nr : nr;  // row i of gate at slot part i, of up at nr + i
    const u32 slot0 = smem_u32(slots);
    auto issue = [&](int st) {
        if (st < steps) {
            const int bytes = min(STEP, (int)(rb - (long long)st * STEP));
            const u32 dst = slot0 + (st % WS_STAGES) * WS_SLOT;
            for (int j = 0; j < streams; j++) {
                const u8* src = (j < nr ? w + j * rb : up + (j - nr) * rb) + (size_t)st * STEP;
                for (int p = 16 * lane; p < bytes; p += 512) cp_async16(dst + j * STEP + p, src + p, true);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int st = 0; st < WS_STAGES - 1; st++) issue(st);
    // Only now the activations (written by the previous kernel) may be read.
    pdl_enter();
    for (int st = 0; st < steps; st++) {
        issue(st + WS_STAGES - 1);
        // Step st's group has landed (the later WS_STAGES - 1 may still fly), for every lane.
        asm volatile("cp.async.wait_group %0;" ::"n"(WS_STAGES - 1) : "memory");
        __syncwarp();
        const int u = st * 32 + lane;
        if (u < units) {
            // Each row's bytes as if the whole row were there: step st's blocks at their
            // offsets within the row (Fmt::load adds (u / 8) · BLK).
            const u8* base = slots + (st % WS_STAGES) * WS_SLOT - (size_t)st * STEP;
            const typename U8::X xv = U8::load_x(xq, xd, u);
#pragma unroll
            for (int i = 0; i < GD_R; i++)
                if (i < nr) {
                    acc[i] += U8::dot(F::load(base + i * STEP, u, nb), u, xv);
                    if (UP) acc_up[i] += U8::dot(F::load(base + (nr + i) * STEP, u, nb), u, xv);
                }
        }
        // Every lane is done with the slot before a later issue refills it.
        __syncwarp();
    }
    cp_async_wait_all();
}

// Same parameters and grid as gemv_q8 (GD_R rows a warp, blocks of GD_WARPS warps; only
// one row a warp is instantiated: with two, Llama-3-8B's launches were slower); the
// host sends only Q4_K / Q6_K matrices (gated: Q4_K gate and up of equal row bytes), rows
// and pointers 16-byte aligned.
template <int GD_R>
__device__ __forceinline__ void gemv_ws_body(const i8* xq, const float* xd, GEMV_PARAMS) {
    __shared__ __align__(128) u8 ws_smem[GD_WARPS][WS_STAGES * WS_SLOT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    GvRows g;
    const int gw = blockIdx.x * GD_WARPS + warp;
    const bool mine = gv_pick_rows<GD_R>(gw, total, gated, w0, rb0, ty0, rows0, out0, ld0, bias0,
                                         w1, rb1, ty1, rows1, out1, ld1, bias1, w2, rb2, ty2, out2,
                                         ld2, bias2, g);
    if (!mine) {
        pdl_enter();
        return;
    }
    const int nr = min(GD_R, g.rows - g.r0);
    float acc[GD_R], acc_up[GD_R];
#pragma unroll
    for (int i = 0; i < GD_R; i++) acc[i] = acc_up[i] = 0.0f;
    const u8* wr = g.w + (size_t)g.r0 * g.rb;
    u8* slots = ws_smem[warp];
    // The weights are never written during a step: ws_rows sends the first copies before
    // the wait on the previous kernel (pdl_enter).
    if (gated) {
        const u8* ur = w1 + (size_t)g.r0 * rb1;
        ws_rows<T_Q4_K, true, GD_R>(wr, ur, g.rb, nr, xq, xd, k, lane, slots, acc, acc_up);
    } else if (g.ty == T_Q4_K) {
        ws_rows<T_Q4_K, false, GD_R>(wr, nullptr, g.rb, nr, xq, xd, k, lane, slots, acc, acc_up);
    } else {
        ws_rows<T_Q6_K, false, GD_R>(wr, nullptr, g.rb, nr, xq, xd, k, lane, slots, acc, acc_up);
    }
    gv_store_rows<GD_R>(acc, acc_up, nr, g.r0, gated, act, out0, g.out, g.bias, lane);
}

extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, 5)
gemv_ws_r1(const i8* xq, const float* xd, GEMV_PARAMS) {
    gemv_ws_body<1>(xq, xd, GEMV_ARGS);
}

// ---------------------------------------------------------------------------------------
// Speculative verification steps of T = 2..8 tokens (`gemv_v2` .. `gemv_v8`, one kernel per
// T): every token's sums exactly as the launch's single-token kernel computes them. A lane
// holds the units it holds there (u = lane, lane + 32, ...; the wide units of gemv_q8 /
// gemv_q8_r1 / gemv_q8_b*, or the plain ones of gemv_ws_r1), decodes each once, adds its
// dots with every token in that order, and the lanes' sums go through warp_sum's tree
// (vt_reduce), so each token's result is the single-token one bit for bit (a row's sums do
// not depend on which rows a warp takes). What makes them cheaper than one row a warp with
// each token's work behind a `t < n` test:
// - T is a constant: the T tokens' activation loads and dots are independent and interleave;
// - a warp walks its rows (grid-stride over the launch's rows) with the next chunk of weights
//   already loading into registers while it computes this one, and its first weights are
//   requested before the wait on the previous kernel;
// - the T (gated: 2T) sums of a row reduce in one transposed butterfly: P - 1 + (5 - log2 P)
//   shuffles for P ≥ T values, not 5 a value.

// Values a lane reduces: V rounded up to a power of two.
__host__ __device__ constexpr int vt_pow2(int v) { return v <= 1 ? 1 : 2 * vt_pow2((v + 1) / 2); }
__host__ __device__ constexpr int vt_log2(int p) { return p <= 1 ? 0 : 1 + vt_log2(p / 2); }

// v[0..S) -> v[0..S/2): a lane whose `bit` is set keeps the upper half, its partner (lane ^
// bit) the lower, and each adds the other's copy of what it keeps: value j's sum over the
// pair, as warp_sum's step at `bit` computes it (float addition commutes).
template <int S>
__device__ __forceinline__ void vt_halve(float* v, int lane, int bit) {
    const bool hi = lane & bit;
#pragma unroll
    for (int j = 0; j < S / 2; j++) {
        const float keep = hi ? v[j + S / 2] : v[j], send = hi ? v[j] : v[j + S / 2];
        v[j] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
    }
}

// warp_sum of each of P values (a power of two, at most 32): the sum of value
// (lane >> (5 - log2 P)) & (P - 1) is returned, bit for bit warp_sum's (the same pairs added
// at each of the steps 16, 8, 4, 2, 1).
template <int P>
__device__ __forceinline__ float vt_reduce(float (&v)[P], int lane) {
    if constexpr (P >= 2) vt_halve<P>(v, lane, 16);
    if constexpr (P >= 4) vt_halve<P / 2>(v, lane, 8);
    if constexpr (P >= 8) vt_halve<P / 4>(v, lane, 4);
    if constexpr (P >= 16) vt_halve<P / 8>(v, lane, 2);
    if constexpr (P >= 32) vt_halve<P / 16>(v, lane, 1);
    float s = v[0];
#pragma unroll
    for (int o = 16 >> vt_log2(P); o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

// Chunk c (NU units a lane) of row r (< rows: else nothing) into raw (and raw_up).
template <int TY, bool UP, int NU>
__device__ __forceinline__ void vt_fetch(const u8* w, const u8* up, long long rb, int rows, int r,
                                         int c, int units, int nb, int lane,
                                         typename Fmt<TY>::Raw (&raw)[NU],
                                         typename Fmt<TY>::Raw (&raw_up)[UP ? NU : 1]) {
#pragma unroll
    for (int i = 0; i < NU; i++) {
        const int u = (c * NU + i) * 32 + lane;
        if (r < rows && u < units) {
            raw[i] = Fmt<TY>::load(w + (size_t)r * rb, u, nb);
            if (UP) raw_up[UP ? i : 0] = Fmt<TY>::load(up + (size_t)r * rb, u, nb);
        }
    }
}

// Rows r_first, r_first + r_step, ... (< rows) of one matrix (with UP the same rows of up):
// out[t][r] = row · x_t as the single-token kernels store it (gated: act(gate) * up; act != 0
// on plain rows: added into out). Chunks of NU units a lane; the next chunk (of this row or
// the warp's next) is loaded while this one is computed.
template <int TY, bool UP, int T, int NU>
__device__ __forceinline__ void vt_rows(const u8* w, const u8* up, long long rb, int rows,
                                     int r_first, int r_step, const i8* xq, const float* xd,
                                     int k, int lane, int act, float* out, int ld,
                                     const float* bias) {
    typedef Fmt<TY> F;
    typedef Unit8<TY> U8;
    typedef UnitW<U8, typename F::Raw> UW;
    constexpr int V = UP ? 2 * T : T, P = vt_pow2(V), L = vt_log2(P);
    const int units = F::units(k), nb = k >> 5;
    const int chunks = (units + 32 * NU - 1) / (32 * NU);
    typename F::Raw raw[NU], raw_up[UP ? NU : 1];
    vt_fetch<TY, UP, NU>(w, up, rb, rows, r_first, 0, units, nb, lane, raw, raw_up);
    pdl_enter();  // the weights are never written; the activations are read after this
    for (int r = r_first; r < rows; r += r_step) {
        float acc[P];
#pragma unroll
        for (int j = 0; j < P; j++) acc[j] = 0.0f;
        for (int c = 0; c < chunks; c++) {
            typename UW::W wd[NU], wu[UP ? NU : 1];
#pragma unroll
            for (int i = 0; i < NU; i++)
                if ((c * NU + i) * 32 + lane < units) {
                    const int u = (c * NU + i) * 32 + lane;
                    wd[i] = UW::prep(raw[i], u);
                    if (UP) wu[UP ? i : 0] = UW::prep(raw_up[UP ? i : 0], u);
                }
            if (c + 1 < chunks)
                vt_fetch<TY, UP, NU>(w, up, rb, rows, r, c + 1, units, nb, lane, raw, raw_up);
            else
                vt_fetch<TY, UP, NU>(w, up, rb, rows, r + r_step, 0, units, nb, lane, raw, raw_up);
#pragma unroll
            for (int i = 0; i < NU; i++) {
                const int u = (c * NU + i) * 32 + lane;
                if (u < units) {
#pragma unroll
                    for (int t = 0; t < T; t++) {
                        const typename U8::X xv =
                            U8::load_x(xq + (size_t)t * k, xd + (size_t)t * nb, u);
                        acc[UP ? 2 * t : t] += UW::dot(wd[i], xv);
                        if (UP) acc[UP ? 2 * t + 1 : t] += UW::dot(wu[UP ? i : 0], xv);
                    }
                }
            }
        }
        const float s = vt_reduce<P>(acc, lane);
        const int idx = (lane >> (5 - L)) & (P - 1);
        if (UP) {
            // Gate (even idx) and up (odd) of a token: lanes differing in bit 5 - L.
            const float su = __shfl_xor_sync(0xffffffffu, s, 1 << (5 - L));
            const int t = idx >> 1;
            if ((lane & ((2 << (5 - L)) - 1)) == 0 && t < T)
                out[(size_t)t * ld + r] = gv_act(s, act) * su;
        } else if ((lane & ((1 << (5 - L)) - 1)) == 0 && idx < T) {
            const float b = bias ? bias[r] : 0.0f;
            if (act) out[(size_t)idx * ld + r] += s + b;
            else out[(size_t)idx * ld + r] = s + b;
        }
    }
}

// Gated launches whose gate and up differ in format (wide units): each row's gate sums, then
// its up sums, plain warp_sum, no prefetch (no Q4_K_M file has such a pair).
template <int T>
__device__ __forceinline__ void vt_rows_pair(const u8* w, int ty, long long rb, const u8* up,
                                             int tyu, long long rbu, int rows, int r_first,
                                             int r_step, const i8* xq, const float* xd, int k,
                                             int lane, int act, float* out, int ld) {
    for (int r = r_first; r < rows; r += r_step) {
        float acc[1][T], acc_up[1][T];
#pragma unroll
        for (int t = 0; t < T; t++) acc[0][t] = acc_up[0][t] = 0.0f;
        rows_dot8_tw_any<1, T>(ty, w + (size_t)r * rb, rb, 1, xq, xd, k, T, lane, acc);
        rows_dot8_tw_any<1, T>(tyu, up + (size_t)r * rbu, rbu, 1, xq, xd, k, T, lane, acc_up);
#pragma unroll
        for (int t = 0; t < T; t++) {
            const float g = warp_sum(acc[0][t]), u = warp_sum(acc_up[0][t]);
            if (lane == 0) out[(size_t)t * ld + r] = gv_act(g, act) * u;
        }
    }
}

// Same parameters as gemv_q8 (n == T; rpb 1: the wide units, 0: gemv_ws_r1's plain ones, Q4_K /
// Q6_K only, gated only for Q4_K pairs). Grid: blockIdx.y is the matrix (gated: one, gate's
// rows each with up's), blockIdx.x any number of blocks of GD_WARPS warps (the host sends at
// most a wave of them): warp g takes rows g, g + warps, ... of the matrix. (A loop over the
// matrices in one block spilled.)
template <int T>
__device__ __forceinline__ void gemv_v_body(const i8* xq, const float* xd, GEMV_PARAMS) {
    const int lane = threadIdx.x & 31, s = blockIdx.y;
    const int r0 = blockIdx.x * GD_WARPS + (threadIdx.x >> 5), nw = gridDim.x * GD_WARPS;
    const u8* w = s == 0 ? w0 : s == 1 ? w1 : w2;
    const long long rb = s == 0 ? rb0 : s == 1 ? rb1 : rb2;
    const int ty = s == 0 ? ty0 : s == 1 ? ty1 : ty2;
    const int rows = s == 0 ? rows0 : s == 1 ? rows1 : total - rows0 - rows1;
    float* out = s == 0 ? out0 : s == 1 ? out1 : out2;
    const int ld = s == 0 ? ld0 : s == 1 ? ld1 : ld2;
    const float* bias = s == 0 ? bias0 : s == 1 ? bias1 : bias2;
    if (r0 >= rows || (gated && s > 0)) {
        pdl_enter();
        return;
    }
#define VT_ROWS(TYP, UPP, NU)                                                                  \
    vt_rows<TYP, UPP, T, NU>(w, w1, rb, rows, r0, nw, xq, xd, k, lane, act, out, ld, bias)
    if (gated && (ty0 != ty1 || rb0 != rb1)) {
        pdl_enter();
        vt_rows_pair<T>(w0, ty0, rb0, w1, ty1, rb1, rows, r0, nw, xq, xd, k, lane, act, out0, ld0);
    } else if (rpb == 0) {
        if (gated) VT_ROWS(T_Q4_K, true, 1);
        else if (ty == T_Q4_K) VT_ROWS(T_Q4_K, false, 2);
        else VT_ROWS(T_Q6_K, false, 2);
    } else {
#define VT_WIDE(TYP, WT)                                                                       \
    case TYP:                                                                                  \
        if (gated) VT_ROWS(WT, true, 1);                                                       \
        else VT_ROWS(WT, false, 1);                                                            \
        return;
        switch (ty) {
        VT_WIDE(T_Q4_K, T_Q4_K_W)
        VT_WIDE(T_Q6_K, T_Q6_K_W)
        VT_WIDE(T_Q8_0, T_Q8_0_W)
        VT_WIDE(T_Q4_0, T_Q4_0_W)
        VT_WIDE(T_IQ4_NL, T_IQ4_NL_W)
        VT_WIDE(T_IQ4_XS, T_IQ4_XS_W)
        VT_WIDE(T_MXFP4, T_MXFP4_W)
        default: pdl_enter(); return;
        }
#undef VT_WIDE
    }
#undef VT_ROWS
}

// 3 blocks an SM (168 registers): at 4 (128) the wide formats' bodies spilled ~100-250 bytes
// in their row loops. The host sends at most VT_BLOCKS blocks an SM.
#define VT_BLOCKS 3
#define GEMV_V(T)                                                                              \
    extern "C" __global__ void __launch_bounds__(GD_WARPS * 32, VT_BLOCKS)                     \
        gemv_v##T(const i8* xq, const float* xd, GEMV_PARAMS) {                                \
        gemv_v_body<T>(xq, xd, GEMV_ARGS);                                                     \
    }
GEMV_V(2)
GEMV_V(3)
GEMV_V(4)
GEMV_V(5)
GEMV_V(6)
GEMV_V(7)
GEMV_V(8)
#undef GEMV_V
