//! The mixture-of-experts feed-forward block on the CPU: router logits, expert selection
//! (`kestrel_model::moe::route`), then, expert by expert, the gated MLP of the tokens that
//! chose it, read from that expert's rows of the stacked 3-D weights (the other experts'
//! bytes are never touched), and each token's weighted sum in its selection order (as
//! llama.cpp adds them).

use std::cell::RefCell;

use anyhow::Context;
use kestrel_model::{Activation, LayerWeights, MoeConfig};

use crate::ops::{gate_values, matmul_rows};
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
    /// Their inputs, gate/up and down products.
    xs: Vec<f32>,
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
            gate_values(be.numerics, gate, up, act);
            let down = grow(&mut s.down, m * d);
            matmul_rows(be, gate, &layer.ffn_down, e * d..(e + 1) * d, m, down);
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
