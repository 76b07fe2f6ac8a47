//! The single-token step as one persistent kernel (`mega`, kernels/mega.cu): runs of a
//! recorded step's launches that it can take (8-bit-activation norms and GEMVs, RoPE with
//! split attention and its merge, the LM head) become its phases, each keeping the
//! arguments the backend recorded, so the forward and the launch-level kernels stay the one
//! definition. Everything the kernel assumes is checked here; a run it cannot take stays
//! as it was.

use super::{Arg, Launch};
use crate::compile::KERNELS;
use kestrel_gguf::GgmlType;

/// Dynamic shared memory of a `mega` block (the H100's opt-in maximum per block).
pub const SMEM_BYTES: u32 = 232_448;
/// Consumer warps (MG_WARPS) plus the producer warp.
pub const THREADS: u32 = 32 * (CONSUMER_WARPS + 1);
const CONSUMER_WARPS: u32 = 8;
const SLOTS: usize = 16;
const MAX_ROWS: usize = 8;
/// Most key splits of one attention phase (the partials' size).
const MAX_SPLITS: usize = 512;

/// Widest norm or quantization the kernel runs locally (its activations' shared copy is
/// sized for the widest GEMV input).
const MAX_LOCAL: i64 = 1 << 16;

const NORM: i32 = 1;
const QUANT: i32 = 2;
const GEMV: i32 = 3;
const ATTN: i32 = 4;
const COMBINE: i32 = 5;

/// Whether the kernel's GEMVs read the format of ggml type id `ty` (gemv_q8's formats).
fn format_ok(ty: i64) -> bool {
    let q8 = [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K];
    u32::try_from(ty)
        .ok()
        .and_then(GgmlType::from_id)
        .is_some_and(|t| q8.contains(&t))
}

/// One phase, laid out as `MgPhase` (352 bytes).
#[derive(Clone, Debug, PartialEq)]
pub struct Phase {
    pub kind: i32,
    barrier: bool,
    local_x: bool,
    rpc: [i32; 3],
    /// Offset of this phase's block row bounds in the plan's bounds (GEMV).
    bounds_at: usize,
    a: Vec<i64>,
}

pub const PHASE_BYTES: usize = 352;

impl Phase {
    fn new(kind: i32, a: Vec<i64>) -> Phase {
        Phase {
            kind,
            barrier: false,
            local_x: false,
            rpc: [1; 3],
            bounds_at: 0,
            a,
        }
    }

    /// Weight bytes the phase streams (GEMV; 0 otherwise).
    pub fn weight_bytes(&self) -> u64 {
        if self.kind != GEMV {
            return 0;
        }
        rows_and_bytes(&self.a)
            .iter()
            .map(|&(rows, bytes)| (rows * bytes) as u64)
            .sum()
    }

    /// The device layout, with the bounds array at `bounds_base` (a u32 device array).
    pub fn bytes(&self, bounds_base: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(PHASE_BYTES);
        for v in [
            self.kind,
            self.barrier as i32,
            self.local_x as i32,
            self.rpc[0],
            self.rpc[1],
            self.rpc[2],
        ] {
            out.extend(v.to_le_bytes());
        }
        out.extend((bounds_base + 4 * self.bounds_at as u64).to_le_bytes());
        for i in 0..40 {
            out.extend(self.a.get(i).copied().unwrap_or(0).to_le_bytes());
        }
        out
    }
}

/// What one `mega` launch needs, before upload.
#[derive(Debug)]
pub struct Plan {
    /// The launches replaced: `start .. end` of the step's list.
    pub start: usize,
    pub end: usize,
    pub phases: Vec<Phase>,
    pub bounds: Vec<u32>,
    pub barriers: usize,
    pub slot_bytes: u32,
    pub x_bytes: u32,
    /// Floats of the attention partials (0: no attention phase).
    pub part_floats: usize,
    pub weight_bytes: u64,
}

/// A launch's arguments as 8-byte integers (pointers, ints, float bits).
fn raw(l: &Launch) -> Vec<i64> {
    l.args
        .iter()
        .map(|a| match *a {
            Arg::P(v) => v as i64,
            Arg::I(v) => i64::from(v),
            Arg::L(v) => v,
            Arg::F(v) => i64::from(v.to_bits() as i32),
        })
        .collect()
}

fn name(l: &Launch) -> &'static str {
    KERNELS[l.func]
}

fn is_gemv(name: &str) -> bool {
    matches!(
        name,
        "gemv_q8" | "gemv_q8_r1" | "gemv_q8_b" | "gemv_q8_b_r1" | "gemv_ws_r1"
    )
}

/// Segments of a GEMV's arguments (gemv_q8's order: xq, xd, then GEMV_PARAMS):
/// (pointer, row bytes, format, rows) each; gated launches give gate and up.
fn gemv_segments(a: &[i64]) -> Vec<(i64, i64, i64, i64)> {
    let (total, gated, rows0, rows1) = (a[6], a[7] != 0, a[12], a[19]);
    if gated {
        return vec![(a[9], a[10], a[11], rows0), (a[16], a[17], a[18], rows0)];
    }
    let rows2 = total - rows0 - rows1;
    [(9, rows0), (16, rows1), (23, rows2)]
        .into_iter()
        .filter(|&(_, rows)| rows > 0)
        .map(|(b, rows)| (a[b], a[b + 1], a[b + 2], rows))
        .collect()
}

/// Whether the kernel's GEMV takes this launch: one token, gemv_q8's formats, rows and
/// pointers 16-byte aligned (bulk copies), whole 64-value units.
fn gemv_ok(a: &[i64]) -> bool {
    if a.len() != 29 || a[4] != 1 || a[3] <= 0 || a[3] % 64 != 0 {
        return false;
    }
    // Segments present are a prefix (the kernel indexes rows per chunk by segment).
    if a[7] == 0 && a[19] == 0 && a[6] - a[12] > 0 {
        return false;
    }
    gemv_segments(a).iter().all(|&(w, rb, ty, rows)| {
        format_ok(ty) && w % 16 == 0 && rb % 16 == 0 && rb > 0 && rows > 0
    })
}

/// (rows, bytes a row) of each segment of a GEMV phase as the kernel walks them: gated
/// phases one segment whose rows are a gate row and an up row side by side.
fn rows_and_bytes(a: &[i64]) -> Vec<(i64, i64)> {
    let segs = gemv_segments(a);
    if a[7] != 0 {
        vec![(segs[0].3, a[10] + a[17])]
    } else {
        segs.iter().map(|s| (s.3, s.1)).collect()
    }
}

/// Plain arguments of one recognized piece of a run.
enum Piece {
    Local(Phase),
    Gemv(Phase),
    Attn(Phase, Phase),
}

/// The piece starting at launch `i`, and the launches it takes.
fn piece(launches: &[Launch], i: usize, sms: usize) -> Option<(Piece, usize)> {
    let l = &launches[i];
    let a = raw(l);
    match name(l) {
        "rms_norm_q8" if a.len() == 7 && a[3] % 32 == 0 && a[3] <= MAX_LOCAL => {
            let mut v = a.clone();
            v.extend([0, 0]);
            Some((Piece::Local(Phase::new(NORM, v)), 1))
        }
        // The logit row of a single-token step, gathered for the final norm: folded into it.
        "gather_rows" if a.len() == 4 && l.grid.0 == 1 => {
            let next = launches.get(i + 1)?;
            let n = raw(next);
            if name(next) != "rms_norm_q8"
                || n.len() != 7
                || n[0] != a[1]
                || n[3] != a[3]
                || n[3] % 32 != 0
                || n[3] > MAX_LOCAL
            {
                return None;
            }
            let mut v = n.clone();
            v.extend([a[2], a[0]]);
            Some((Piece::Local(Phase::new(NORM, v)), 2))
        }
        "quantize_x_q8" if a.len() == 4 && a[1] % 32 == 0 && a[1] <= MAX_LOCAL => {
            Some((Piece::Local(Phase::new(QUANT, a)), 1))
        }
        n if is_gemv(n) && gemv_ok(&a) => Some((Piece::Gemv(Phase::new(GEMV, a)), 1)),
        "rope_store_kv" => {
            attention_piece(launches, i, sms).map(|(a, c, n)| (Piece::Attn(a, c), n))
        }
        _ => None,
    }
}

/// rope_store_kv, a split attention launch of one token and its merge as the ATTN and
/// COMBINE phases (partials pointer filled in at upload).
fn attention_piece(launches: &[Launch], i: usize, sms: usize) -> Option<(Phase, Phase, usize)> {
    let r = raw(&launches[i]);
    if r.len() != 26 || launches[i].grid.0 != 1 || r[0] != 0 {
        return None;
    }
    let (q, k, v, kc, vc) = (r[4], r[5], r[6], r[7], r[8]);
    let (n_rot, neox) = (r[17], r[18] != 0);
    let at = launches.get(i + 1)?;
    let a = raw(at);
    let an = name(at);
    let tiled = an.starts_with("attention_split_tiled");
    let split = matches!(an, "attention_split" | "attention_split_gqa");
    let want = if tiled { 18 } else { 16 };
    if !(tiled || split) || a.len() != want || at.grid.0 != 1 || a[15] != 0 {
        return None;
    }
    // Same query, cache and step buffers as the RoPE launch.
    if a[0] != q || a[1] != kc || a[2] != vc || a[4..8] != r[9..13] {
        return None;
    }
    let (n_head, n_head_kv, head_dim) = (a[9], a[10], a[11]);
    let (scale, window, splits) = (a[12], a[13], a[14]);
    if r[14] != n_head || r[15] != n_head_kv || r[16] != head_dim || a[8] != r[13] {
        return None;
    }
    let per_lane = head_dim / 32;
    let group = if n_head_kv > 0 { n_head / n_head_kv } else { 0 };
    let rope_ok =
        n_rot > 0 && n_rot <= head_dim && n_rot % 2 == 0 && (!neox || (n_rot / 2) % per_lane == 0);
    if !matches!(head_dim, 64 | 128)
        || group == 0
        || group > 8
        || n_head % n_head_kv != 0
        || !rope_ok
    {
        return None;
    }
    // The output and its quantization: the tiled launch's own with one split, else the
    // merge's.
    let (out, q8, q8d, used) = if tiled && splits == 1 {
        (a[3], a[16], a[17], 2)
    } else {
        let c = launches.get(i + 2)?;
        let m = raw(c);
        if name(c) != "attention_combine" || m.len() != 8 || m[5] != 0 || c.grid.0 != 1 {
            return None;
        }
        (m[1], m[6], m[7], 3)
    };
    if q8 == 0 || q8d == 0 {
        return None;
    }
    let max_splits = (sms * CONSUMER_WARPS as usize / n_head_kv as usize).clamp(1, MAX_SPLITS);
    let mut attn = vec![q, k, v, kc, vc];
    attn.extend(&r[9..13]); // positions, seq_of, table_off, tables
    attn.extend([r[13], n_head, n_head_kv, head_dim, scale, window]);
    attn.extend(&r[17..26]); // n_rot .. freq_factors
    attn.extend([0, max_splits as i64]);
    let combine = vec![
        0,
        out,
        n_head,
        head_dim,
        q8,
        q8d,
        max_splits as i64,
        r[9],
        window,
        n_head_kv,
    ];
    Some((Phase::new(ATTN, attn), Phase::new(COMBINE, combine), used))
}

/// The longest run of launches from `start` the kernel takes, as phases (None: fewer than
/// two GEMVs, not worth a launch).
fn run_at(launches: &[Launch], start: usize, sms: usize) -> Option<(Vec<Phase>, usize)> {
    let mut phases: Vec<Phase> = Vec::new();
    let mut i = start;
    let mut gemvs = 0;
    while i < launches.len() {
        let Some((p, used)) = piece(launches, i, sms) else {
            break;
        };
        match p {
            // A norm or quantization runs in every block into its shared copy: only a GEMV
            // reading exactly that copy may follow.
            Piece::Local(ph) => {
                let next = launches.get(i + used).map(|l| (name(l), raw(l)));
                let (q, d) = if ph.kind == NORM {
                    (ph.a[5], ph.a[6])
                } else {
                    (ph.a[2], ph.a[3])
                };
                match next {
                    Some((n, a)) if is_gemv(n) && gemv_ok(&a) && a[0] == q && a[1] == d => {
                        let mut g = Phase::new(GEMV, a);
                        let mut ph = ph;
                        g.local_x = local_norms();
                        ph.local_x = g.local_x;
                        phases.push(ph);
                        phases.push(g);
                        gemvs += 1;
                        i += used + 1;
                    }
                    _ => break,
                }
            }
            Piece::Gemv(g) => {
                phases.push(g);
                gemvs += 1;
                i += used;
            }
            Piece::Attn(a, c) => {
                phases.push(a);
                phases.push(c);
                i += used;
            }
        }
    }
    (gemvs >= 2).then_some((phases, i))
}

/// Row boundaries of a GEMV phase over `blocks` blocks, balanced by bytes.
fn row_bounds(rows_bytes: &[(i64, i64)], blocks: usize) -> Vec<u32> {
    let total: i64 = rows_bytes.iter().map(|&(r, b)| r * b).sum();
    let mut bounds = Vec::with_capacity(blocks + 1);
    let (mut row, mut seg, mut in_seg, mut done) = (0i64, 0usize, 0i64, 0i64);
    for b in 0..blocks {
        let target = total * b as i64 / blocks as i64;
        while seg < rows_bytes.len() && done + rows_bytes[seg].1 <= target {
            done += rows_bytes[seg].1;
            row += 1;
            in_seg += 1;
            if in_seg == rows_bytes[seg].0 {
                seg += 1;
                in_seg = 0;
            }
        }
        bounds.push(row as u32);
    }
    bounds.push(rows_bytes.iter().map(|s| s.0).sum::<i64>() as u32);
    bounds
}

/// The first run of `launches` the kernel takes, planned for `sms` blocks.
pub fn plan(launches: &[Launch], sms: usize) -> Option<Plan> {
    let (start, (mut phases, end)) =
        (0..launches.len()).find_map(|s| run_at(launches, s, sms).map(|r| (s, r)))?;
    // The activations' shared copy: the widest GEMV input; the slots: the rest.
    let widest = phases
        .iter()
        .filter(|p| p.kind == GEMV)
        .map(|p| p.a[3])
        .max()?;
    let x_bytes = (widest as u32).next_multiple_of(128);
    // After the activations: the slots' barriers, 32 floats for sums, the attention merge's
    // CONSUMER_WARPS × 130 floats.
    let fixed = x_bytes + x_bytes / 8 + 16 * SLOTS as u32 + 4 * 32 + 4 * 130 * CONSUMER_WARPS;
    let slot_bytes = (SMEM_BYTES.checked_sub(fixed)? / SLOTS as u32) / 16 * 16;
    let mut bounds = Vec::new();
    let mut weight_bytes = 0u64;
    let mut part_floats = 0usize;
    let n = phases.len();
    for (i, p) in phases.iter_mut().enumerate() {
        // Distributed norms and quantizations are read by every block's GEMV next.
        let distributed = matches!(p.kind, GEMV | ATTN | COMBINE) || !p.local_x;
        p.barrier = distributed && i + 1 < n;
        match p.kind {
            GEMV => {
                let rows_bytes = rows_and_bytes(&p.a);
                if rows_bytes.iter().any(|&(_, b)| b > i64::from(slot_bytes)) {
                    return None;
                }
                for (s, &(_, b)) in rows_bytes.iter().enumerate() {
                    p.rpc[s] = (i64::from(slot_bytes) / b).clamp(1, MAX_ROWS as i64) as i32;
                }
                weight_bytes += p.weight_bytes();
                p.bounds_at = bounds.len();
                bounds.extend(row_bounds(&rows_bytes, sms));
            }
            ATTN => {
                let (n_head, hd, max_splits) = (p.a[10], p.a[12], p.a[25]);
                part_floats = part_floats.max((n_head * max_splits * (hd + 2)) as usize);
            }
            _ => {}
        }
    }
    let barriers = phases.iter().filter(|p| p.barrier).count();
    Some(Plan {
        start,
        end,
        phases,
        bounds,
        barriers,
        slot_bytes,
        x_bytes,
        part_floats,
        weight_bytes,
    })
}

/// Slots of the ring in use (`KESTREL_CUDA_MEGA_SLOTS`: 8 or 16, the default; a multiple
/// of the consumer warps, so that each slot has one consumer).
pub fn ring() -> i32 {
    static RING: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *RING.get_or_init(|| {
        let n: i32 = std::env::var("KESTREL_CUDA_MEGA_SLOTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(SLOTS as i32);
        let w = CONSUMER_WARPS as i32;
        (n / w * w).clamp(w, SLOTS as i32)
    })
}

/// Measurement switches (`KESTREL_CUDA_MEGA_FLAGS`; wrong results): 1 = GEMV phases stream
/// their weights without computing.
pub fn flags() -> i32 {
    static FLAGS: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *FLAGS.get_or_init(|| {
        std::env::var("KESTREL_CUDA_MEGA_FLAGS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

/// Whether norms and quantizations feeding a GEMV run in every block into its shared copy
/// (`KESTREL_CUDA_MEGA_LOCAL=1`) or, the default, spread over the grid with a barrier after.
/// Measured (H100, Llama-3-8B Q4_K_M, per token): local 605 µs of norms and 603 of
/// quantizations, spread 334 and 111 (a grid barrier costs ~1 µs; every block quantizing a
/// whole 14,336-value row cost ~19 µs).
pub fn local_norms() -> bool {
    static LOCAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LOCAL.get_or_init(|| std::env::var("KESTREL_CUDA_MEGA_LOCAL").is_ok_and(|v| v == "1"))
}

/// Phase kinds by name, for the profile.
pub fn kind_name(kind: i32) -> &'static str {
    match kind {
        NORM => "norm (local)",
        QUANT => "quantize (local)",
        GEMV => "gemv",
        ATTN => "rope + attention",
        COMBINE => "attention merge",
        _ => "?",
    }
}

impl Plan {
    /// The phases' device bytes, with the partials at `part` and the bounds at `bounds`.
    pub fn phase_bytes(&self, part: u64, bounds: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.phases.len() * PHASE_BYTES);
        for p in &self.phases {
            let mut p = p.clone();
            match p.kind {
                ATTN => p.a[24] = part as i64,
                COMBINE => p.a[0] = part as i64,
                _ => {}
            }
            out.extend(p.bytes(bounds));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bounds_cover_every_row_once_balanced_by_bytes() {
        // Q (4 rows of 10 bytes), K (2 of 10), V (2 of 30): 120 bytes over 4 blocks.
        let b = row_bounds(&[(4, 10), (2, 10), (2, 30)], 4);
        assert_eq!(b.first(), Some(&0));
        assert_eq!(b.last(), Some(&8));
        assert!(b.windows(2).all(|w| w[0] <= w[1]));
        // 30 bytes a block: rows 0..3, 3..6, 6..7, 7..8.
        assert_eq!(b, vec![0, 3, 6, 7, 8]);
        for blocks in 1..40 {
            let b = row_bounds(&[(1000, 144), (7, 210), (33, 34)], blocks);
            assert_eq!(b.len(), blocks + 1);
            assert_eq!((b[0], b[blocks]), (0, 1040));
            assert!(b.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    fn launch(name: &str, grid: u32, args: Vec<Arg>) -> Launch {
        Launch {
            func: KERNELS.iter().position(|k| *k == name).unwrap(),
            grid: (grid, 1, 1),
            block: 128,
            args,
            weight_bytes: 0,
        }
    }

    /// gemv_q8's arguments for one plain 256-column matrix (`ty`, rows of `rb` bytes at `w`)
    /// reading the 8-bit activations at (q, d).
    fn gemv(q: u64, d: u64, w: u64, rb: i64, ty: GgmlType, rows: i32) -> Launch {
        use Arg::*;
        let mut a = vec![P(q), P(d), P(0), I(256), I(1), I(0), I(rows), I(0), I(0)];
        a.extend([
            P(w),
            L(rb),
            I(ty.id() as i32),
            I(rows),
            P(0x9000),
            I(rows),
            P(0),
        ]);
        a.extend([P(0), L(0), I(0), I(0), P(0), I(0), P(0)]);
        a.extend([P(0), L(0), I(0), P(0), I(0), P(0)]);
        launch("gemv_q8", 8, a)
    }

    fn norm(x: u64, q: u64, d: u64, cols: i32) -> Launch {
        use Arg::*;
        launch(
            "rms_norm_q8",
            16,
            vec![P(x), P(0x100), P(0x200), I(cols), F(1e-5), P(q), P(d)],
        )
    }

    #[test]
    fn plan_takes_norm_and_gemv_runs_and_stops_at_unknown_launches() {
        let (q, d) = (0x1000, 0x2000);
        let list = vec![
            launch("embed", 1, vec![]),
            norm(0x3000, q, d, 256),
            gemv(q, d, 0x10_0000, 144, GgmlType::Q4K, 64),
            norm(0x3000, q, d, 256),
            gemv(q, d, 0x20_0000, 224, GgmlType::Q6K, 32),
            launch("argmax_rows", 1, vec![]),
        ];
        let plan = plan(&list, 4).expect("a run of two GEMVs");
        assert_eq!((plan.start, plan.end), (1, 5));
        let kinds: Vec<i32> = plan.phases.iter().map(|p| p.kind).collect();
        assert_eq!(kinds, vec![NORM, GEMV, NORM, GEMV]);
        // Spread norms and every GEMV but the last have a barrier after them.
        let barriers: Vec<bool> = plan.phases.iter().map(|p| p.barrier).collect();
        assert_eq!(barriers, vec![!local_norms(), true, !local_norms(), false]);
        assert_eq!(plan.weight_bytes, 64 * 144 + 32 * 224);
        // Rows per chunk: as many whole rows as a slot holds, at most MAX_ROWS.
        assert_eq!(plan.phases[1].rpc[0], MAX_ROWS as i32);
        assert_eq!(plan.bounds.len(), 2 * 5);
    }

    #[test]
    fn plan_refuses_what_the_kernel_cannot_take() {
        let (q, d) = (0x1000, 0x2000);
        let good = |w: u64, rb: i64, ty: GgmlType| gemv(q, d, w, rb, ty, 64);
        let with = |g: Launch| {
            vec![
                norm(0x3000, q, d, 256),
                good(0x10_0000, 144, GgmlType::Q4K),
                g,
            ]
        };
        assert!(plan(&with(good(0x20_0000, 144, GgmlType::Q4K)), 4).is_some());
        // Q5_K, a misaligned matrix, rows not a multiple of 16 bytes: no second GEMV.
        assert!(plan(&with(good(0x20_0000, 176, GgmlType::Q5K)), 4).is_none());
        assert!(plan(&with(good(0x20_0008, 144, GgmlType::Q4K)), 4).is_none());
        assert!(plan(&with(good(0x20_0000, 136, GgmlType::Q8_0)), 4).is_none());
        // A norm whose output another launch reads than the GEMV: the run stops before it.
        let mut other = good(0x20_0000, 144, GgmlType::Q4K);
        other.args[0] = Arg::P(0x5000);
        let list = vec![
            good(0x10_0000, 144, GgmlType::Q4K),
            norm(0x3000, q, d, 256),
            other,
        ];
        assert!(plan(&list, 4).is_none());
        // Two tokens: not a single-token step.
        let mut two = good(0x20_0000, 144, GgmlType::Q4K);
        two.args[4] = Arg::I(2);
        assert!(plan(&with(two), 4).is_none());
    }

    /// rope_store_kv, attention_split_tiled128 (`splits` key ranges) and, for more than one
    /// split, attention_combine of one token: 32 query heads over 8 kv heads of 128 dims.
    fn attention_launches(splits: i32) -> Vec<Launch> {
        use Arg::*;
        let (q, k, v, kc, vc) = (0x100, 0x200, 0x300, 0x400, 0x500);
        let slots = [P(0x600), P(0x700), P(0x800), P(0x900)];
        let mut rope = vec![P(0), P(0), P(0), P(0), P(q), P(k), P(v), P(kc), P(vc)];
        rope.extend(slots);
        rope.extend([
            I(16),
            I(32),
            I(8),
            I(128),
            I(128),
            I(0),
            F(0.9),
            F(1.0),
            F(0.0),
        ]);
        rope.extend([F(1.0), F(0.0), F(0.0), P(0)]);
        let mut attn = vec![P(q), P(kc), P(vc), P(0xa00)];
        attn.extend(slots);
        attn.extend([I(16), I(32), I(8), I(128), F(0.088), I(0), I(splits), I(0)]);
        attn.extend([P(0xb00), P(0xc00)]);
        let mut list = vec![
            launch("rope_store_kv", 1, rope),
            launch("attention_split_tiled128", 1, attn),
        ];
        if splits > 1 {
            let merge = vec![P(0xa00), P(0xd00), I(32), I(128), I(splits), I(0)];
            let merge = [merge, vec![P(0xb00), P(0xc00)]].concat();
            list.push(launch("attention_combine", 1, merge));
        }
        list
    }

    #[test]
    fn attention_launches_become_attention_and_merge_phases() {
        for splits in [1, 8] {
            let list = attention_launches(splits);
            let (attn, merge, used) = attention_piece(&list, 0, 132).expect("taken");
            assert_eq!(used, list.len());
            assert_eq!((attn.kind, merge.kind), (ATTN, COMBINE));
            // q, k, v, the caches, the step's buffers, the geometry, RoPE's constants.
            assert_eq!(&attn.a[..5], &[0x100, 0x200, 0x300, 0x400, 0x500]);
            assert_eq!(&attn.a[5..9], &[0x600, 0x700, 0x800, 0x900]);
            assert_eq!(&attn.a[9..13], &[16, 32, 8, 128]);
            assert_eq!(attn.a[13], i64::from(0.088f32.to_bits() as i32));
            assert_eq!((attn.a[15], attn.a[16]), (128, 0));
            assert_eq!(attn.a[17], i64::from(0.9f32.to_bits() as i32));
            // Splits are the kernel's own: as many as the grid's warps over the kv heads.
            assert_eq!(
                attn.a[25],
                (132 * CONSUMER_WARPS as i64 / 8).min(MAX_SPLITS as i64)
            );
            // The output and its quantization: the tiled launch's with one split, else the
            // merge's (the same buffers here), and the merge knows the split rule's inputs.
            let out = if splits == 1 { 0xa00 } else { 0xd00 };
            assert_eq!((merge.a[1], merge.a[4], merge.a[5]), (out, 0xb00, 0xc00));
            assert_eq!(
                (merge.a[2], merge.a[3], merge.a[7], merge.a[9]),
                (32, 128, 0x600, 8)
            );
        }
    }

    #[test]
    fn attention_the_kernel_cannot_take_is_left_alone() {
        let refused = |edit: &dyn Fn(&mut Vec<Launch>)| {
            let mut list = attention_launches(8);
            edit(&mut list);
            attention_piece(&list, 0, 132).is_none()
        };
        assert!(!refused(&|_| {}));
        // The merged Q/K/V source (cuBLAS steps), a second token, another query buffer, a
        // 96-dim head, no merge after several splits.
        assert!(refused(&|l| l[0].args[0] = Arg::P(0x42)));
        assert!(refused(&|l| l[1].args[15] = Arg::I(1)));
        assert!(refused(&|l| l[1].args[0] = Arg::P(0x42)));
        assert!(refused(&|l| {
            l[0].args[16] = Arg::I(96);
            l[1].args[11] = Arg::I(96);
        }));
        assert!(refused(&|l| {
            l.pop();
        }));
    }

    #[test]
    fn phase_layout_matches_the_kernel_struct() {
        let mut p = Phase::new(GEMV, vec![7, -1]);
        p.bounds_at = 3;
        let b = p.bytes(1000);
        assert_eq!(b.len(), PHASE_BYTES);
        assert_eq!(&b[0..4], &GEMV.to_le_bytes());
        assert_eq!(&b[24..32], &1012u64.to_le_bytes());
        assert_eq!(&b[32..40], &7i64.to_le_bytes());
        assert_eq!(&b[40..48], &(-1i64).to_le_bytes());
    }
}
