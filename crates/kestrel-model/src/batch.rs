//! The flat token batch every forward pass takes: prefill, decode and mixes of both.

use crate::ModelError;

/// One sequence's view of the paged KV cache during a step.
#[derive(Debug, Default)]
pub struct SeqSlot {
    /// Cache blocks of this sequence, in position order.
    pub block_table: Vec<u32>,
    /// Number of positions held in the cache once this step's tokens are written.
    pub kv_len: usize,
}

/// A flat batch of tokens from one or more sequences.
///
/// Token `i` has id `tokens[i]`, sits at `positions[i]` of sequence `seq_of[i]` (an index
/// into `seqs`). Its key and value are written to the cache slot of that position, and it
/// attends to every cached position of its sequence up to and including its own.
#[derive(Debug, Default)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub seq_of: Vec<u32>,
    pub seqs: Vec<SeqSlot>,
    /// Indices of the tokens whose logits are wanted, ascending.
    pub logit_rows: Vec<u32>,
}

// Clone by hand: `clone_from` reuses the vectors' capacity (the derived one reallocates
// them all), so a backend copying each step's batch allocates nothing in steady state.
impl Clone for SeqSlot {
    fn clone(&self) -> SeqSlot {
        SeqSlot {
            block_table: self.block_table.clone(),
            kv_len: self.kv_len,
        }
    }

    fn clone_from(&mut self, source: &SeqSlot) {
        self.block_table.clone_from(&source.block_table);
        self.kv_len = source.kv_len;
    }
}

impl Clone for Batch {
    fn clone(&self) -> Batch {
        Batch {
            tokens: self.tokens.clone(),
            positions: self.positions.clone(),
            seq_of: self.seq_of.clone(),
            seqs: self.seqs.clone(),
            logit_rows: self.logit_rows.clone(),
        }
    }

    fn clone_from(&mut self, source: &Batch) {
        self.tokens.clone_from(&source.tokens);
        self.positions.clone_from(&source.positions);
        self.seq_of.clone_from(&source.seq_of);
        self.seqs.clone_from(&source.seqs);
        self.logit_rows.clone_from(&source.logit_rows);
    }
}

impl Batch {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// A batch holding one sequence's tokens at consecutive positions from `start`.
    pub fn single(tokens: &[u32], start: usize, block_table: Vec<u32>, all_logits: bool) -> Batch {
        let n = tokens.len();
        Batch {
            tokens: tokens.to_vec(),
            positions: (start..start + n).map(|p| p as u32).collect(),
            seq_of: vec![0; n],
            seqs: vec![SeqSlot {
                block_table,
                kv_len: start + n,
            }],
            logit_rows: if all_logits {
                (0..n as u32).collect()
            } else if n > 0 {
                vec![n as u32 - 1]
            } else {
                vec![]
            },
        }
    }

    /// Checks internal consistency against the cache geometry.
    pub fn validate(
        &self,
        block_size: usize,
        n_blocks: usize,
        vocab: usize,
    ) -> Result<(), ModelError> {
        let n = self.tokens.len();
        let bad = |m: String| Err(ModelError::Invalid(format!("bad batch: {m}")));
        if self.positions.len() != n || self.seq_of.len() != n {
            return bad("tokens, positions and seq_of differ in length".into());
        }
        for (i, ((&t, &p), &s)) in self
            .tokens
            .iter()
            .zip(&self.positions)
            .zip(&self.seq_of)
            .enumerate()
        {
            if t as usize >= vocab {
                return bad(format!("token {i} has id {t}, vocabulary has {vocab}"));
            }
            let Some(seq) = self.seqs.get(s as usize) else {
                return bad(format!("token {i} belongs to missing sequence {s}"));
            };
            if p as usize >= seq.kv_len {
                return bad(format!(
                    "token {i} at position {p} beyond kv_len {}",
                    seq.kv_len
                ));
            }
        }
        for (s, seq) in self.seqs.iter().enumerate() {
            if seq.block_table.len() * block_size < seq.kv_len {
                return bad(format!(
                    "sequence {s} has too few blocks for {} positions",
                    seq.kv_len
                ));
            }
            if let Some(&b) = seq.block_table.iter().find(|&&b| b as usize >= n_blocks) {
                return bad(format!("sequence {s} uses block {b}, cache has {n_blocks}"));
            }
        }
        if self.logit_rows.windows(2).any(|w| w[0] >= w[1]) {
            return bad("logit_rows not strictly ascending".into());
        }
        if self.logit_rows.last().is_some_and(|&r| r as usize >= n) {
            return bad("logit row out of range".into());
        }
        Ok(())
    }
}
