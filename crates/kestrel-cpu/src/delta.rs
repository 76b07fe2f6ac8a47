//! Gated DeltaNet linear attention on the CPU (Qwen3-Next, Qwen3.5), as llama.cpp's CPU
//! backend computes it: `ggml_ssm_conv` (taps summed in order in f32), SiLU, the L2 norm
//! of q and k (`rms_norm(x, eps / n) / sqrt(n)`, the sum of squares in f64), and
//! `ggml_gated_delta_net`'s sequential recurrence, token by token, in each sequence's
//! state; then the gated RMS norm of each head's output. Prompts run the same recurrence
//! as decoding, so a prompt's state is exactly the one its tokens decoded one by one reach.
//!
//! A sequence's state is keyed by (its first cache block, layer): a sequence owns its first
//! block while it lives (the engine turns prefix sharing off for these models), and a state
//! starts from zero whenever a sequence's token at position 0 arrives. Every other token
//! must continue where its sequence's state stopped, or the step fails: such a state
//! cannot be rolled back or rebuilt from K/V blocks.

use std::collections::HashMap;

use anyhow::{Context, bail};
use kestrel_model::{Batch, DeltaNetConfig, DeltaNetWeights};

use crate::{CpuTensor, CpuWeight};

/// One sequence's state in one linear-attention layer.
pub struct RecurrentState {
    /// Tokens the state has taken in.
    len: usize,
    /// The last `d_conv - 1` inputs of each convolution channel, `[conv_dim × (d_conv - 1)]`.
    conv: Vec<f32>,
    /// Each v head's `[head_v_dim × head_k_dim]` matrix (row j: value dimension j).
    ssm: Vec<f32>,
}

/// The states of every live sequence, by (first block, layer).
#[derive(Default)]
pub struct RecurrentStates {
    states: HashMap<(u32, usize), RecurrentState>,
}

impl RecurrentStates {
    /// (sequence, layer) states held.
    pub fn len(&self) -> usize {
        self.states.len()
    }

    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// Drops every layer's state of the sequence whose first block is `first_block`.
    pub fn forget(&mut self, first_block: u32) {
        self.states.retain(|&(b, _), _| b != first_block);
    }
}

fn zeros(len: usize) -> anyhow::Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .with_context(|| format!("allocating a linear-attention state of {len} values"))?;
    v.resize(len, 0.0);
    Ok(v)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// ggml's vector `expf` (`ggml_v_expf`, its AVX-512 form, which llama.cpp's CPU backend runs
/// on such machines): at most 1.5 ulp from `expf`, and not always equal to it.
fn ggml_v_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),                  // 0x1.7f7d1cp-20
        (-n).mul_add(f32::from_bits(0x3f31_7200), x), // 0x1.62e4p-1
    );
    let u = b * b;
    let j = f32::from_bits(0x3c07_2010) // 0x1.0e4020p-7
        .mul_add(b, f32::from_bits(0x3d2b_9f17)) // 0x1.573e2ep-5
        .mul_add(
            u,
            f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)), // 0x1.555e66p-3, 0x1.fffdb6p-2
        )
        .mul_add(u, f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0)); // 0x1.ffffecp-1
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // scalef: j · 2^n (n is a whole number here).
    j * 2f32.powi(n as i32)
}

/// SiLU of a row as ggml's `ggml_vec_silu_f32` computes it with AVX-512: 16-wide blocks
/// through `ggml_v_expf`, the tail through `expf`.
fn silu_row(row: &mut [f32]) {
    let vec_len = row.len() - row.len() % 16;
    let (head, tail) = row.split_at_mut(vec_len);
    head.iter_mut()
        .for_each(|v| *v = *v / (1.0 + ggml_v_expf(-*v)));
    tail.iter_mut().for_each(|v| *v = silu(*v));
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { (1.0 + x.exp()).ln() }
}

/// ggml's RMS norm scale of `x` with epsilon `eps` (f32 squares summed in f64).
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// `ggml_vec_dot_f32` in its AVX-512 order: four 16-lane fused multiply-add accumulators
/// over blocks of 64, folded (0+2, 1+3, then 0+1) and reduced as `_mm512_reduce_add_ps`
/// does (halves, then quarters, then pairs); the values past the last block added after.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let np = n - n % 64;
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, s) in lanes.iter_mut().enumerate() {
                let k = i + 16 * j + l;
                *s = a[k].mul_add(b[k], *s);
            }
        }
    }
    let mut v = [0f32; 16];
    for l in 0..16 {
        v[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut h = [0f32; 8];
    for l in 0..8 {
        h[l] = v[l + 8] + v[l];
    }
    let q = [h[4] + h[0], h[5] + h[1], h[6] + h[2], h[7] + h[3]];
    let mut sum = (q[0] + q[2]) + (q[1] + q[3]);
    for k in np..n {
        sum += a[k] * b[k];
    }
    sum
}

/// An f32 weight's values (vectors as loaded; a matrix such as the convolution taps read
/// from its file bytes).
fn values(w: &CpuWeight, what: &str) -> anyhow::Result<Vec<f32>> {
    match w {
        CpuWeight::Vector(v) => Ok(v.clone()),
        CpuWeight::Matrix {
            file,
            info,
            ty,
            rows,
            cols,
            ..
        } => {
            let mut out = vec![0f32; rows * cols];
            kestrel_quant::dequantize_row(*ty, file.tensor_data(info), &mut out)
                .with_context(|| format!("reading {what}"))?;
            Ok(out)
        }
    }
}

fn vector<'a>(w: &'a CpuWeight, len: usize, what: &str) -> anyhow::Result<&'a [f32]> {
    match w {
        CpuWeight::Vector(v) if v.len() == len => Ok(v),
        _ => bail!("{what} must be a vector of {len} values"),
    }
}

/// The layer's core after its input projections (see `Backend::delta_net`).
#[allow(clippy::too_many_arguments)]
pub fn delta_net(
    states: &mut RecurrentStates,
    layer: usize,
    cfg: &DeltaNetConfig,
    w: &DeltaNetWeights<CpuWeight>,
    mix: &CpuTensor,
    z: &CpuTensor,
    beta: &CpuTensor,
    alpha: &CpuTensor,
    eps: f32,
    batch: &Batch,
    n: usize,
    out: &mut CpuTensor,
) -> anyhow::Result<()> {
    let (hk, hv, nv) = (cfg.head_k_dim, cfg.head_v_dim, cfg.n_v_heads);
    let (key_dim, conv_dim, taps) = (cfg.key_dim(), cfg.conv_dim(), cfg.d_conv);
    let conv_w = values(&w.conv, "ssm_conv1d")?;
    if conv_w.len() != conv_dim * taps {
        bail!(
            "ssm_conv1d has {} values, expected {}",
            conv_w.len(),
            conv_dim * taps
        );
    }
    let dt_bias = vector(&w.dt_bias, nv, "ssm_dt.bias")?;
    let a = vector(&w.a, nv, "ssm_a")?;
    let norm = vector(&w.norm, hv, "ssm_norm")?;
    let keep = taps - 1;
    let scale = 1.0 / (hk as f32).sqrt();
    let l2_eps = eps / hk as f32;
    let l2_scale = 1.0 / (hk as f32).sqrt();
    let mut conv_out = vec![0f32; conv_dim];
    let mut delta = vec![0f32; hv];
    let mut z_act = vec![0f32; cfg.value_dim()];
    for t in 0..n {
        let seq = batch.seq_of[t] as usize;
        let pos = batch.positions[t] as usize;
        let first = *batch.seqs[seq]
            .block_table
            .first()
            .context("a sequence without cache blocks")?;
        let key = (first, layer);
        if pos == 0 {
            match states.states.get_mut(&key) {
                Some(s) => {
                    s.len = 0;
                    s.conv.fill(0.0);
                    s.ssm.fill(0.0);
                }
                None => {
                    let s = RecurrentState {
                        len: 0,
                        conv: zeros(conv_dim * keep)?,
                        ssm: zeros(cfg.state_len())?,
                    };
                    states.states.insert(key, s);
                }
            }
        }
        let Some(state) = states.states.get_mut(&key).filter(|s| s.len == pos) else {
            let at = states.states.get(&key).map_or(0, |s| s.len);
            bail!(
                "a linear-attention layer's state holds {at} tokens of this sequence but the \
                 step continues at position {pos}: models with recurrent layers cannot roll \
                 back or reuse cached prefixes"
            );
        };

        // Causal convolution over the last `taps` inputs of each channel, then SiLU; the
        // window slides by one.
        let x = &mix.data[t * mix.cols..t * mix.cols + conv_dim];
        for c in 0..conv_dim {
            let hist = &mut state.conv[c * keep..(c + 1) * keep];
            let wc = &conv_w[c * taps..(c + 1) * taps];
            let mut sum = 0f32;
            for i in 0..keep {
                sum += hist[i] * wc[i];
            }
            sum += x[c] * wc[keep];
            conv_out[c] = sum;
            if keep > 0 {
                hist.copy_within(1.., 0);
                hist[keep - 1] = x[c];
            }
        }
        silu_row(&mut conv_out);
        // L2-normalized q and k heads.
        for head in conv_out[..2 * key_dim].chunks_exact_mut(hk) {
            let s = rms_scale(head, l2_eps);
            head.iter_mut().for_each(|v| *v = *v * s * l2_scale);
        }
        let (q, rest) = conv_out.split_at(key_dim);
        let (k, v) = rest.split_at(key_dim);

        let o_row = &mut out.data[t * out.cols..t * out.cols + cfg.value_dim()];
        z_act.copy_from_slice(&z.data[t * z.cols..t * z.cols + cfg.value_dim()]);
        for head in z_act.chunks_exact_mut(hv) {
            silu_row(head);
        }
        for h in 0..nv {
            let kh = cfg.k_head(h);
            let (qh, kh_) = (&q[kh * hk..(kh + 1) * hk], &k[kh * hk..(kh + 1) * hk]);
            let vh = &v[h * hv..(h + 1) * hv];
            let (bc, ac) = cfg.beta_alpha_cols(h);
            let b = sigmoid(beta.data[t * beta.cols + bc]);
            let g = softplus(alpha.data[t * alpha.cols + ac] + dt_bias[h]) * a[h];
            let decay = g.exp();
            let s = &mut state.ssm[h * hv * hk..(h + 1) * hv * hk];
            s.iter_mut().for_each(|x| *x *= decay);
            for (j, row) in s.chunks_exact(hk).enumerate() {
                delta[j] = (vh[j] - dot(row, kh_)) * b;
            }
            for (j, row) in s.chunks_exact_mut(hk).enumerate() {
                let d = delta[j];
                // ggml_vec_mad_f32: fused multiply-adds.
                row.iter_mut()
                    .zip(kh_)
                    .for_each(|(x, &kk)| *x = kk.mul_add(d, *x));
            }
            let o = &mut o_row[h * hv..(h + 1) * hv];
            for (j, row) in s.chunks_exact(hk).enumerate() {
                o[j] = dot(row, qh) * scale;
            }
            // Gated RMS norm: rms_norm(o) · ssm_norm · silu(z).
            let rs = rms_scale(o, eps);
            let zh = &z_act[h * hv..(h + 1) * hv];
            for j in 0..hv {
                o[j] = o[j] * rs * norm[j] * zh[j];
            }
        }
        state.len += 1;
    }
    Ok(())
}

/// `q` and `gate` from each token's `[n_head × 2·head_dim]` row (query, then gate, per head).
pub fn split_gated_query(
    qg: &CpuTensor,
    head_dim: usize,
    n: usize,
    q: &mut CpuTensor,
    gate: &mut CpuTensor,
) -> anyhow::Result<()> {
    kestrel_model::backend::check_gated_query_split(qg.cols, q.cols, gate.cols, head_dim)?;
    for t in 0..n {
        let src = &qg.data[t * qg.cols..(t + 1) * qg.cols];
        for (h, pair) in src.chunks_exact(2 * head_dim).enumerate() {
            let o = t * q.cols + h * head_dim;
            q.data[o..o + head_dim].copy_from_slice(&pair[..head_dim]);
            gate.data[o..o + head_dim].copy_from_slice(&pair[head_dim..]);
        }
    }
    Ok(())
}

/// `x *= sigmoid(gate)`.
pub fn sigmoid_mul(x: &mut CpuTensor, gate: &CpuTensor, n: usize) -> anyhow::Result<()> {
    if x.cols != gate.cols {
        bail!("sigmoid_mul: {} columns against {}", x.cols, gate.cols);
    }
    let len = n * x.cols;
    x.data[..len]
        .iter_mut()
        .zip(&gate.data[..len])
        .for_each(|(v, &g)| *v *= sigmoid(g));
    Ok(())
}

/// `out += y · sigmoid(x · w)` per token (f32 dot product, as ggml's f32 product).
pub fn add_sigmoid_gated(
    out: &mut CpuTensor,
    y: &CpuTensor,
    x: &CpuTensor,
    w: &CpuWeight,
    n: usize,
) -> anyhow::Result<()> {
    let w = vector(w, x.cols, "the shared expert's gate")?;
    if out.cols != y.cols {
        bail!("add_sigmoid_gated: {} columns against {}", out.cols, y.cols);
    }
    for t in 0..n {
        let g = sigmoid(dot(&x.data[t * x.cols..(t + 1) * x.cols], w));
        let (o, yr) = (
            &mut out.data[t * out.cols..(t + 1) * out.cols],
            &y.data[t * y.cols..(t + 1) * y.cols],
        );
        o.iter_mut().zip(yr).for_each(|(a, &b)| *a += b * g);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// One token's projections: conv input, output gate, beta row, alpha row.
    type Row = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

    /// The layer's definition in f64, one sequence's tokens in order (exact exp, no fused
    /// rounding): the oracle for the indexing (head pairing, beta/alpha columns, state
    /// layout) and the arithmetic.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        cfg: &DeltaNetConfig,
        conv_w: &[f32],
        dt: &[f32],
        a: &[f32],
        norm: &[f32],
        rows: &[Row],
        eps: f64,
    ) -> Vec<Vec<f64>> {
        let (hk, hv, nv, taps) = (cfg.head_k_dim, cfg.head_v_dim, cfg.n_v_heads, cfg.d_conv);
        let (key_dim, conv_dim) = (cfg.key_dim(), cfg.conv_dim());
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let mut state = vec![vec![0f64; hv * hk]; nv];
        let mut out = Vec::new();
        for (t, (mix, z, beta, alpha)) in rows.iter().enumerate() {
            let mut c = vec![0f64; conv_dim];
            for (ch, cv) in c.iter_mut().enumerate() {
                let mut s = 0.0;
                for i in 0..taps {
                    // Tap i reads the input taps-1-i tokens back (zero before the start).
                    let back = taps - 1 - i;
                    if t >= back {
                        s += rows[t - back].0[ch] as f64 * conv_w[ch * taps + i] as f64;
                    }
                }
                *cv = silu(s);
            }
            let _ = mix;
            for head in c[..2 * key_dim].chunks_exact_mut(hk) {
                let n: f64 = head.iter().map(|v| v * v).sum::<f64>() + eps;
                head.iter_mut().for_each(|v| *v /= n.sqrt());
            }
            let mut o = vec![0f64; cfg.value_dim()];
            for h in 0..nv {
                let kh = cfg.k_head(h);
                let q = &c[kh * hk..(kh + 1) * hk];
                let k = &c[key_dim + kh * hk..key_dim + (kh + 1) * hk];
                let v = &c[2 * key_dim + h * hv..2 * key_dim + (h + 1) * hv];
                let (bc, ac) = cfg.beta_alpha_cols(h);
                let b = 1.0 / (1.0 + (-(beta[bc] as f64)).exp());
                let x = alpha[ac] as f64 + dt[h] as f64;
                let g = (1.0 + x.exp()).ln() * a[h] as f64;
                let s = &mut state[h];
                s.iter_mut().for_each(|x| *x *= g.exp());
                for j in 0..hv {
                    let sk: f64 = (0..hk).map(|i| s[j * hk + i] * k[i]).sum();
                    let d = (v[j] - sk) * b;
                    (0..hk).for_each(|i| s[j * hk + i] += k[i] * d);
                }
                let oh = &mut o[h * hv..(h + 1) * hv];
                for (j, oj) in oh.iter_mut().enumerate() {
                    *oj = (0..hk).map(|i| s[j * hk + i] * q[i]).sum::<f64>() / (hk as f64).sqrt();
                }
                let ms = oh.iter().map(|v| v * v).sum::<f64>() / hv as f64;
                for j in 0..hv {
                    oh[j] *= norm[j] as f64 / (ms + eps).sqrt() * silu(z[h * hv + j] as f64);
                }
            }
            out.push(o);
        }
        out
    }

    #[test]
    fn matches_an_f64_reference_across_steps_and_sequences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for qwen3next_layout in [true, false] {
            // Awkward sizes: heads of 24, three k heads for six v heads, three taps.
            let cfg = DeltaNetConfig {
                d_conv: 3,
                head_k_dim: 24,
                head_v_dim: 24,
                n_k_heads: 3,
                n_v_heads: 6,
                qwen3next_layout,
            };
            let nv = cfg.n_v_heads;
            let mut r = |n: usize, s: f32| -> Vec<f32> {
                (0..n).map(|_| rng.random_range(-s..s)).collect()
            };
            let conv_w = r(cfg.conv_dim() * cfg.d_conv, 0.6);
            let dt = r(nv, 1.0);
            let a: Vec<f32> = r(nv, 0.2).iter().map(|v| v - 0.3).collect();
            let norm: Vec<f32> = r(cfg.head_v_dim, 0.2).iter().map(|v| v + 1.0).collect();
            let ba_cols = if qwen3next_layout { 2 * nv } else { nv };
            // Two sequences of 9 and 5 tokens.
            let seqs: Vec<Vec<_>> = [9usize, 5]
                .iter()
                .map(|&len| {
                    (0..len)
                        .map(|_| {
                            (
                                r(cfg.conv_dim(), 2.0),
                                r(cfg.value_dim(), 2.0),
                                r(ba_cols, 2.0),
                                r(nv, 2.0),
                            )
                        })
                        .collect()
                })
                .collect();
            let dummy = || CpuWeight::Vector(Vec::new());
            let w = DeltaNetWeights {
                in_qkv: dummy(),
                gate: dummy(),
                beta: dummy(),
                alpha: None,
                conv: CpuWeight::Vector(conv_w.clone()),
                dt_bias: CpuWeight::Vector(dt.clone()),
                a: CpuWeight::Vector(a.clone()),
                norm: CpuWeight::Vector(norm.clone()),
                out: dummy(),
            };
            let eps = 1e-6;
            let mut states = RecurrentStates::default();
            let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 2];
            // Steps mixing the two sequences: (tokens of seq 0, tokens of seq 1).
            let mut done = [0usize, 0];
            for (n0, n1) in [(4usize, 2usize), (1, 1), (4, 2)] {
                let mut batch = Batch::default();
                let mut slot = 0;
                for (s, cnt) in [(0usize, n0), (1, n1)] {
                    let cnt = cnt.min(seqs[s].len() - done[s]);
                    if cnt == 0 {
                        continue;
                    }
                    let ids = vec![0u32; cnt];
                    batch.push_part(slot, &ids, done[s], &[10 + s as u32], cnt);
                    slot += 1;
                }
                batch.seqs.truncate(slot);
                let n = batch.len();
                let tensor = |cols: usize| CpuTensor {
                    data: vec![0.0; n * cols],
                    cols,
                };
                let (mut mix, mut z, mut beta, mut alpha) = (
                    tensor(cfg.conv_dim()),
                    tensor(cfg.value_dim()),
                    tensor(ba_cols),
                    tensor(nv),
                );
                let mut owner = Vec::new();
                for (s, cnt) in [(0usize, n0), (1, n1)] {
                    for _ in 0..cnt.min(seqs[s].len() - done[s]) {
                        let t = owner.len();
                        let row = &seqs[s][done[s]];
                        mix.data[t * mix.cols..][..mix.cols].copy_from_slice(&row.0);
                        z.data[t * z.cols..][..z.cols].copy_from_slice(&row.1);
                        beta.data[t * beta.cols..][..beta.cols].copy_from_slice(&row.2);
                        alpha.data[t * alpha.cols..][..alpha.cols].copy_from_slice(&row.3);
                        owner.push(s);
                        done[s] += 1;
                    }
                }
                let alpha_t = if qwen3next_layout { &beta } else { &alpha };
                let mut out = tensor(cfg.value_dim());
                delta_net(
                    &mut states,
                    2,
                    &cfg,
                    &w,
                    &mix,
                    &z,
                    &beta,
                    alpha_t,
                    eps,
                    &batch,
                    n,
                    &mut out,
                )
                .expect("delta_net");
                for (t, &s) in owner.iter().enumerate() {
                    got[s].push(out.data[t * out.cols..(t + 1) * out.cols].to_vec());
                }
            }
            for s in 0..2 {
                let rows: Vec<_> = seqs[s]
                    .iter()
                    .map(|(m, z, b, al)| {
                        let al = if qwen3next_layout {
                            b.clone()
                        } else {
                            al.clone()
                        };
                        (m.clone(), z.clone(), b.clone(), al)
                    })
                    .collect();
                let want = reference(&cfg, &conv_w, &dt, &a, &norm, &rows, eps as f64);
                assert_eq!(got[s].len(), want.len());
                for (t, (g, w)) in got[s].iter().zip(&want).enumerate() {
                    for (j, (&gv, &wv)) in g.iter().zip(w).enumerate() {
                        assert!(
                            (gv as f64 - wv).abs() <= 1e-4 * (1.0 + wv.abs()),
                            "layout {qwen3next_layout}, seq {s}, token {t}, value {j}: {gv} vs {wv}"
                        );
                    }
                }
            }
            // A sequence that does not continue where its state is: an error.
            let mut batch = Batch::default();
            batch.push_part(0, &[0], 3, &[10], 1);
            let one = |cols: usize| CpuTensor {
                data: vec![0.0; cols],
                cols,
            };
            let (mix, z, beta) = (one(cfg.conv_dim()), one(cfg.value_dim()), one(ba_cols));
            let mut out = one(cfg.value_dim());
            let e = delta_net(
                &mut states,
                2,
                &cfg,
                &w,
                &mix,
                &z,
                &beta,
                &beta,
                eps,
                &batch,
                1,
                &mut out,
            );
            assert!(e.is_err());
        }
    }
}
