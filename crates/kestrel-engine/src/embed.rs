//! Embeddings: the final-norm hidden states of each input's tokens, pooled into one vector
//! per input (`<arch>.pooling_type`: mean, first token or last token), as llama.cpp's
//! `llama_get_embeddings_seq` gives them (not normalized).

use anyhow::bail;
use kestrel_model::{Backend, Output, Pooling};

use crate::engine::{Engine, Sequence};

/// Most inputs sharing one step.
const MAX_PACK: usize = 64;

/// One part of an embedding step: input `input`'s tokens `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbedPart {
    pub input: usize,
    pub start: usize,
    pub len: usize,
}

/// The steps that evaluate inputs of `lens` tokens in steps of at most `budget` tokens:
/// short inputs (up to `budget`) packed whole, up to [`MAX_PACK`] a step; a longer one
/// alone in consecutive chunks. Each input's blocks are held only during its steps.
pub fn plan_steps(lens: &[usize], budget: usize) -> Vec<Vec<EmbedPart>> {
    let budget = budget.max(1);
    let mut steps = Vec::new();
    let mut pack: Vec<EmbedPart> = Vec::new();
    let mut used = 0;
    for (input, &len) in lens.iter().enumerate() {
        if len > budget {
            if !pack.is_empty() {
                steps.push(std::mem::take(&mut pack));
                used = 0;
            }
            for start in (0..len).step_by(budget) {
                steps.push(vec![EmbedPart {
                    input,
                    start,
                    len: budget.min(len - start),
                }]);
            }
            continue;
        }
        if used + len > budget || pack.len() == MAX_PACK {
            steps.push(std::mem::take(&mut pack));
            used = 0;
        }
        pack.push(EmbedPart {
            input,
            start: 0,
            len,
        });
        used += len;
    }
    if !pack.is_empty() {
        steps.push(pack);
    }
    steps
}

impl<B: Backend> Engine<B> {
    /// The most KV blocks [`Self::embed`] holds at once for inputs of `lens` tokens.
    pub fn embed_blocks(&self, lens: &[usize]) -> usize {
        plan_steps(lens, self.max_batch_tokens())
            .iter()
            .map(|step| {
                step.iter()
                    .map(|p| self.blocks.blocks_for(p.start + p.len))
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
    }

    /// One embedding per input: its tokens are evaluated as a fresh sequence (nothing
    /// shared with the cache's other contents; the blocks are given back at the end) and
    /// the final-norm hidden states of its tokens pooled as `pooling` says (mean, first,
    /// last). The caller makes sure [`Self::embed_blocks`] blocks are free.
    pub fn embed(&mut self, inputs: &[&[u32]], pooling: Pooling) -> anyhow::Result<Vec<Vec<f32>>> {
        if !matches!(pooling, Pooling::Mean | Pooling::Cls | Pooling::Last) {
            bail!(
                "pooling '{}' gives no single vector per input",
                pooling.name()
            );
        }
        let cfg = self.config();
        let (n_embd, vocab, ctx) = (cfg.n_embd, cfg.vocab_size, self.ctx);
        for (i, t) in inputs.iter().enumerate() {
            if t.is_empty() {
                bail!("input {i} has no tokens");
            }
            if t.len() > ctx {
                bail!("input {i} has {} tokens, the context holds {ctx}", t.len());
            }
            if let Some(&id) = t.iter().find(|&&id| id as usize >= vocab) {
                bail!("input {i} has token id {id}, the vocabulary has {vocab} tokens");
            }
        }
        let lens: Vec<usize> = inputs.iter().map(|t| t.len()).collect();
        let steps = plan_steps(&lens, self.max_batch_tokens());
        let mut sums = vec![vec![0f64; n_embd]; inputs.len()];
        let mut seqs: Vec<Sequence> = vec![Sequence::default(); inputs.len()];
        let mut batch = kestrel_model::Batch::default();
        let mut rows = Vec::new();
        let result = (|| -> anyhow::Result<()> {
            for step in &steps {
                batch.clear_tokens();
                batch.output = Output::Hidden;
                // Per part: the index of its first hidden row and how many it has.
                let mut row_of = Vec::with_capacity(step.len());
                let mut n_rows = 0;
                for (slot, p) in step.iter().enumerate() {
                    let seq = &mut seqs[p.input];
                    self.blocks.ensure(&mut seq.block_table, p.start + p.len)?;
                    let first = batch.len();
                    let end = first + p.len;
                    batch.push_part(
                        slot,
                        &inputs[p.input][p.start..p.start + p.len],
                        p.start,
                        &seq.block_table,
                        0,
                    );
                    let wanted = match pooling {
                        Pooling::Mean => first..end,
                        Pooling::Cls if p.start == 0 => first..first + 1,
                        Pooling::Last if p.start + p.len == lens[p.input] => end - 1..end,
                        _ => end..end,
                    };
                    let want = wanted.len();
                    batch.logit_rows.extend(wanted.map(|r| r as u32));
                    row_of.push((n_rows, want));
                    n_rows += want;
                }
                batch.seqs.truncate(step.len());
                self.forward(&batch)?;
                let Engine {
                    backend, scratch, ..
                } = self;
                backend.with_rows(scratch.hidden(), n_rows, &mut rows, &mut |h| {
                    for (p, &(first, want)) in step.iter().zip(&row_of) {
                        let sum = &mut sums[p.input];
                        for row in h[first * n_embd..(first + want) * n_embd].chunks_exact(n_embd) {
                            for (s, &v) in sum.iter_mut().zip(row) {
                                *s += v as f64;
                            }
                        }
                    }
                })?;
                for p in step {
                    seqs[p.input]
                        .tokens
                        .extend_from_slice(&inputs[p.input][p.start..p.start + p.len]);
                    if p.start + p.len == lens[p.input] {
                        self.release(&mut seqs[p.input]);
                    }
                }
            }
            Ok(())
        })();
        for seq in &mut seqs {
            self.release(seq);
        }
        result?;
        let div = |i: usize| match pooling {
            Pooling::Mean => lens[i] as f64,
            _ => 1.0,
        };
        Ok(sums
            .iter()
            .enumerate()
            .map(|(i, s)| s.iter().map(|&v| (v / div(i)) as f32).collect())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_packs_short_inputs_and_chunks_long_ones() {
        let steps = plan_steps(&[3, 4, 10, 2, 5, 5], 8);
        let flat: Vec<Vec<(usize, usize, usize)>> = steps
            .iter()
            .map(|s| s.iter().map(|p| (p.input, p.start, p.len)).collect())
            .collect();
        assert_eq!(
            flat,
            vec![
                vec![(0, 0, 3), (1, 0, 4)],
                vec![(2, 0, 8)],
                vec![(2, 8, 2)],
                vec![(3, 0, 2), (4, 0, 5)],
                vec![(5, 0, 5)],
            ]
        );
        // Every token of every input exactly once, in order.
        for lens in [vec![1; 200], vec![17, 1, 64, 65, 3], vec![]] {
            let steps = plan_steps(&lens, 16);
            let mut seen = vec![0; lens.len()];
            for step in &steps {
                assert!(step.iter().map(|p| p.len).sum::<usize>() <= 16);
                assert!(step.len() <= MAX_PACK);
                for p in step {
                    assert_eq!(p.start, seen[p.input]);
                    seen[p.input] += p.len;
                }
            }
            assert_eq!(seen, lens);
        }
    }
}
