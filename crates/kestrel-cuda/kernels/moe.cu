// Mixture-of-experts feed-forward blocks (src/moe.rs): the routing of `kestrel_model::moe::
// route` per token on the device, then the selected experts' gated MLPs read from the
// stacked `ffn_*_exps` matrices (expert e's rows are rows e·rows..(e+1)·rows) with the
// per-format dot products of gemv.cu (`row_dot_any` / `row_dot2_any`, generic over the
// block format). Every product is one warp per row whose lanes accumulate each token
// independently of the others, so a token's result is the same whatever else the step
// holds (decode, grouped prefill, batch-invariant verification).
//
// Every step: moe_router (f32 logits), moe_route. Steps of up to 8 tokens then: moe_gate_up (one block row per (token,
// slot) pair, the expert id read from the device), moe_down (each token's row summed over
// its k experts in slot order, no atomics); with 8-bit activations (formats gemv_q8 reads)
// moe_router also quantizes the inputs, and moe_gate_up_q8 / moe_down_q8 run gemv_q8's
// units and dp4a dot products instead. Larger steps group the pairs by expert
// (moe_group), gather their inputs (moe_gather), run tiles of up to GV_MAX_T pairs of one
// expert (moe_gate_up_tiles, moe_down_tiles: each weight row read once per tile), and add
// each token's weighted outputs in slot order (moe_combine). Grids are sized for the worst
// case (tiles beyond the count exit at once), so no step needs the host.

#define MOE_MAX_EXPERT 1024
#define MOE_MAX_K 16
#define MOE_ROWS 4  // rows a 128-thread block computes: one warp each

// gate/up nonlinearity of one value pair, as the CPU computes it: act(g) * u, or gpt-oss's
// clamped SwiGLU (limit > 0): min(g, limit) · sigmoid(alpha · ·) · (clamp(u, ±limit) + 1).
__device__ __forceinline__ float moe_act(float g, float u, int act, float alpha, float limit) {
    if (limit > 0.0f) {
        const float x = fminf(g, limit);
        const float y = fminf(fmaxf(u, -limit), limit);
        return __fmul_rn(__fdiv_rn(x, 1.0f + expf(__fmul_rn(alpha, -x))), y + 1.0f);
    }
    return __fmul_rn(gv_act(g, act), u);
}

// Router logits in f32 (as llama.cpp keeps the router): block (expert e, tile of up to
// GV_MAX_T tokens) of 4 warps splitting the row, logits[t][e] = w_e · x[t]. Each token's
// sums are its own (the same whatever the step's size).
// With xq set the block also quantizes 32-value blocks of its tokens' inputs for the 8-bit
// decode kernels (quantize_x_q8's rounding: xq, and a scale per 32 in xd): warp w of block e
// takes blocks 4e + w, 4e + w + 4·ne, ... (d a multiple of 32).
extern "C" __global__ void __launch_bounds__(GV_THREADS) moe_router(const float* x, int d,
                                                                     int n, const u8* w,
                                                                     long long rb, int ty,
                                                                     int ne, float* logits,
                                                                     i8* xq, float* xd) {
    pdl_enter();
    if (xq) {
        const int t0q = blockIdx.y * GV_MAX_T, ntq = min(GV_MAX_T, n - t0q);
        const int lane = threadIdx.x & 31;
        for (int b = blockIdx.x * (GV_THREADS / 32) + (threadIdx.x >> 5); b < d / 32;
             b += ne * (GV_THREADS / 32))
            for (int t = t0q; t < t0q + ntq; t++)
                q8_store_block(x[(size_t)t * d + b * 32 + lane], (size_t)t * d + b * 32 + lane,
                               xq, xd);
    }
    __shared__ float red[(GV_THREADS / 32) * GV_MAX_T];
    const int e = blockIdx.x, t0 = blockIdx.y * GV_MAX_T;
    const int nt = min(GV_MAX_T, n - t0);
    float acc[GV_MAX_T];
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++) acc[t] = 0.0f;
    row_dot_any(ty, w + (size_t)e * rb, x + (size_t)t0 * d, d, nt, threadIdx.x, GV_THREADS,
                acc);
    row_reduce(acc, nt, GV_THREADS / 32, red);
    if (threadIdx.x == 0)
#pragma unroll
        for (int t = 0; t < GV_MAX_T; t++)
            if (t < nt) logits[(size_t)(t0 + t) * ne + e] = acc[t];
}

// The sort key of expert e's logit v: larger keys first = larger logits first, the lower
// index first among equal ones (−0 equal to +0, as the CPU's comparison); 0 pads.
__device__ __forceinline__ unsigned long long moe_key(float v, int e) {
    u32 b = __float_as_uint(v);
    if ((b << 1) == 0) b = 0;
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)b << 32) | (unsigned long long)(0xffffffffu - (u32)e);
}

// The logit of a key (moe_key's inverse) and its expert.
__device__ __forceinline__ float moe_key_value(unsigned long long key) {
    const u32 b = (u32)(key >> 32);
    return __uint_as_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
}
__device__ __forceinline__ int moe_key_expert(unsigned long long key) {
    return (int)(0xffffffffu - (u32)key);
}

// Per token (one block of P threads, P the power of two ≥ n_expert, ≥ 32): ids[t·k + s] and
// wts[t·k + s] of its k experts, in decreasing order (lower index first among equal logits).
// Thread e holds expert e's key; a bitonic sort of the block's keys (warp shuffles for
// strides below 32, shared memory above: log2(P)·(log2(P)+1)/2 steps, no loop over the
// experts) leaves the s-th largest in thread s. gating 0: softmax over all n_expert logits
// (renormalized over the chosen when norm); 1: softmax over the chosen logits only. The
// exponentials' sum is taken in f64 and its f32 reciprocal scales each, as ggml does; the
// renormalizing sum is clamped below at 2^-14.
extern "C" __global__ void __launch_bounds__(MOE_MAX_EXPERT) moe_route(const float* logits,
                                                                       const float* bias,
                                                                       int n_expert, int k,
                                                                       int gating, int norm,
                                                                       int* ids, float* wts) {
    pdl_enter();
    __shared__ unsigned long long xk[2][MOE_MAX_EXPERT];
    __shared__ double part[MOE_MAX_EXPERT / 32];
    __shared__ float sv[MOE_MAX_K];
    __shared__ int sel[MOE_MAX_K];
    const int t = blockIdx.x, e = threadIdx.x, P = blockDim.x, lane = e & 31;
    float v = 0.0f;
    unsigned long long key = 0;
    if (e < n_expert) {
        v = logits[(size_t)t * n_expert + e];
        if (bias) v = __fadd_rn(v, bias[e]);
        key = moe_key(v, e);
    }
    int buf = 0;
    for (int size = 2; size <= P; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            unsigned long long other;
            if (stride >= 32) {
                xk[buf][e] = key;
                __syncthreads();
                other = xk[buf][e ^ stride];
                buf ^= 1;
            } else {
                other = __shfl_xor_sync(0xffffffffu, key, stride);
            }
            // Descending runs where (e & size) == 0 (all of them in the last merge).
            const bool keep_max = ((e & stride) == 0) == ((e & size) == 0);
            key = keep_max ? (key > other ? key : other) : (key < other ? key : other);
        }
    if (e < k) {
        sel[e] = moe_key_expert(key);
        sv[e] = moe_key_value(key);
    }
    __syncthreads();
    const float mx = sv[0];
    double sum = 0.0;
    if (gating == 0) {
        double s = e < n_expert ? (double)expf(v - mx) : 0.0;
        s = warp_sum(s);
        if (lane == 0) part[e >> 5] = s;
        __syncthreads();
        if (e >= k) return;
        for (int i = 0; i < (P >> 5); i++) sum += part[i];
    } else {
        if (e >= k) return;
        for (int s = 0; s < k; s++) sum += (double)expf(sv[s] - mx);
    }
    const float scale = (float)(1.0 / sum);
    // Every chosen thread adds the k weights in slot order (the same sum in each).
    float tot = 0.0f;
    for (int s = 0; s < k; s++) tot = __fadd_rn(tot, __fmul_rn(expf(sv[s] - mx), scale));
    tot = fmaxf(tot, 6.103515625e-5f);
    const float we = __fmul_rn(expf(sv[e] - mx), scale);
    ids[t * k + e] = sel[e];
    wts[t * k + e] = norm ? __fdiv_rn(we, tot) : we;
}

// The gated product of one expert row r for `n` tokens at x (rows of d values): out[t·ldo + r]
// = moe_act(gate_r · x_t + bg[r], up_r · x_t + bu[r]). One warp; lane 0 writes.
__device__ __forceinline__ void moe_gate_up_row(const float* x, int d, int n, int r,
                                                const u8* rg, int tyg, const u8* ru, int tyu,
                                                const float* bg, const float* bu, int act,
                                                float alpha, float limit, float* out,
                                                long long ldo) {
    const int lane = threadIdx.x & 31;
    float g[GV_MAX_T], u[GV_MAX_T];
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++) { g[t] = 0.0f; u[t] = 0.0f; }
    if (tyg != tyu || !row_dot2_any(tyg, rg, ru, x, d, n, lane, 32, g, u)) {
        row_dot_any(tyg, rg, x, d, n, lane, 32, g);
        row_dot_any(tyu, ru, x, d, n, lane, 32, u);
    }
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++)
        if (t < n) { g[t] = warp_sum(g[t]); u[t] = warp_sum(u[t]); }
    if (lane != 0) return;
    const float b0 = bg ? bg[r] : 0.0f, b1 = bu ? bu[r] : 0.0f;
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++)
        if (t < n) out[t * ldo + r] = moe_act(__fadd_rn(g[t], b0), __fadd_rn(u[t], b1), act, alpha, limit);
}

#define MOE_GATE_UP_PARAMS                                                                     \
    int d, int ff, const u8 *wg, long long rbg, int tyg, const u8 *wu, long long rbu, int tyu, \
        const float *bg, const float *bu, int act, float alpha, float limit

// Decode: block (row group, pair p = t·k + s): a[p][r] for the rows r of the group, expert
// ids[p], token t's input x[t].
extern "C" __global__ void __launch_bounds__(GV_THREADS) moe_gate_up(const float* x, int k,
                                                                      const int* ids, float* a,
                                                                      MOE_GATE_UP_PARAMS) {
    pdl_enter();
    const int r = blockIdx.x * MOE_ROWS + (threadIdx.x >> 5), p = blockIdx.y;
    if (r >= ff) return;
    const long long e = ids[p], row = e * ff + r;
    moe_gate_up_row(x + (size_t)(p / k) * d, d, 1, r, wg + row * rbg, tyg, wu + row * rbu, tyu,
                    bg ? bg + e * ff : nullptr, bu ? bu + e * ff : nullptr, act, alpha, limit,
                    a + (size_t)p * ff, 0);
}

// The down product of one expert row r for n inputs at a (rows of ff values), bias added:
// into v[t]. One warp; every lane gets the sums.
__device__ __forceinline__ void moe_down_row(const float* a, int ff, int n, const u8* row,
                                             int ty, float b, float* v) {
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++) v[t] = 0.0f;
    row_dot_any(ty, row, a, ff, n, threadIdx.x & 31, 32, v);
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++)
        if (t < n) v[t] = __fadd_rn(warp_sum(v[t]), b);
}

// Decode: block (row group, token t) of 8 warps: out[t][r] = Σ_s wts[t·k+s] · (down_e ·
// a[t·k+s] + bd_e[r]) over the k slots in order, e = ids[t·k+s]. Each warp takes one
// (row, slot) product (k ≤ 8: 8 / k rows a block; k > 8: one row, slots w and w + 8), so all
// of a row's expert rows load at once; the block then sums each row over its slots in order
// (no atomics).
extern "C" __global__ void __launch_bounds__(256)
moe_down(const float* a, int ff, int d, int k, const int* ids, const float* wts, const u8* wd,
         long long rbd, int tyd, const float* bd, float* out) {
    pdl_enter();
    __shared__ float part[8][MOE_MAX_K];
    const int w = threadIdx.x >> 5, t = blockIdx.y;
    const int rpb = k <= 8 ? 8 / k : 1;
    const int rl = k <= 8 ? w / k : 0;
    const int r = blockIdx.x * rpb + rl;
    if (rl < rpb && r < d) {
        for (int s = k <= 8 ? w % k : w; s < k; s += 8) {
            const int p = t * k + s;
            const long long e = ids[p];
            float v[GV_MAX_T];
            moe_down_row(a + (size_t)p * ff, ff, 1, wd + (e * d + r) * rbd, tyd,
                         bd ? bd[e * d + r] : 0.0f, v);
            if ((threadIdx.x & 31) == 0) part[rl][s] = __fmul_rn(v[0], wts[p]);
        }
    }
    __syncthreads();
    if (threadIdx.x < rpb) {
        const int rr = blockIdx.x * rpb + threadIdx.x;
        if (rr >= d) return;
        float o = part[threadIdx.x][0];
        for (int s = 1; s < k; s++) o = __fadd_rn(o, part[threadIdx.x][s]);
        out[(size_t)t * d + rr] = o;
    }
}

// ---------------------------------------------------------------------------------------
// Decode on 8-bit activations (steps of up to 8 tokens; the formats gemv_q8 reads: Q4_K,
// Q6_K, Q8_0, Q4_0, IQ4_NL, IQ4_XS, MXFP4): gemv_q8's wide units and dp4a dot products with
// the expert's rows found through the ids on the device. A token's results do not depend on
// the step around it (each (pair, row) and (token, row) is one warp's work), so
// batch-invariant steps need nothing special here either.

#define MOE_Q8_WARPS 16  // moe_gate_up_q8: warps a block, 2 rows each: one 32-value q8 block

// Block (32-row group, pair p = t·k + s): rows r of expert ids[p]'s gate and up times token
// t's 8-bit input (xq, xd), the activation fused, then the 32 values quantized for
// moe_down_q8 (aq: a row of ff int8 per pair, ad: a scale per 32). ff a multiple of 32.
extern "C" __global__ void __launch_bounds__(MOE_Q8_WARPS * 32, 1)
moe_gate_up_q8(const i8* xq, const float* xd, int k, const int* ids, i8* aq, float* ad,
               MOE_GATE_UP_PARAMS) {
    pdl_enter();
    __shared__ float vals[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int p = blockIdx.y, r0 = blockIdx.x * 32 + 2 * warp;
    const long long e = ids[p];
    const size_t t = p / k;
    const i8* x = xq + t * d;
    const float* xs = xd + t * (d / 32);
    const u8* g = wg + (e * ff + r0) * rbg;
    const u8* u = wu + (e * ff + r0) * rbu;
    float acc[2] = {0.0f, 0.0f}, acc_up[2] = {0.0f, 0.0f};
    bool waited = true;
    if (tyg == tyu && rbg == rbu) {
        rows_dot8_any<2, 2, true>(tyg, g, u, rbg, 2, x, xs, d, lane, acc, acc_up, waited);
    } else {
        rows_dot8_any<2, 2, true>(tyg, g, nullptr, rbg, 2, x, xs, d, lane, acc, nullptr, waited);
        rows_dot8_any<2, 2, true>(tyu, u, nullptr, rbu, 2, x, xs, d, lane, acc_up, nullptr,
                                  waited);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        acc[i] = warp_sum(acc[i]);
        acc_up[i] = warp_sum(acc_up[i]);
    }
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int r = r0 + i;
            const float b0 = bg ? bg[e * ff + r] : 0.0f, b1 = bu ? bu[e * ff + r] : 0.0f;
            vals[2 * warp + i] =
                moe_act(__fadd_rn(acc[i], b0), __fadd_rn(acc_up[i], b1), act, alpha, limit);
        }
    __syncthreads();
    if (warp == 0) q8_store_block(vals[lane], (size_t)p * ff + blockIdx.x * 32 + lane, aq, ad);
}

// This lane's share of rows r0 .. r0 + nr (≤ R) of the token's k experts' down matrices
// (expert id[s]'s rows at wd + (id[s]·d + r)·rb), each dotted with its slot's 8-bit
// activations (aq + s·ff, ad + s·ff/32) and weighted by wt[s]: the warp's (slot, unit)
// pairs are one flat range its lanes stride over, NU units in flight a lane.
template <int TY, int R, int NU>
__device__ __forceinline__ void moe_down_rows8(const u8* wd, long long rb, int d, int r0, int nr,
                                               const int* id, const float* wt, const i8* aq,
                                               const float* ad, int ff, int k, int lane,
                                               float* acc) {
    typedef Fmt<TY> F;
    typedef Unit8<TY> U8;
    const int units = F::units(ff), nb = ff >> 5, total = k * units;
    for (int i0 = lane; i0 < total; i0 += 32 * NU) {
        typename F::Raw raw[NU][R];
        int s[NU], u[NU];
#pragma unroll
        for (int j = 0; j < NU; j++) {
            const int idx = i0 + 32 * j;
            s[j] = idx / units;
            u[j] = idx - s[j] * units;
            if (idx < total) {
                const u8* row = wd + ((long long)id[s[j]] * d + r0) * rb;
#pragma unroll
                for (int i = 0; i < R; i++)
                    if (i < nr) raw[j][i] = F::load(row + i * rb, u[j], nb);
            }
        }
#pragma unroll
        for (int j = 0; j < NU; j++)
            if (i0 + 32 * j < total) {
                const typename U8::X xv =
                    U8::load_x(aq + (size_t)s[j] * ff, ad + (size_t)s[j] * nb, u[j]);
                const float w = wt[s[j]];
#pragma unroll
                for (int i = 0; i < R; i++)
                    if (i < nr) acc[i] = fmaf(w, U8::dot(raw[j][i], u[j], xv), acc[i]);
            }
    }
}

#define MOE_DOWN_R 2  // moe_down_q8: rows a warp

// Block (8-row group, token t) of 4 warps, MOE_DOWN_R rows each: out[t][r] = Σ_s wts[t·k+s] ·
// (down_e · a[t·k+s] + bd_e[r]), e = ids[t·k+s], a the 8-bit activations of moe_gate_up_q8.
extern "C" __global__ void __launch_bounds__(128, 4)
moe_down_q8(const i8* aq, const float* ad, int ff, int d, int k, const int* ids,
            const float* wts, const u8* wd, long long rbd, int tyd, const float* bd,
            float* out) {
    pdl_enter();
    const int lane = threadIdx.x & 31, t = blockIdx.y;
    const int r0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * MOE_DOWN_R;
    if (r0 >= d) return;
    const int nr = min(MOE_DOWN_R, d - r0);
    const int* id = ids + (size_t)t * k;
    const float* wt = wts + (size_t)t * k;
    const i8* a = aq + (size_t)t * k * ff;
    const float* as = ad + (size_t)t * k * (ff / 32);
    float acc[MOE_DOWN_R];
#pragma unroll
    for (int i = 0; i < MOE_DOWN_R; i++) acc[i] = 0.0f;
#define MOE_DOWN_CASE(T, TW)                                                                   \
    case T:                                                                                    \
        moe_down_rows8<TW, MOE_DOWN_R, 2>(wd, rbd, d, r0, nr, id, wt, a, as, ff, k, lane, acc); \
        break;
    switch (tyd) {
    MOE_DOWN_CASE(T_Q4_K, T_Q4_K_W)
    MOE_DOWN_CASE(T_Q6_K, T_Q6_K_W)
    MOE_DOWN_CASE(T_Q8_0, T_Q8_0_W)
    MOE_DOWN_CASE(T_Q4_0, T_Q4_0_W)
    MOE_DOWN_CASE(T_IQ4_NL, T_IQ4_NL_W)
    MOE_DOWN_CASE(T_IQ4_XS, T_IQ4_XS_W)
    MOE_DOWN_CASE(T_MXFP4, T_MXFP4_W)
    default: break;
    }
#undef MOE_DOWN_CASE
#pragma unroll
    for (int i = 0; i < MOE_DOWN_R; i++) acc[i] = warp_sum(acc[i]);
    if (lane != 0) return;
#pragma unroll
    for (int i = 0; i < MOE_DOWN_R; i++)
        if (i < nr) {
            const int r = r0 + i;
            float o = acc[i];
            if (bd)
                for (int s = 0; s < k; s++) o = fmaf(wt[s], bd[(size_t)id[s] * d + r], o);
            out[(size_t)t * d + r] = o;
        }
}

// Groups the np = n·k pairs by expert (one block): pos[p] = the pair's place in the grouped
// order (by expert; within an expert in no particular order: each pair's results do not
// depend on its neighbours), order[pos] = p, and the tiles of up to GV_MAX_T consecutive
// pairs of one expert: tiles[0] = their count, then (expert, first, count) each.
extern "C" __global__ void __launch_bounds__(1024) moe_group(const int* ids, int np,
                                                             int n_expert, int* pos, int* order,
                                                             int* tiles) {
    pdl_enter();
    __shared__ int cnt[MOE_MAX_EXPERT], start[MOE_MAX_EXPERT], tstart[MOE_MAX_EXPERT];
    __shared__ int fill[MOE_MAX_EXPERT];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) { cnt[e] = 0; fill[e] = 0; }
    __syncthreads();
    for (int p = threadIdx.x; p < np; p += blockDim.x) atomicAdd(&cnt[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0, ts = 0;
        for (int e = 0; e < n_expert; e++) {
            start[e] = s;
            tstart[e] = ts;
            s += cnt[e];
            ts += (cnt[e] + GV_MAX_T - 1) / GV_MAX_T;
        }
        tiles[0] = ts;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        const int e = ids[p];
        const int at = start[e] + atomicAdd(&fill[e], 1);
        pos[p] = at;
        order[at] = p;
    }
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        const int nt = (cnt[e] + GV_MAX_T - 1) / GV_MAX_T;
        for (int i = 0; i < nt; i++) {
            int* tl = tiles + 1 + 3 * (tstart[e] + i);
            tl[0] = e;
            tl[1] = start[e] + i * GV_MAX_T;
            tl[2] = min(GV_MAX_T, cnt[e] - i * GV_MAX_T);
        }
    }
}

// xs[q] = x[order[q] / k] for each grouped place q (one block each).
extern "C" __global__ void moe_gather(const float* x, int d, int k, const int* order,
                                      float* xs) {
    pdl_enter();
    const int q = blockIdx.x;
    const float* src = x + (size_t)(order[q] / k) * d;
    float* dst = xs + (size_t)q * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
}

// Grouped: block (row group, tile): a[q][r] for the tile's pairs q (grouped order).
extern "C" __global__ void __launch_bounds__(GV_THREADS)
moe_gate_up_tiles(const float* xs, const int* tiles, float* a, MOE_GATE_UP_PARAMS) {
    pdl_enter();
    const int r = blockIdx.x * MOE_ROWS + (threadIdx.x >> 5), ti = blockIdx.y;
    if (ti >= tiles[0] || r >= ff) return;
    const int* tl = tiles + 1 + 3 * ti;
    const long long e = tl[0], row = e * ff + r;
    const int q0 = tl[1], n = tl[2];
    moe_gate_up_row(xs + (size_t)q0 * d, d, n, r, wg + row * rbg, tyg, wu + row * rbu, tyu,
                    bg ? bg + e * ff : nullptr, bu ? bu + e * ff : nullptr, act, alpha, limit,
                    a + (size_t)q0 * ff, ff);
}

// Grouped: block (row group, tile): ys[q][r] = wts[order[q]] · (down_e · a[q] + bd_e[r]).
extern "C" __global__ void __launch_bounds__(GV_THREADS)
moe_down_tiles(const float* a, int ff, int d, const int* tiles, const int* order,
               const float* wts, const u8* wd, long long rbd, int tyd, const float* bd,
               float* ys) {
    pdl_enter();
    const int r = blockIdx.x * MOE_ROWS + (threadIdx.x >> 5), ti = blockIdx.y;
    if (ti >= tiles[0] || r >= d) return;
    const int* tl = tiles + 1 + 3 * ti;
    const long long e = tl[0];
    const int q0 = tl[1], n = tl[2];
    float v[GV_MAX_T];
    moe_down_row(a + (size_t)q0 * ff, ff, n, wd + (e * d + r) * rbd, tyd,
                 bd ? bd[e * d + r] : 0.0f, v);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int t = 0; t < GV_MAX_T; t++)
        if (t < n) ys[(size_t)(q0 + t) * d + r] = __fmul_rn(v[t], wts[order[q0 + t]]);
}

// out[t][i] = Σ_s ys[pos[t·k+s]][i], slot by slot in order.
extern "C" __global__ void moe_combine(const float* ys, const int* pos, int d, int k, int n,
                                       float* out) {
    pdl_enter();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * d) return;
    const int t = (int)(i / d), c = (int)(i % d);
    float o = ys[(size_t)pos[t * k] * d + c];
    for (int s = 1; s < k; s++) o = __fadd_rn(o, ys[(size_t)pos[t * k + s] * d + c]);
    out[i] = o;
}

// A shared expert's gate: out[t] += y[t] · sigmoid(x[t] · w). Block (token t, group of
// MOE_SG_OUT · 256 outputs), 256 threads: each block takes the whole dot product
// (x[t] and w are one row each, the same sums in every block), with w's first
// MOE_SG_W · 256 values requested before the wait on the previous kernel and this thread's
// outputs and y requested before the reduction: one round of loads after the wait.
#define MOE_SG_W 16
#define MOE_SG_OUT 4
extern "C" __global__ void __launch_bounds__(256) moe_shared_gate(float* out, const float* y,
                                                                    const float* x,
                                                                    const float* w, int d,
                                                                    int dy) {
    __shared__ float red[8];
    const int t = blockIdx.x, tid = threadIdx.x;
    float wr[MOE_SG_W];
#pragma unroll
    for (int j = 0; j < MOE_SG_W; j++) {
        const int i = tid + 256 * j;
        wr[j] = i < d ? w[i] : 0.0f;
    }
    pdl_enter();
    const float* xt = x + (size_t)t * d;
    float xr[MOE_SG_W];
#pragma unroll
    for (int j = 0; j < MOE_SG_W; j++) {
        const int i = tid + 256 * j;
        xr[j] = i < d ? xt[i] : 0.0f;
    }
    const int o0 = blockIdx.y * (MOE_SG_OUT * 256) + tid;
    float yr[MOE_SG_OUT], orr[MOE_SG_OUT];
#pragma unroll
    for (int j = 0; j < MOE_SG_OUT; j++) {
        const int i = o0 + 256 * j;
        if (i < dy) {
            yr[j] = y[(size_t)t * dy + i];
            orr[j] = out[(size_t)t * dy + i];
        }
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < MOE_SG_W; j++)
        if (tid + 256 * j < d) s = fmaf(xr[j], wr[j], s);
    for (int i = tid + 256 * MOE_SG_W; i < d; i += 256) s = fmaf(xt[i], w[i], s);
    s = warp_sum(s);
    if ((tid & 31) == 0) red[tid >> 5] = s;
    __syncthreads();
    float z = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) z += red[i];
    const float gate = 1.0f / (1.0f + expf(-z));
#pragma unroll
    for (int j = 0; j < MOE_SG_OUT; j++) {
        const int i = o0 + 256 * j;
        if (i < dy) out[(size_t)t * dy + i] = __fadd_rn(orr[j], __fmul_rn(yr[j], gate));
    }
}
