//! The mixture-of-experts feed-forward block on the CPU: router logits (plus bias),
//! expert selection (`kestrel_model::moe::route`), then, expert by expert, the gated MLP
//! of the tokens that chose it (with the expert's biases where the model has them), read
//! from that expert's rows of the stacked 3-D weights (the other experts' bytes are never
//! touched), and each token's weighted sum in its selection order (as llama.cpp adds
//! them).

use std::cell::RefCell;

use anyhow::Context;
use kestrel_model::{Activation, ClampedSwiglu, LayerWeights, MoeConfig};

use crate::ops::{gate_values, matmul_rows, row};
use crate::{CpuBackend, CpuTensor, CpuWeight};

/// Buffers of one block, grown once and reused (a decode step allocates nothing after the
/// first).
#[derive(Default)]
struct MoeScratch {
    /// Router logits, `[n × n_expert]`.
    logits: Vec<f32>,
    /// `(expert, weight)` of each (token, slot), `[n × n_expert_used]`.
    routes: Vec<(usize, f32)>,
    /// The (token, slot) indices routed to the current expert.
    picked: Vec<usize>,
    /// Their inputs, gate/up and down products, and the expert's bias row.
    xs: Vec<f32>,
    bias: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    /// Each (token, slot)'s weighted expert output, `[n × n_expert_used × n_embd]`.
    ys: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<MoeScratch> = RefCell::new(MoeScratch::default());
}

fn grow(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

pub fn moe_ffn(
    be: &CpuBackend,
    x: &CpuTensor,
    layer: &LayerWeights<CpuWeight>,
    moe: &MoeConfig,
    act: Activation,
    n: usize,
    out: &mut CpuTensor,
) -> anyhow::Result<()> {
    let router = layer
        .ffn_gate_inp
        .as_ref()
        .context("a mixture-of-experts layer without its router (ffn_gate_inp)")?;
    let (d, ff, k) = (x.cols, moe.n_ff_exp, moe.n_expert_used);
    SCRATCH.with_borrow_mut(|s| {
        let logits = grow(&mut s.logits, n * moe.n_expert);
        matmul_rows(be, &x.data, router, 0..moe.n_expert, n, logits);
        if let Some(b) = &layer.ffn_gate_inp_bias {
            add_rows(logits, b.vector());
        }
        s.routes.resize(n * k, (0, 0.0));
        for (l, r) in logits
            .chunks_exact(moe.n_expert)
            .zip(s.routes.chunks_exact_mut(k))
        {
            kestrel_model::moe::route(moe, l, r);
        }
        let ys = grow(&mut s.ys, n * k * d);
        for e in 0..moe.n_expert {
            s.picked.clear();
            s.picked.extend((0..n * k).filter(|&i| s.routes[i].0 == e));
            let m = s.picked.len();
            if m == 0 {
                continue;
            }
            let xs = grow(&mut s.xs, m * d);
            for (dst, &i) in xs.chunks_exact_mut(d).zip(&s.picked) {
                let t = i / k;
                dst.copy_from_slice(&x.data[t * d..(t + 1) * d]);
            }
            let gate = grow(&mut s.gate, m * ff);
            let up = grow(&mut s.up, m * ff);
            matmul_rows(be, xs, &layer.ffn_gate, e * ff..(e + 1) * ff, m, gate);
            matmul_rows(be, xs, &layer.ffn_up, e * ff..(e + 1) * ff, m, up);
            add_expert_bias(&layer.ffn_gate_exps_bias, e, &mut s.bias, gate);
            add_expert_bias(&layer.ffn_up_exps_bias, e, &mut s.bias, up);
            match moe.clamped_swiglu {
                Some(c) => clamped_swiglu(c, gate, up),
                None => gate_values(be.numerics, gate, up, act),
            }
            let down = grow(&mut s.down, m * d);
            matmul_rows(be, gate, &layer.ffn_down, e * d..(e + 1) * d, m, down);
            add_expert_bias(&layer.ffn_down_exps_bias, e, &mut s.bias, down);
            for (src, &i) in down.chunks_exact(d).zip(&s.picked) {
                let w = s.routes[i].1;
                for (y, v) in ys[i * d..(i + 1) * d].iter_mut().zip(src) {
                    *y = v * w;
                }
            }
        }
        for (o, y) in out.data[..n * d]
            .chunks_exact_mut(d)
            .zip(ys.chunks_exact(k * d))
        {
            o.copy_from_slice(&y[..d]);
            for slot in y.chunks_exact(d).skip(1) {
                o.iter_mut().zip(slot).for_each(|(o, v)| *o += v);
            }
        }
        Ok(())
    })
}

/// `rows[i] += bias` for every row of `bias.len()` values.
fn add_rows(rows: &mut [f32], bias: &[f32]) {
    for r in rows.chunks_exact_mut(bias.len().max(1)) {
        r.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
    }
}

/// Adds expert `e`'s row of a stacked bias (`[n_expert × cols]`), if there is one, to
/// every row of `rows`; `buf` receives the row.
fn add_expert_bias(bias: &Option<CpuWeight>, e: usize, buf: &mut Vec<f32>, rows: &mut [f32]) {
    if let Some(w @ CpuWeight::Matrix { cols, .. }) = bias {
        let b = grow(buf, *cols);
        row(w, e, b);
        add_rows(rows, b);
    }
}

/// ggml's `swiglu_oai`, element by element: `g = act(g) * (u + 1)` with both clamped.
fn clamped_swiglu(c: ClampedSwiglu, g: &mut [f32], u: &[f32]) {
    for (g, &u) in g.iter_mut().zip(u) {
        let x = g.min(c.limit);
        let y = u.clamp(-c.limit, c.limit);
        *g = x / (1.0 + (c.alpha * -x).exp()) * (y + 1.0);
    }
}
