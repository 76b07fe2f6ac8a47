// The paged KV cache and attention: store_kv / rope_store_kv, the split decode kernels
// (one block a head, grouped, tiled on the tensor cores) and their combine, the prefill
// kernels; gather_rows (the logit rows of a step).

// Cache slot of position `pos` of the sequence whose block table starts at `table`.
__device__ __forceinline__ size_t kv_slot(const u32* table, int block_size, int pos) {
    return (size_t)table[pos / block_size] * block_size + pos % block_size;
}

// Writes each token's key and value (as f16) into its sequence's cache slot.
extern "C" __global__ void store_kv(const float* k, const float* v, u16* kc, u16* vc,
                                    const u32* positions, const u32* seq_of, const u32* table_off,
                                    const u32* tables, int block_size, int kv_dim) {
    pdl_enter();
    const int i = blockIdx.x;
    const u32* table = tables + table_off[seq_of[i]];
    const size_t slot = kv_slot(table, block_size, (int)positions[i]);
    for (int d = threadIdx.x; d < kv_dim; d += blockDim.x) {
        kc[slot * kv_dim + d] = f2h(k[(size_t)i * kv_dim + d]);
        vc[slot * kv_dim + d] = f2h(v[(size_t)i * kv_dim + d]);
    }
}

// Storage kinds of the cache's keys or values (the Rust side's KvType as cuda_kind()).
// KV_F16: one f16 per value. KV_Q8_0: ggml's Q8_0 numbers (32 values along the head
// dimension share the f16 scale amax / 127, each an i8 rounded half to even), laid out
// for aligned loads: a layer's buffer holds every slot's kv_dim quants first (one byte a
// value, slot-major), then every slot's kv_dim / 32 f16 scales (`sc`, slot-major).
// KV_FP8: the same layout with E4M3 bytes of x · 448 / amax (nearest even, saturating at
// ±448) and the f16 scale amax / 448.
// KV_Q4_0: ggml's Q4_0 numbers (the f16 scale d = m / -8 of the block's value m of largest
// magnitude, quants min(15, trunc(x / d + 8.5))), packed as ggml packs them: per block 16
// bytes, byte j holding value j (low nibble) and value j + 16 (high); the scales as above,
// after every slot's kv_dim / 2 bytes.
#define KV_F16 0
#define KV_Q8_0 1
#define KV_FP8 2
#define KV_Q4_0 3

// E4M3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, 0x7f / 0xff
// NaN, unused here) of x rounded to nearest even, saturating at ±448.
__device__ __forceinline__ u8 f32_to_e4m3(float x) {
    const u8 sign = (__float_as_uint(x) >> 24) & 0x80;
    const float a = fminf(fabsf(x), 448.0f);
    if (a < 0.015625f) {
        // Subnormal: multiples of 2^-9 (8 · 2^-9 = 2^-6 is the smallest normal, code 0x08).
        return sign | (u8)__float2int_rn(a * 512.0f);
    }
    u32 b = __float_as_uint(a);
    b += 0x7ffffu + ((b >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
    const int e = (int)(b >> 23) - 127;  // -6..8 (448 stays 448)
    return sign | (u8)(((e + 7) << 3) | ((b >> 20) & 7u));
}

__device__ __forceinline__ float e4m3_to_f32(u8 v) {
    const u32 e = (v >> 3) & 15u, m = v & 7u;
    const float a = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return (v & 0x80) ? -a : a;
}

// Value `off` (of kv_dim) of cache slot `slot`, dequantized.
__device__ __forceinline__ float kv_load(const u16* c, const u16* sc, int kind, size_t slot,
                                         int kv_dim, int off) {
    const size_t at = slot * kv_dim + off;
    if (kind == KV_F16) return h2f(c[at]);
    if (kind == KV_Q4_0) {
        const u8 b = reinterpret_cast<const u8*>(c)[(at >> 5) * 16 + (at & 15)];
        return (float)((at & 16 ? b >> 4 : b & 15) - 8) * h2f(sc[at >> 5]);
    }
    if (kind == KV_FP8) return e4m3_to_f32(reinterpret_cast<const u8*>(c)[at]) * h2f(sc[at >> 5]);
    return (float)reinterpret_cast<const i8*>(c)[at] * h2f(sc[at >> 5]);
}

// Stores value `off` of slot `slot`; for quantized kinds the warp's 32 lanes hold one
// aligned 32-value block (off = 32 b + lane), whose scale lane 0 writes.
__device__ __forceinline__ void kv_put(u16* c, u16* sc, int kind, size_t slot, int kv_dim,
                                       int off, float x) {
    const size_t at = slot * kv_dim + off;
    if (kind == KV_F16) {
        c[at] = f2h(x);
        return;
    }
    const int lane = threadIdx.x & 31;
    if (kind == KV_Q4_0) {
        // ggml's quantize_row_q4_0_ref: m = the first value of largest magnitude.
        float best = fabsf(x);
        int bi = lane;
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
            }
        }
        const float m = best > 0.0f ? __shfl_sync(0xffffffffu, x, bi) : 0.0f;
        const float d = m / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        // Unfused, as the C code: x · id rounded, then + 8.5 rounded, then truncated.
        const int q = min(15, (int)__fadd_rn(__fmul_rn(x, id), 8.5f));
        const int hi = __shfl_down_sync(0xffffffffu, q, 16);
        if (lane < 16) reinterpret_cast<u8*>(c)[(at >> 5) * 16 + lane] = (u8)(q | (hi << 4));
        if (lane == 0) sc[at >> 5] = f2h(d);
        return;
    }
    float amax = fabsf(x);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (kind == KV_FP8) {
        const float id = amax != 0.0f ? 448.0f / amax : 0.0f;
        reinterpret_cast<u8*>(c)[at] = f32_to_e4m3(x * id);
        if (lane == 0) sc[at >> 5] = f2h(amax / 448.0f);
        return;
    }
    // ggml's x86 Q8_0: d = amax / 127 kept as f16, q = round_half_even(x · 127 / amax).
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    reinterpret_cast<i8*>(c)[at] = (i8)max(-127, min(127, __float2int_rn(x * id)));
    if (lane == 0) sc[at >> 5] = f2h(amax / 127.0f);
}

// store_kv for caches of any kind (kt: keys', vt: values'), quantized here on the device:
// one block a token, a warp a 32-value block of keys or values at a time. ks / vs: the
// scale regions (unused for KV_F16).
extern "C" __global__ void store_kv_q(const float* k, const float* v, u16* kc, u16* vc,
                                      const u32* positions, const u32* seq_of,
                                      const u32* table_off, const u32* tables, int block_size,
                                      int kv_dim, u16* ks, u16* vs, int kt, int vt) {
    pdl_enter();
    const int i = blockIdx.x;
    const u32* table = tables + table_off[seq_of[i]];
    const size_t slot = kv_slot(table, block_size, (int)positions[i]);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int blocks = kv_dim >> 5;
    for (int b = warp; b < 2 * blocks; b += n_warps) {
        const bool val = b >= blocks;
        const int off = (val ? b - blocks : b) * 32 + lane;
        const float x = (val ? v : k)[(size_t)i * kv_dim + off];
        if (val) kv_put(vc, vs, vt, slot, kv_dim, off, x);
        else kv_put(kc, ks, kt, slot, kv_dim, off, x);
    }
}

#define NEG_INF __int_as_float(0xff800000u)
#define ATT_WARPS 4
#define ATT_MAX_HD 256
#define ATT_PER_LANE (ATT_MAX_HD / 32)

// Attention of token i, head h over the keys [k_begin, k_end) of its sequence: each warp
// walks every ATT_WARPS-th key with an online softmax, then the warps are merged. Leaves
// in `res` the sum of exp(score - *big) · value over those keys (unnormalized), with the
// largest score in *big and the sum of exp(score - *big) in *total (0 when the range is
// empty). The caller's block has ATT_WARPS warps; `res` holds head_dim floats (shared).
// `ks`, `vs`, `kt`, `vt`: the scales and kinds of quantized caches (kv_load); the f16
// kernels pass KV_F16, which folds away. The query stays f32 (llama.cpp's CPU backend
// rounds it to Q8_0 for quantized keys; this is the f32 arithmetic that approximates).
__device__ __forceinline__ void attn_range(const float* q, const u16* kc, const u16* vc,
                                           int i, int h, int k_begin, int k_end,
                                           const u32* table, int block_size, int n_head,
                                           int n_head_kv, int head_dim, float scale,
                                           float* res, float* big_out, float* total_out,
                                           const u16* ks = nullptr, const u16* vs = nullptr,
                                           int kt = KV_F16, int vt = KV_F16) {
    __shared__ float qs[ATT_MAX_HD];
    __shared__ float w_max[ATT_WARPS], w_sum[ATT_WARPS];
    __shared__ float w_acc[ATT_WARPS][ATT_MAX_HD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kv_head = h / (n_head / n_head_kv);
    const int kv_dim = n_head_kv * head_dim;
    const float* qr = q + (size_t)i * n_head * head_dim + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qr[d];
    __syncthreads();

    float m = NEG_INF, l = 0.0f;
    float acc[ATT_PER_LANE];
#pragma unroll
    for (int j = 0; j < ATT_PER_LANE; j++) acc[j] = 0.0f;

    for (int kp = k_begin + warp; kp < k_end; kp += ATT_WARPS) {
        const size_t slot = kv_slot(table, block_size, kp);
        const int head_off = kv_head * head_dim;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < ATT_PER_LANE; j++) {
            const int d = lane + 32 * j;
            if (d < head_dim) dot += qs[d] * kv_load(kc, ks, kt, slot, kv_dim, head_off + d);
        }
        const float score = warp_sum(dot) * scale;
        const float m_new = fmaxf(m, score);
        const float corr = expf(m - m_new);
        const float p = expf(score - m_new);
        l = l * corr + p;
#pragma unroll
        for (int j = 0; j < ATT_PER_LANE; j++) {
            const int d = lane + 32 * j;
            if (d < head_dim)
                acc[j] = acc[j] * corr + p * kv_load(vc, vs, vt, slot, kv_dim, head_off + d);
        }
        m = m_new;
    }

    if (lane == 0) {
        w_max[warp] = m;
        w_sum[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < ATT_PER_LANE; j++) {
        const int d = lane + 32 * j;
        if (d < head_dim) w_acc[warp][d] = acc[j];
    }
    __syncthreads();
    float big = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++)
        if (w_sum[w] > 0.0f) big = fmaxf(big, w_max[w]);
    float total = 0.0f;
    for (int w = 0; w < ATT_WARPS; w++)
        if (w_sum[w] > 0.0f) total += w_sum[w] * expf(w_max[w] - big);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++)
            if (w_sum[w] > 0.0f) a += w_acc[w][d] * expf(w_max[w] - big);
        res[d] = a;
    }
    *big_out = big;
    *total_out = total;
}

// Split s of `splits` equal ranges of the keys a token at `pos` sees (causal; with window >
// 0 only the last `window` positions): [begin, end), empty for splits past the end.
__device__ __forceinline__ void split_key_range(int pos, int window, int splits, int s,
                                                int& begin, int& end) {
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int span = (pos + 1 - lo + splits - 1) / splits;
    begin = lo + s * span;
    end = min(pos + 1, begin + span);
}

// Attention of token tok0 + blockIdx.x, head blockIdx.y over its sequence's cached
// positions (causal, optionally a sliding window).
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention(const float* q, const u16* kc, const u16* vc, float* out, const u32* positions,
          const u32* seq_of, const u32* table_off, const u32* tables, int block_size, int n_head,
          int n_head_kv, int head_dim, float scale, int window, int tok0) {
    pdl_enter();
    __shared__ float res[ATT_MAX_HD];
    const int i = tok0 + blockIdx.x, h = blockIdx.y;
    int k_begin, k_end;
    split_key_range((int)positions[i], window, 1, 0, k_begin, k_end);
    float big, total;
    attn_range(q, kc, vc, i, h, k_begin, k_end, tables + table_off[seq_of[i]], block_size, n_head,
               n_head_kv, head_dim, scale, res, &big, &total);
    float* o = out + (size_t)i * n_head * head_dim + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = res[d] / total;
}

// out[j] = x[rows[j]], one block per output row.
extern "C" __global__ void gather_rows(const float* x, float* out, const u32* rows, int cols) {
    pdl_enter();
    const float* src = x + (size_t)rows[blockIdx.x] * cols;
    float* dst = out + (size_t)blockIdx.x * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) dst[j] = src[j];
}

// Decode attention split across keys ("flash decoding"): block (token, head, split z)
// covers one of `splits` equal ranges of the token's visible keys and writes its
// unnormalized partial result (acc[head_dim], running max, running sum) to `part`;
// attention_combine merges the splits. Spreads a long context over many blocks instead of
// one block per head walking every key.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_split(const float* q, const u16* kc, const u16* vc, float* part, const u32* positions,
                const u32* seq_of, const u32* table_off, const u32* tables, int block_size,
                int n_head, int n_head_kv, int head_dim, float scale, int window, int splits,
                int tok0) {
    pdl_enter();
    // i: the token (from tok0); li: its slot in `part`.
    const int li = blockIdx.x, i = tok0 + li, h = blockIdx.y, s = blockIdx.z;
    int k_begin, k_end;
    split_key_range((int)positions[i], window, splits, s, k_begin, k_end);
    float* o = part + (((size_t)li * n_head + h) * splits + s) * (head_dim + 2);
    float big, total;
    // The partial sums go straight to `part`: each thread writes its own dims.
    attn_range(q, kc, vc, i, h, k_begin, k_end, tables + table_off[seq_of[i]], block_size,
               n_head, n_head_kv, head_dim, scale, o, &big, &total);
    if (threadIdx.x == 0) {
        o[head_dim] = big;
        o[head_dim + 1] = total;
    }
}

// `attention` and `attention_split` over a cache with quantized keys or values (kinds kt,
// vt; scales ks, vs: see kv_load): the same arguments with those four last.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_q(const float* q, const u16* kc, const u16* vc, float* out, const u32* positions,
            const u32* seq_of, const u32* table_off, const u32* tables, int block_size,
            int n_head, int n_head_kv, int head_dim, float scale, int window, int tok0,
            const u16* ks, const u16* vs, int kt, int vt) {
    pdl_enter();
    __shared__ float res[ATT_MAX_HD];
    const int i = tok0 + blockIdx.x, h = blockIdx.y;
    int k_begin, k_end;
    split_key_range((int)positions[i], window, 1, 0, k_begin, k_end);
    float big, total;
    attn_range(q, kc, vc, i, h, k_begin, k_end, tables + table_off[seq_of[i]], block_size, n_head,
               n_head_kv, head_dim, scale, res, &big, &total, ks, vs, kt, vt);
    float* o = out + (size_t)i * n_head * head_dim + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = res[d] / total;
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_split_q(const float* q, const u16* kc, const u16* vc, float* part,
                  const u32* positions, const u32* seq_of, const u32* table_off,
                  const u32* tables, int block_size, int n_head, int n_head_kv, int head_dim,
                  float scale, int window, int splits, int tok0, const u16* ks, const u16* vs,
                  int kt, int vt) {
    pdl_enter();
    const int li = blockIdx.x, i = tok0 + li, h = blockIdx.y, s = blockIdx.z;
    int k_begin, k_end;
    split_key_range((int)positions[i], window, splits, s, k_begin, k_end);
    float* o = part + (((size_t)li * n_head + h) * splits + s) * (head_dim + 2);
    float big, total;
    attn_range(q, kc, vc, i, h, k_begin, k_end, tables + table_off[seq_of[i]], block_size,
               n_head, n_head_kv, head_dim, scale, o, &big, &total, ks, vs, kt, vt);
    if (threadIdx.x == 0) {
        o[head_dim] = big;
        o[head_dim + 1] = total;
    }
}

// attention_split for grouped-query attention: block (token, kv head, split z) computes
// every query head sharing that kv head, so each key and value row is read once for the
// group instead of once per head. Lane l holds dims [l*PER, l*PER + PER) of the head
// (head_dim = 32 * PER, PER <= 4) and each warp prefetches its next key's rows while it
// computes the current one. Same partial-result layout as attention_split.
#define GQA_MAX_GROUP 8
#define GQA_MAX_PER 4
// The body of attention_split_gqa and attention_split_gqa_q (k_sc, v_sc, kt_kind, vt_kind:
// a quantized cache's scales and kinds, see kv_load; KV_F16 folds the quantized loads away).
__device__ __forceinline__ void
split_gqa(const float* q, const u16* kc, const u16* vc, float* part, const u32* positions,
          const u32* seq_of, const u32* table_off, const u32* tables, int block_size, int n_head,
          int n_head_kv, int head_dim, float scale, int window, int splits, int tok0,
          const u16* k_sc, const u16* v_sc, int kt_kind, int vt_kind) {
    __shared__ float w_max[ATT_WARPS][GQA_MAX_GROUP], w_sum[ATT_WARPS][GQA_MAX_GROUP];
    __shared__ float w_acc[ATT_WARPS][GQA_MAX_GROUP][GQA_MAX_PER * 32];
    const int li = blockIdx.x, i = tok0 + li, kvh = blockIdx.y, s = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = n_head / n_head_kv, per = head_dim / 32;
    const int kv_dim = n_head_kv * head_dim;
    int k_begin, k_end;
    split_key_range((int)positions[i], window, splits, s, k_begin, k_end);
    const u32* table = tables + table_off[seq_of[i]];

    // This lane's slice of each query head, pre-scaled.
    float qr[GQA_MAX_GROUP][GQA_MAX_PER];
    float acc[GQA_MAX_GROUP][GQA_MAX_PER];
    float m[GQA_MAX_GROUP], l[GQA_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < GQA_MAX_GROUP; g++) {
        const float* qh = q + (size_t)i * n_head * head_dim + (size_t)(kvh * group + g) * head_dim;
#pragma unroll
        for (int e = 0; e < GQA_MAX_PER; e++) {
            qr[g][e] = (g < group && e < per) ? qh[lane * per + e] * scale : 0.0f;
            acc[g][e] = 0.0f;
        }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }

    float kn[GQA_MAX_PER], vn[GQA_MAX_PER];
    auto load = [&](int kp, float* kr, float* vr) {
        if (kt_kind != KV_F16 || vt_kind != KV_F16) {
            const size_t slot = kv_slot(table, block_size, kp);
            const int off = kvh * head_dim + lane * per;
#pragma unroll
            for (int e = 0; e < GQA_MAX_PER; e++) {
                kr[e] = e < per ? kv_load(kc, k_sc, kt_kind, slot, kv_dim, off + e) : 0.0f;
                vr[e] = e < per ? kv_load(vc, v_sc, vt_kind, slot, kv_dim, off + e) : 0.0f;
            }
            return;
        }
        const size_t base = kv_slot(table, block_size, kp) * kv_dim + (size_t)kvh * head_dim + lane * per;
        if (per == 4) {
            // 8-byte loads: base is a multiple of 4 halves (head_dim = 128).
            const uint2 kw = *reinterpret_cast<const uint2*>(kc + base);
            const uint2 vw = *reinterpret_cast<const uint2*>(vc + base);
            kr[0] = h2f((u16)(kw.x & 0xffff)); kr[1] = h2f((u16)(kw.x >> 16));
            kr[2] = h2f((u16)(kw.y & 0xffff)); kr[3] = h2f((u16)(kw.y >> 16));
            vr[0] = h2f((u16)(vw.x & 0xffff)); vr[1] = h2f((u16)(vw.x >> 16));
            vr[2] = h2f((u16)(vw.y & 0xffff)); vr[3] = h2f((u16)(vw.y >> 16));
            return;
        }
#pragma unroll
        for (int e = 0; e < GQA_MAX_PER; e++) {
            kr[e] = e < per ? h2f(kc[base + e]) : 0.0f;
            vr[e] = e < per ? h2f(vc[base + e]) : 0.0f;
        }
    };
    int kp = k_begin + warp;
    if (kp < k_end) load(kp, kn, vn);
    for (; kp < k_end; kp += ATT_WARPS) {
        float kr[GQA_MAX_PER], vr[GQA_MAX_PER];
#pragma unroll
        for (int e = 0; e < GQA_MAX_PER; e++) {
            kr[e] = kn[e];
            vr[e] = vn[e];
        }
        if (kp + ATT_WARPS < k_end) load(kp + ATT_WARPS, kn, vn);
#pragma unroll
        for (int g = 0; g < GQA_MAX_GROUP; g++) {
            if (g < group) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < GQA_MAX_PER; e++) dot += qr[g][e] * kr[e];
                const float score = warp_sum(dot);
                const float m_new = fmaxf(m[g], score);
                const float corr = expf(m[g] - m_new);
                const float p = expf(score - m_new);
                l[g] = l[g] * corr + p;
#pragma unroll
                for (int e = 0; e < GQA_MAX_PER; e++) acc[g][e] = acc[g][e] * corr + p * vr[e];
                m[g] = m_new;
            }
        }
    }

    // Merge the warps, head by head.
#pragma unroll
    for (int g = 0; g < GQA_MAX_GROUP; g++) {
        if (g < group) {
            if (lane == 0) {
                w_max[warp][g] = m[g];
                w_sum[warp][g] = l[g];
            }
#pragma unroll
            for (int e = 0; e < GQA_MAX_PER; e++)
                if (e < per) w_acc[warp][g][lane * per + e] = acc[g][e];
        }
    }
    __syncthreads();
    for (int g = warp; g < group; g += ATT_WARPS) {
        float big = NEG_INF;
        for (int w = 0; w < ATT_WARPS; w++)
            if (w_sum[w][g] > 0.0f) big = fmaxf(big, w_max[w][g]);
        float total = 0.0f;
        float* o = part + (((size_t)li * n_head + kvh * group + g) * splits + s) * (head_dim + 2);
        for (int d = lane; d < head_dim; d += 32) {
            float a = 0.0f;
            for (int w = 0; w < ATT_WARPS; w++)
                if (w_sum[w][g] > 0.0f) a += w_acc[w][g][d] * expf(w_max[w][g] - big);
            o[d] = a;
        }
        for (int w = 0; w < ATT_WARPS; w++)
            if (w_sum[w][g] > 0.0f) total += w_sum[w][g] * expf(w_max[w][g] - big);
        if (lane == 0) {
            o[head_dim] = big;
            o[head_dim + 1] = total;
        }
    }
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_split_gqa(const float* q, const u16* kc, const u16* vc, float* part,
                    const u32* positions, const u32* seq_of, const u32* table_off,
                    const u32* tables, int block_size, int n_head, int n_head_kv, int head_dim,
                    float scale, int window, int splits, int tok0) {
    pdl_enter();
    split_gqa(q, kc, vc, part, positions, seq_of, table_off, tables, block_size, n_head,
              n_head_kv, head_dim, scale, window, splits, tok0, nullptr, nullptr, KV_F16, KV_F16);
}

// attention_split_gqa over a cache with quantized keys or values: the same arguments, then
// the scales and kinds (each key and value row read and dequantized once per group).
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_split_gqa_q(const float* q, const u16* kc, const u16* vc, float* part,
                      const u32* positions, const u32* seq_of, const u32* table_off,
                      const u32* tables, int block_size, int n_head, int n_head_kv,
                      int head_dim, float scale, int window, int splits, int tok0,
                      const u16* k_sc, const u16* v_sc, int kt, int vt) {
    pdl_enter();
    split_gqa(q, kc, vc, part, positions, seq_of, table_off, tables, block_size, n_head,
              n_head_kv, head_dim, scale, window, splits, tok0, k_sc, v_sc, kt, vt);
}

// Decode attention on the tensor cores, for grouped (or single) heads of 64 or 128 dims:
// block (token, kv head, split z) computes the split's keys for every query head of the
// group (at most 8) and writes the same partials as attention_split (or, with one split,
// the normalized output itself: no attention_combine). Each of the block's 4 warps walks
// its own chunks of TA_KEYS = 16 consecutive keys (warp w: chunks w, w + 4, ...): the
// chunk's K and V rows are copied from the paged cache into the warp's shared rows with
// 16-byte cp.async (K and V in separate groups, so the next chunk's K streams in during
// this chunk's P·V and its V during the next scores), then
//   scores S = Q·Kᵀ: mma m16n8k16, A = the group's queries (row h < 8: head h rounded to
//     f16, row h + 8: the rounding's remainder, also f16, so S_hi + S_lo keeps q to ~22
//     bits at no extra mma), B = the K rows via ldmatrix;
//   one online-softmax update per chunk and head (lane 4h..4h+3 hold head h's scores);
//   O += P·V: A = P (again rows h / h + 8: f16 p and its remainder), B = the V rows via
//     ldmatrix.trans, f32 accumulators (64 or 32 per lane).
// Scores are kept in log2 units (q pre-scaled by scale · log2 e); the partial's max is
// stored in natural units as attention_combine expects. The warps are merged at the end
// through shared memory (the K/V rows' space). Rows are padded by 16 bytes: the 8 rows an
// ldmatrix reads hit distinct banks. Needs sm_80 (cp.async, ldmatrix, f16 mma.sync).
#define TA_WARPS 4
#define TA_KEYS 16
#define TA_MAX_GROUP 8
#define TA_LOG2E 1.4426950408889634f
#define TA_LN2 0.6931471805599453f

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// x0, x1 as two f16 pairs: hi = (f16(x0), f16(x1)) (x0 in the low half), lo = the
// remainders x - hi rounded to f16, so hi + lo holds each value to ~22 bits.
__device__ __forceinline__ void split_f16x2(float x0, float x1, u32& hi, u32& lo) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(x1), "f"(x0));
    const float r0 = x0 - h2f((u16)(hi & 0xffffu)), r1 = x1 - h2f((u16)(hi >> 16));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(r1), "f"(r0));
}

// The A operand of the tiled kernels' scores: the group's queries of token i, kv head kvh,
// pre-scaled into log2 units. Row g < 8 holds head g rounded to f16, row g + 8 the
// remainder (zeros past the group); 4 values per thread and step. The caller syncs.
template <int HD>
__device__ __forceinline__ void tiled_queries(const float* q, u16 (*qrows)[HD + 8], int i,
                                              int n_head, int group, int kvh, float scale) {
#pragma unroll
    for (int r = 0; r < TA_MAX_GROUP * HD / 4 / (TA_WARPS * 32); r++) {
        const int idx = r * TA_WARPS * 32 + threadIdx.x;
        const int g = idx / (HD / 4), d = (idx % (HD / 4)) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (g < group)
            x = *reinterpret_cast<const float4*>(q + (size_t)i * n_head * HD +
                                                 (size_t)(kvh * group + g) * HD + d);
        const float qs = scale * TA_LOG2E;
        uint2 xh, xl;
        split_f16x2(x.x * qs, x.y * qs, xh.x, xl.x);
        split_f16x2(x.z * qs, x.w * qs, xh.y, xl.y);
        *reinterpret_cast<uint2*>(&qrows[g][d]) = xh;
        *reinterpret_cast<uint2*>(&qrows[g + 8][d]) = xl;
    }
}

// The end of the tiled kernels: merges the 4 warps' running max m (log2 units), sum l (this
// lane's part) and outputs acc (as attn_tiled's) through w_o (shared, TA_WARPS · TA_MAX_GROUP
// · HD floats, free: the caller synced), then writes the partial of split s (or with one
// split the normalized output and its 8-bit quantization, if q8 is set). PERM: acc's tiles
// in attn_tiled_q8's order (tile 4b + j, column n: dim 32b + 4n + j) instead of dims 8nt + n.
template <int HD, bool PERM = false>
__device__ __forceinline__ void tiled_finish(float m, float l, float (&acc)[HD / 8][4],
                                             float* w_o, float* dest, int li, int i, int kvh,
                                             int s, int group, int n_head, int splits, i8* q8,
                                             float* q8d) {
    __shared__ float w_m[TA_WARPS][TA_MAX_GROUP], w_l[TA_WARPS][TA_MAX_GROUP];
    __shared__ float w_wt[TA_WARPS][TA_MAX_GROUP], h_big[TA_MAX_GROUP], h_tot[TA_MAX_GROUP];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = lane >> 2, qd = (lane & 3) * 2;
    // Weights exp2(m_w - max) per head, then the outputs.
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if ((lane & 3) == 0) {
        w_m[warp][h] = m;
        w_l[warp][h] = l;
    }
    if (PERM) {
        // Lane (h, c) holds columns 2c, 2c + 1 of tiles 4b .. 4b + 3: dims 32b + 8c + 4e + j.
#pragma unroll
        for (int b = 0; b < HD / 32; b++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                *reinterpret_cast<float4*>(
                    &w_o[(warp * TA_MAX_GROUP + h) * HD + b * 32 + 4 * qd + 4 * e]) =
                    make_float4(acc[4 * b][e] + acc[4 * b][e + 2],
                                acc[4 * b + 1][e] + acc[4 * b + 1][e + 2],
                                acc[4 * b + 2][e] + acc[4 * b + 2][e + 2],
                                acc[4 * b + 3][e] + acc[4 * b + 3][e + 2]);
    } else {
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++)
            *reinterpret_cast<float2*>(&w_o[(warp * TA_MAX_GROUP + h) * HD + nt * 8 + qd]) =
                make_float2(acc[nt][0] + acc[nt][2], acc[nt][1] + acc[nt][3]);
    }
    __syncthreads();
    if (threadIdx.x < group) {
        const int g = threadIdx.x;
        float big = NEG_INF;
        for (int w = 0; w < TA_WARPS; w++)
            if (w_l[w][g] > 0.0f) big = fmaxf(big, w_m[w][g]);
        float total = 0.0f;
        for (int w = 0; w < TA_WARPS; w++) {
            const float wt = w_l[w][g] > 0.0f ? ex2(w_m[w][g] - big) : 0.0f;
            w_wt[w][g] = wt;
            total += w_l[w][g] * wt;
        }
        h_big[g] = big;
        h_tot[g] = total;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * HD; idx += TA_WARPS * 32) {
        const int g = idx / HD, d = idx % HD;
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < TA_WARPS; w++) a += w_o[(w * TA_MAX_GROUP + g) * HD + d] * w_wt[w][g];
        const int head = kvh * group + g;
        if (splits == 1) {
            const size_t o = (size_t)i * n_head * HD + (size_t)head * HD + d;
            const float y = h_tot[g] > 0.0f ? a / h_tot[g] : 0.0f;
            dest[o] = y;
            // The next GEMV's 8-bit activations (as quantize_x_q8): a warp's 32 lanes hold
            // 32 consecutive dims of one head here, one block of 32.
            if (q8) q8_store_block(y, o, q8, q8d);
        } else {
            dest[(((size_t)li * n_head + head) * splits + s) * (HD + 2) + d] = a;
        }
    }
    if (splits > 1 && threadIdx.x < group) {
        const int g = threadIdx.x;
        float* o = dest + (((size_t)li * n_head + kvh * group + g) * splits + s) * (HD + 2);
        o[HD] = h_tot[g] > 0.0f ? h_big[g] * TA_LN2 : NEG_INF;
        o[HD + 1] = h_tot[g];
    }
}

// One online-softmax step of the tiled kernels for a chunk: x = this lane's 4 scores (log2
// units, NEG_INF past the split) of head h, whose 16 are spread over lanes 4h..4h+3. Updates
// the running max m and this lane's sum l, rescales acc, leaves the weights in p. The
// chunk's first key is always in the split, so its max is finite. LAZY: acc is rescaled
// only when some lane's max moved (warp-uniform; a factor of 1 leaves it as it is).
template <int NT, bool LAZY = false>
__device__ __forceinline__ void tiled_softmax(const float (&x)[4], float& m, float& l,
                                              float (&acc)[NT][4], float (&p)[4]) {
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float corr = ex2(m - m_new);  // 0 while m is still -inf
#pragma unroll
    for (int e = 0; e < 4; e++) p[e] = x[e] == NEG_INF ? 0.0f : ex2(x[e] - m_new);
    l = l * corr + ((p[0] + p[1]) + (p[2] + p[3]));
    m = m_new;
    if (LAZY && !__any_sync(0xffffffffu, corr != 1.0f)) return;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        acc[nt][0] *= corr;
        acc[nt][1] *= corr;
        acc[nt][2] *= corr;
        acc[nt][3] *= corr;
    }
}

// Stages of each warp's ring in attn_tiled (a stage: the K and V rows of one 16-key chunk,
// ROW = HD + 8 halves a row): 3 for 128-dim heads (106 KiB a block, 2 blocks an SM), 2 for
// 64-dim heads (38 KiB, 4 blocks an SM by the launch bounds). The block's dynamic shared memory: TA_WARPS rings,
// then the query rows (attention.rs's `tiled_smem` mirrors it).
#define TA_STAGES(HD) ((HD) == 128 ? 3 : 2)
#define TA_STAGE_HALVES(HD) (2 * TA_KEYS * ((HD) + 8))
#define TA_SMEM_BYTES(HD) \
    ((TA_WARPS * TA_STAGES(HD) * TA_STAGE_HALVES(HD) + 16 * ((HD) + 8)) * 2)

// The tiled decode attention over an f16 cache: block (token, kv head, split), the group's
// query heads together on the tensor cores (scores and P·V as m16 mma, rows 8.. the f16
// remainders of rows 0..), each warp its 16-key chunks of the split (every TA_WARPS-th)
// through a ring of TA_STAGES(HD) stages: the warp's first chunks all stream in at once and
// a stage is refilled with the chunk TA_STAGES later as soon as its P·V is done.
//
// The step's inputs (positions, block tables) are host-written and the keys before
// pos + 1 - fresh (fresh: the step's token count) were written by earlier steps, so the
// first chunks wholly below that are issued before the grid-dependency wait: under PDL they
// stream while the previous kernel (the RoPE + store of this step's keys) still runs.
template <int HD>
__device__ __forceinline__ void attn_tiled(const float* q, const u16* kc, const u16* vc,
                                           float* dest, const u32* positions,
                                           const u32* seq_of, const u32* table_off,
                                           const u32* tables, int block_size, int n_head,
                                           int n_head_kv, float scale, int window, int splits,
                                           int tok0, i8* q8, float* q8d, int fresh) {
    constexpr int ROW = HD + 8;                 // halves per shared row (16 bytes of padding)
    constexpr int SEGS = HD / 8;                // 16-byte pieces per row
    constexpr int LOADS = TA_KEYS * SEGS / 32;  // cp.async per lane per chunk of K (or of V)
    constexpr int NT = HD / 8;                  // 8-dim tiles of the output
    constexpr int STAGES = TA_STAGES(HD);
    constexpr int STAGE = TA_STAGE_HALVES(HD);
    static_assert(TA_WARPS * STAGES * STAGE * 2 >= TA_WARPS * TA_MAX_GROUP * HD * 4, "merge");
    // Per warp STAGES × (K rows, V rows), then the query rows; the rings are reused as the
    // warps' outputs (f32) at the end.
    extern __shared__ __align__(16) u8 ta_smem[];
    u16* smem = reinterpret_cast<u16*>(ta_smem);
    u16(*qrows)[ROW] = reinterpret_cast<u16(*)[ROW]>(smem + TA_WARPS * STAGES * STAGE);
    const int li = blockIdx.x, i = tok0 + li, kvh = blockIdx.y, s = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = n_head / n_head_kv;
    const int kv_dim = n_head_kv * HD;
    const int pos = (int)positions[i];
    int k_begin, k_end;
    split_key_range(pos, window, splits, s, k_begin, k_end);
    const u32* table = tables + table_off[seq_of[i]];
    // mma fragment coordinates: this lane's first column pair qd.
    const int qd = (lane & 3) * 2;

    const u32 ring = smem_u32(smem + warp * STAGES * STAGE);
    const u32 qa = smem_u32(&qrows[0][0]);
    // Stage st's K rows (and + TA_KEYS rows, its V rows).
    auto ks = [&](int st) { return ring + (u32)(st * STAGE) * 2u; };
    constexpr u32 V_OFF = TA_KEYS * ROW * 2;
    // Cache slot of key c + (lane & 15) of the chunk starting at c (0 past the split).
    auto chunk_slot = [&](int c) -> u32 {
        const int kp = c + (lane & 15);
        return kp < k_end ? (u32)kv_slot(table, block_size, kp) : 0u;
    };
    // The chunk's rows of `cache` into the shared rows at `base` (zeros past the split:
    // their scores are masked, and p = 0 must not meet a NaN).
    auto issue_rows = [&](u32 base, const u16* cache, int c, u32 slot) {
#pragma unroll
        for (int it = 0; it < LOADS; it++) {
            const int f = it * 32 + lane, kl = f / SEGS, seg = f % SEGS;
            const u32 sl = __shfl_sync(0xffffffffu, slot, kl);
            const bool ok = c + kl < k_end;
            const u16* src =
                ok ? cache + (size_t)sl * kv_dim + (size_t)kvh * HD + seg * 8 : cache;
            cp_async16(base + (u32)(kl * ROW + seg * 8) * 2u, src, ok);
        }
    };
    // Chunk c (if in the split) into stage st as one cp.async group (empty past the end).
    auto issue = [&](int st, int c, u32 slot) {
        if (c < k_end) {
            issue_rows(ks(st), kc, c, slot);
            issue_rows(ks(st) + V_OFF, vc, c, slot);
        }
        cp_async_commit();
    };

    constexpr int STRIDE = TA_WARPS * TA_KEYS;
    const int c0 = k_begin + warp * TA_KEYS;
    // The ring's first chunks: those wholly before pos + 1 - fresh now, the rest (in order:
    // the groups are waited on oldest first) after the wait.
    const int safe = pos + 1 - fresh;
    int st0 = 0;
    while (st0 < STAGES && c0 + st0 * STRIDE < k_end &&
           min(c0 + st0 * STRIDE + TA_KEYS, k_end) <= safe) {
        issue(st0, c0 + st0 * STRIDE, chunk_slot(c0 + st0 * STRIDE));
        st0++;
    }
    pdl_enter();
    for (int st = st0; st < STAGES; st++) {
        const int c = c0 + st * STRIDE;
        issue(st, c, c < k_end ? chunk_slot(c) : 0u);
    }
    // Groups committed so far: the ring's STAGES chunks, oldest first. Each iteration
    // commits one more (the chunk STAGES later, empty past the end), so "all but the newest
    // STAGES - 1 groups done" is the current chunk at the top of the loop.

    // While the first chunks stream in: the group's queries (tiled_queries).
    tiled_queries<HD>(q, qrows, i, n_head, group, kvh, scale);
    __syncthreads();

    float m = NEG_INF, l = 0.0f;  // head h: running max (log2 units), this lane's sum
    float acc[NT][4];             // [nt][0..1]: rows h, [nt][2..3]: rows h + 8 (remainders)
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

    // The slot of the next chunk to issue, read a chunk ahead.
    u32 slot_n = c0 + STAGES * STRIDE < k_end ? chunk_slot(c0 + STAGES * STRIDE) : 0u;
    int st = 0;
    for (int c = c0; c < k_end; c += STRIDE) {
        const int cn = c + STAGES * STRIDE;
        const u32 slot_cn = slot_n;
        slot_n = cn + STRIDE < k_end ? chunk_slot(cn + STRIDE) : 0u;
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
        __syncwarp();
        const u32 kb = ks(st), vb = kb + V_OFF;
        // sc[j]: keys 8j + qd, 8j + qd + 1 of the chunk; [0..1] from rows h, [2..3] from h + 8.
        float sc[2][4];
#pragma unroll
        for (int j = 0; j < 2; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
        for (int k2 = 0; k2 < HD / 32; k2++) {
#pragma unroll
            for (int half = 0; half < 2; half++) {
                // A: matrix lane / 8 = rows 8·((lane / 8) & 1) .. + 7, dims kk + 8·(lane / 16).
                const int kk = k2 * 32 + half * 16;
                u32 a[4];
                ldsm_x4(a, qa + (u32)((((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + kk +
                                      (lane >> 4) * 8) *
                               2u);
                // B: matrix lane / 8 = keys 8·(lane / 16) .. + 7, dims kk + 8·((lane / 8) & 1):
                // b0, b1 for keys 0..7 (sc[0]), b2, b3 for keys 8..15 (sc[1]).
                u32 b[4];
                ldsm_x4(b, kb + (u32)(((lane >> 4) * 8 + (lane & 7)) * ROW + kk +
                                      ((lane >> 3) & 1) * 8) *
                               2u);
                mma_f16(sc[0], a, b[0], b[1]);
                mma_f16(sc[1], a, b[2], b[3]);
            }
        }

        // One online-softmax step for the chunk: head h's 16 scores are spread over lanes
        // 4h..4h+3 (4 each). Key c is always in the split, so the chunk max is finite.
        float x[4];
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                x[2 * j + e] = c + 8 * j + qd + e < k_end ? sc[j][e] + sc[j][e + 2] : NEG_INF;
        float p[4];
        tiled_softmax(x, m, l, acc, p);
        // A fragments of P: keys qd, qd + 1 (pa[0]: f16, pa[1]: remainder) and 8 + qd, 9 + qd.
        u32 pa[4];
        split_f16x2(p[0], p[1], pa[0], pa[1]);
        split_f16x2(p[2], p[3], pa[2], pa[3]);
#pragma unroll
        for (int n2 = 0; n2 < HD / 16; n2++) {
            // Matrix lane / 8: keys 8·((lane / 8) & 1) .. + 7, dims n2*16 + 8·(lane / 16) .. + 7,
            // transposed: B fragments of output tiles 2·n2 (b0, b1) and 2·n2 + 1 (b2, b3).
            u32 b[4];
            ldsm_x4_trans(b, vb + (u32)((((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + n2 * 16 +
                                        (lane >> 4) * 8) *
                                 2u);
            mma_f16(acc[2 * n2], pa, b[0], b[1]);
            mma_f16(acc[2 * n2 + 1], pa, b[2], b[3]);
        }
        __syncwarp();  // every lane has read the stage's rows: refill it
        issue(st, cn, slot_cn);
        st = st + 1 == STAGES ? 0 : st + 1;
    }
    cp_async_wait_all();

    // Merge the warps (tiled_finish); the rings' space is free once every warp is done.
    __syncthreads();
    tiled_finish<HD>(m, l, acc, reinterpret_cast<float*>(smem), dest, li, i, kvh, s, group,
                     n_head, splits, q8, q8d);
}

// attn_tiled for 64- and 128-dim heads. Same arguments as attention_split_gqa, then
// `fresh`; `dest` is the partials buffer, or with splits = 1 the attention output
// (normalized). With q8 set (single-token steps), one split also writes the output's 8-bit
// quantization (q8, q8d). TA_SMEM_BYTES(HD) of dynamic shared memory. The grid-dependency
// wait (pdl_enter) is inside, after the first loads.
#define ATTN_TILED_KERNEL(NAME, HD, MIN_BLOCKS)                                                \
    extern "C" __global__ void __launch_bounds__(TA_WARPS * 32, MIN_BLOCKS)                   \
    NAME(const float* q, const u16* kc, const u16* vc, float* dest, const u32* positions,     \
         const u32* seq_of, const u32* table_off, const u32* tables, int block_size,          \
         int n_head, int n_head_kv, int head_dim, float scale, int window, int splits,        \
         int tok0, i8* q8, float* q8d, int fresh) {                                           \
        attn_tiled<HD>(q, kc, vc, dest, positions, seq_of, table_off, tables, block_size,     \
                       n_head, n_head_kv, scale, window, splits, tok0, q8, q8d, fresh);       \
    }
ATTN_TILED_KERNEL(attention_split_tiled64, 64, 4)
ATTN_TILED_KERNEL(attention_split_tiled128, 128, 2)

// The tiled decode attention over quantized keys and values (both of KV_Q8_0, KV_Q4_0 or
// KV_FP8, kinds kt / vt: kv_load's layouts), the same walk as attn_tiled (block (token, kv
// head, split), each warp its 16-key chunks, the same partials or output). A chunk's raw
// rows (quants and the per-32 f16 scales, nothing dequantized in memory) stream into the
// warp's staging buffers by cp.async; once landed the warp turns the quants into f16 rows
// of their integer (or E4M3) values, exact in f16, and the scales stay aside:
//   scores: each 32-dim block's two k16 mma give Σ q·quant over that block, times the key's
//     scale of the block (q8_0/q4_0/fp8 blocks are 32 dims), summed in f32;
//   P·V: each 32-dim block of the output takes A = P times the value rows' scales of that
//     block (again split into f16 and remainder rows), B = the exact value rows.
// So only the f32 sums and the ~22-bit q and p splits round, as in the f16 kernel. One f16
// row buffer per warp serves K then V: the next chunk's raw K streams in from the moment
// this one is converted, its raw V from V's conversion on.

// 16 quants of a 16-byte piece (4 words) of Q8_0 / FP8 as f16 values into 2 uint4 at dst.
__device__ __forceinline__ void tq_byte_piece(uint4 w, int kind, uint4* dst) {
    const u32 in[4] = {w.x, w.y, w.z, w.w};
    u32 o[8];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (kind == KV_FP8) {
#if __CUDA_ARCH__ >= 890
            asm("{ .reg .b16 lo, hi;\n\t mov.b32 {lo, hi}, %2;\n\t"
                "cvt.rn.f16x2.e4m3x2 %0, lo;\n\t cvt.rn.f16x2.e4m3x2 %1, hi; }"
                : "=r"(o[2 * j]), "=r"(o[2 * j + 1])
                : "r"(in[j]));
#else
            const u32 x = in[j];
            o[2 * j] = pack_f16x2(e4m3_to_f32((u8)x), e4m3_to_f32((u8)(x >> 8)));
            o[2 * j + 1] = pack_f16x2(e4m3_to_f32((u8)(x >> 16)), e4m3_to_f32((u8)(x >> 24)));
#endif
        } else {
            // i8 x as f16: (1024 + (x + 128)) - 1152, the byte placed under 0x64.
            const u32 x = in[j] ^ 0x80808080u;
            const u32 lo = __byte_perm(x, 0x64646464u, 0x4140);
            const u32 hi = __byte_perm(x, 0x64646464u, 0x4342);
            asm("sub.f16x2 %0, %1, %2;" : "=r"(o[2 * j]) : "r"(lo), "r"(0x64806480u));
            asm("sub.f16x2 %0, %1, %2;" : "=r"(o[2 * j + 1]) : "r"(hi), "r"(0x64806480u));
        }
    }
    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
    dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// One Q4_0 block's 16 bytes (byte j: value j low, j + 16 high) as its 32 values - 8 in f16
// into 4 uint4 at dst.
__device__ __forceinline__ void tq_nibble_piece(uint4 w, uint4* dst) {
    const u32 in[4] = {w.x, w.y, w.z, w.w};
    u32 o[16];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        // n as f16: (1024 + n) - 1032.
        const u32 lo = in[j] & 0x0f0f0f0fu, hi = (in[j] >> 4) & 0x0f0f0f0fu;
        const u32 a = __byte_perm(lo, 0x64646464u, 0x4140), b = __byte_perm(lo, 0x64646464u, 0x4342);
        const u32 c = __byte_perm(hi, 0x64646464u, 0x4140), d = __byte_perm(hi, 0x64646464u, 0x4342);
        asm("sub.f16x2 %0, %1, %2;" : "=r"(o[2 * j]) : "r"(a), "r"(0x64086408u));
        asm("sub.f16x2 %0, %1, %2;" : "=r"(o[2 * j + 1]) : "r"(b), "r"(0x64086408u));
        asm("sub.f16x2 %0, %1, %2;" : "=r"(o[8 + 2 * j]) : "r"(c), "r"(0x64086408u));
        asm("sub.f16x2 %0, %1, %2;" : "=r"(o[8 + 2 * j + 1]) : "r"(d), "r"(0x64086408u));
    }
#pragma unroll
    for (int j = 0; j < 4; j++) dst[j] = make_uint4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]);
}

// An asynchronous copy of 4 or 8 bytes (cp.async.ca), zeros when !valid.
__device__ __forceinline__ void cp_async_small(u32 dst, const void* src, int bytes, bool valid) {
    if (bytes == 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src),
                     "r"(valid ? 8 : 0)
                     : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
                     "r"(valid ? 4 : 0)
                     : "memory");
}

// Bytes of one warp's part of attn_tiled_q's dynamic shared memory (HD-dim heads): the f16
// rows, TQ_STAGES stages of raw rows and scales of K and V, the current chunk's scales as f32.
// The block: TA_WARPS of them, then the query rows. (attention.rs's `tiled_q_smem` mirrors it.)
#define TQ_STAGES 2
#define TQ_ROWS_BYTES(HD) (TA_KEYS * ((HD) + 8) * 2)
#define TQ_STAGE_BYTES(HD) (2 * TA_KEYS * (HD) + 2 * TA_KEYS * ((HD) / 32) * 2)
#define TQ_WARP_BYTES(HD) \
    (TQ_ROWS_BYTES(HD) + TQ_STAGES * TQ_STAGE_BYTES(HD) + 2 * TA_KEYS * ((HD) / 32) * 4)

// The 8 f16 of x, each times the f16 of d2's halves (d2 = the scale in both), rounded.
__device__ __forceinline__ uint4 hmul2x4(uint4 x, u32 d2) {
    uint4 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r.x) : "r"(x.x), "r"(d2));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r.y) : "r"(x.y), "r"(d2));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r.z) : "r"(x.z), "r"(d2));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r.w) : "r"(x.w), "r"(d2));
    return r;
}

template <int HD>
__device__ __forceinline__ void attn_tiled_q(const float* q, const u16* kc, const u16* vc,
                                             float* dest, const u32* positions,
                                             const u32* seq_of, const u32* table_off,
                                             const u32* tables, int block_size, int n_head,
                                             int n_head_kv, float scale, int window,
                                             int splits, int tok0, i8* q8, float* q8d,
                                             const u16* k_sc, const u16* v_sc, int kt, int vt,
                                             int fresh) {
    constexpr int ROW = HD + 8;  // halves per f16 row (16 bytes of padding)
    constexpr int NT = HD / 8;   // 8-dim tiles of the output
    constexpr int NB = HD / 32;  // 32-value blocks (scales) per row
    extern __shared__ __align__(16) u8 tq_smem[];
    static_assert(TA_WARPS * TQ_WARP_BYTES(HD) >= TA_WARPS * TA_MAX_GROUP * HD * 4, "merge");
    const int li = blockIdx.x, i = tok0 + li, kvh = blockIdx.y, s = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = n_head / n_head_kv;
    const int kv_dim = n_head_kv * HD;
    int k_begin, k_end;
    split_key_range((int)positions[i], window, splits, s, k_begin, k_end);
    const u32* table = tables + table_off[seq_of[i]];
    const int qd = (lane & 3) * 2;  // this lane's first column pair
    // This warp's buffers.
    u8* wbase = tq_smem + warp * TQ_WARP_BYTES(HD);
    u16(*rows)[ROW] = reinterpret_cast<u16(*)[ROW]>(wbase);
    u8* stages = wbase + TQ_ROWS_BYTES(HD);
    // Stage st, side (0: keys, 1: values): raw quants [TA_KEYS][HD], raw scales [TA_KEYS][NB].
    auto raw = [&](int st, int side) { return stages + st * TQ_STAGE_BYTES(HD) + side * TA_KEYS * HD; };
    auto raw_sc = [&](int st, int side) {
        return reinterpret_cast<u16*>(stages + st * TQ_STAGE_BYTES(HD) + 2 * TA_KEYS * HD) +
               side * TA_KEYS * NB;
    };
    float(*cur)[TA_KEYS][NB] =
        reinterpret_cast<float(*)[TA_KEYS][NB]>(stages + TQ_STAGES * TQ_STAGE_BYTES(HD));
    u16(*qrows)[ROW] = reinterpret_cast<u16(*)[ROW]>(tq_smem + TA_WARPS * TQ_WARP_BYTES(HD));
    const u32 rs = smem_u32(&rows[0][0]);
    const u32 qa = smem_u32(&qrows[0][0]);

    auto chunk_slot = [&](int c) -> u32 {
        const int kp = c + (lane & 15);
        return kp < k_end ? (u32)kv_slot(table, block_size, kp) : 0u;
    };
    // The chunk's raw rows of one side into stage st, zeros past the split (their rows
    // convert to zeros or -8 with a zero scale: scores masked, p = 0).
    auto issue_side = [&](int st, int side, int c, u32 slot) {
        const int kind = side ? vt : kt;
        const u8* cache = reinterpret_cast<const u8*>(side ? vc : kc);
        const u16* sc = side ? v_sc : k_sc;
        const int rb = kind == KV_Q4_0 ? HD / 2 : HD;  // quant bytes of a head's row
        const int segs_log = kind == KV_Q4_0 ? __ffs(HD / 32) - 1 : __ffs(HD / 16) - 1;
        const u32 dst = smem_u32(raw(st, side));
#pragma unroll
        for (int it = 0; it < HD / 32; it++) {
            if (it * 32 < rb) {
                const int f = it * 32 + lane, kl = f >> segs_log, seg = f & ((1 << segs_log) - 1);
                const u32 sl = __shfl_sync(0xffffffffu, slot, kl);
                const bool ok = c + kl < k_end;
                const u8* src =
                    ok ? cache + (size_t)sl * (kv_dim / HD * rb) + (size_t)kvh * rb + seg * 16
                       : cache;
                cp_async16(dst + (u32)(kl * HD + seg * 16), src, ok);
            }
        }
        const int kl = lane & 15;
        const bool ok = c + kl < k_end;
        const u32 sl = __shfl_sync(0xffffffffu, slot, kl);
        const u16* src = ok ? sc + (size_t)sl * (kv_dim / 32) + (size_t)kvh * NB : sc;
        if (lane < 16) cp_async_small(smem_u32(raw_sc(st, side) + kl * NB), src, NB * 2, ok);
    };
    // Chunk c (if in the split) into stage st as one cp.async group (empty past the end).
    auto issue = [&](int st, int c) {
        if (c < k_end) {
            const u32 slot = chunk_slot(c);
            issue_side(st, 0, c, slot);
            issue_side(st, 1, c, slot);
        }
        cp_async_commit();
    };
    // Stage st's landed rows of one side as f16 rows and f32 scales (the caller syncs).
    auto convert = [&](int st, int side) {
        const int kind = side ? vt : kt;
        const u8* r = raw(st, side);
        if (kind == KV_Q4_0) {
#pragma unroll
            for (int it = 0; it < HD / 64; it++) {
                const int f = it * 32 + lane, kl = f / NB, b = f % NB;
                const uint4 x = *reinterpret_cast<const uint4*>(r + kl * HD + b * 16);
                tq_nibble_piece(x, reinterpret_cast<uint4*>(&rows[kl][b * 32]));
            }
        } else {
#pragma unroll
            for (int it = 0; it < HD / 32; it++) {
                const int f = it * 32 + lane, kl = f / (HD / 16), seg = f % (HD / 16);
                const uint4 x = *reinterpret_cast<const uint4*>(r + kl * HD + seg * 16);
                tq_byte_piece(x, kind, reinterpret_cast<uint4*>(&rows[kl][seg * 16]));
            }
        }
        const u16* sc = raw_sc(st, side);
        for (int e = lane; e < TA_KEYS * NB; e += 32) cur[side][e / NB][e % NB] = h2f(sc[e]);
    };

    constexpr int STRIDE = TA_WARPS * TA_KEYS;
    int c = k_begin + warp * TA_KEYS;
    // TQ_STAGES chunks in flight from the start, one cp.async group each; a chunk's stage is
    // refilled (chunk + TQ_STAGES) once both its sides are converted, so "all but the newest
    // TQ_STAGES - 1 groups done" is the current chunk at the top of the loop. As in
    // attn_tiled, the chunks wholly before pos + 1 - fresh (keys and scales of earlier
    // steps) are issued before the grid-dependency wait, the rest after it, in order.
    const int safe = (int)positions[i] + 1 - fresh;
    int st0 = 0;
    while (st0 < TQ_STAGES && c + st0 * STRIDE < k_end &&
           min(c + st0 * STRIDE + TA_KEYS, k_end) <= safe) {
        issue(st0, c + st0 * STRIDE);
        st0++;
    }
    pdl_enter();
    for (int st = st0; st < TQ_STAGES; st++) issue(st, c + st * STRIDE);

    tiled_queries<HD>(q, qrows, i, n_head, group, kvh, scale);
    __syncthreads();

    float m = NEG_INF, l = 0.0f;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

    for (int st = 0; c < k_end; c += STRIDE, st = st + 1 == TQ_STAGES ? 0 : st + 1) {
        asm volatile("cp.async.wait_group %0;" ::"n"(TQ_STAGES - 1) : "memory");
        __syncwarp();
        convert(st, 0);
        __syncwarp();
        // sc[j][e]: key 8j + qd + e of the chunk, Σ over the 32-dim blocks of the key's scale
        // times the block's (hi + lo) sum.
        float sc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
        for (int k2 = 0; k2 < NB; k2++) {
            float t[2][4];
#pragma unroll
            for (int j = 0; j < 2; j++) t[j][0] = t[j][1] = t[j][2] = t[j][3] = 0.0f;
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int kk = k2 * 32 + half * 16;
                u32 a[4];
                ldsm_x4(a, qa + (u32)((((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + kk +
                                      (lane >> 4) * 8) *
                               2u);
                u32 b[4];
                ldsm_x4(b, rs + (u32)(((lane >> 4) * 8 + (lane & 7)) * ROW + kk +
                                      ((lane >> 3) & 1) * 8) *
                               2u);
                mma_f16(t[0], a, b[0], b[1]);
                mma_f16(t[1], a, b[2], b[3]);
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    sc[j][e] += cur[0][8 * j + qd + e][k2] * (t[j][e] + t[j][e + 2]);
        }
        float x[4];
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                x[2 * j + e] = c + 8 * j + qd + e < k_end ? sc[j][e] : NEG_INF;
        float p[4];
        tiled_softmax(x, m, l, acc, p);

        __syncwarp();  // every lane is done with the K rows
        convert(st, 1);
        __syncwarp();
        issue(st, c + TQ_STAGES * STRIDE);  // the stage is free: the chunk after the next
#pragma unroll
        for (int b = 0; b < NB; b++) {
            // P for this 32-dim block: each key's weight times its value scale, split.
            u32 pa[4];
            split_f16x2(p[0] * cur[1][qd][b], p[1] * cur[1][qd + 1][b], pa[0], pa[1]);
            split_f16x2(p[2] * cur[1][8 + qd][b], p[3] * cur[1][9 + qd][b], pa[2], pa[3]);
#pragma unroll
            for (int n2 = 2 * b; n2 < 2 * b + 2; n2++) {
                u32 bb[4];
                ldsm_x4_trans(bb, rs + (u32)((((lane >> 3) & 1) * 8 + (lane & 7)) * ROW +
                                             n2 * 16 + (lane >> 4) * 8) *
                                      2u);
                mma_f16(acc[2 * n2], pa, bb[0], bb[1]);
                mma_f16(acc[2 * n2 + 1], pa, bb[2], bb[3]);
            }
        }
        __syncwarp();  // every lane has read the V rows and scales
    }
    cp_async_wait_all();
    __syncthreads();
    tiled_finish<HD>(m, l, acc, reinterpret_cast<float*>(tq_smem), dest, li, i, kvh, s, group,
                     n_head, splits, q8, q8d);
}

// attn_tiled_q for 64- and 128-dim heads: attention_split_tiled*'s arguments up to q8d, the
// scales and kinds as the other `_q` kernels take them, then `fresh`; TA_WARPS ·
// TQ_WARP_BYTES(HD) + the query rows of dynamic shared memory. The grid-dependency wait
// (pdl_enter) is inside, after the first loads.
#define ATTN_TILED_Q_KERNEL(NAME, HD, MIN_BLOCKS)                                              \
    extern "C" __global__ void __launch_bounds__(TA_WARPS * 32, MIN_BLOCKS)                   \
    NAME(const float* q, const u16* kc, const u16* vc, float* dest, const u32* positions,     \
         const u32* seq_of, const u32* table_off, const u32* tables, int block_size,          \
         int n_head, int n_head_kv, int head_dim, float scale, int window, int splits,        \
         int tok0, i8* q8, float* q8d, const u16* k_sc, const u16* v_sc, int kt, int vt,       \
         int fresh) {                                                                         \
        attn_tiled_q<HD>(q, kc, vc, dest, positions, seq_of, table_off, tables, block_size,   \
                         n_head, n_head_kv, scale, window, splits, tok0, q8, q8d, k_sc, v_sc, \
                         kt, vt, fresh);                                                      \
    }
ATTN_TILED_Q_KERNEL(attention_split_tiled64_q, 64, 4)
ATTN_TILED_Q_KERNEL(attention_split_tiled128_q, 128, 3)

// The tiled decode attention over q8_0 keys and values (both KV_Q8_0): attn_tiled's walk
// (block (token, kv head, split), each warp its 16-key chunks, the same partials or output,
// the chunks of older keys issued before the grid-dependency wait, each chunk's slots read a
// chunk ahead), but the warp's ring of TQ8_STAGES(HD) stages holds a chunk's raw quants and
// scales (34 bytes a 32-value block instead of 64), and the quants go from there straight into
// mma fragments as exact f16 integers, with no f16 rows in between:
//   scores: the k-steps' dims are permuted so that lane (g, c) of B reads 8 consecutive
//     bytes of key g's (and g + 8's) 32-dim block: bytes 8c + 4s .. + 3 for k-step s of the
//     block, (bytes 0, 2) as k = 2c, 2c + 1 and (1, 3) as 2c + 8, 2c + 9; the query
//     fragments (rows g: q rounded to f16, g + 8: the remainder, kept in registers) take
//     the same order. Each block's two k-steps sum Σ q·quant, times the key's block scale,
//     summed in f32.
//   P·V: output tile 4b + j's column n is dim 32b + 4n + j, so lane (g, c) reads the word
//     of dims 4g .. 4g + 3 of keys 2c, 2c + 1, 2c + 8, 2c + 9 and pairs their bytes j; A =
//     P times the keys' value scales of block b, split into f16 and remainder rows.
// So the arithmetic is attn_tiled_q's (only the f32 sums and the ~22-bit q and p splits
// round). Rows are padded (keys by 32 bytes, values by 16) so that those reads hit distinct
// banks. TQ8_SMEM_BYTES(HD) of dynamic shared memory (attention.rs's `tiled_q8_smem`
// mirrors it): 5 stages for 128-dim heads (100 KiB a block, 2 blocks an SM), 4 for 64-dim
// (46 KiB, 4 an SM).
#define TQ8_KROW(HD) ((HD) + 32)
#define TQ8_VROW(HD) ((HD) + 16)
#define TQ8_STAGES(HD) ((HD) == 128 ? 5 : 4)
#define TQ8_STAGE_BYTES(HD) \
    (TA_KEYS * (TQ8_KROW(HD) + TQ8_VROW(HD)) + 2 * TA_KEYS * ((HD) / 32) * 2)
#define TQ8_SMEM_BYTES(HD) (TA_WARPS * TQ8_STAGES(HD) * TQ8_STAGE_BYTES(HD))

// Bytes 0 and 2 of r (two i8) as an f16 pair (byte 0 in the low half), exactly:
// (1024 + (x + 128)) - 1152.
__device__ __forceinline__ u32 q8_pair(u32 r) {
    const u32 x = (r & 0x00ff00ffu) ^ 0x64806480u;
    u32 y;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(y) : "r"(x), "r"(0x64806480u));
    return y;
}

// The NB f16 scales at p (4-byte aligned) as f32.
template <int NB>
__device__ __forceinline__ void q8_scales(const u8* p, float (&d)[NB]) {
#pragma unroll
    for (int w = 0; w < NB / 2; w++) {
        const u32 x = reinterpret_cast<const u32*>(p)[w];
        d[2 * w] = h2f((u16)(x & 0xffffu));
        d[2 * w + 1] = h2f((u16)(x >> 16));
    }
}

template <int HD>
__device__ __forceinline__ void attn_tiled_q8(const float* q, const u8* kc, const u8* vc,
                                              float* dest, const u32* positions,
                                              const u32* seq_of, const u32* table_off,
                                              const u32* tables, int block_size, int n_head,
                                              int n_head_kv, float scale, int window,
                                              int splits, int tok0, i8* q8, float* q8d,
                                              const u16* k_sc, const u16* v_sc, int fresh) {
    constexpr int NB = HD / 32;  // 32-value blocks (scales) per row
    constexpr int NT = HD / 8;   // 8-dim tiles of the output
    constexpr int KROW = TQ8_KROW(HD), VROW = TQ8_VROW(HD);
    constexpr int STAGES = TQ8_STAGES(HD);
    constexpr int STAGE = TQ8_STAGE_BYTES(HD);
    // A stage: K quants [TA_KEYS][KROW], V quants [TA_KEYS][VROW], K scales [TA_KEYS][NB]
    // f16, V scales likewise.
    constexpr int V_OFF = TA_KEYS * KROW;
    constexpr int KS_OFF = TA_KEYS * (KROW + VROW);
    constexpr int VS_OFF = KS_OFF + TA_KEYS * NB * 2;
    static_assert(TA_WARPS * STAGES * STAGE >= TA_WARPS * TA_MAX_GROUP * HD * 4, "merge");
    extern __shared__ __align__(16) u8 t8_smem[];
    const int li = blockIdx.x, i = tok0 + li, kvh = blockIdx.y, s = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, qc = lane & 3;  // mma fragment row / column pair
    const int group = n_head / n_head_kv;
    const int kv_dim = n_head_kv * HD;
    const int pos = (int)positions[i];
    int k_begin, k_end;
    split_key_range(pos, window, splits, s, k_begin, k_end);
    const u32* table = tables + table_off[seq_of[i]];
    const u8* ring = t8_smem + warp * STAGES * STAGE;
    const u32 ring_s = smem_u32(ring);

    // Cache slot of key c + (lane & 15) of the chunk starting at c (0 past the split).
    auto chunk_slot = [&](int c) -> u32 {
        const int kp = c + (lane & 15);
        return kp < k_end ? (u32)kv_slot(table, block_size, kp) : 0u;
    };
    // Chunk c (if in the split) into stage st as one cp.async group (empty past the end):
    // its K and V quants (16-byte pieces), and from lanes 0..15 the key scales, 16..31 the
    // value scales of key lane & 15. Zeros past the split (scores masked, p = 0 · 0).
    auto issue = [&](int st, int c, u32 slot) {
        if (c < k_end) {
            const u32 base = ring_s + (u32)(st * STAGE);
#pragma unroll
            for (int it = 0; it < HD / 32; it++) {
                const int f = it * 32 + lane, kl = f / (HD / 16), seg = f % (HD / 16);
                const u32 sl = __shfl_sync(0xffffffffu, slot, kl);
                const bool ok = c + kl < k_end;
                const size_t off = ok ? (size_t)sl * kv_dim + (size_t)kvh * HD + seg * 16 : 0;
                cp_async16(base + (u32)(kl * KROW + seg * 16), kc + off, ok);
                cp_async16(base + (u32)(V_OFF + kl * VROW + seg * 16), vc + off, ok);
            }
            const int kl = lane & 15;
            const bool ok = c + kl < k_end;
            const u16* sc = lane < 16 ? k_sc : v_sc;
            const u16* src = ok ? sc + (size_t)slot * (kv_dim / 32) + (size_t)kvh * NB : sc;
            cp_async_small(base + (u32)((lane < 16 ? KS_OFF : VS_OFF) + kl * NB * 2), src,
                           NB * 2, ok);
        }
        cp_async_commit();
    };

    constexpr int STRIDE = TA_WARPS * TA_KEYS;
    const int c0 = k_begin + warp * TA_KEYS;
    // The ring's first chunks: those wholly before pos + 1 - fresh (written by earlier
    // steps) now, the rest (in order: the groups are waited on oldest first) after the wait.
    const int safe = pos + 1 - fresh;
    int st0 = 0;
    while (st0 < STAGES && c0 + st0 * STRIDE < k_end &&
           min(c0 + st0 * STRIDE + TA_KEYS, k_end) <= safe) {
        issue(st0, c0 + st0 * STRIDE, chunk_slot(c0 + st0 * STRIDE));
        st0++;
    }
    pdl_enter();
    for (int st = st0; st < STAGES; st++) {
        const int c = c0 + st * STRIDE;
        issue(st, c, c < k_end ? chunk_slot(c) : 0u);
    }

    // The query fragments of k-step 2b + s: dims d = 32b + 8qc + 4s .. d + 3 of head g of
    // the group (zeros past it), pre-scaled into log2 units: [0] = f16 of (d, d + 2), [1]
    // its remainder (row g + 8), [2] / [3] the same of (d + 1, d + 3).
    u32 qf[2 * NB][4];
    {
        const float qs = scale * TA_LOG2E;
        const float* qrow = q + (size_t)i * n_head * HD + (size_t)(kvh * group + g) * HD;
#pragma unroll
        for (int k = 0; k < 2 * NB; k++) {
            float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (g < group)
                x = *reinterpret_cast<const float4*>(qrow + (k >> 1) * 32 + 8 * qc + 4 * (k & 1));
            split_f16x2(x.x * qs, x.z * qs, qf[k][0], qf[k][1]);
            split_f16x2(x.y * qs, x.w * qs, qf[k][2], qf[k][3]);
        }
    }

    float m = NEG_INF, l = 0.0f;  // head g: running max (log2 units), this lane's sum
    float acc[NT][4];             // tile 4b + j (see above); [0..1] rows g, [2..3] g + 8
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

    // The slot of the next chunk to issue, read a chunk ahead.
    u32 slot_n = c0 + STAGES * STRIDE < k_end ? chunk_slot(c0 + STAGES * STRIDE) : 0u;
    int st = 0;
    for (int c = c0; c < k_end; c += STRIDE) {
        const int cn = c + STAGES * STRIDE;
        const u32 slot_cn = slot_n;
        slot_n = cn + STRIDE < k_end ? chunk_slot(cn + STRIDE) : 0u;
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
        __syncwarp();
        const u8* kq = ring + st * STAGE;
        const u8* vq = kq + V_OFF;
        // This lane's keys 2qc, 2qc + 1, 8 + 2qc, 9 + 2qc (its score columns and P's A
        // columns): their key and value scales.
        float kd[4][NB], vd[4][NB];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int key = (r >> 1) * 8 + 2 * qc + (r & 1);
            q8_scales<NB>(kq + KS_OFF + key * NB * 2, kd[r]);
            q8_scales<NB>(kq + VS_OFF + key * NB * 2, vd[r]);
        }
        // sc[j][e]: key 8j + 2qc + e of the chunk, Σ over the blocks of its scale times the
        // block's (hi + lo) sum.
        float sc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
        for (int b = 0; b < NB; b++) {
            float t[2][4];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                t[j][0] = t[j][1] = t[j][2] = t[j][3] = 0.0f;
                const uint2 w =
                    *reinterpret_cast<const uint2*>(kq + (8 * j + g) * KROW + b * 32 + 8 * qc);
                mma_f16(t[j], qf[2 * b], q8_pair(w.x), q8_pair(w.x >> 8));
                mma_f16(t[j], qf[2 * b + 1], q8_pair(w.y), q8_pair(w.y >> 8));
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    sc[j][e] += kd[2 * j + e][b] * (t[j][e] + t[j][e + 2]);
        }
        float x[4];
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                x[2 * j + e] = c + 8 * j + 2 * qc + e < k_end ? sc[j][e] : NEG_INF;
        float p[4];
        tiled_softmax<NT, true>(x, m, l, acc, p);
#pragma unroll
        for (int b = 0; b < NB; b++) {
            // P for this block: each key's weight times its value scale, split.
            u32 pa[4];
            split_f16x2(p[0] * vd[0][b], p[1] * vd[1][b], pa[0], pa[1]);
            split_f16x2(p[2] * vd[2][b], p[3] * vd[3][b], pa[2], pa[3]);
            const u8* vb = vq + b * 32 + 4 * g;
            const u32 w0 = *reinterpret_cast<const u32*>(vb + (2 * qc) * VROW);
            const u32 w1 = *reinterpret_cast<const u32*>(vb + (2 * qc + 1) * VROW);
            const u32 w2 = *reinterpret_cast<const u32*>(vb + (2 * qc + 8) * VROW);
            const u32 w3 = *reinterpret_cast<const u32*>(vb + (2 * qc + 9) * VROW);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                // Byte j of the first word in byte 0, of the second in byte 2.
                const u32 sel = (u32)j | ((u32)(4 + j) << 8);
                mma_f16(acc[4 * b + j], pa, q8_pair(__byte_perm(w0, w1, sel)),
                        q8_pair(__byte_perm(w2, w3, sel)));
            }
        }
        __syncwarp();  // every lane has read the stage: refill it
        issue(st, cn, slot_cn);
        st = st + 1 == STAGES ? 0 : st + 1;
    }
    cp_async_wait_all();

    // Merge the warps (tiled_finish); the rings' space is free once every warp is done.
    __syncthreads();
    tiled_finish<HD, true>(m, l, acc, reinterpret_cast<float*>(t8_smem), dest, li, i, kvh, s,
                           group, n_head, splits, q8, q8d);
}

// attn_tiled_q8 for 64- and 128-dim heads: attention_split_tiled*_q's arguments (the kinds
// unused: both KV_Q8_0), TQ8_SMEM_BYTES(HD) of dynamic shared memory.
#define ATTN_TILED_Q8_KERNEL(NAME, HD, MIN_BLOCKS)                                             \
    extern "C" __global__ void __launch_bounds__(TA_WARPS * 32, MIN_BLOCKS)                   \
    NAME(const float* q, const u16* kc, const u16* vc, float* dest, const u32* positions,     \
         const u32* seq_of, const u32* table_off, const u32* tables, int block_size,          \
         int n_head, int n_head_kv, int head_dim, float scale, int window, int splits,        \
         int tok0, i8* q8, float* q8d, const u16* k_sc, const u16* v_sc, int kt, int vt,       \
         int fresh) {                                                                         \
        attn_tiled_q8<HD>(q, reinterpret_cast<const u8*>(kc), reinterpret_cast<const u8*>(vc), \
                          dest, positions, seq_of, table_off, tables, block_size, n_head,     \
                          n_head_kv, scale, window, splits, tok0, q8, q8d, k_sc, v_sc, fresh); \
    }
ATTN_TILED_Q8_KERNEL(attention_split_tiled64_q8, 64, 4)
ATTN_TILED_Q8_KERNEL(attention_split_tiled128_q8, 128, 2)

// The merge weights of one (token, head)'s partials p (splits × (head_dim + 2) floats:
// the partial output, its max, its sum), computed by one warp: weight[s] = exp(max_s −
// max) (0 for an empty split) and, from lane 0, *total = Σ sum_s · weight[s].
__device__ __forceinline__ void combine_weights(const float* p, int head_dim, int splits,
                                                int lane, float* weight, float* total) {
    float big = NEG_INF;
    for (int s = lane; s < splits; s += 32) {
        const float* ps = p + (size_t)s * (head_dim + 2);
        if (ps[head_dim + 1] > 0.0f) big = fmaxf(big, ps[head_dim]);
    }
    for (int o = 16; o > 0; o >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
    float sum = 0.0f;
    for (int s = lane; s < splits; s += 32) {
        const float* ps = p + (size_t)s * (head_dim + 2);
        const float w = ps[head_dim + 1] > 0.0f ? expf(ps[head_dim] - big) : 0.0f;
        weight[s] = w;
        sum += ps[head_dim + 1] * w;
    }
    sum = warp_sum(sum);
    if (lane == 0) *total = sum;
}

// Dim d of the merged output (combine_weights' weight and total).
__device__ __forceinline__ float combine_value(const float* p, int head_dim, int splits,
                                               const float* weight, float total, int d) {
    float a = 0.0f;
    for (int s = 0; s < splits; s++)
        if (weight[s] != 0.0f) a += p[(size_t)s * (head_dim + 2) + d] * weight[s];
    return a / total;
}

// Merges the splits of attention_split: one block per (token, head). Each split's weight
// exp(max_s - max) is computed once into shared memory. With q8 set (single-token steps,
// head_dim a multiple of 32), also the output's 8-bit quantization as quantize_x_q8's.
#define MAX_SPLITS 64
extern "C" __global__ void attention_combine(const float* part, float* out, int n_head,
                                             int head_dim, int splits, int tok0, i8* q8,
                                             float* q8d) {
    pdl_enter();
    __shared__ float weight[MAX_SPLITS];
    __shared__ float total_s;
    const int li = blockIdx.x, i = tok0 + li, h = blockIdx.y;
    const float* p = part + ((size_t)li * n_head + h) * splits * (head_dim + 2);
    if (threadIdx.x < 32) combine_weights(p, head_dim, splits, threadIdx.x, weight, &total_s);
    __syncthreads();
    const size_t o = (size_t)i * n_head * head_dim + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        const float y = combine_value(p, head_dim, splits, weight, total_s, d);
        out[o + d] = y;
        if (q8) q8_store_block(y, o + d, q8, q8d);
    }
}

// attention_combine for steps of a few tokens whose output feeds mmk_t8* / mms_*: block
// (token row t < npad, 256-value block kb of the row; 256 threads) merges the splits of the
// 256 / head_dim heads it covers (head_dim 64, 128 or 256), writes them as attention_combine
// does and quantizes the 256 values in mmk's layout as quantize_x_mmk would (rows t >= n:
// zeros, as there).
#define CM_MAX_HEADS 4
extern "C" __global__ void __launch_bounds__(256)
attention_combine_mmk(const float* part, float* out, int n_head, int head_dim, int splits,
                      int n, int npad, i8* q, float* xk, i8* xb) {
    pdl_enter();
    __shared__ float weight[CM_MAX_HEADS][MAX_SPLITS];
    __shared__ float total_s[CM_MAX_HEADS];
    const int t = blockIdx.x, kb = blockIdx.y;
    const int width = n_head * head_dim, hb = 256 / head_dim;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = kb * 256 + threadIdx.x;  // the value this thread writes
    float v = 0.0f;
    if (t < n) {  // uniform in the block
        if (warp < hb) {
            const float* p = part + ((size_t)t * n_head + kb * hb + warp) * splits * (head_dim + 2);
            combine_weights(p, head_dim, splits, lane, weight[warp], &total_s[warp]);
        }
        __syncthreads();
        const int h = j / head_dim, d = j % head_dim, hl = h - kb * hb;
        const float* p = part + ((size_t)t * n_head + h) * splits * (head_dim + 2);
        v = combine_value(p, head_dim, splits, weight[hl], total_s[hl], d);
        out[(size_t)t * width + j] = v;
    }
    mmk_store_q8(v, q + (size_t)t * width + j, xk, xb, kb, t, npad);
}

// Prefill attention, flash style: block (tile of FA_Q consecutive tokens of one sequence,
// head) walks the union of its tokens' visible keys in tiles of FA_K, keeping each token's
// running max, sum and output in registers (no score matrix in memory). K and V tiles are
// read once per block from the paged f16 cache into shared memory as f32. Warp w owns the
// block's tokens 4w..4w+3; in the score phase lane = key, in the P·V phase lane = dims.
// The host launches it per run of one sequence's tokens, with head_dim <= FA_HD (a multiple
// of 4).
#define FA_Q 16
#define FA_K 32
#define FA_HD 128
// The body of attention_prefill and attention_prefill_q (k_sc, v_sc, kt, vt: a quantized
// cache's scales and kinds, see kv_load; KV_F16 folds the quantized loads away).
__device__ __forceinline__ void
prefill_tiles(const float* q, const u16* kc, const u16* vc, float* out, const u32* positions,
              const u32* seq_of, const u32* table_off, const u32* tables, int block_size,
              int tok0, int n, int n_head, int n_head_kv, int head_dim, float scale, int window,
              const u16* k_sc, const u16* v_sc, int kt_kind, int vt_kind) {
    __shared__ __align__(16) float qs[FA_Q][FA_HD + 4];
    __shared__ __align__(16) float ks[FA_K][FA_HD + 4];
    __shared__ float vs[FA_K][FA_HD];
    __shared__ float ps[4][4][FA_K];
    // Tokens tok0 .. tok0 + n of the step (one sequence's run).
    const int t0 = tok0 + blockIdx.x * FA_Q, h = blockIdx.y;
    const int nq = min(FA_Q, tok0 + n - t0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kv_head = h / (n_head / n_head_kv);
    const int kv_dim = n_head_kv * head_dim;
    const size_t q_stride = (size_t)n_head * head_dim;

    // The block's queries, pre-scaled (zero rows past the batch's end).
    for (int idx = threadIdx.x; idx < FA_Q * head_dim; idx += blockDim.x) {
        const int qi = idx / head_dim, d = idx % head_dim;
        qs[qi][d] = qi < nq ? q[(size_t)(t0 + qi) * q_stride + h * head_dim + d] * scale : 0.0f;
    }
    // Keys any of the block's tokens sees, and this warp's tokens' own ranges.
    int lo_all = 0x7fffffff, hi_all = -1;
    for (int qi = 0; qi < nq; qi++) {
        const int pos = (int)positions[t0 + qi];
        lo_all = min(lo_all, window > 0 ? max(0, pos + 1 - window) : 0);
        hi_all = max(hi_all, pos);
    }
    int my_pos[4], my_lo[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int qi = warp * 4 + j;
        my_pos[j] = qi < nq ? (int)positions[t0 + qi] : -1;
        my_lo[j] = window > 0 ? max(0, my_pos[j] + 1 - window) : 0;
    }
    const u32* table = tables + table_off[seq_of[t0]];
    float m[4], l[4], acc[4][FA_HD / 32];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        m[j] = NEG_INF;
        l[j] = 0.0f;
#pragma unroll
        for (int c = 0; c < FA_HD / 32; c++) acc[j][c] = 0.0f;
    }
    const int half_dim = head_dim / 2;
    for (int kt = lo_all; kt <= hi_all; kt += FA_K) {
        __syncthreads();  // the previous tile (and qs, the first time) is ready / consumed
        for (int idx = threadIdx.x; idx < FA_K * half_dim; idx += blockDim.x) {
            const int key = idx / half_dim, d = 2 * (idx % half_dim);
            const int kp = kt + key;
            float k0 = 0.0f, k1 = 0.0f, v0 = 0.0f, v1 = 0.0f;
            if (kp <= hi_all) {
                const size_t slot = kv_slot(table, block_size, kp);
                const int off = kv_head * head_dim + d;
                if (kt_kind == KV_F16) {
                    const u32 kw = *(const u32*)(kc + slot * kv_dim + off);
                    k0 = h2f((u16)(kw & 0xFFFF));
                    k1 = h2f((u16)(kw >> 16));
                } else {
                    k0 = kv_load(kc, k_sc, kt_kind, slot, kv_dim, off);
                    k1 = kv_load(kc, k_sc, kt_kind, slot, kv_dim, off + 1);
                }
                if (vt_kind == KV_F16) {
                    const u32 vw = *(const u32*)(vc + slot * kv_dim + off);
                    v0 = h2f((u16)(vw & 0xFFFF));
                    v1 = h2f((u16)(vw >> 16));
                } else {
                    v0 = kv_load(vc, v_sc, vt_kind, slot, kv_dim, off);
                    v1 = kv_load(vc, v_sc, vt_kind, slot, kv_dim, off + 1);
                }
            }
            ks[key][d] = k0;
            ks[key][d + 1] = k1;
            vs[key][d] = v0;
            vs[key][d + 1] = v1;
        }
        __syncthreads();
        // Scores of key kt + lane against the warp's four tokens.
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int d = 0; d < head_dim; d += 4) {
            const float4 kv = *(const float4*)&ks[lane][d];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float4 qv = *(const float4*)&qs[warp * 4 + j][d];
                s[j] = fmaf(qv.x, kv.x, s[j]);
                s[j] = fmaf(qv.y, kv.y, s[j]);
                s[j] = fmaf(qv.z, kv.z, s[j]);
                s[j] = fmaf(qv.w, kv.w, s[j]);
            }
        }
        const int kp = kt + lane;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const bool valid = kp >= my_lo[j] && kp <= my_pos[j];
            const float sj = valid ? s[j] : NEG_INF;
            float tile_max = sj;
            for (int o = 16; o > 0; o >>= 1)
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
            const float m_new = fmaxf(m[j], tile_max);
            float p = 0.0f, corr = 1.0f;
            if (m_new != NEG_INF) {
                p = valid ? expf(sj - m_new) : 0.0f;
                corr = expf(m[j] - m_new);  // 0 when m[j] is still -inf
            }
            l[j] = l[j] * corr + warp_sum(p);
            m[j] = m_new;
#pragma unroll
            for (int c = 0; c < FA_HD / 32; c++) acc[j][c] *= corr;
            ps[warp][j][lane] = p;
        }
        __syncwarp();
        const int n_keys = min(FA_K, hi_all + 1 - kt);
        for (int kk = 0; kk < n_keys; kk++) {
            float pj[4];
#pragma unroll
            for (int j = 0; j < 4; j++) pj[j] = ps[warp][j][kk];
#pragma unroll
            for (int c = 0; c < FA_HD / 32; c++) {
                const int d = lane + 32 * c;
                if (d < head_dim) {
                    const float v = vs[kk][d];
#pragma unroll
                    for (int j = 0; j < 4; j++) acc[j][c] = fmaf(pj[j], v, acc[j][c]);
                }
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int qi = warp * 4 + j;
        if (qi >= nq) continue;
        float* o = out + (size_t)(t0 + qi) * q_stride + h * head_dim;
        const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
#pragma unroll
        for (int c = 0; c < FA_HD / 32; c++) {
            const int d = lane + 32 * c;
            if (d < head_dim) o[d] = acc[j][c] * inv;
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
attention_prefill(const float* q, const u16* kc, const u16* vc, float* out, const u32* positions,
                  const u32* seq_of, const u32* table_off, const u32* tables, int block_size,
                  int tok0, int n, int n_head, int n_head_kv, int head_dim, float scale,
                  int window) {
    pdl_enter();
    prefill_tiles(q, kc, vc, out, positions, seq_of, table_off, tables, block_size, tok0, n,
                  n_head, n_head_kv, head_dim, scale, window, nullptr, nullptr, KV_F16, KV_F16);
}

// attention_prefill over a cache with quantized keys or values (dequantized as the tiles
// are staged into shared memory): the same arguments, then the scales and kinds.
extern "C" __global__ void __launch_bounds__(128)
attention_prefill_q(const float* q, const u16* kc, const u16* vc, float* out,
                    const u32* positions, const u32* seq_of, const u32* table_off,
                    const u32* tables, int block_size, int tok0, int n, int n_head,
                    int n_head_kv, int head_dim, float scale, int window, const u16* k_sc,
                    const u16* v_sc, int kt, int vt) {
    pdl_enter();
    prefill_tiles(q, kc, vc, out, positions, seq_of, table_off, tables, block_size, tok0, n,
                  n_head, n_head_kv, head_dim, scale, window, k_sc, v_sc, kt, vt);
}

// Prefill attention on the tensor cores (FlashAttention-2 style): block (tile of FM_Q = 64
// consecutive tokens of one sequence's run, query head), 4 warps of 16 query rows each. The
// queries are rounded to f16 once into mma fragments held in registers; K and V tiles of
// FM_K = 64 keys come from the paged f16 cache into shared memory (cp.async: V of a tile
// and K of the next one load while the previous phase computes). S = Q·Kᵀ and O += P·V are
// mma.sync m16n8k16 (f16 operands, f32 sums); the online softmax runs on S in registers
// (base 2, scale folded in), P is rounded to f16 for the second product. Same arguments
// and masking as attention_prefill (causal, sliding window); one kernel per head size.
//
// Fragments of mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (PTX ISA, "Matrix
// Fragments for mma.m16n8k16 with floating point type"), lane = 4g + c (g = lane >> 2,
// c = lane & 3); each .b32 register holds two f16, the lower column (or k) in the low half:
//   A (16×16, row): a0 = (row g, cols 2c, 2c+1)    a1 = (row g+8, cols 2c, 2c+1)
//                   a2 = (row g, cols 2c+8, 2c+9)  a3 = (row g+8, cols 2c+8, 2c+9)
//   B (16×8, col):  b0 = (k 2c, 2c+1; col g)       b1 = (k 2c+8, 2c+9; col g)
//   C/D (16×8 f32): d0, d1 = (row g, cols 2c, 2c+1)  d2, d3 = (row g+8, cols 2c, 2c+1)
// Here: A of S is Q (rows = the warp's queries, k = dims); B of S is Kᵀ (k = dims, col = key),
// i.e. K rows as stored: ldmatrix (no .trans) of 8 keys × 8 dims gives lane (key g, dims 2c,
// 2c+1) = b0. The S accumulator of keys 8j..8j+7 (d0..d3 above) is already the A layout of
// P for keys 16kk..16kk+15: a0 = S-tile 2kk (d0, d1), a1 = 2kk (d2, d3), a2 = 2kk+1 (d0, d1),
// a3 = 2kk+1 (d2, d3). B of O is V (k = keys, col = dims), stored key-major: ldmatrix.trans
// of 8 keys × 8 dims gives lane (keys 2c, 2c+1; dim g) = b0.
#define FM_Q 64
#define FM_K 64
#define FM_WARPS 4
// Halves of padding per shared row: rows 16 bytes apart modulo 128, so the 8 row addresses
// of each ldmatrix phase hit distinct banks.
#define FM_PAD 8

// QUANT: keys and values both quantized (kinds kt, vt; scales k_sc, v_sc: kv_load's
// layouts). Each tile's raw rows (quants and scales) then stream into one staging buffer by
// cp.async, K then V, and the block turns them into the f16 tiles (each value its quant
// times its block's scale, rounded to f16 once, as the f16 cache rounds its values): K of
// tile t lands during the P·V of tile t - 1, V during the scores.
template <int HD, bool QUANT>
__device__ __forceinline__ void
attention_prefill_mma(const float* q, const u16* kc, const u16* vc, float* out,
                      const u32* positions, const u32* seq_of, const u32* table_off,
                      const u32* tables, int block_size, int tok0, int n, int n_head,
                      int n_head_kv, float scale, int window, const float* sinks,
                      const u16* k_sc = nullptr, const u16* v_sc = nullptr, int kt_kind = KV_F16,
                      int vt_kind = KV_F16) {
    constexpr int LD = HD + FM_PAD;  // shared row length, halves
    constexpr int CH = HD / 8;       // 16-byte chunks per key row
    constexpr int KS = HD / 16;      // k-steps of S = Q·Kᵀ
    constexpr int NT = HD / 8;       // 8-dim column tiles of O
    __shared__ __align__(16) u16 ks[FM_K * LD];
    __shared__ __align__(16) u16 vs[FM_K * LD];
    __shared__ int w_range[FM_WARPS][2];
    __shared__ u32 slots[2][FM_K];  // cache slot of each key of a tile, by tile parity
    // QUANT: one tile's raw quants (HD bytes a key; Q4_0 uses half) and f16 scales.
    __shared__ __align__(16) u8 raw[QUANT ? FM_K * HD : 16];
    __shared__ __align__(16) u16 raw_sc[QUANT ? FM_K * (HD / 32) : 8];
    pdl_enter();
    const int h = blockIdx.x;
    // The latest tokens see the most keys: their tiles are scheduled first.
    const int t0 = tok0 + (gridDim.y - 1 - blockIdx.y) * FM_Q;
    const int nq = min(FM_Q, tok0 + n - t0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int kv_head = h / (n_head / n_head_kv);
    const int kv_dim = n_head_kv * HD;
    const size_t q_stride = (size_t)n_head * HD;

    // The lane's two query rows (g and g + 8 of the warp's 16): position and first visible
    // key; rows past the run's end see nothing (pos -1).
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    const int pos0 = r0 < nq ? (int)positions[t0 + r0] : -1;
    const int pos1 = r1 < nq ? (int)positions[t0 + r1] : -1;
    const int lo0 = window > 0 ? max(0, pos0 + 1 - window) : 0;
    const int lo1 = window > 0 ? max(0, pos1 + 1 - window) : 0;
    // The warp's key range (union of its rows'), and the range every one of its rows sees
    // (tiles inside it need no mask).
    int w_lo = min(pos0 >= 0 ? lo0 : 0x7fffffff, pos1 >= 0 ? lo1 : 0x7fffffff);
    int w_hi = max(pos0, pos1);
    int all_lo = max(lo0, lo1), all_hi = min(pos0, pos1);
    for (int o = 16; o > 0; o >>= 1) {
        w_lo = min(w_lo, __shfl_xor_sync(0xffffffffu, w_lo, o));
        w_hi = max(w_hi, __shfl_xor_sync(0xffffffffu, w_hi, o));
        all_lo = max(all_lo, __shfl_xor_sync(0xffffffffu, all_lo, o));
        all_hi = min(all_hi, __shfl_xor_sync(0xffffffffu, all_hi, o));
    }
    if (lane == 0) {
        w_range[warp][0] = w_lo;
        w_range[warp][1] = w_hi;
    }

    // Q fragments (A layout), rounded to f16: qf[s] covers dims 16s .. 16s + 15.
    u32 qf[KS][4];
    {
        const float* qr0 = q + (size_t)(t0 + r0) * q_stride + h * HD + 2 * c;
        const float* qr1 = qr0 + 8 * q_stride;
        const float2 zero = make_float2(0.0f, 0.0f);
#pragma unroll
        for (int s = 0; s < KS; s++) {
            const float2 x0 = r0 < nq ? *(const float2*)(qr0 + 16 * s) : zero;
            const float2 x1 = r1 < nq ? *(const float2*)(qr1 + 16 * s) : zero;
            const float2 x2 = r0 < nq ? *(const float2*)(qr0 + 16 * s + 8) : zero;
            const float2 x3 = r1 < nq ? *(const float2*)(qr1 + 16 * s + 8) : zero;
            qf[s][0] = pack_f16x2(x0.x, x0.y);
            qf[s][1] = pack_f16x2(x1.x, x1.y);
            qf[s][2] = pack_f16x2(x2.x, x2.y);
            qf[s][3] = pack_f16x2(x3.x, x3.y);
        }
    }
    __syncthreads();  // w_range
    int lo_all = 0x7fffffff, hi_all = -1;
#pragma unroll
    for (int w = 0; w < FM_WARPS; w++) {
        lo_all = min(lo_all, w_range[w][0]);
        hi_all = max(hi_all, w_range[w][1]);
    }

    // Cache slot of key kt + threadIdx.x (threads 0 .. FM_K - 1; 0 past hi_all): each
    // tile's slots are looked up once, by one thread per key, into slots[parity].
    const u32* table = tables + table_off[seq_of[t0]];
    auto slot_of = [&](int kt) -> u32 {
        const int kp = kt + (int)threadIdx.x;
        return threadIdx.x < FM_K && kp <= hi_all ? (u32)kv_slot(table, block_size, kp) : 0u;
    };
    // Keys kt .. kt + FM_K - 1 of one cache (K or V) into shared memory as one cp.async
    // group; keys past hi_all (never a valid slot) are zero-filled.
    // (Unrolled 2 at a time: ptxas keeps every row's addresses of a full unroll in
    // registers, 236 instead of 165 for 128-dim heads.)
    const u32 ks_base = smem_u32(ks), vs_base = smem_u32(vs);
    auto load_tile = [&](u32 dst, const u16* cache, int kt, const u32* tile_slots) {
#pragma unroll 2
        for (int it = 0; it < FM_K * CH / (FM_WARPS * 32); it++) {
            const int i = threadIdx.x + it * FM_WARPS * 32;
            const int key = i / CH, ch = i % CH;
            const bool ok = kt + key <= hi_all;
            const u16* src = cache + (size_t)tile_slots[key] * kv_dim + kv_head * HD + ch * 8;
            cp_async16(dst + (u32)(key * LD + ch * 8) * 2, src, ok);
        }
        cp_async_commit();
    };
    // Per-lane ldmatrix row addresses (halves). K: matrices (keys +0..7, dims +0..7),
    // (keys +0..7, dims +8..15), (keys +8..15, dims +0..7), (keys +8..15, dims +8..15) =
    // b0, b1 of key tile j and b0, b1 of key tile j + 1. V (.trans): (keys +0..7, dims +0..7),
    // (keys +8..15, dims +0..7), (keys +0..7, dims +8..15), (keys +8..15, dims +8..15) =
    // b0, b1 of dim tile d and b0, b1 of dim tile d + 1.
    // QUANT: keys kt .. kt + FM_K - 1 of one side's raw rows into `raw` / `raw_sc` as one
    // cp.async group (zeros past hi_all: they convert to zeros).
    auto load_raw = [&](int side, int kt, const u32* tile_slots) {
        const int kind = side ? vt_kind : kt_kind;
        const u8* cache = reinterpret_cast<const u8*>(side ? vc : kc);
        const u16* sc = side ? v_sc : k_sc;
        const int rb = kind == KV_Q4_0 ? HD / 2 : HD;  // quant bytes of a head's row
        const int segs = rb / 16;
        for (int i = threadIdx.x; i < FM_K * segs; i += FM_WARPS * 32) {
            const int key = i / segs, seg = i % segs;
            const bool ok = kt + key <= hi_all;
            const u8* src = cache + (size_t)tile_slots[key] * (kv_dim / HD * rb) +
                            (size_t)kv_head * rb + seg * 16;
            cp_async16(smem_u32(raw + key * HD + seg * 16), src, ok);
        }
        if (threadIdx.x < FM_K) {
            const int key = threadIdx.x;
            const u16* src = sc + (size_t)tile_slots[key] * (kv_dim / 32) + (size_t)kv_head * (HD / 32);
            cp_async_small(smem_u32(raw_sc + key * (HD / 32)), src, HD / 16, kt + key <= hi_all);
        }
        cp_async_commit();
    };
    // QUANT: the landed raw rows of one side into the f16 tile at dst (the caller syncs).
    auto convert_raw = [&](int side, u16* dst) {
        const int kind = side ? vt_kind : kt_kind;
        if (kind == KV_Q4_0) {
            for (int i = threadIdx.x; i < FM_K * HD / 32; i += FM_WARPS * 32) {
                const int key = i / (HD / 32), b = i % (HD / 32);
                uint4 o[4];
                tq_nibble_piece(*reinterpret_cast<const uint4*>(raw + key * HD + b * 16), o);
                const u32 d2 = raw_sc[key * (HD / 32) + b] * 0x10001u;
                uint4* to = reinterpret_cast<uint4*>(dst + key * LD + b * 32);
#pragma unroll
                for (int j = 0; j < 4; j++) to[j] = hmul2x4(o[j], d2);
            }
        } else {
            for (int i = threadIdx.x; i < FM_K * HD / 16; i += FM_WARPS * 32) {
                const int key = i / (HD / 16), seg = i % (HD / 16);
                uint4 o[2];
                tq_byte_piece(*reinterpret_cast<const uint4*>(raw + key * HD + seg * 16), kind, o);
                const u32 d2 = raw_sc[key * (HD / 32) + seg / 2] * 0x10001u;
                uint4* to = reinterpret_cast<uint4*>(dst + key * LD + seg * 16);
                to[0] = hmul2x4(o[0], d2);
                to[1] = hmul2x4(o[1], d2);
            }
        }
    };
    const int r8 = lane & 7, m_lo = (lane >> 3) & 1, m_hi = lane >> 4;  // row, matrix bits
    const u32 k_lane = ks_base + 2 * ((r8 + 8 * m_hi) * LD + 8 * m_lo);
    const u32 v_lane = vs_base + 2 * ((r8 + 8 * m_lo) * LD + 8 * m_hi);

    float o[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // Running max (base-2 units, scale folded in) and this lane's part of the row sums.
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const float sl2 = scale * 1.4426950408889634f;

    {
        const u32 first = slot_of(lo_all);
        if (threadIdx.x < FM_K) slots[0][threadIdx.x] = first;
    }
    __syncthreads();
    if constexpr (QUANT) load_raw(0, lo_all, slots[0]);
    else load_tile(ks_base, kc, lo_all, slots[0]);
    for (int kt = lo_all, par = 0; kt <= hi_all; kt += FM_K, par ^= 1) {
        // The next tile's slots: looked up now, stored after S (slots[par ^ 1] was last read
        // by the previous tile's V load, before the barrier below).
        const u32 next_slot = slot_of(kt + FM_K);
        if constexpr (QUANT) {
            cp_async_wait_all();  // this tile's raw K
            __syncthreads();
            convert_raw(0, ks);
            __syncthreads();
            load_raw(1, kt, slots[par]);  // lands while S is computed
        } else {
            load_tile(vs_base, vc, kt, slots[par]);  // lands while S is computed
            cp_async_wait_prev();  // this tile's K (all but the newest group)
            __syncthreads();
        }
        // Warp-uniform: whether any of the warp's rows sees a key of this tile.
        const bool active = kt <= w_hi && kt + FM_K - 1 >= w_lo;
        u32 pf[FM_K / 16][4];  // P in A layout, keys 16kk .. 16kk + 15
        if (active) {
            float s[FM_K / 8][4];
#pragma unroll
            for (int j = 0; j < FM_K / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int k = 0; k < KS; k++) {
#pragma unroll
                for (int j = 0; j < FM_K / 8; j += 2) {
                    u32 b[4];
                    ldsm_x4(b, k_lane + 2 * (8 * j * LD + 16 * k));
                    mma_f16(s[j], qf[k], b[0], b[1]);
                    mma_f16(s[j + 1], qf[k], b[2], b[3]);
                }
            }
            // Scale to base 2 and mask: s[j][e] is key kt + 8j + 2c + (e & 1) of row
            // r0 (e < 2) or r1 (e >= 2).
            const bool full = kt >= all_lo && kt + FM_K - 1 <= all_hi;
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int j = 0; j < FM_K / 8; j++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int kp = kt + 8 * j + 2 * c + e;
                    float x0 = s[j][e] * sl2, x1 = s[j][2 + e] * sl2;
                    if (!full) {
                        if (kp < lo0 || kp > pos0) x0 = NEG_INF;
                        if (kp < lo1 || kp > pos1) x1 = NEG_INF;
                    }
                    s[j][e] = x0;
                    s[j][2 + e] = x1;
                    mx0 = fmaxf(mx0, x0);
                    mx1 = fmaxf(mx1, x1);
                }
            }
            // A row's 64 scores sit in the 4 lanes of its quad.
#pragma unroll
            for (int o2 = 1; o2 < 4; o2 <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
            }
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            // Rows with no visible key yet: subtract 0 (every p is exp2(-inf) = 0).
            const float base0 = mn0 == NEG_INF ? 0.0f : mn0;
            const float base1 = mn1 == NEG_INF ? 0.0f : mn1;
            const float corr0 = exp2f(m0 - base0), corr1 = exp2f(m1 - base1);
            m0 = mn0;
            m1 = mn1;
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int j = 0; j < FM_K / 8; j++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    s[j][e] = exp2f(s[j][e] - base0);
                    s[j][2 + e] = exp2f(s[j][2 + e] - base1);
                    sum0 += s[j][e];
                    sum1 += s[j][2 + e];
                }
            }
            l0 = l0 * corr0 + sum0;
            l1 = l1 * corr1 + sum1;
#pragma unroll
            for (int d = 0; d < NT; d++) {
                o[d][0] *= corr0;
                o[d][1] *= corr0;
                o[d][2] *= corr1;
                o[d][3] *= corr1;
            }
#pragma unroll
            for (int kk = 0; kk < FM_K / 16; kk++) {
                pf[kk][0] = pack_f16x2(s[2 * kk][0], s[2 * kk][1]);
                pf[kk][1] = pack_f16x2(s[2 * kk][2], s[2 * kk][3]);
                pf[kk][2] = pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pf[kk][3] = pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
        }
        if (threadIdx.x < FM_K) slots[par ^ 1][threadIdx.x] = next_slot;
        if constexpr (QUANT) {
            cp_async_wait_all();  // this tile's raw V
            __syncthreads();      // ... for every thread; the next slots are in place
            convert_raw(1, vs);
            __syncthreads();
            if (kt + FM_K <= hi_all) load_raw(0, kt + FM_K, slots[par ^ 1]);  // during P·V
        } else {
            __syncthreads();  // every warp is done with ks; the next slots are in place
            if (kt + FM_K <= hi_all) {
                load_tile(ks_base, kc, kt + FM_K, slots[par ^ 1]);  // lands while P·V is computed
            } else {
                cp_async_commit();  // an empty group keeps the wait counts uniform
            }
            cp_async_wait_prev();  // this tile's V
            __syncthreads();
        }
        if (active) {
#pragma unroll
            for (int kk = 0; kk < FM_K / 16; kk++) {
#pragma unroll
                for (int d = 0; d < NT; d += 2) {
                    u32 b[4];
                    ldsm_x4_trans(b, v_lane + 2 * (16 * kk * LD + 8 * d));
                    mma_f16(o[d], pf[kk], b[0], b[1]);
                    mma_f16(o[d + 1], pf[kk], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with vs
    }

    // Whole-row sums (the quad's lanes), then O / l: lane holds dims 8d + 2c, 8d + 2c + 1.
#pragma unroll
    for (int o2 = 1; o2 < 4; o2 <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
    }
    // gpt-oss's sink (sinks non-null): head h's logit joins each row's max and denominator
    // and adds no value: O · 2^(m - m') / (l · 2^(m - m') + 2^(sink - m')), m' = max(m, sink),
    // in base 2 (m: the row's running max; rows with no key have m = -inf, so keep = 0).
    float keep0 = 1.0f, keep1 = 1.0f;
    if (sinks) {
        const float sk = sinks[h] * 1.4426950408889634f;
        const float mm0 = fmaxf(m0, sk), mm1 = fmaxf(m1, sk);
        keep0 = exp2f(m0 - mm0);
        keep1 = exp2f(m1 - mm1);
        l0 = l0 * keep0 + exp2f(sk - mm0);
        l1 = l1 * keep1 + exp2f(sk - mm1);
    }
    const float inv0 = l0 > 0.0f ? keep0 / l0 : 0.0f, inv1 = l1 > 0.0f ? keep1 / l1 : 0.0f;
    float* out0 = out + (size_t)(t0 + r0) * q_stride + h * HD + 2 * c;
    float* out1 = out0 + 8 * q_stride;
#pragma unroll
    for (int d = 0; d < NT; d++) {
        if (r0 < nq) *(float2*)(out0 + 8 * d) = make_float2(o[d][0] * inv0, o[d][1] * inv0);
        if (r1 < nq) *(float2*)(out1 + 8 * d) = make_float2(o[d][2] * inv1, o[d][3] * inv1);
    }
}

// Grid (n_head, ceil(n / FM_Q)), FM_WARPS * 32 threads; the arguments of attention_prefill
// (head_dim must be the HD of the name: the host picks the kernel by it), then gpt-oss's
// sink logit per head (null: none).
#define ATTN_PREFILL_MMA(HD)                                                                  \
    extern "C" __global__ void __launch_bounds__(FM_WARPS * 32) attention_prefill_mma##HD(  \
        const float* q, const u16* kc, const u16* vc, float* out, const u32* positions,       \
        const u32* seq_of, const u32* table_off, const u32* tables, int block_size, int tok0, \
        int n, int n_head, int n_head_kv, int head_dim, float scale, int window,              \
        const float* sinks) {                                                                 \
        attention_prefill_mma<HD, false>(q, kc, vc, out, positions, seq_of, table_off,        \
                                         tables, block_size, tok0, n, n_head, n_head_kv, scale, \
                                         window, sinks);                                      \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(FM_WARPS * 32) attention_prefill_mma##HD##_q( \
        const float* q, const u16* kc, const u16* vc, float* out, const u32* positions,       \
        const u32* seq_of, const u32* table_off, const u32* tables, int block_size, int tok0, \
        int n, int n_head, int n_head_kv, int head_dim, float scale, int window,              \
        const float* sinks, const u16* k_sc, const u16* v_sc, int kt, int vt) {               \
        attention_prefill_mma<HD, true>(q, kc, vc, out, positions, seq_of, table_off, tables, \
                                        block_size, tok0, n, n_head, n_head_kv, scale, window, \
                                        sinks, k_sc, v_sc, kt, vt);                           \
    }
// `_q`: over caches with quantized keys and values (the scales and kinds last).
ATTN_PREFILL_MMA(64)
ATTN_PREFILL_MMA(128)

// RoPE on a token's query and key heads, then its key and value into the cache (rope +
// rope + store_kv in one launch). Block (token, head): heads 0 .. n_head - 1 are the query
// heads, the next n_head_kv the key heads, whose block also stores that head's key and
// value rows. (One block per token walked every head serially: ~7 µs a step.)
// With m set, the heads come from the merged Q/K/V product (rows of (n_head + 2 n_head_kv) ·
// head_dim values) plus their biases (bq, bk, bv; null: none): each block copies its head into
// q or k first and stores the value straight from m — the split (split_qkv) on the way, one
// launch and one pass fewer. m null: q and k hold the heads already (bv unused).
// ROPE_PARAMS passed on.
#define ROPE_ANGLE_ARGS_ALL                                                                    \
    head_dim, n_rot, neox, theta_scale, freq_scale, ext_factor, mscale, corr_lo, corr_hi,      \
        freq_factors

// pdl_enter with the dependents let in before the wait: the next kernel (the step's
// attention) may start while this one still waits for the Q/K/V product. Every kernel that
// follows rope_store_kv waits (pdl_enter) before it reads what this one writes; the tiled
// decode attention loads older keys first (attn_tiled).
__device__ __forceinline__ void pdl_enter_early() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The body of rope_store_kv and rope_store_kv_q: the store of each key head's rows as kinds
// kt / vt (scales ks / vs; KV_F16 folds the quantized store away).
__device__ __forceinline__ void rope_store(const float* m, const float* bq, const float* bk,
                                           const float* bv, float* q, float* k, const float* v,
                                           u16* kc, u16* vc, const u32* positions,
                                           const u32* seq_of, const u32* table_off,
                                           const u32* tables, int block_size, int n_head,
                                           int n_head_kv, ROPE_PARAMS, u16* ks, u16* vs, int kt,
                                           int vt) {
    pdl_enter_early();
    const int i = blockIdx.x, h = blockIdx.y;
    const float pos = (float)positions[i];
    const int q_dim = n_head * head_dim, kv_dim = n_head_kv * head_dim;
    const float* mr = m ? m + (size_t)i * (q_dim + 2 * kv_dim) : nullptr;
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    rope_angles(pos, ROPE_ANGLE_ARGS, cs, sn);
    if (h < n_head) {
        float* qr = q + (size_t)i * q_dim + (size_t)h * head_dim;
        if (mr) {
            const int c0 = h * head_dim;
            for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
                qr[d] = mr[c0 + d] + (bq ? bq[c0 + d] : 0.0f);
        }
        __syncthreads();  // the angles (and the copied head), for every thread
        rope_apply(qr, 1, head_dim, n_rot, neox, cs, sn);
        return;
    }
    const int off = (h - n_head) * head_dim;
    float* kr = k + (size_t)i * kv_dim + off;
    if (mr) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
            kr[d] = mr[q_dim + off + d] + (bk ? bk[off + d] : 0.0f);
    }
    __syncthreads();
    rope_apply(kr, 1, head_dim, n_rot, neox, cs, sn);
    __syncthreads();  // the roped key (global memory) is visible to the whole block
    const u32* table = tables + table_off[seq_of[i]];
    const size_t sl = kv_slot(table, block_size, (int)positions[i]);
    const float* vr = mr ? mr + q_dim + kv_dim + off : v + (size_t)i * kv_dim + off;
    if (kt == KV_F16 && vt == KV_F16) {
        const size_t slot = sl * kv_dim + off;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            kc[slot + d] = f2h(kr[d]);
            vc[slot + d] = f2h(mr && bv ? vr[d] + bv[off + d] : vr[d]);
        }
        return;
    }
    // Quantized (as store_kv_q): a warp a 32-value block of the head's key or value.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int nb = head_dim >> 5;
    for (int b = warp; b < 2 * nb; b += n_warps) {
        const bool val = b >= nb;
        const int d = (val ? b - nb : b) * 32 + lane;
        if (val) kv_put(vc, vs, vt, sl, kv_dim, off + d, mr && bv ? vr[d] + bv[off + d] : vr[d]);
        else kv_put(kc, ks, kt, sl, kv_dim, off + d, kr[d]);
    }
}

extern "C" __global__ void rope_store_kv(const float* m, const float* bq, const float* bk,
                                         const float* bv, float* q, float* k, const float* v,
                                         u16* kc, u16* vc, const u32* positions,
                                         const u32* seq_of, const u32* table_off,
                                         const u32* tables, int block_size, int n_head,
                                         int n_head_kv, ROPE_PARAMS) {
    rope_store(m, bq, bk, bv, q, k, v, kc, vc, positions, seq_of, table_off, tables, block_size,
               n_head, n_head_kv, ROPE_ANGLE_ARGS_ALL, nullptr, nullptr, KV_F16, KV_F16);
}

// rope_store_kv into a cache with quantized keys or values (kinds kt, vt; scales ks, vs: see
// kv_put): the same arguments with those four last. Needs head_dim a multiple of 32 and a
// block of whole warps.
extern "C" __global__ void rope_store_kv_q(const float* m, const float* bq, const float* bk,
                                           const float* bv, float* q, float* k, const float* v,
                                           u16* kc, u16* vc, const u32* positions,
                                           const u32* seq_of, const u32* table_off,
                                           const u32* tables, int block_size, int n_head,
                                           int n_head_kv, ROPE_PARAMS, u16* ks, u16* vs, int kt,
                                           int vt) {
    rope_store(m, bq, bk, bv, q, k, v, kc, vc, positions, seq_of, table_off, tables, block_size,
               n_head, n_head_kv, ROPE_ANGLE_ARGS_ALL, ks, vs, kt, vt);
}

// gpt-oss's attention sinks: `attention_q` with a learned logit per query head (sinks[h])
// joining each softmax's denominator, out = Σ exp(s_j - m) v_j / (Σ exp(s_j - m) + exp(sink -
// m)). One block per (token tok0 + blockIdx.x, head blockIdx.y), any step size and any
// cache (ks, vs, kt, vt as attention_q; KV_F16 and null scales for f16 caches).
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_sinks(const float* q, const u16* kc, const u16* vc, float* out, const u32* positions,
                const u32* seq_of, const u32* table_off, const u32* tables, int block_size,
                int n_head, int n_head_kv, int head_dim, float scale, int window, int tok0,
                const u16* ks, const u16* vs, int kt, int vt, const float* sinks) {
    pdl_enter();
    __shared__ float res[ATT_MAX_HD];
    const int i = tok0 + blockIdx.x, h = blockIdx.y;
    int k_begin, k_end;
    split_key_range((int)positions[i], window, 1, 0, k_begin, k_end);
    float big, total;
    attn_range(q, kc, vc, i, h, k_begin, k_end, tables + table_off[seq_of[i]], block_size, n_head,
               n_head_kv, head_dim, scale, res, &big, &total, ks, vs, kt, vt);
    const float sink = sinks[h];
    const float m = total > 0.0f ? fmaxf(big, sink) : sink;
    const float keep = total > 0.0f ? expf(big - m) : 0.0f;
    const float norm = keep / (total * keep + expf(sink - m));
    float* o = out + (size_t)i * n_head * head_dim + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = res[d] * norm;
}
