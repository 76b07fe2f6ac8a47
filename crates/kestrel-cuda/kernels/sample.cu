// Sampling on the device: kestrel_model::sampling's definition (read its module docs first),
// one block of SAMPLE_THREADS per logit row; only the token ids go back to the host.
//
// No sort: every filter is a threshold on an order-preserving key of the logit plus, for
// ties at the threshold, the last id kept in id order. top-k's threshold is a radix select
// (12-, 12- and 8-bit digits: three passes over the row, which sits in L2); top-p's is a
// bisection over the key, over the top-k survivors gathered in shared memory when there are
// at most SAMPLE_GATHER of them, else over the row; the draw is one ordered scan. A row's
// settings are SAMPLE_WORDS u32 words (packed by CudaBackend::sample_rows), then every
// row's (token id, count) penalty pairs. A row with a token mask (a grammar's allowed
// tokens, one bit a token) bans every other token first: a greedy row reads the row through
// the mask, any other writes -inf over the banned logits.

#define SAMPLE_THREADS 1024
#define SAMPLE_WORDS 12
#define SAMPLE_NONE 0xffffffffu
// Most top-k survivors top-p works on in shared memory.
#define SAMPLE_GATHER 2048

// Order-preserving key of a logit: NaN ranks as -inf and -0 as +0 (they tie on the host).
__device__ __forceinline__ u32 sample_key(float l) {
    if (l != l) l = NEG_INF;
    if (l == 0.0f) l = 0.0f;
    const u32 b = __float_as_uint(l);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float sample_key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// NaN logits are impossible tokens: ranked and weighted as -inf.
__device__ __forceinline__ float sample_clean(float l) { return l != l ? NEG_INF : l; }

// Calls f(i, logit_i) for every logit of the row, the block's threads striding over it with
// 16-byte loads, four in flight a thread: one 4-byte load at a time left a pass over a
// 128K-word row (in L2) latency-bound at ~50 us.
template <class F>
__device__ __forceinline__ void for_each_logit(const float* row, int cols, F f) {
    if ((cols & 3) != 0) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) f(i, row[i]);
        return;
    }
    const float4* r4 = (const float4*)row;
    const int n4 = cols >> 2, step = blockDim.x;
    int j = threadIdx.x;
    for (; j + 3 * step < n4; j += 4 * step) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = r4[j + u * step];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = 4 * (j + u * step);
            f(i, v[u].x);
            f(i + 1, v[u].y);
            f(i + 2, v[u].z);
            f(i + 3, v[u].w);
        }
    }
    for (; j < n4; j += step) {
        const float4 v = r4[j];
        f(4 * j, v.x);
        f(4 * j + 1, v.y);
        f(4 * j + 2, v.z);
        f(4 * j + 3, v.w);
    }
}

// Σ over the row of f(i, key_i, logit_i) (NaN logits passed as -inf), summed by the block.
template <class F>
__device__ double row_sum(const float* row, int cols, F f) {
    double s = 0.0;
    for_each_logit(row, cols, [&](int i, float l) {
        l = sample_clean(l);
        s += f((u32)i, sample_key(l), l);
    });
    return block_sum(s);
}

// The key of the k-th largest logit (1 <= k <= cols; NaN as -inf), digit by digit from the
// top (12, 12, then 8 bits): each pass counts, per digit, the keys that share the digits
// found so far. `above` gets the number of keys above it, `ties` the number equal to it.
__device__ u32 radix_kth(const float* row, int cols, u32 k, u32& above, u32& ties) {
    __shared__ u32 hist[4096];
    __shared__ u32 found[3];  // digit, count above it within the prefix, its count
    const int lane = threadIdx.x & 31;
    u32 prefix = 0, acc = 0;
    for (int pass = 0; pass < 3; pass++) {
        const int shift = pass == 0 ? 20 : (pass == 1 ? 8 : 0);
        const int bits = pass == 2 ? 8 : 12;
        const u32 bins = 1u << bits, top = (u32)(shift + bits);
        for (u32 b = threadIdx.x; b < bins; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for_each_logit(row, cols, [&](int, float l) {
            const u32 key = sample_key(sample_clean(l));
            if (top == 32 || (key >> top) == (prefix >> top)) {
                // One atomic per distinct digit of the warp: logits crowd into few digits.
                const u32 d = (key >> shift) & (bins - 1);
                const u32 same = __match_any_sync(__activemask(), d);
                if (lane == __ffs(same) - 1) atomicAdd(&hist[d], (u32)__popc(same));
            }
        });
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l sums bins [l·per, (l+1)·per); the highest lane whose suffix reaches
            // `need` holds the digit, found by walking its bins down.
            const u32 per = bins >> 5, need = k - acc;
            u32 s = 0;
            for (u32 b = lane * per; b < (lane + 1) * per; b++) s += hist[b];
            u32 c = s;
            for (int o = 1; o < 32; o <<= 1) {
                const u32 t = __shfl_down_sync(0xffffffffu, c, o);
                if (lane + o < 32) c += t;
            }
            const u32 reach = __ballot_sync(0xffffffffu, c >= need);
            if (lane == 31 - __clz(reach)) {
                u32 run = c - s;
                for (u32 b = (lane + 1) * per; b-- > lane * per;) {
                    if (run + hist[b] >= need) {
                        found[0] = b;
                        found[1] = run;
                        found[2] = hist[b];
                        break;
                    }
                    run += hist[b];
                }
            }
        }
        __syncthreads();
        prefix |= found[0] << shift;
        acc += found[1];
        ties = found[2];
        __syncthreads();
    }
    above = acc;
    return prefix;
}

// The first index i < n at which target < Σ_{j <= i} weight(j) (weights >= 0, in index
// order), or n when the sum never exceeds target. Each warp owns one contiguous range: the
// warp whose range holds the crossing walks it 32 indices at a time. All threads call.
template <class F>
__device__ u32 find_in_order(u32 n, double target, F weight) {
    __shared__ double warp_total[32];
    __shared__ u32 found;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const u32 span = ((n + n_warps - 1) / n_warps + 31) & ~31u;
    const u32 lo = min(n, warp * span), hi = min(n, lo + span);
    double s = 0.0;
#pragma unroll 8
    for (u32 i = lo + lane; i < hi; i += 32) s += weight(i);
    s = warp_sum(s);
    if (lane == 0) warp_total[warp] = s;
    if (threadIdx.x == 0) found = n;
    __syncthreads();
    double before = 0.0;
    for (u32 w = 0; w < warp; w++) before += warp_total[w];
    if (before <= target && target < before + s) {
        double cumulative = before;
        u32 last = SAMPLE_NONE;  // the last index of positive weight walked so far
        bool hit = false;
        for (u32 base = lo; base < hi && !hit; base += 32) {
            const u32 i = base + lane;
            const double w = i < hi ? weight(i) : 0.0;
            double c = w;  // inclusive scan over the lanes
            for (int o = 1; o < 32; o <<= 1) {
                const double t = shfl_f64(c, [&](u32 h) { return __shfl_up_sync(0xffffffffu, h, o); });
                if ((int)lane >= o) c += t;
            }
            const u32 crossing = __ballot_sync(0xffffffffu, target < cumulative + c);
            if (crossing) {
                hit = true;
                if (lane == (u32)(__ffs(crossing) - 1)) found = i;
            } else {
                const u32 positive = __ballot_sync(0xffffffffu, w > 0.0);
                if (positive) last = base + 31 - __clz(positive);
                cumulative += shfl_f64(c, [](u32 h) { return __shfl_sync(0xffffffffu, h, 31); });
            }
        }
        // Rounding (the walk sums in another order than the range total): the range's
        // last possible index.
        if (!hit && lane == 0 && last != SAMPLE_NONE) found = last;
    }
    __syncthreads();
    return found;
}

// The largest key t in [lo, hi] with measure(t) >= target, given measure(lo) >= target and
// measure non-increasing.
template <class M>
__device__ u32 bisect_key(u32 lo, u32 hi, double target, M measure) {
    while (lo < hi) {
        const u32 mid = lo + (u32)(((unsigned long long)hi - lo + 1) / 2);
        if (measure(mid) >= target) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// x: n rows of `cols` logits (penalties and masks are applied in place); params:
// SAMPLE_WORDS words a row — 0 inv_temperature (0: greedy), 1 top_k (0: off), 2 top_p,
// 3 ln(min_p) (-inf: off), 4 repeat / 5 presence / 6 frequency penalty, 7 first penalty
// pair, 8 pairs, 9-10 the draw u (f64, low word first), 11 the row's mask (its index in
// `masks`, SAMPLE_NONE: none) — then the pairs; masks: `mask_words` words each (bit j % 32
// of word j / 32: token j allowed; null when no row has one); out: one token id a row.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(float* x, const u32* params, u32* out, int cols, const u32* masks, int mask_words) {
    pdl_enter();
    __shared__ float best_value[32];
    __shared__ u32 best_index[32];
    __shared__ u32 last_positive;
    float* row = x + (size_t)blockIdx.x * cols;
    const u32* p = params + (size_t)blockIdx.x * SAMPLE_WORDS;
    const float inv_t = __uint_as_float(p[0]);
    const u32 top_k = p[1];
    const float top_p = __uint_as_float(p[2]);
    const float min_p_log = __uint_as_float(p[3]);
    const float repeat = __uint_as_float(p[4]), presence = __uint_as_float(p[5]),
                frequency = __uint_as_float(p[6]);
    const u32* pairs = params + (size_t)gridDim.x * SAMPLE_WORDS + 2 * (size_t)p[7];
    double u;
    asm("mov.b64 %0, {%1, %2};" : "=d"(u) : "r"(p[9]), "r"(p[10]));
    const u32* mask =
        masks != nullptr && p[11] != SAMPLE_NONE ? masks + (size_t)p[11] * mask_words : nullptr;
    auto banned = [&](int j) { return mask != nullptr && !((mask[j >> 5] >> (j & 31)) & 1u); };

    // 0. The token mask, before the penalties as on the host (a banned logit stays -inf
    // under them). A greedy row only reads through it (step 2).
    if (mask != nullptr && inv_t != 0.0f) {
        for (int j = threadIdx.x; j < cols; j += blockDim.x) {
            if (banned(j)) row[j] = NEG_INF;
        }
        __syncthreads();
    }

    // 1. Penalties (each id once per row, so no two threads touch one logit). Explicit
    // roundings: the host computes these without fused multiply-adds.
    for (u32 j = threadIdx.x; j < p[8]; j += blockDim.x) {
        const u32 id = pairs[2 * j], count = pairs[2 * j + 1];
        if (id < (u32)cols) {
            float l = row[id];
            l = l <= 0.0f ? __fmul_rn(l, repeat) : __fdiv_rn(l, repeat);
            row[id] = __fsub_rn(l, __fadd_rn(__fmul_rn((float)count, frequency), presence));
        }
    }
    __syncthreads();

    // 2. The largest logit and its first index (NaN never wins): greedy rows, and rows
    // whose largest logit is ±inf, take that index.
    float v = NEG_INF;
    u32 idx = SAMPLE_NONE;
    for_each_logit(row, cols, [&](int j, float y) {
        if (banned(j)) y = NEG_INF;
        // Each thread sees its indices in increasing order: an equal later value never wins.
        if (y == y && (idx == SAMPLE_NONE || y > v || (y == v && (u32)j < idx))) {
            v = y;
            idx = (u32)j;
        }
    });
    block_argmax(v, idx, best_value, best_index);
    const float m = v;
    if (inv_t == 0.0f || !(m > NEG_INF && m < -NEG_INF)) {
        if (threadIdx.x == 0) out[blockIdx.x] = idx == SAMPLE_NONE ? 0u : idx;
        return;
    }
    const u32 top_key = sample_key(m);

    // 3. top-k: A(i) = key > a_key, or key == a_key and i <= a_cut.
    u32 a_key = 0, a_cut = SAMPLE_NONE;
    const bool top_k_on = top_k > 0 && top_k < (u32)cols;
    if (top_k_on) {
        u32 above, ties;
        a_key = radix_kth(row, cols, top_k, above, ties);
        const u32 need = top_k - above;
        if (need < ties) {
            a_cut = find_in_order((u32)cols, need - 0.5, [&](u32 i) {
                return sample_key(sample_clean(row[i])) == a_key ? 1.0 : 0.0;
            });
        }
    }
    auto in_a = [&](u32 i, u32 k) { return k > a_key || (k == a_key && i <= a_cut); };

    // 4. min-p: B(i) = l >= m + ln(min_p).
    const float floor = __fadd_rn(m, min_p_log);

    // 5. top-p over A and B: C(i) = key > c_key, or key == c_key and i <= c_cut.
    u32 c_key = 0, c_cut = SAMPLE_NONE;
    if (top_p < 1.0f) {
        auto mass = [&](float l) { return (double)expf(__fsub_rn(l, m)); };
        // With top-k on and small, its survivors that pass min-p are gathered into shared
        // memory (in no order) while A's mass is summed: the bisection then reads only them.
        __shared__ float gathered[SAMPLE_GATHER];
        __shared__ u32 n_gathered;
        const bool gather = top_k_on && top_k <= SAMPLE_GATHER;
        double total;
        if (gather) {
            if (threadIdx.x == 0) n_gathered = 0;
            __syncthreads();
            double s = 0.0;
            for_each_logit(row, cols, [&](int i, float l) {
                l = sample_clean(l);
                if (in_a((u32)i, sample_key(l))) {
                    s += mass(l);
                    if (l >= floor) {
                        const u32 slot = atomicAdd(&n_gathered, 1u);
                        if (slot < SAMPLE_GATHER) gathered[slot] = l;
                    }
                }
            });
            total = block_sum(s);  // its barriers also publish `gathered`
        } else {
            total = row_sum(row, cols, [&](u32 i, u32 k, float l) {
                return in_a(i, k) ? mass(l) : 0.0;
            });
        }
        const u32 n_g = gather ? min(n_gathered, (u32)SAMPLE_GATHER) : 0;
        // Σ over the survivors of A and B of their mass where key >= t, or (ties) of 1 where
        // key == t. (One non-generic lambda: NVRTC 13.0 takes a generic lambda's call
        // operator for a host function.)
        auto over_kept = [&](u32 t, bool ties) {
            auto f = [&](u32 k, float l) {
                return ties ? (k == t ? 1.0 : 0.0) : (k >= t ? mass(l) : 0.0);
            };
            if (gather) {
                double s = 0.0;
                for (u32 j = threadIdx.x; j < n_g; j += blockDim.x) {
                    const float l = gathered[j];
                    s += f(sample_key(l), l);
                }
                return block_sum(s);
            }
            return row_sum(row, cols, [&](u32 i, u32 k, float l) {
                return in_a(i, k) && l >= floor ? f(k, l) : 0.0;
            });
        };
        auto kept_from = [&](u32 t) { return over_kept(t, false); };
        const double target = (double)top_p * total;
        // The mass of A and B may stay under the target (min-p removed it, or rounding):
        // then top-p keeps all of them.
        if (kept_from(0) >= target) {
            c_key = bisect_key(0, top_key, target, kept_from);
            const double above = c_key < 0xffffffffu ? kept_from(c_key + 1) : 0.0;
            const double ties = over_kept(c_key, true);
            const double each = mass(sample_key_value(c_key));
            const double need = fmax(1.0, ceil((target - above) / each));
            if (need < ties) {
                c_cut = find_in_order((u32)cols, need - 0.5, [&](u32 i) {
                    const float l = sample_clean(row[i]);
                    const u32 k = sample_key(l);
                    return k == c_key && in_a(i, k) && l >= floor ? 1.0 : 0.0;
                });
            }
        }
    }

    // 6. The draw, in id order, over the survivors of A, B and C.
    auto weight = [&](u32 i, float l) {
        l = sample_clean(l);
        const u32 k = sample_key(l);
        const bool kept = in_a(i, k) && l >= floor && (k > c_key || (k == c_key && i <= c_cut));
        return kept ? (double)expf(__fmul_rn(__fsub_rn(l, m), inv_t)) : 0.0;
    };
    double total = 0.0;
    for_each_logit(row, cols, [&](int i, float l) { total += weight((u32)i, l); });
    total = block_sum(total);
    const u32 id = find_in_order((u32)cols, u * total, [&](u32 i) { return weight(i, row[i]); });
    if (id < (u32)cols) {
        if (threadIdx.x == 0) out[blockIdx.x] = id;
        return;
    }
    // Rounding left the sum just under the target: the last possible token.
    if (threadIdx.x == 0) last_positive = 0;
    __syncthreads();
    u32 last = 0;
    for_each_logit(row, cols, [&](int i, float l) {
        if (weight((u32)i, l) > 0.0) last = max(last, (u32)i);
    });
    atomicMax(&last_positive, last);
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = last_positive;
}
