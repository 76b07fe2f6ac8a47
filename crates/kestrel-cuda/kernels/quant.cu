// Dequantization of GGUF block formats and the kernels that read quantized weights
// (embedding lookup, matrix multiplication). Every row is seen as groups of 32 values;
// `dequant32` expands one group, whatever the format.

// ggml type ids.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_MXFP4 39

// Q6_K blocks on the GPU: GGUF's 210 bytes (ql 128, qh 64, scales 16, d 2) followed by 14
// bytes of padding, so that every block (and every word in it) is 16-byte aligned and read
// with plain vector loads; the backend pads them at upload (`upload_matrix`).
#define Q6K_GPU_BYTES 224
#define T_BF16 30

// Scale and minimum of sub-block j (0..7) of a Q4_K / Q5_K block (6-bit packed).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, float* sc, float* mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// The 4-bit codebook formats (IQ4_NL, IQ4_XS, MXFP4): each nibble indexes 16 int8 levels,
// held here as four little-endian words (ggml's kvalues_iq4nl, kvalues_mxfp4).
#define IQ4NL_T0 0xBFAD9881u
#define IQ4NL_T1 0xF6EADDCFu
#define IQ4NL_T2 0x26190D01u
#define IQ4NL_T3 0x71594535u
#define MXFP4_T0 0x03020100u
#define MXFP4_T1 0x0C080604u
#define MXFP4_T2 0xFDFEFF00u
#define MXFP4_T3 0xF4F8FAFCu

// The levels of the 8 nibbles of q (4 quant bytes) as int8 bytes: lo = the low nibbles'
// (bytes 0..3 in order), hi = the high nibbles' (llama.cpp's get_int_from_table_16).
__device__ __forceinline__ void lut16(u32 q, u32 t0, u32 t1, u32 t2, u32 t3, u32& lo, u32& hi) {
    const u32 sel = 0x32103210u | ((q & 0x88888888u) >> 1);
    u32 tmp[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 s = q >> (16 * i);
        const u32 a = __byte_perm(t0, t1, s), b = __byte_perm(t2, t3, s);
        tmp[i] = __byte_perm(a, b, sel >> (16 * i));
    }
    lo = __byte_perm(tmp[0], tmp[1], 0x6420);
    hi = __byte_perm(tmp[0], tmp[1], 0x7531);
}

// ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128), subnormal for e < 2.
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __int_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// IQ4_XS sub-block ib's scale: d * (ls - 32), from the block's 8 header bytes (d f16,
// scales_h u16 in h.x; scales_l in h.y).
__device__ __forceinline__ float iq4xs_scale(uint2 h, int ib) {
    const int ls = ((h.y >> (4 * ib)) & 0xF) | (((h.x >> (16 + 2 * ib)) & 3) << 4);
    return h2f((u16)(h.x & 0xFFFF)) * (float)(ls - 32);
}

// Values g*32 .. g*32+31 of a row into w; for float rows only the first `lim` are read
// (the rest are zero), quantized rows are whole blocks.
// (nb: 32-value blocks per row, where Q8_0 / Q4_0 / Q5_0 rows keep their scales, and
// Q5_0's fifth bits, after the quants; IQ4_NL and MXFP4 rows as Q4_0's, with MXFP4's
// one-byte exponents; IQ4_XS rows keep the blocks' 128 quant bytes first, then their 8
// header bytes.)
__device__ __forceinline__ void dequant32(int ty, const u8* row, int g, int lim, float* w, int nb) {
    switch (ty) {
    case T_F32: {
        const float* r = (const float*)row + (size_t)g * 32;
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = i < lim ? r[i] : 0.0f;
        break;
    }
    case T_F16: {
        const u16* r = (const u16*)row + (size_t)g * 32;
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = i < lim ? h2f(r[i]) : 0.0f;
        break;
    }
    case T_BF16: {
        const u16* r = (const u16*)row + (size_t)g * 32;
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = i < lim ? __int_as_float(((u32)r[i]) << 16) : 0.0f;
        break;
    }
    case T_Q8_0: {
        const float d = h2f(*(const u16*)(row + (size_t)nb * 32 + 2 * g));
        const i8* q = (const i8*)(row + (size_t)g * 32);
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = d * (float)q[i];
        break;
    }
    case T_Q4_0: {
        const float d = h2f(*(const u16*)(row + (size_t)nb * 16 + 2 * g));
        const u8* q = row + (size_t)g * 16;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            w[i] = d * (float)((int)(q[i] & 0xF) - 8);
            w[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
        }
        break;
    }
    case T_Q4_1: {
        const u8* b = row + (size_t)g * 20;
        const float d = ld_f16(b), m = ld_f16(b + 2);
        const u8* q = b + 4;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            w[i] = d * (float)(q[i] & 0xF) + m;
            w[i + 16] = d * (float)(q[i] >> 4) + m;
        }
        break;
    }
    case T_Q5_0: {
        const float d = h2f(*(const u16*)(row + (size_t)nb * 20 + 2 * g));
        const u32 qh = *(const u32*)(row + (size_t)nb * 16 + 4 * g);
        const u8* q = row + (size_t)g * 16;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10;
            const int h1 = (qh >> (j + 12)) & 0x10;
            w[j] = d * (float)(((q[j] & 0xF) | h0) - 16);
            w[j + 16] = d * (float)(((q[j] >> 4) | h1) - 16);
        }
        break;
    }
    case T_Q5_1: {
        const u8* b = row + (size_t)g * 24;
        const float d = ld_f16(b), m = ld_f16(b + 2);
        const u32 qh = (u32)b[4] | ((u32)b[5] << 8) | ((u32)b[6] << 16) | ((u32)b[7] << 24);
        const u8* q = b + 8;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10;
            const int h1 = (qh >> (j + 12)) & 0x10;
            w[j] = d * (float)((q[j] & 0xF) | h0) + m;
            w[j + 16] = d * (float)((q[j] >> 4) | h1) + m;
        }
        break;
    }
    case T_Q4_K: {
        const u8* b = row + (size_t)(g >> 3) * 144;
        const int s = g & 7;
        const float d = ld_f16(b), dmin = ld_f16(b + 2);
        float sc, mn;
        scale_min_k4(s, b + 4, &sc, &mn);
        const float d1 = d * sc, m1 = dmin * mn;
        const u8* q = b + 16 + 32 * (s >> 1);
        const int shift = (s & 1) * 4;
#pragma unroll
        for (int l = 0; l < 32; l++) w[l] = d1 * (float)((q[l] >> shift) & 0xF) - m1;
        break;
    }
    case T_Q5_K: {
        const u8* b = row + (size_t)(g >> 3) * 176;
        const int s = g & 7;
        const float d = ld_f16(b), dmin = ld_f16(b + 2);
        float sc, mn;
        scale_min_k4(s, b + 4, &sc, &mn);
        const float d1 = d * sc, m1 = dmin * mn;
        const u8* qh = b + 16;
        const u8* q = b + 48 + 32 * (s >> 1);
        const int shift = (s & 1) * 4;
        const u8 hb = (u8)(1u << s);
#pragma unroll
        for (int l = 0; l < 32; l++) {
            const int v = ((q[l] >> shift) & 0xF) + ((qh[l] & hb) ? 16 : 0);
            w[l] = d1 * (float)v - m1;
        }
        break;
    }
    case T_Q6_K: {
        const u8* b = row + (size_t)(g >> 3) * Q6K_GPU_BYTES;
        const int s = g & 7, half = s >> 2, r = s & 3;
        const u8* ql = b + 64 * half + (r & 1) * 32;
        const u8* qh = b + 128 + 32 * half;
        const i8* sc = (const i8*)(b + 192) + 8 * half + 2 * r;
        const float d = h2f(*(const u16*)(b + 208));
        const int lo_shift = (r >> 1) * 4, hi_shift = 2 * r;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            const int q = ((ql[l] >> lo_shift) & 0xF) | (((qh[l] >> hi_shift) & 3) << 4);
            w[l] = d * (float)sc[l >> 4] * (float)(q - 32);
        }
        break;
    }
    case T_IQ4_NL:
    case T_IQ4_XS:
    case T_MXFP4: {
        float d;
        if (ty == T_IQ4_NL) d = h2f(*(const u16*)(row + (size_t)nb * 16 + 2 * g));
        else if (ty == T_MXFP4) d = e8m0_half(row[(size_t)nb * 16 + g]);
        else d = iq4xs_scale(*(const uint2*)(row + (size_t)nb * 16 + 8 * (g >> 3)), g & 7);
        const bool mx = ty == T_MXFP4;
        const u32 t0 = mx ? MXFP4_T0 : IQ4NL_T0, t1 = mx ? MXFP4_T1 : IQ4NL_T1;
        const u32 t2 = mx ? MXFP4_T2 : IQ4NL_T2, t3 = mx ? MXFP4_T3 : IQ4NL_T3;
        const u32* q = (const u32*)(row + (size_t)g * 16);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 lo, hi;
            lut16(q[i], t0, t1, t2, t3, lo, hi);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                w[4 * i + j] = d * (float)(i8)((lo >> (8 * j)) & 0xFF);
                w[16 + 4 * i + j] = d * (float)(i8)((hi >> (8 * j)) & 0xFF);
            }
        }
        break;
    }
    default:
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = 0.0f;
    }
}

// out[i] = table[tokens[i]] (dequantized); one block per token.
// A token past the table (an all-NaN row's argmax, chained on the device to the next
// step) reads row 0: memory stays safe and the host rejects the id when it reads it.
extern "C" __global__ void embed(const u8* table, int ty, long long row_bytes, int k,
                                 const u32* tokens, float* out, unsigned rows) {
    pdl_enter();
    const int i = blockIdx.x;
    const u32 t = tokens[i] < rows ? tokens[i] : 0u;
    const u8* row = table + (size_t)t * (size_t)row_bytes;
    const int n_groups = (k + 31) / 32;
    float* o = out + (size_t)i * k;
    for (int g = threadIdx.x; g < n_groups; g += blockDim.x) {
        float v[32];
        const int lim = min(32, k - g * 32);
        dequant32(ty, row, g, lim, v, n_groups);
#pragma unroll
        for (int j = 0; j < 32; j++)
            if (j < lim) o[g * 32 + j] = v[j];
    }
}

#define MM_TOK 4

// out[t][row] = dot(W[row], x[t]). One warp per weight row; blockIdx.y picks a group of
// MM_TOK tokens, so each group of weights is expanded once per MM_TOK tokens.
extern "C" __global__ void matmul(const u8* w, int ty, long long row_bytes, int k, int n_out,
                                  const float* x, float* out, int n) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= n_out) return;
    const int t0 = blockIdx.y * MM_TOK;
    const int nt = min(MM_TOK, n - t0);
    const u8* r = w + (size_t)row * (size_t)row_bytes;
    float acc[MM_TOK];
#pragma unroll
    for (int t = 0; t < MM_TOK; t++) acc[t] = 0.0f;
    const int n_groups = (k + 31) / 32;
    for (int g = lane; g < n_groups; g += 32) {
        float v[32];
        const int lim = min(32, k - g * 32);
        dequant32(ty, r, g, lim, v, n_groups);
#pragma unroll
        for (int t = 0; t < MM_TOK; t++) {
            if (t < nt) {
                const float* xr = x + (size_t)(t0 + t) * k + g * 32;
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < 32; j++)
                    if (j < lim) s += v[j] * xr[j];
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MM_TOK; t++) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < nt) out[(size_t)(t0 + t) * n_out + row] = s;
    }
}

// W (rows × k, any format) → f16, row-major with k values per row: the weight operand of a
// tensor-core GEMM (prefill). One thread per 32-value group.
extern "C" __global__ void dequant_f16(const u8* w, int ty, long long row_bytes, int k,
                                       int rows, u16* out) {
    pdl_enter();
    const int gpr = (k + 31) / 32;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * gpr) return;
    const int row = (int)(i / gpr), g = (int)(i % gpr);
    const int lim = min(32, k - g * 32);
    float v[32];
    dequant32(ty, w + (size_t)row * (size_t)row_bytes, g, lim, v, gpr);
    u16* o = out + (size_t)row * k + (size_t)g * 32;
    if (lim == 32 && (k & 7) == 0) {
        // 16-byte stores: the row starts 16-byte aligned when k is a multiple of 8.
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint4 s;
            s.x = (u32)f2h(v[8 * j]) | ((u32)f2h(v[8 * j + 1]) << 16);
            s.y = (u32)f2h(v[8 * j + 2]) | ((u32)f2h(v[8 * j + 3]) << 16);
            s.z = (u32)f2h(v[8 * j + 4]) | ((u32)f2h(v[8 * j + 5]) << 16);
            s.w = (u32)f2h(v[8 * j + 6]) | ((u32)f2h(v[8 * j + 7]) << 16);
            ((uint4*)o)[j] = s;
        }
    } else {
        for (int j = 0; j < lim; j++) o[j] = f2h(v[j]);
    }
}

// out[i] = f16(x[i]): the activation operand of a tensor-core GEMM.
extern "C" __global__ void f32_to_f16(const float* x, u16* out, long long len) {
    pdl_enter();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) out[i] = f2h(x[i]);
}
