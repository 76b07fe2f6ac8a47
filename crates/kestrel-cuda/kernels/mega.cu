// ---------------------------------------------------------------------------------------
// `mega`: a run of a single-token step's launches (norms, GEMVs, RoPE + attention, the LM
// head) as one persistent kernel, so that the weights stream without a gap at launch
// boundaries. One block per SM; warp MG_WARPS is the producer: it walks every GEMV phase's
// rows of its block in order and copies them (cp.async.bulk) into a ring of MG_SLOTS shared
// slots, running ahead across phases and grid barriers (weights are never written during a
// step). The consumer warps run the phases in order: chunk c of a GEMV phase (≤ MG_MAX_ROWS
// whole rows) belongs to warp c % MG_WARPS, which dots its rows with the 8-bit activations
// exactly as gemv_q8 does (same units, same order: bit for bit its outputs, given the same
// activations); norms and quantizations feeding a GEMV run spread over the grid (or, with
// the host's local mode, in every block into its shared copy of the activations);
// attention runs one (kv head, key range) per warp, RoPE on the way, its merge one head per
// block; a grid barrier follows each phase that others read.
// The host builds the phases from the recorded launches (src/mega.rs) and checks every
// limit assumed here (formats, alignment, sizes).
//
// Status (thirteenth session, H100): correct (gpu-check --mega) but slower than the
// launches it replaces (Llama-3-8B Q4_K_M tg128 210 against 370 t/s), so off by default;
// the per-phase profile and what it showed are in crates/kestrel-cuda/NOTES.md.

#define MG_WARPS 8
#define MG_CT (MG_WARPS * 32)
#define MG_THREADS (MG_CT + 32)
#define MG_SLOTS 16
#define MG_MAX_ROWS 8
// 32-value blocks a warp of a norm / quantization phase takes at once.
#define MG_QB 8

#define MG_NORM 1
#define MG_QUANT 2
#define MG_GEMV 3
#define MG_ATTN 4
#define MG_COMBINE 5

// `flags` of a launch (measurements only: the results are wrong).
#define MG_NO_DOTS 1  // GEMV phases stream their weights without computing

// One phase; `a` holds its arguments, 8 bytes each (layouts in src/mega.rs).
struct MgPhase {
    int kind;
    int barrier;  // a grid barrier after the phase
    int local_x;  // GEMV: the activations are the block's shared copy (else a[0], a[1])
    int rpc[3];   // GEMV: rows per chunk of each segment
    const u32* bounds;  // GEMV: first row of each block (gridDim.x + 1 entries)
    long long a[40];
};

#define MG_P(T, i) ((T)ph.a[i])
#define MG_I(i) ((int)ph.a[i])
#define MG_F(i) __int_as_float((int)ph.a[i])

// The consumer warps' own barrier (the producer never joins it).
__device__ __forceinline__ void mg_sync() { asm volatile("bar.sync 1, %0;" ::"n"(MG_CT) : "memory"); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Waits for the phase of parity `parity` of the barrier at `bar`; traps (with a line on
// stdout) if it has not completed after seconds: a copy that never lands.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    for (long long tries = 0;; tries++) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
        if (done) return;
        if (tries > (1ll << 26)) {
            printf("mega: block %d thread %d stuck on barrier %u parity %u\n", blockIdx.x,
                   threadIdx.x, bar, parity);
            __trap();
        }
    }
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// All consumer threads: the grid barrier `ctr` (one counter per barrier of the kernel).
__device__ __forceinline__ void mg_grid_sync(u32* ctr) {
    mg_sync();
    if (threadIdx.x == 0) {
        // Release: the block's writes (ordered before by the bar.sync) become visible with
        // the arrival; acquire below: the other blocks' writes are visible after it.
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
        u32 v;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ctr) : "memory");
            if (v >= gridDim.x) break;
            __nanosleep(64);
            // A block that never arrives (not resident): fail loudly instead of hanging.
            if (++spins > (1ll << 24)) {
                printf("mega: block %d stuck at a grid barrier (%u of %u arrived)\n",
                       blockIdx.x, v, gridDim.x);
                __trap();
            }
        } while (v < gridDim.x);
    }
    mg_sync();
}

__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Sum over the consumer threads (red: MG_WARPS floats of shared memory).
__device__ __forceinline__ float mg_sum(float v, float* red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    mg_sync();
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < MG_WARPS; w++) s += red[w];
    mg_sync();
    return s;
}

// Rows of the block's share of a GEMV phase, in chunks: f(segment, first row, rows). The
// producer and the consumers walk the same sequence. Segments: gated phases one (gate and
// up rows side by side), else up to three matrices end to end.
template <class F>
__device__ __forceinline__ void mg_chunks(const MgPhase& ph, F f) {
    const int gated = MG_I(7), total = MG_I(6), rows0 = MG_I(12), rows1 = MG_I(19);
    const int ends[3] = {rows0, gated ? rows0 : rows0 + rows1, gated ? rows0 : total};
    int r = (int)ph.bounds[blockIdx.x];
    const int end = (int)ph.bounds[blockIdx.x + 1];
    int s = 0;
    while (r < end) {
        while (r >= ends[s]) s++;
        const int start = s == 0 ? 0 : ends[s - 1];
        const int n = min(ph.rpc[s], min(end, ends[s]) - r);
        f(s, r - start, n);
        r += n;
    }
}

// Segment s of a GEMV phase: its rows' pointer, row bytes, format.
__device__ __forceinline__ void mg_seg(const MgPhase& ph, int s, const u8*& w, long long& rb,
                                       int& ty) {
    const int b = 9 + 7 * s;  // w0 at a[9], w1 at a[16], w2 at a[23]
    w = MG_P(const u8*, b);
    rb = ph.a[b + 1];
    ty = MG_I(b + 2);
}

// acc[i] += row i · x for this lane's units (gemv_q8's order); with UP, acc_up[i] from the
// up rows at `up` too.
template <int TY, bool UP>
__device__ __forceinline__ void mg_rows(const u8* w, const u8* up, long long rb, int nr,
                                        const i8* xq, const float* xd, int k, int lane, float* acc,
                                        float* acc_up) {
    typedef Fmt<TY> F;
    typedef Unit8<TY> U8;
    const int units = F::units(k), nb = k >> 5;
    for (int u = lane; u < units; u += 32) {
        const typename U8::X xv = U8::load_x(xq, xd, u);
#pragma unroll
        for (int i = 0; i < MG_MAX_ROWS; i++)
            if (i < nr) {
                acc[i] += U8::dot(F::load(w + i * rb, u, nb), u, xv);
                if (UP) acc_up[i] += U8::dot(F::load(up + i * rb, u, nb), u, xv);
            }
    }
}

template <bool UP>
__device__ __forceinline__ void mg_rows_any(int ty, const u8* w, const u8* up, long long rb,
                                            int nr, const i8* xq, const float* xd, int k,
                                            int lane, float* acc, float* acc_up) {
    switch (ty) {
    case T_Q4_K: mg_rows<T_Q4_K_W, UP>(w, up, rb, nr, xq, xd, k, lane, acc, acc_up); return;
    case T_Q6_K: mg_rows<T_Q6_K_W, UP>(w, up, rb, nr, xq, xd, k, lane, acc, acc_up); return;
    case T_Q8_0: mg_rows<T_Q8_0_W, UP>(w, up, rb, nr, xq, xd, k, lane, acc, acc_up); return;
    case T_Q4_0: mg_rows<T_Q4_0_W, UP>(w, up, rb, nr, xq, xd, k, lane, acc, acc_up); return;
    default: return;
    }
}

// Consumers: one GEMV phase. `c` counts the block's chunks over the whole kernel.
__device__ __forceinline__ void mg_gemv(const MgPhase& ph, int& c, int ring, const u8* slots,
                                        int slot_bytes, u32 full0, u32 empty0, const i8* sxq,
                                        const float* sxd, int flags) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i8* xq = ph.local_x ? sxq : MG_P(const i8*, 0);
    const float* xd = ph.local_x ? sxd : MG_P(const float*, 1);
    const int k = MG_I(3), gated = MG_I(7), act = MG_I(8);
    mg_chunks(ph, [&](int s, int r0, int nr) {
        const int slot = c % ring;
        if (c % MG_WARPS == warp) {
            mbar_wait(full0 + 8 * slot, (c / ring) & 1);
            const u8* base = slots + (size_t)slot * slot_bytes;
            const u8* w;
            long long rb;
            int ty;
            mg_seg(ph, s, w, rb, ty);
            float acc[MG_MAX_ROWS], acc_up[MG_MAX_ROWS];
#pragma unroll
            for (int i = 0; i < MG_MAX_ROWS; i++) acc[i] = acc_up[i] = 0.0f;
            if (flags & MG_NO_DOTS) {
                // measurement only: the weights stream, nothing is computed
            } else if (gated) {
                const long long rb1 = ph.a[17];
                const int ty1 = MG_I(18);
                const u8* up = base + (size_t)nr * rb;
                if (ty == ty1 && rb == rb1) {
                    mg_rows_any<true>(ty, base, up, rb, nr, xq, xd, k, lane, acc, acc_up);
                } else {
                    mg_rows_any<false>(ty, base, nullptr, rb, nr, xq, xd, k, lane, acc, acc_up);
                    mg_rows_any<false>(ty1, up, nullptr, rb1, nr, xq, xd, k, lane, acc_up,
                                       nullptr);
                }
            } else {
                mg_rows_any<false>(ty, base, nullptr, rb, nr, xq, xd, k, lane, acc, acc_up);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * slot);
            const int ob = 13 + 7 * s;  // out0 at a[13], out1 at a[20], out2 at a[26]
            float* out = MG_P(float*, s == 2 ? 26 : ob);
            const float* bias = MG_P(const float*, s == 2 ? 28 : ob + 2);
            gv_store_rows<MG_MAX_ROWS>(acc, acc_up, nr, r0, gated, act, MG_P(float*, 13), out,
                                       bias, lane);
        }
        c++;
    });
}

// The producer's lane 0: every GEMV phase's chunks of this block, in order.
__device__ __forceinline__ void mg_produce(const MgPhase* phases, int n_phases, int ring,
                                           u32 slots0, int slot_bytes, u32 full0, u32 empty0) {
    int c = 0;
    for (int p = 0; p < n_phases; p++) {
        const MgPhase& ph = phases[p];
        if (ph.kind != MG_GEMV) continue;
        const int gated = MG_I(7);
        mg_chunks(ph, [&](int s, int r0, int nr) {
            const int slot = c % ring;
            if (c >= ring) mbar_wait(empty0 + 8 * slot, ((c / ring) - 1) & 1);
            const u8* w;
            long long rb;
            int ty;
            mg_seg(ph, s, w, rb, ty);
            const u32 bytes = (u32)(nr * rb);
            const u32 up_bytes = gated ? (u32)(nr * ph.a[17]) : 0u;
            const u32 dst = slots0 + (u32)slot * (u32)slot_bytes;
            mbar_expect(full0 + 8 * slot, bytes + up_bytes);
            bulk_copy(dst, w + (size_t)r0 * rb, bytes, full0 + 8 * slot);
            if (gated)
                bulk_copy(dst + bytes, MG_P(const u8*, 16) + (size_t)r0 * ph.a[17], up_bytes,
                          full0 + 8 * slot);
            c++;
        });
    }
}

// rms_norm_q8 (kind MG_NORM: a = x, w, out, cols, eps, q, d, rows, src) or quantize_x_q8
// (MG_QUANT: a = x, k, q, d): spread over the grid, writing the kernel's global outputs,
// or (ph.local_x) all of it in every block into its shared copy, block 0 also writing the
// global outputs. MG_NORM with rows set reads row rows[0] of src (a gather_rows folded in;
// the gathered row is written to x as well).
__device__ __forceinline__ void mg_norm_quant(const MgPhase& ph, i8* sxq, float* sxd, float* red) {
    const bool norm = ph.kind == MG_NORM;
    const int cols = norm ? MG_I(3) : MG_I(1);
    const u32* rows = norm ? MG_P(const u32*, 7) : nullptr;
    const float* x = MG_P(const float*, 0);
    if (rows) x = MG_P(const float*, 8) + (size_t)rows[0] * cols;
    i8* q = norm ? MG_P(i8*, 5) : MG_P(i8*, 2);
    float* d = norm ? MG_P(float*, 6) : MG_P(float*, 3);
    const float* w = norm ? MG_P(const float*, 1) : nullptr;
    float* out = norm ? MG_P(float*, 2) : nullptr;
    float* gathered = rows ? MG_P(float*, 0) : nullptr;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float scale = 1.0f;
    if (norm) {
        // All loads first (one round of latency), then the sum.
        float ss = 0.0f;
#pragma unroll 8
        for (int j = 4 * threadIdx.x; j < cols; j += 4 * MG_CT) {
            const float4 v = *(const float4*)(x + j);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        ss = mg_sum(ss, red);
        scale = 1.0f / sqrtf(ss / (float)cols + MG_F(4));
    }
    // Each warp quantizes 32-value blocks, MG_QB of them at once (independent chains:
    // loads, the amax shuffles and the divisions of one block wait on each other). Local
    // (ph.local_x): every block all of them, into its shared copy; else the grid's warps
    // share them and write the global outputs only (a grid barrier follows).
    const bool local = ph.local_x;
    const int blocks = cols >> 5;
    const int first = local ? warp : blockIdx.x * MG_WARPS + warp;
    const int stride = local ? MG_WARPS : gridDim.x * MG_WARPS;
    const bool globals = !local || blockIdx.x == 0;
    for (int b0 = first; b0 < blocks; b0 += stride * MG_QB) {
        float v[MG_QB], amax[MG_QB], raw[MG_QB];
#pragma unroll
        for (int i = 0; i < MG_QB; i++) {
            const int b = b0 + i * stride, j = 32 * b + lane;
            raw[i] = b < blocks ? x[j] : 0.0f;
            v[i] = norm && b < blocks ? raw[i] * scale * w[j] : raw[i];
            amax[i] = fabsf(v[i]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int i = 0; i < MG_QB; i++)
                amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], o));
#pragma unroll
        for (int i = 0; i < MG_QB; i++) {
            const int b = b0 + i * stride, j = 32 * b + lane;
            if (b < blocks) {
                // round(v / step) as v times the block's reciprocal step (measured no
                // faster than a division per value; the rounding differs from
                // quantize_x_q8's only for quotients within an ulp of a half).
                const float step = amax[i] / 127.0f;
                const float inv = step > 0.0f ? 127.0f / amax[i] : 0.0f;
                const i8 qi = (i8)max(-127, min(127, __float2int_rn(v[i] * inv)));
                if (local) {
                    sxq[j] = qi;
                    if (lane == 0) sxd[b] = step;
                }
                if (globals) {
                    if (out) out[j] = v[i];
                    if (gathered) gathered[j] = raw[i];
                    q[j] = qi;
                    if (lane == 0) d[b] = step;
                }
            }
        }
    }
    mg_sync();
}

// Key splits of a single-token attention over `span` keys: `keys` keys a split, at most
// max_splits (the host sizes the partials for it). The merge computes the same.
__device__ __forceinline__ int mg_splits(int span, int max_splits, int keys) {
    return max(1, min(max_splits, (span + keys - 1) / keys));
}
// Keys per split: one round of loads of each warp task (MG_KA keys' rows in flight).
#define MG_KA(G, PL) ((G) * (PL) <= 16 ? 4 : 2)

// MG_ATTN: RoPE of the token's query and key heads, its key and value into the cache, and
// the partial attention of (kv head, key range) per warp task, written as attention_split's
// partials (unnormalized output, max, sum). a = q, k, v, kc, vc, positions, seq_of,
// table_off, tables, block_size, n_head, n_head_kv, head_dim, scale, window, n_rot, neox,
// theta_scale, freq_scale, ext_factor, mscale, corr_lo, corr_hi, freq_factors, part,
// max_splits. PL: head dims per lane; G: query heads per kv head.
template <int PL, int G>
__device__ __forceinline__ void mg_attn(const MgPhase& ph, int gw, int nw) {
    const int lane = threadIdx.x & 31;
    const int pos = (int)MG_P(const u32*, 5)[0];
    const u32* table = MG_P(const u32*, 8) + MG_P(const u32*, 7)[MG_P(const u32*, 6)[0]];
    const int block_size = MG_I(9), n_head = MG_I(10), n_head_kv = MG_I(11);
    const int hd = PL * 32, window = MG_I(14), n_rot = MG_I(15), neox = MG_I(16);
    const float scale = MG_F(13);
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0, span = pos + 1 - lo;
    constexpr int KA = MG_KA(G, PL);
    const int max_splits = MG_I(25), splits = mg_splits(span, max_splits, KA);
    const int chunk = (span + splits - 1) / splits;
    const int kv_dim = n_head_kv * hd;
    const int d0 = PL * lane;
    // This lane's rotation factors (the same for every head): pairs (d, d + 1) or, with
    // neox, (d, d + n_rot / 2), the partner lane's value fetched by a shuffle.
    float rc[PL], rs[PL];
    int partner = lane;
    const int half = n_rot / 2;
#pragma unroll
    for (int i = 0; i < PL; i++) {
        const int d = d0 + i;
        const int p = neox ? (d < half ? d : d - half) : d / 2;
        rc[i] = 1.0f;
        rs[i] = 0.0f;
        if (d < n_rot)
            rope_cs(p, (float)pos, n_rot, MG_F(17), MG_F(18), MG_F(19), MG_F(20), MG_F(21),
                    MG_F(22), MG_P(const float*, 23), rc[i], rs[i]);
    }
    if (neox && d0 < n_rot) partner = d0 < half ? lane + half / PL : lane - half / PL;
    // Rotated values of this lane's dims of a head row r.
    auto rope_row = [&](const float* r, float* out) {
        float v[PL];
#pragma unroll
        for (int i = 0; i < PL; i++) v[i] = r[d0 + i];
#pragma unroll
        for (int i = 0; i < PL; i++) {
            const float o = __shfl_sync(0xffffffffu, v[i], partner);
            const int d = d0 + i;
            if (d >= n_rot) {
                out[i] = v[i];
            } else if (neox) {
                out[i] = d < half ? v[i] * rc[i] - o * rs[i] : o * rs[i] + v[i] * rc[i];
            } else if ((i & 1) == 0) {
                out[i] = v[i] * rc[i] - v[i + 1] * rs[i];
            } else {
                out[i] = v[i - 1] * rs[i] + v[i] * rc[i];
            }
        }
    };
    const float* qb = MG_P(const float*, 0);
    const float* kb = MG_P(const float*, 1);
    const float* vb = MG_P(const float*, 2);
    u16* kc = MG_P(u16*, 3);
    u16* vc = MG_P(u16*, 4);
    float* part = MG_P(float*, 24);
    for (int t = gw; t < n_head_kv * splits; t += nw) {
        const int g = t / splits, s = t % splits;
        const int b = lo + s * chunk, e = min(pos + 1, b + chunk);
        float q[G][PL];
#pragma unroll
        for (int h = 0; h < G; h++) rope_row(qb + (size_t)(g * G + h) * hd, q[h]);
        // The token's own key and value, as the cache holds them (f16).
        float kr[PL];
        rope_row(kb + (size_t)g * hd, kr);
        u16 kh[PL], vh[PL];
#pragma unroll
        for (int i = 0; i < PL; i++) {
            kh[i] = f2h(kr[i]);
            vh[i] = f2h(vb[(size_t)g * hd + d0 + i]);
        }
        if ((pos - lo) / chunk == s) {
            const size_t at = kv_slot(table, block_size, pos) * kv_dim + (size_t)g * hd + d0;
#pragma unroll
            for (int i = 0; i < PL; i++) {
                kc[at + i] = kh[i];
                vc[at + i] = vh[i];
            }
        }
        float m[G], l[G], acc[G][PL];
#pragma unroll
        for (int h = 0; h < G; h++) {
            m[h] = NEG_INF;
            l[h] = 0.0f;
#pragma unroll
            for (int i = 0; i < PL; i++) acc[h][i] = 0.0f;
        }
        for (int j0 = b; j0 < e; j0 += KA) {
            float kf[KA][PL], vf[KA][PL];
#pragma unroll
            for (int jj = 0; jj < KA; jj++) {
                const int j = j0 + jj;
#pragma unroll
                for (int i = 0; i < PL; i++) kf[jj][i] = vf[jj][i] = 0.0f;
                if (j < e) {
                    if (j == pos) {
#pragma unroll
                        for (int i = 0; i < PL; i++) {
                            kf[jj][i] = h2f(kh[i]);
                            vf[jj][i] = h2f(vh[i]);
                        }
                    } else {
                        const size_t at =
                            kv_slot(table, block_size, j) * kv_dim + (size_t)g * hd + d0;
#pragma unroll
                        for (int i = 0; i < PL; i++) {
                            kf[jj][i] = h2f(kc[at + i]);
                            vf[jj][i] = h2f(vc[at + i]);
                        }
                    }
                }
            }
#pragma unroll
            for (int jj = 0; jj < KA; jj++) {
                if (j0 + jj >= e) break;
#pragma unroll
                for (int h = 0; h < G; h++) {
                    float dot = 0.0f;
#pragma unroll
                    for (int i = 0; i < PL; i++) dot += q[h][i] * kf[jj][i];
                    const float score = warp_sum(dot) * scale;
                    const float m_new = fmaxf(m[h], score);
                    const float corr = expf(m[h] - m_new);
                    const float p = expf(score - m_new);
                    l[h] = l[h] * corr + p;
#pragma unroll
                    for (int i = 0; i < PL; i++) acc[h][i] = acc[h][i] * corr + p * vf[jj][i];
                    m[h] = m_new;
                }
            }
        }
#pragma unroll
        for (int h = 0; h < G; h++) {
            float* o = part + ((size_t)(g * G + h) * max_splits + s) * (hd + 2);
#pragma unroll
            for (int i = 0; i < PL; i++) o[d0 + i] = acc[h][i];
            if (lane == 0) {
                o[hd] = l[h] > 0.0f ? m[h] : NEG_INF;
                o[hd + 1] = l[h];
            }
        }
    }
    (void)n_head;
}

// MG_COMBINE: one head per block: its warps merge every MG_WARPS-th partial each, then
// warp 0 merges the warps' (through `cmb`: MG_WARPS × (head_dim + 2) floats) and writes the
// output and its 8-bit quantization (quantize_x_q8's). a = part, out, n_head, head_dim, q8,
// q8d, max_splits, positions, window, n_head_kv.
template <int PL>
__device__ __forceinline__ void mg_combine(const MgPhase& ph, float* cmb) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, hd = PL * 32, d0 = PL * lane;
    const float* part = MG_P(const float*, 0);
    float* out = MG_P(float*, 1);
    i8* q8 = MG_P(i8*, 4);
    float* q8d = MG_P(float*, 5);
    const int n_head = MG_I(2), max_splits = MG_I(6), window = MG_I(8);
    const int pos = (int)MG_P(const u32*, 7)[0];
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int group = n_head / MG_I(9);
    const int splits = mg_splits(pos + 1 - lo, max_splits, MG_KA(group, PL));
    for (int h = blockIdx.x; h < n_head; h += gridDim.x) {
        const float* p = part + (size_t)h * max_splits * (hd + 2);
        float m = NEG_INF, l = 0.0f, y[PL];
#pragma unroll
        for (int i = 0; i < PL; i++) y[i] = 0.0f;
#pragma unroll 2
        for (int s = warp; s < splits; s += MG_WARPS) {
            const float* ps = p + (size_t)s * (hd + 2);
            const float sum = ps[hd + 1], mx = ps[hd];
            float v[PL];
#pragma unroll
            for (int i = 0; i < PL; i++) v[i] = ps[d0 + i];
            if (sum > 0.0f) {
                const float m_new = fmaxf(m, mx);
                const float c_old = expf(m - m_new), c_new = expf(mx - m_new);
                l = l * c_old + sum * c_new;
#pragma unroll
                for (int i = 0; i < PL; i++) y[i] = y[i] * c_old + v[i] * c_new;
                m = m_new;
            }
        }
        float* mine = cmb + warp * (hd + 2);
#pragma unroll
        for (int i = 0; i < PL; i++) mine[d0 + i] = y[i];
        if (lane == 0) {
            mine[hd] = m;
            mine[hd + 1] = l;
        }
        mg_sync();
        if (warp == 0) {
            float big = NEG_INF;
            for (int w = 0; w < MG_WARPS; w++)
                if (cmb[w * (hd + 2) + hd + 1] > 0.0f) big = fmaxf(big, cmb[w * (hd + 2) + hd]);
            float total = 0.0f, o[PL];
#pragma unroll
            for (int i = 0; i < PL; i++) o[i] = 0.0f;
            for (int w = 0; w < MG_WARPS; w++) {
                const float* cw = cmb + w * (hd + 2);
                if (cw[hd + 1] > 0.0f) {
                    const float wt = expf(cw[hd] - big);
                    total += cw[hd + 1] * wt;
#pragma unroll
                    for (int i = 0; i < PL; i++) o[i] += cw[d0 + i] * wt;
                }
            }
            // 32-value blocks of the row are held by 32 / PL consecutive lanes.
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < PL; i++) {
                o[i] = total > 0.0f ? o[i] / total : 0.0f;
                amax = fmaxf(amax, fabsf(o[i]));
            }
            for (int x = 1; x < 32 / PL; x <<= 1)
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, x));
            const float step = amax / 127.0f;
            const size_t at = (size_t)h * hd + d0;
#pragma unroll
            for (int i = 0; i < PL; i++) {
                out[at + i] = o[i];
                q8[at + i] = (i8)q8_round(o[i], step);
            }
            if ((d0 & 31) == 0) q8d[at >> 5] = step;
        }
        mg_sync();
    }
}

template <int PL>
__device__ __forceinline__ void mg_attn_group(const MgPhase& ph, int gw, int nw) {
    switch (MG_I(10) / MG_I(11)) {
    case 1: mg_attn<PL, 1>(ph, gw, nw); return;
    case 2: mg_attn<PL, 2>(ph, gw, nw); return;
    case 3: mg_attn<PL, 3>(ph, gw, nw); return;
    case 4: mg_attn<PL, 4>(ph, gw, nw); return;
    case 5: mg_attn<PL, 5>(ph, gw, nw); return;
    case 6: mg_attn<PL, 6>(ph, gw, nw); return;
    case 7: mg_attn<PL, 7>(ph, gw, nw); return;
    case 8: mg_attn<PL, 8>(ph, gw, nw); return;
    default: return;
    }
}

// ring (at most MG_SLOTS, a multiple of MG_WARPS): slots in use; chunk c goes to slot
// c % ring and warp c % MG_WARPS, so every slot has one consumer warp, which waits on it
// in order (a warp never runs a ring ahead of its slot's phases). Shared memory: MG_SLOTS slots of slot_bytes, the
// activations (x_bytes int8 values, their
// x_bytes / 32 steps), the slots' full and empty barriers, 32 floats for sums, then
// MG_WARPS × 130 floats for the attention merge.
// counters: one per grid barrier plus one (the exit count); zero at launch, and zero again
// when the last block leaves.
extern "C" __global__ void __launch_bounds__(MG_THREADS, 1)
mega(const MgPhase* phases, int n_phases, u32* counters, int slot_bytes, int x_bytes, int ring,
     int flags, unsigned long long* times) {
    extern __shared__ __align__(128) u8 mg_smem[];
    u8* slots = mg_smem;
    i8* sxq = (i8*)(mg_smem + MG_SLOTS * slot_bytes);
    float* sxd = (float*)(mg_smem + MG_SLOTS * slot_bytes + x_bytes);
    u8* tail = mg_smem + MG_SLOTS * slot_bytes + x_bytes + x_bytes / 8;
    const u32 full0 = smem_u32(tail), empty0 = full0 + 8 * MG_SLOTS;
    float* red = (float*)(tail + 16 * MG_SLOTS);
    float* cmb = red + 32;  // MG_WARPS * (128 + 2) floats
    if (threadIdx.x == 0) {
        for (int i = 0; i < MG_SLOTS; i++) {
            mbar_init(full0 + 8 * i, 1);
            mbar_init(empty0 + 8 * i, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x >= MG_CT) {
        // The producer: weights only, so it need not wait for the previous kernel.
        if (threadIdx.x == MG_CT)
            mg_produce(phases, n_phases, ring, smem_u32(slots), slot_bytes, full0, empty0);
        return;
    }
    pdl_enter();
    const int gw = blockIdx.x * MG_WARPS + (threadIdx.x >> 5), nw = gridDim.x * MG_WARPS;
    int c = 0, bar = 0;
    // Profiling (times set): block 0's clock at the start, then after each phase's work and
// after its barrier.
    const bool timing = times && blockIdx.x == 0 && threadIdx.x == 0;
    if (timing) times[0] = globaltimer();
    for (int p = 0; p < n_phases; p++) {
        const MgPhase& ph = phases[p];
        switch (ph.kind) {
        case MG_NORM:
        case MG_QUANT: mg_norm_quant(ph, sxq, sxd, red); break;
        case MG_GEMV:
            mg_gemv(ph, c, ring, slots, slot_bytes, full0, empty0, sxq, sxd, flags);
            break;
        case MG_ATTN:
            if (MG_I(12) == 64) mg_attn_group<2>(ph, gw, nw);
            else mg_attn_group<4>(ph, gw, nw);
            break;
        case MG_COMBINE:
            if (MG_I(3) == 64) mg_combine<2>(ph, cmb);
            else mg_combine<4>(ph, cmb);
            break;
        default: break;
        }
        if (timing) times[2 * p + 1] = globaltimer();
        if (ph.barrier) mg_grid_sync(counters + bar++);
        if (timing) times[2 * p + 2] = globaltimer();
    }
    mg_sync();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(counters + bar, 1u) == gridDim.x - 1) {
            // Every block has passed every barrier: ready for the next launch.
            for (int i = 0; i <= bar; i++) counters[i] = 0;
            __threadfence();
        }
    }
}
