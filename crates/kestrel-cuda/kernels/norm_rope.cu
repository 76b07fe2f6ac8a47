// RMSNorm (with the 8-bit or f16 copy of its output for the product reading it next) and
// RoPE (the angles, shared with rope_store_kv in attention.cu).

// One block per row: out = x / sqrt(mean(x²) + eps) * w. In place is fine (out == x).
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int cols, float eps) {
    pdl_enter();
    const float* xr = x + (size_t)blockIdx.x * cols;
    float* o = out + (size_t)blockIdx.x * cols;
    const float scale = rms_scale(xr, cols, eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) o[j] = xr[j] * scale * w[j];
}

// rms_norm that also writes the result as f16 to `h` (row-major like out), as f32_to_f16
// would from out.
extern "C" __global__ void rms_norm_f16(const float* x, const float* w, float* out, int cols,
                                        float eps, u16* h) {
    pdl_enter();
    const float* xr = x + (size_t)blockIdx.x * cols;
    float* o = out + (size_t)blockIdx.x * cols;
    u16* hr = h + (size_t)blockIdx.x * cols;
    const float scale = rms_scale(xr, cols, eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const float v = xr[j] * scale * w[j];
        o[j] = v;
        hr[j] = f2h(v);
    }
}

// rms_norm of one row that also leaves the result quantized for gemv_q8 (as quantize_x_q8
// would: blocks of 32, d = max|v| / 127, q = round(v / d)); cols a multiple of 32. Each
// block sums the squares of the whole row (every block the same sum, in the same order)
// and writes its own blockDim.x values (grid-strided): a single-token row is one step of
// latency on many SMs instead of several on one. Each warp's 32 consecutive values are one
// 8-bit block.
extern "C" __global__ void rms_norm_q8(const float* x, const float* w, float* out, int cols,
                                       float eps, i8* q, float* d) {
    pdl_enter();
    // Row blockIdx.y (one row in decode steps; a verification step's rows each as alone).
    const size_t row = blockIdx.y;
    x += row * cols;
    out += row * cols;
    q += row * cols;
    d += row * (cols >> 5);
    const float scale = rms_scale(x, cols, eps);
    const int lane = threadIdx.x & 31;
    for (int base = blockIdx.x * blockDim.x; base < cols; base += gridDim.x * blockDim.x) {
        const int j = base + threadIdx.x;
        const float v = j < cols ? x[j] * scale * w[j] : 0.0f;
        float step;
        const int qi = warp_q8(v, step);
        if (j < cols) {
            out[j] = v;
            q[j] = (i8)qi;
            if (lane == 0) d[j >> 5] = step;
        }
    }
}

// Rotary embedding in place of one token's row of heads, as ggml computes the angles: f32
// throughout, theta advanced by repeated multiplication with theta_scale. rope_cs: the
// cos / sin of pair p (times mscale); rope_angles: those of every pair, computed once per
// block into `cs` / `sn` (n_rot / 2 entries; the caller syncs before the first use), then
// the block's threads stride over (head, pair).
__device__ __forceinline__ void rope_cs(int p, float pos, int n_rot, float theta_scale,
                                        float freq_scale, float ext_factor, float mscale,
                                        float corr_lo, float corr_hi, const float* freq_factors,
                                        float& c, float& s) {
    float theta_extrap = pos;
    for (int j = 0; j < p; j++) theta_extrap *= theta_scale;
    const float factor = freq_factors ? freq_factors[p] : 1.0f;
    const float extrap = theta_extrap / factor;
    const float interp = freq_scale * extrap;
    float theta = interp;
    if (ext_factor != 0.0f) {
        const float y = ((float)p - corr_lo) / fmaxf(0.001f, corr_hi - corr_lo);
        const float ramp = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext_factor;
        theta = interp * (1.0f - ramp) + extrap * ramp;
    }
    c = cosf(theta) * mscale;
    s = sinf(theta) * mscale;
    (void)n_rot;
}

__device__ __forceinline__ void rope_angles(float pos, int n_rot, float theta_scale,
                                            float freq_scale, float ext_factor, float mscale,
                                            float corr_lo, float corr_hi,
                                            const float* freq_factors, float* cs, float* sn) {
    for (int p = threadIdx.x; p < n_rot / 2; p += blockDim.x)
        rope_cs(p, pos, n_rot, theta_scale, freq_scale, ext_factor, mscale, corr_lo, corr_hi,
                freq_factors, cs[p], sn[p]);
}

__device__ __forceinline__ void rope_apply(float* row, int n_heads, int head_dim, int n_rot,
                                           int neox, const float* cs, const float* sn) {
    const int half = n_rot / 2;
    for (int idx = threadIdx.x; idx < n_heads * half; idx += blockDim.x) {
        const int h = idx / half, p = idx % half;
        const float c = cs[p], s = sn[p];
        float* head = row + h * head_dim;
        const int a = neox ? p : 2 * p;
        const int b = neox ? p + half : 2 * p + 1;
        const float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

#define ROPE_MAX_HALF 128

#define ROPE_PARAMS                                                                            \
    int head_dim, int n_rot, int neox, float theta_scale, float freq_scale, float ext_factor,  \
        float mscale, float corr_lo, float corr_hi, const float *freq_factors
#define ROPE_ANGLE_ARGS                                                                        \
    n_rot, theta_scale, freq_scale, ext_factor, mscale, corr_lo, corr_hi, freq_factors

// Rotary embedding in place, one block per token.
extern "C" __global__ void rope(float* x, const u32* positions, int cols, ROPE_PARAMS) {
    pdl_enter();
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    const int i = blockIdx.x;
    rope_angles((float)positions[i], ROPE_ANGLE_ARGS, cs, sn);
    __syncthreads();
    rope_apply(x + (size_t)i * cols, cols / head_dim, head_dim, n_rot, neox, cs, sn);
}
