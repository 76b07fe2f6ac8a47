// Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5; `DeltaNetConfig` in kestrel-model
// defines it, crates/kestrel-cpu/src/delta.rs is the CPU's form): the causal convolution
// with its state, then the L2 norm of the q and k heads with the recurrent update of each
// v head's state token by token, the gated RMS norm of the output; and the small element-wise ops
// of gated attention (the query / gate split, the sigmoid gate of its output).
//
// Each sequence's state lives in a slot of one device buffer (src/delta.rs): slot
// `slot_of_block[first cache block of the sequence]`, found from the step's block tables,
// so a step's launches are the same whichever sequences it holds (graph replay). A
// sequence whose first token in the step is at position 0 starts from a zero state.

#define DN_MAX_TAPS 8
// Lanes per state row in delta_scan, and the most columns (head_k_dim) a lane holds / P.
#define DN_P 4
#define DN_C 32

// The state slot of the step's sequence s.
__device__ __forceinline__ size_t dn_slot(int s, const u32* table_off, const u32* tables,
                                          const u32* slot_of_block) {
    return (size_t)slot_of_block[tables[table_off[s]]];
}

__device__ __forceinline__ float dn_silu(float x) { return x / (1.0f + expf(-x)); }

// The run [t0, t1) of the step's tokens that belong to sequence s (the host checks that a
// sequence's tokens are consecutive), found by the whole block; every thread gets it.
__device__ __forceinline__ void dn_run(const u32* seq_of, int n, int s, int& t0, int& t1) {
    __shared__ int run[2];
    if (threadIdx.x == 0) run[0] = run[1] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        if ((int)seq_of[i] != s) continue;
        if (i == 0 || (int)seq_of[i - 1] != s) run[0] = i;
        if (i == n - 1 || (int)seq_of[i + 1] != s) run[1] = i + 1;
    }
    __syncthreads();
    t0 = run[0];
    t1 = run[1];
}

// Tokens of a sequence each delta_conv thread takes (at least DN_MAX_TAPS - 1, so that only
// a sequence's first chunk reads its conv state).
#define DN_CONV_CHUNK 16

// Causal depthwise convolution of `taps` taps over each channel, then SiLU: out[t][c] for
// chunk blockIdx.y (DN_CONV_CHUNK tokens) of the step's tokens of sequence blockIdx.z,
// reading the `taps - 1` inputs before the step from the sequence's conv state
// ([conv_dim × (taps - 1)] at `conv_off` in its slot; zeros at position 0); the first
// chunk's thread leaves there the sequence's last inputs. w: [conv_dim × taps] (tap taps-1
// multiplies the current input). Grid (ceil(conv_dim / blockDim.x), chunks, sequences).
extern "C" __global__ void delta_conv(const float* mix, int mix_cols, const float* w, int conv_dim,
                                      int taps, float* states, long long slot_len,
                                      long long conv_off, const u32* positions,
                                      const u32* seq_of, const u32* table_off,
                                      const u32* tables, const u32* slot_of_block, int n,
                                      float* out) {
    pdl_enter();
    const int s = blockIdx.z;
    int t0, t1;
    dn_run(seq_of, n, s, t0, t1);
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int a = t0 + blockIdx.y * DN_CONV_CHUNK;
    if (c >= conv_dim || a >= t1) return;
    const int b = min(t1, a + DN_CONV_CHUNK);
    const int keep = taps - 1;
    const bool fresh = positions[t0] == 0;
    float* hist_g = states + dn_slot(s, table_off, tables, slot_of_block) * slot_len + conv_off +
                    (size_t)c * keep;
    const float* wc = w + (size_t)c * taps;
    float wt[DN_MAX_TAPS];
#pragma unroll
    for (int i = 0; i < DN_MAX_TAPS; i++) wt[i] = i < taps ? wc[i] : 0.0f;
    // The input at token u of the step (u < t0: from the state, or zero at position 0).
    auto input = [&](int u) -> float {
        if (u >= t0) return mix[(size_t)u * mix_cols + c];
        return fresh ? 0.0f : hist_g[keep - (t0 - u)];
    };
    // The window before token a, oldest first.
    float hist[DN_MAX_TAPS - 1];
#pragma unroll
    for (int i = 0; i < DN_MAX_TAPS - 1; i++) hist[i] = i < keep ? input(a - keep + i) : 0.0f;
    // The sequence's new state (its last `keep` inputs), read before anything is written.
    float next[DN_MAX_TAPS - 1];
    const bool first = blockIdx.y == 0;
    if (first) {
#pragma unroll
        for (int i = 0; i < DN_MAX_TAPS - 1; i++) next[i] = i < keep ? input(t1 - keep + i) : 0.0f;
    }
    float last = 0.0f;
#pragma unroll
    for (int i = 0; i < DN_MAX_TAPS; i++)
        if (i == keep) last = wt[i];
    for (int t = a; t < b; t++) {
        const float x = mix[(size_t)t * mix_cols + c];
        // The CPU's order: the history's taps, then the current input's.
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < DN_MAX_TAPS - 1; i++)
            if (i < keep) sum += hist[i] * wt[i];
        sum += x * last;
        // Slide the window by one.
#pragma unroll
        for (int i = 0; i < DN_MAX_TAPS - 2; i++)
            if (i + 1 < keep) hist[i] = hist[i + 1];
#pragma unroll
        for (int i = 0; i < DN_MAX_TAPS - 1; i++)
            if (i == keep - 1) hist[i] = x;
        out[(size_t)t * conv_dim + c] = dn_silu(sum);
    }
    if (first) {
#pragma unroll
        for (int i = 0; i < DN_MAX_TAPS - 1; i++)
            if (i < keep) hist_g[i] = next[i];
    }
}

// Tokens delta_scan stages in shared memory at a time.
#define DN_STAGE 16
// State rows (value dimensions) of a v head each delta_scan block holds: a head's rows are
// spread over ceil(hv / DN_ROWS) blocks, so that a layer's 32 heads fill ~128 SMs.
#define DN_ROWS 32

// The gated delta rule of rows [part·DN_ROWS, part·DN_ROWS + DN_ROWS) of v head h
// (blockIdx.x = h · parts + part) of the step's sequence blockIdx.y, its tokens in order:
// S ← exp(g)·S; S ← S + β (v − S k) kᵀ; o = S q / sqrt(hk), with β = sigmoid(beta),
// g = softplus(alpha + dt_bias) · a, q and k L2-normalized as the CPU does (ggml's rms_norm
// with eps / hk, then 1 / sqrt(hk)). `conv`: the convolution's output (q heads, k heads,
// v heads); out[t][h·hv + j] = o_j (before the gated norm). State row j (value dimension
// j, hk values) is held in registers by DN_P lanes, lane p its columns p, p + DN_P, ...
// (hk <= DN_P · DN_C); blockDim.x = DN_ROWS · DN_P; rows past hv idle. The block stages
// DN_STAGE tokens' q, k, its rows of v, β and decay in shared memory at a time (loads in
// parallel), with each staged token's q and k norms (a warp a vector), so that a token's
// step waits on no global load and holds only the state's two dot products.
extern "C" __global__ void __launch_bounds__(DN_ROWS * DN_P)
    delta_scan(const float* conv, int conv_dim, const float* beta, int beta_cols,
               const float* alpha, int alpha_cols, const float* dt_bias, const float* a, int hk,
               int hv, int nv, int nk, int qwen3next_layout, float* states, long long slot_len,
               long long ssm_off, const u32* positions, const u32* seq_of, const u32* table_off,
               const u32* tables, const u32* slot_of_block, int n, float eps, float* out,
               int out_cols) {
    pdl_enter();
    __shared__ float s_q[DN_STAGE][DN_P * DN_C];
    __shared__ float s_k[DN_STAGE][DN_P * DN_C];
    __shared__ float s_v[DN_STAGE][DN_ROWS];
    __shared__ float s_b[DN_STAGE], s_decay[DN_STAGE], s_qs[DN_STAGE], s_ks[DN_STAGE];
    const int parts = (hv + DN_ROWS - 1) / DN_ROWS;
    const int h = blockIdx.x / parts, row0 = (blockIdx.x % parts) * DN_ROWS;
    const int s = blockIdx.y;
    int t0, t1;
    dn_run(seq_of, n, s, t0, t1);
    if (t0 >= t1) return;
    const int jr = threadIdx.x / DN_P, p = threadIdx.x % DN_P;
    const int j = row0 + jr;
    const bool live = j < hv;
    const int rows = min(DN_ROWS, hv - row0);
    int kh, bc, ac;
    if (qwen3next_layout) {
        const int r = nv / nk;
        kh = h / r;
        bc = kh * 2 * r + h % r;
        ac = bc + r;
    } else {
        kh = h % nk;
        bc = h;
        ac = h;
    }
    const int key_dim = hk * nk;
    float* sg = states + dn_slot(s, table_off, tables, slot_of_block) * slot_len + ssm_off +
                ((size_t)h * hv + (live ? j : 0)) * hk;
    const float scale = 1.0f / sqrtf((float)hk);
    const float l2_eps = eps / (float)hk;
    const float dt = dt_bias[h], ah = a[h];
    const bool fresh = positions[t0] == 0;
    float S[DN_C];
#pragma unroll
    for (int c = 0; c < DN_C; c++) {
        const int i = p + DN_P * c;
        S[c] = (!fresh && live && i < hk) ? sg[i] : 0.0f;
    }
    const int width = 2 * hk + rows;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int base = t0; base < t1; base += DN_STAGE) {
        const int m = min(DN_STAGE, t1 - base);
        __syncthreads();  // the previous stage is consumed
        for (int e = threadIdx.x; e < m * width; e += blockDim.x) {
            const int tt = e / width, f = e - tt * width;
            const float* row = conv + (size_t)(base + tt) * conv_dim;
            if (f < hk)
                s_q[tt][f] = row[kh * hk + f];
            else if (f < 2 * hk)
                s_k[tt][f - hk] = row[key_dim + kh * hk + f - hk];
            else
                s_v[tt][f - 2 * hk] = row[2 * key_dim + h * hv + row0 + f - 2 * hk];
        }
        if (threadIdx.x < m) {
            const size_t t = base + threadIdx.x;
            s_b[threadIdx.x] = 1.0f / (1.0f + expf(-beta[t * beta_cols + bc]));
            const float x = alpha[t * alpha_cols + ac] + dt;
            s_decay[threadIdx.x] = expf((x > 20.0f ? x : logf(1.0f + expf(x))) * ah);
        }
        __syncthreads();
        // Each staged token's q and k scales (L2 norm, then 1 / sqrt(hk)), a warp a vector.
        for (int w = warp; w < 2 * m; w += warps) {
            const float* x = (w & 1) ? s_k[w >> 1] : s_q[w >> 1];
            float ss = 0.0f;
            for (int i = lane; i < hk; i += 32) ss = fmaf(x[i], x[i], ss);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (lane == 0) {
                const float sc = scale / sqrtf(ss / (float)hk + l2_eps);
                if (w & 1)
                    s_ks[w >> 1] = sc;
                else
                    s_qs[w >> 1] = sc * scale;
            }
        }
        __syncthreads();
        for (int tt = 0; tt < m; tt++) {
            const float decay = s_decay[tt], b = s_b[tt], ks = s_ks[tt];
            const float v = live ? s_v[tt][jr] : 0.0f;
            float kk[DN_C];
            float sk0 = 0.0f, sk1 = 0.0f;
#pragma unroll
            for (int c = 0; c < DN_C; c++) {
                const int i = p + DN_P * c;
                kk[c] = i < hk ? s_k[tt][i] * ks : 0.0f;
                S[c] *= decay;
                if (c & 1)
                    sk1 = fmaf(S[c], kk[c], sk1);
                else
                    sk0 = fmaf(S[c], kk[c], sk0);
            }
            float sk = sk0 + sk1;
#pragma unroll
            for (int o = 1; o < DN_P; o <<= 1) sk += __shfl_xor_sync(0xffffffffu, sk, o);
            const float delta = (v - sk) * b;
            float o0 = 0.0f, o1 = 0.0f;
#pragma unroll
            for (int c = 0; c < DN_C; c++) {
                const int i = p + DN_P * c;
                const float qi = i < hk ? s_q[tt][i] : 0.0f;
                S[c] = fmaf(kk[c], delta, S[c]);
                if (c & 1)
                    o1 = fmaf(S[c], qi, o1);
                else
                    o0 = fmaf(S[c], qi, o0);
            }
            float o_j = o0 + o1;
#pragma unroll
            for (int o = 1; o < DN_P; o <<= 1) o_j += __shfl_xor_sync(0xffffffffu, o_j, o);
            if (p == 0 && live) out[(size_t)(base + tt) * out_cols + h * hv + j] = o_j * s_qs[tt];
        }
    }
    if (live) {
#pragma unroll
        for (int c = 0; c < DN_C; c++) {
            const int i = p + DN_P * c;
            if (i < hk) sg[i] = S[c];
        }
    }
}

// The gated RMS norm of head blockIdx.y of row blockIdx.x, in place:
// o · rms_scale(o, eps) · norm · silu(z).
extern "C" __global__ void delta_gated_norm(float* o, int o_cols, const float* z, int z_cols,
                                            const float* norm, int hv, float eps) {
    pdl_enter();
    float* x = o + (size_t)blockIdx.x * o_cols + (size_t)blockIdx.y * hv;
    const float* zr = z + (size_t)blockIdx.x * z_cols + (size_t)blockIdx.y * hv;
    const float rs = rms_scale(x, hv, eps);
    __syncthreads();
    for (int j = threadIdx.x; j < hv; j += blockDim.x) x[j] = x[j] * rs * norm[j] * dn_silu(zr[j]);
}

// delta_gated_norm of a single-token step whose consumer is a gemv_q8 (hv a multiple of
// 32): the row also in 8 bits on the way out, as rms_norm_q8 writes it (each warp's 32
// consecutive values one block: q[j], d[j / 32]).
extern "C" __global__ void delta_gated_norm_q8(float* o, int o_cols, const float* z, int z_cols,
                                               const float* norm, int hv, float eps, i8* q,
                                               float* d) {
    pdl_enter();
    const size_t at = (size_t)blockIdx.x * o_cols + (size_t)blockIdx.y * hv;
    float* x = o + at;
    const float* zr = z + (size_t)blockIdx.x * z_cols + (size_t)blockIdx.y * hv;
    const float rs = rms_scale(x, hv, eps);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < hv; base += blockDim.x) {
        const int j = base + threadIdx.x;
        const float v = j < hv ? x[j] * rs * norm[j] * dn_silu(zr[j]) : 0.0f;
        float step;
        const int qi = warp_q8(v, step);
        if (j < hv) {
            x[j] = v;
            q[at + j] = (i8)qi;
            if (lane == 0) d[(at + j) >> 5] = step;
        }
    }
}

// Each token's [n_head × 2·head_dim] row of qg (per head its query, then its gate) into q
// and gate ([n_head × head_dim] each); one thread per value of q, len = n · q_cols.
extern "C" __global__ void split_gated_query(const float* qg, float* q, float* gate, int q_cols,
                                             int head_dim, int len) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const int t = i / q_cols, c = i - t * q_cols;
    const int h = c / head_dim, d = c - h * head_dim;
    const float* src = qg + (size_t)t * 2 * q_cols + (size_t)h * 2 * head_dim + d;
    q[i] = src[0];
    gate[i] = src[head_dim];
}

// x *= sigmoid(gate), element-wise.
extern "C" __global__ void sigmoid_mul(float* x, const float* gate, int len) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}
