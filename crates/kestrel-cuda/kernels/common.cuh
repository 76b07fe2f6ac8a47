// Shared helpers of every Kestrel kernel. Compiled by NVRTC without any CUDA header:
// half conversions go through inline PTX.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

// Programmatic dependent launch (Hopper): the host launches every kernel with programmatic
// stream serialization, so its blocks may be scheduled while the previous kernel still
// runs. Each kernel first waits until that kernel has completed and its writes are visible
// (before touching global memory at all: it may overwrite what that kernel still reads),
// then allows the next one to be scheduled. A no-op for plain launches.
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, as half::f16::from_f32 on the CPU.
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}

// A little-endian f16 at any byte address (quantized blocks are only 2-byte aligned).
__device__ __forceinline__ float ld_f16(const u8* p) {
    return h2f((u16)p[0] | ((u16)p[1] << 8));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// llama.cpp's 8-bit rounding of a 32-value block held one value per lane of a warp:
// step = max|v| / 127 over the warp, and the returned q = round(v / step) within ±127.
__device__ __forceinline__ int warp_q8(float v, float& step) {
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    step = amax / 127.0f;
    const int qi = step > 0.0f ? __float2int_rn(v / step) : 0;
    return max(-127, min(127, qi));
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int n_warps = (blockDim.x + 31) >> 5;
        float s = lane < n_warps ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// Asynchronous 16-byte copies global -> shared (cp.async, sm_80+), committed in groups.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
// The same to a shared-space address, writing zeros when !valid.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :
                 : "r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most one of this thread's committed groups is still in flight.
__device__ __forceinline__ void cp_async_wait_prev() {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
}
// Waits until all of them have landed.
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}
