// Kernels over other GPUs' memory (reached through peer access, or the same GPU's): the
// layer split's copies between stages.

// n values from src (this GPU) to dst (this GPU or a peer's, written over NVLink): the
// layer split's activations at a stage boundary. A kernel rather than a memory copy, so
// that it is captured in the step's graph like the others (a copy between devices is not).
extern "C" __global__ void __launch_bounds__(256)
copy_peer(const float* src, float* dst, long long n) {
    pdl_enter();
    const long long stride = (long long)gridDim.x * 256;
    const long long n4 = n / 4;
    const float4* s4 = (const float4*)src;
    float4* d4 = (float4*)dst;
    for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < n4; i += stride) d4[i] = s4[i];
    for (long long i = n4 * 4 + (long long)blockIdx.x * 256 + threadIdx.x; i < n; i += stride)
        dst[i] = src[i];
}
