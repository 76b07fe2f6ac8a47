// Element-wise operations: scale, add, bias, the gated activations, the Q/K/V split.

extern "C" __global__ void scale_f32(float* x, int len, float factor) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] *= factor;
}

extern "C" __global__ void add_f32(float* x, const float* y, int len) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] += y[i];
}

extern "C" __global__ void add_bias(float* x, const float* bias, int len, int cols) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] += bias[i % cols];
}

// gate = act(gate) * up; act 0 = SiLU, 1 = GELU (tanh approximation).
// act(g) · u: SiLU (act 0) or tanh-approximated GELU (act 1).
__device__ __forceinline__ float gated_value(float g, float u, int act) {
    float a;
    if (act == 0) {
        a = g / (1.0f + expf(-g));
    } else {
        const float sqrt_2_over_pi = 0.7978846f, coef_a = 0.044715f;
        a = 0.5f * g * (1.0f + tanhf(sqrt_2_over_pi * g * (1.0f + coef_a * g * g)));
    }
    return a * u;
}

extern "C" __global__ void gated_act(float* gate, const float* up, int len, int act) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    gate[i] = gated_value(gate[i], up[i], act);
}

// gated_act that also writes the result as f16 to `h` (the activation operand of the
// cuBLAS GEMM that reads it next: no conversion launch of its own).
extern "C" __global__ void gated_act_f16(float* gate, const float* up, int len, int act, u16* h) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const float v = gated_value(gate[i], up[i], act);
    gate[i] = v;
    h[i] = f2h(v);
}

// gated_act over the merged gate/up product m (rows of 2·ff: gate's, then up's): gate = the
// result (len = n·ff values), and its f16 copy to h for the cuBLAS product that reads it
// next (null: none).
extern "C" __global__ void gated_act_merged(const float* m, int ff, int len, int act,
                                           float* gate, u16* h) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const int t = i / ff, c = i - t * ff;
    const float* row = m + (size_t)t * 2 * ff;
    const float v = gated_value(row[c], row[ff + c], act);
    gate[i] = v;
    if (h) h[i] = f2h(v);
}

// Splits the merged Q/K/V product (rows of qd + 2·kd values) into q, k and v (rows of qd,
// kd, kd), adding their biases (null: none). One thread a value.
extern "C" __global__ void split_qkv(const float* m, float* q, float* k, float* v,
                                     const float* bq, const float* bk, const float* bv, int qd,
                                     int kd, long long len) {
    pdl_enter();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const int w = qd + 2 * kd;
    const long long t = i / w;
    const int c = (int)(i - t * w);
    const float x = m[i];
    if (c < qd) {
        q[t * qd + c] = x + (bq ? bq[c] : 0.0f);
    } else if (c < qd + kd) {
        k[t * kd + c - qd] = x + (bk ? bk[c - qd] : 0.0f);
    } else {
        v[t * kd + c - qd - kd] = x + (bv ? bv[c - qd - kd] : 0.0f);
    }
}

// Mistral 3's attention temperature: row i of x (cols values) times
// 1 + scale · ln(floor(positions[i] / floor_scale) + 1), computed as AttnTemperature::factor
// does (the floor in f32, the logarithm in f64). One block per row.
extern "C" __global__ void scale_by_position(float* x, int cols, const u32* positions,
                                             float scale, int floor_scale) {
    pdl_enter();
    const float steps = floorf((float)positions[blockIdx.x] / (float)floor_scale);
    const float f = (float)(log((double)steps + 1.0) * (double)scale + 1.0);
    float* r = x + (size_t)blockIdx.x * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) r[j] *= f;
}
