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

// A little-endian f16 at any byte address (Q4_1 / Q5_1 / Q5_K blocks are only 2-byte
// aligned on the GPU too).
__device__ __forceinline__ float ld_f16(const u8* p) {
    return h2f((u16)p[0] | ((u16)p[1] << 8));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A double as its two 32-bit halves and back (warp shuffles move 32 bits).
__device__ __forceinline__ void f64_halves(double v, u32& lo, u32& hi) {
    asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "d"(v));
}
__device__ __forceinline__ double f64_join(u32 lo, u32 hi) {
    double v;
    asm("mov.b64 %0, {%1, %2};" : "=d"(v) : "r"(lo), "r"(hi));
    return v;
}
// shfl(u32 half) applied to both halves of v.
template <class S>
__device__ __forceinline__ double shfl_f64(double v, S shfl) {
    u32 lo, hi;
    f64_halves(v, lo, hi);
    return f64_join(shfl(lo), shfl(hi));
}

__device__ __forceinline__ double warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1)
        v += shfl_f64(v, [&](u32 h) { return __shfl_xor_sync(0xffffffffu, h, o); });
    return v;
}

// llama.cpp's 8-bit rounding of v at step = max|v| / 127 of its block: round(v / step)
// within ±127 (0 for an all-zero block).
__device__ __forceinline__ int q8_round(float v, float step) {
    return step > 0.0f ? max(-127, min(127, __float2int_rn(v / step))) : 0;
}

// q8_round of a 32-value block held one value per lane of a warp (step returned).
__device__ __forceinline__ int warp_q8(float v, float& step) {
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    step = amax / 127.0f;
    return q8_round(v, step);
}

// Value `at` (a flat index) of a row quantized to 8 bits as quantize_x_q8 does it, from the
// warp whose 32 lanes hold one aligned block of 32 values: q8[at], and its block's step
// q8d[at / 32] from lane 0.
__device__ __forceinline__ void q8_store_block(float v, size_t at, i8* q8, float* q8d) {
    float step;
    q8[at] = (i8)warp_q8(v, step);
    if ((threadIdx.x & 31) == 0) q8d[at >> 5] = step;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// T: float or double.
template <class T>
__device__ T block_sum(T v) {
    __shared__ T partial[32];
    __shared__ T total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int n_warps = (blockDim.x + 31) >> 5;
        T s = lane < n_warps ? partial[lane] : (T)0;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// 1 / sqrt(mean(x²) + eps) of the row xr of `cols` values, summed by the whole block (every
// block of a launch gets the same sum, in the same order). All threads must call it.
__device__ __forceinline__ float rms_scale(const float* xr, int cols, float eps) {
    float ss = 0.0f;
    if ((cols & 3) == 0 && ((size_t)xr & 15) == 0) {
        // 16-byte loads: a quarter of the dependent load rounds (the row is in L2).
        for (int j = 4 * threadIdx.x; j < cols; j += 4 * blockDim.x) {
            const float4 v = *(const float4*)(xr + j);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int j = threadIdx.x; j < cols; j += blockDim.x) ss += xr[j] * xr[j];
    }
    ss = block_sum(ss);
    return 1.0f / sqrtf(ss / (float)cols + eps);
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

// Shared-space address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// Two floats as f16x2, `lo` in the low half (cvt.rn.f16x2.f32 d, a, b puts a in the high half).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
    return r;
}

// d += A·B, mma.sync m16n8k16, f16 operands, f32 accumulators (sm_80+). Lane (g, c) = (lane
// / 4, lane % 4) holds A rows g, g + 8 at k = 2c, 2c+1 (a[0], a[1]) and 2c+8, 2c+9 (a[2],
// a[3]); B column g at k = 2c, 2c+1 (b0) and 2c+8, 2c+9 (b1); D rows g (d[0], d[1]) and
// g + 8 (d[2], d[3]) at columns 2c, 2c+1.
__device__ __forceinline__ void mma_f16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8×8 f16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix
// i; register i of lane 4g + c holds matrix i's (row g, cols 2c, 2c+1), or with .trans its
// (rows 2c, 2c+1; col g). Volatile + memory: the same addresses are read again after every
// __syncthreads, with new contents.
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
