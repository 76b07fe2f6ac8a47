// ---------------------------------------------------------------------------------------
// Q4_K products of 33..64 tokens on the tensor cores with 4-bit weights (mmw_*): the batched
// decode steps that otherwise read f16 copies of the weights through cuBLAS (3.6× the bytes).
//
// Weights: a second copy of each Q4_K matrix in the "mmw layout", made once at load by
// repack_q4k_mmw: per 16-row tile and 256-value step, MW_TILE = 2,560 contiguous bytes —
// 2,048 bytes of nibbles laid out as the mma A fragments want them, then 512 bytes of
// per-32-value scales (s = d·sc, −m = −dmin·mn as an f16 pair). A weight is s·q − m, one f16
// fma of the exact q (the f16 cuBLAS path rounds d·sc·q − dmin·mn to f16 once as well).
//
// Nibbles: lane (g, c) of a warp holds, for the m16n8k16 A fragment of the tile's 16-value
// slice i (i = 0..15 of the step), rows g / g + 8 at k = 16i + 2c, +1 and 16i + 2c + 8, +9:
// four pairs, packed in one word as pair p at bits 4p..4p+3 (first value) and 16+4p..19+4p
// (second), so that (word >> 4p) & 0x000F000F | 0x64006400 is the pair as f16 1024 + q.
// Pair order: 0 = (g, 2c), 1 = (g + 8, 2c), 2 = (g, 2c + 8), 3 = (g + 8, 2c + 8) — the a0..a3
// registers. Word i of lane L sits at byte (i / 4) · 512 + L · 16 + (i % 4) · 4: a warp's
// 16-byte loads of four slices are one contiguous 512-byte read.
// Scales: word (sb · 16 + r) of the 512 bytes for sub-block sb (32 values) and tile row r.
//
// The product: one block per SM-sized group of row tiles, all 64 token columns; the step's
// activations (f16, [token][k] as cuBLAS takes them, 64 rows zero-filled past n) and weight
// tiles are copied into shared memory with cp.async, MW_STAGES steps in flight; each warp
// owns one 16-row tile (gated: the same 16 rows of gate and of up) and reads its B fragments
// with ldmatrix. f32 accumulators; no split of the row length (the host sizes the blocks).

#define MW_TILE 2560
#define MW_XROW 528  // bytes per token row of a staged step: 256 halves + 16 (ldmatrix rows
                     // of 8 tokens land in distinct banks)
#define MW_STAGES 3
#define MW_MAX_WARPS 8
#define MW_XBYTES (64 * MW_XROW)

// One thread per (tile, step, lane): its 16 nibble words, and 4 of the tile step's 128
// scale words. Rows past the matrix's end are zero (their products are dropped).
extern "C" __global__ void repack_q4k_mmw(const u8* w, long long row_bytes, int rows, int cols,
                                          u8* out) {
    const int steps = cols >> 8, tiles = (rows + 15) >> 4;
    const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)tiles * steps * 32) return;
    const int lane = (int)(id & 31);
    const long long ts = id >> 5;  // tile * steps + step
    const int tile = (int)(ts / steps), st = (int)(ts - (long long)tile * steps);
    const int g = lane >> 2, c = lane & 3;
    u8* o = out + ts * MW_TILE;
    const int r_of[2] = {tile * 16 + g, tile * 16 + g + 8};
#pragma unroll 1
    for (int i = 0; i < 16; i++) {
        u32 word = 0;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const int r = r_of[p & 1];
            if (r >= rows) continue;
            const u8* b = w + (size_t)r * row_bytes + (size_t)st * 144 + 16;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int v = 16 * i + 2 * c + 8 * (p >> 1) + e;  // value in the block
                const u8 byte = b[32 * (v >> 6) + (v & 31)];
                const u32 nib = (v & 32) ? (byte >> 4) : (byte & 15);
                word |= nib << (4 * p + 16 * e);
            }
        }
        *(u32*)(o + (i >> 2) * 512 + lane * 16 + (i & 3) * 4) = word;
    }
#pragma unroll 1
    for (int j = 0; j < 4; j++) {
        const int wi = lane * 4 + j, sb = wi >> 4, r = tile * 16 + (wi & 15);
        u32 word = 0;
        if (r < rows) {
            const u8* b = w + (size_t)r * row_bytes + (size_t)st * 144;
            const uint4 h = *(const uint4*)b;
            int sc[2], mn[2];
            q4k_scale_min_pair(h, sb >> 1, sc, mn);
            const float d = h2f((u16)(h.x & 0xFFFF)), dmin = h2f((u16)(h.x >> 16));
            word = (u32)f2h(d * (float)sc[sb & 1]) | ((u32)f2h(-dmin * (float)mn[sb & 1]) << 16);
        }
        *(u32*)(o + 2048 + wi * 4) = word;
    }
}

// Pair p of a nibble word as f16 (q, exact), scaled: s·q − m (s2 = {s, s}, m2 = {−m, −m}).
__device__ __forceinline__ u32 mw_weight(u32 word, int p, u32 s2, u32 m2) {
    const u32 q = h2_sub(((word >> (4 * p)) & 0x000F000Fu) | 0x64006400u, 0x64006400u);
    return h2_fma(q, s2, m2);
}

// A sub-block's scale pair {s, −m} as {s, s} and {−m, −m}.
__device__ __forceinline__ void mw_scale(u32 sm, u32& s2, u32& m2) {
    asm("prmt.b32 %0, %1, %1, 0x1010;" : "=r"(s2) : "r"(sm));
    asm("prmt.b32 %0, %1, %1, 0x3232;" : "=r"(m2) : "r"(sm));
}

// A fragment of slice word `word` with the scales of rows g (s[0], m[0]) and g + 8 (s[1],
// m[1]).
__device__ __forceinline__ void mw_frag(u32 word, const u32 (&s)[2], const u32 (&m)[2],
                                        u32 (&a)[4]) {
    a[0] = mw_weight(word, 0, s[0], m[0]);
    a[1] = mw_weight(word, 1, s[1], m[1]);
    a[2] = mw_weight(word, 2, s[0], m[0]);
    a[3] = mw_weight(word, 3, s[1], m[1]);
}

// Copies step `st` into the stage at shared address `dst`, each warp its share: the
// activations of 64 tokens (rows >= n zero; warp w copies rows w, w + warps, ...) and the
// MATS weight tiles of its tile `tile` (none past `tiles`), at slot `slot` of the stage.
template <int MATS>
__device__ __forceinline__ void mw_load(u32 dst, int st, const u16* xh, int n, int k,
                                        const u8* const (&wm)[MATS], int tile, int tiles,
                                        int steps, int slot) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const u16* xs = xh + st * 256 + lane * 8;
    for (int t = warp; t < 64; t += warps) {
        const bool ok = t < n;
        cp_async16(dst + t * MW_XROW + lane * 16, xs + (size_t)(ok ? t : 0) * k, ok);
    }
    if (tile >= tiles) return;
    const u32 wdst = dst + MW_XBYTES + slot * MATS * MW_TILE;
#pragma unroll
    for (int m = 0; m < MATS; m++) {
        const u8* src = wm[m] + ((size_t)tile * steps + st) * MW_TILE;
#pragma unroll
        for (int c = lane; c < MW_TILE / 16; c += 32)
            cp_async16(wdst + m * MW_TILE + c * 16, src + c * 16, true);
    }
}

// One staged step for a warp: its MATS tiles (at `wt`, MW_TILE apart) times the 64 tokens
// (ldmatrix row address of this lane for the first token at `xl`), into
// acc[m][token tile][4]. Software-pipelined by hand: slice i + 1's A fragments (expanded
// from the nibbles) and B fragments (ldmatrix) are made before slice i's mma, so that their
// latencies overlap the tensor-core work instead of stalling it.
template <int MATS>
struct MwSlices {
    uint4 q[MATS];       // nibble words of 4 slices
    u32 sc[MATS][2][2];  // scale pairs {s, −m}: [matrix][sub-block of the 4 slices][row g, g+8]
    __device__ __forceinline__ void load(const u8* wt, int j, int lane, int g) {
#pragma unroll
        for (int m = 0; m < MATS; m++) {
            const u8* t = wt + m * MW_TILE;
            q[m] = *(const uint4*)(t + j * 512 + lane * 16);
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int r = 0; r < 2; r++)
                    sc[m][h][r] = *(const u32*)(t + 2048 + (2 * j + h) * 64 + (g + 8 * r) * 4);
        }
    }
    // A fragments of slice ii (0..3) of the 4.
    __device__ __forceinline__ void frags(int ii, u32 (&a)[MATS][4]) const {
#pragma unroll
        for (int m = 0; m < MATS; m++) {
            const u32 word = ii == 0 ? q[m].x : ii == 1 ? q[m].y : ii == 2 ? q[m].z : q[m].w;
            u32 s2[2], m2[2];
#pragma unroll
            for (int r = 0; r < 2; r++) mw_scale(sc[m][ii >> 1][r], s2[r], m2[r]);
            mw_frag(word, s2, m2, a[m]);
        }
    }
};

template <int MATS>
__device__ __forceinline__ void mw_step(const u8* wt, u32 xl, float (&acc)[MATS][8][4]) {
    constexpr int TP = 4;  // pairs of 8-token tiles (one ldmatrix.x4 each)
    const int lane = threadIdx.x & 31, g = lane >> 2;
    MwSlices<MATS> w;
    w.load(wt, 0, lane, g);
    u32 a[MATS][4], b[TP][4];
    w.frags(0, a);
#pragma unroll
    for (int tp = 0; tp < TP; tp++) ldsm_x4(b[tp], xl + tp * 16 * MW_XROW);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u32 an[MATS][4], bn[TP][4];
        if (i + 1 < 16) {
            if (((i + 1) & 3) == 0) w.load(wt, (i + 1) >> 2, lane, g);
            w.frags((i + 1) & 3, an);
#pragma unroll
            for (int tp = 0; tp < TP; tp++)
                ldsm_x4(bn[tp], xl + tp * 16 * MW_XROW + (i + 1) * 32);
        }
#pragma unroll
        for (int tp = 0; tp < TP; tp++)
#pragma unroll
            for (int m = 0; m < MATS; m++) {
                mma_f16(acc[m][2 * tp], a[m], b[tp][0], b[tp][1]);
                mma_f16(acc[m][2 * tp + 1], a[m], b[tp][2], b[tp][3]);
            }
        if (i + 1 < 16) {
#pragma unroll
            for (int m = 0; m < MATS; m++)
#pragma unroll
                for (int e = 0; e < 4; e++) a[m][e] = an[m][e];
#pragma unroll
            for (int tp = 0; tp < TP; tp++)
#pragma unroll
                for (int e = 0; e < 4; e++) b[tp][e] = bn[tp][e];
        }
    }
}

// Steps [s0, s1) of the block's tiles (tile0 + warp, one a warp): acc of this warp's tile,
// zero where the warp has none. Every thread of the block calls it (it holds the block's
// barriers).
template <int MATS>
__device__ __forceinline__ void mw_rows(const u16* xh, int n, int k, const u8* const (&wm)[MATS],
                                        int tile0, int tiles, int s0, int s1,
                                        float (&acc)[MATS][8][4]) {
    extern __shared__ __align__(128) u8 mw_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int steps = k >> 8, tile = tile0 + warp;
    const int stage = MW_XBYTES + MW_MAX_WARPS * MATS * MW_TILE;
    const u32 base = smem_u32(mw_smem);
#pragma unroll
    for (int m = 0; m < MATS; m++)
#pragma unroll
        for (int t = 0; t < 8; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][t][e] = 0.0f;
#pragma unroll
    for (int s = 0; s < MW_STAGES - 1; s++) {
        if (s0 + s < s1)
            mw_load<MATS>(base + s * stage, s0 + s, xh, n, k, wm, tile, tiles, steps, warp);
        cp_async_commit();
    }
    // ldmatrix: lanes 8i..8i+7 address matrix i = (tokens 8 (i / 2).., k 8 (i % 2)..).
    const u32 xl_off = (((lane >> 4) << 3) + (lane & 7)) * MW_XROW + ((lane >> 3) & 1) * 16;
    for (int st = s0; st < s1; st++) {
        asm volatile("cp.async.wait_group %0;" ::"n"(MW_STAGES - 2) : "memory");
        __syncthreads();
        const int nx = st + MW_STAGES - 1;
        if (nx < s1)
            mw_load<MATS>(base + ((nx - s0) % MW_STAGES) * stage, nx, xh, n, k, wm, tile, tiles,
                          steps, warp);
        cp_async_commit();
        const int slot = (st - s0) % MW_STAGES;
        if (tile < tiles)
            mw_step<MATS>(mw_smem + slot * stage + MW_XBYTES + warp * MATS * MW_TILE,
                          base + slot * stage + xl_off, acc);
    }
    cp_async_wait_all();
}

// Calls store(tok, r, t, e) for each accumulator acc[.][t][e] of this warp's tile that holds a
// real output (token tok < n, row r < rows); nothing for a warp past the last tile.
template <class Store>
__device__ __forceinline__ void mw_each_output(int tile, int tiles, int rows, int n,
                                               Store store) {
    if (tile >= tiles) return;
    const int lane = threadIdx.x & 31, r0 = tile * 16 + (lane >> 2), c = lane & 3;
#pragma unroll
    for (int t = 0; t < 8; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int tok = 8 * t + 2 * c + (e & 1), r = r0 + 8 * (e >> 1);
            if (tok < n && r < rows) store(tok, r, t, e);
        }
}

// gate[t][r] = act(G[r]·x[t]) · (U[r]·x[t]) for n ≤ 64 tokens (xh: f16 [n][k], k a multiple
// of 256), also as f16 into h (null: not). G and U: `rows` rows each in the mmw layout.
// Grid: ceil(tiles / warps) blocks of up to MW_MAX_WARPS warps, one tile each; one block a
// SM (224 KB of shared memory). (Tried and removed: two blocks a SM of ≤ 4 tiles and 2
// stages each, 69.3 against 66.5 µs; two warps a tile, each half of the tokens, 84 against
// 80 before the copies were split by warp.)
extern "C" __global__ void __launch_bounds__(MW_MAX_WARPS * 32, 1)
    mmw_gated(const u16* xh, int n, int k, const u8* wg, const u8* wu, int rows, int act,
              float* gate, u16* h) {
    pdl_enter();
    const int tiles = (rows + 15) >> 4, warp = threadIdx.x >> 5;
    const int tile0 = blockIdx.x * (blockDim.x >> 5);
    const u8* const wm[2] = {wg, wu};
    float acc[2][8][4];
    mw_rows<2>(xh, n, k, wm, tile0, tiles, 0, k >> 8, acc);
    mw_each_output(tile0 + warp, tiles, rows, n, [&](int tok, int r, int t, int e) {
        const float v = gated_value(acc[0][t][e], acc[1][t][e], act);
        gate[(size_t)tok * rows + r] = v;
        if (h) h[(size_t)tok * rows + r] = f2h(v);
    });
}
