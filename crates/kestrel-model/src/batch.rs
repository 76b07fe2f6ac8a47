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

/// What a step hands back for the batch's `logit_rows`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Output {
    /// The LM head's logits (`[rows × vocab]` in the scratch's `logits`).
    #[default]
    Logits,
    /// The final-norm hidden states, before the LM head (`[rows × n_embd]` in the
    /// scratch's `hidden()`): embeddings. Up to every token of the step may be a row.
    Hidden,
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
    /// Indices of the tokens whose logits (or hidden states, see `output`) are wanted,
    /// ascending.
    pub logit_rows: Vec<u32>,
    /// Logits or hidden states for `logit_rows`.
    pub output: Output,
    /// Compute every token exactly as a step of that token alone would (a speculative
    /// verification: greedy speculation then yields the tokens of one-at-a-time decoding).
    /// The CPU backend always does; the CUDA backend does for steps of up to 8 tokens when
    /// asked, on slower kernels.
    pub invariant: bool,
    /// The tokens are the ids the previous step chose, which stayed on the device as this
    /// step's input ([`crate::Backend::chain_ids`]); `tokens` holds placeholders (0) the
    /// backend does not read.
    pub tokens_on_device: bool,
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
            output: self.output,
            invariant: self.invariant,
            tokens_on_device: self.tokens_on_device,
        }
    }

    fn clone_from(&mut self, source: &Batch) {
        self.tokens.clone_from(&source.tokens);
        self.positions.clone_from(&source.positions);
        self.seq_of.clone_from(&source.seq_of);
        self.seqs.clone_from(&source.seqs);
        self.invariant = source.invariant;
        self.tokens_on_device = source.tokens_on_device;
        self.logit_rows.clone_from(&source.logit_rows);
        self.output = source.output;
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
        let mut batch = Batch::default();
        let rows = if all_logits { n } else { n.min(1) };
        batch.push_part(0, tokens, start, &block_table, rows);
        batch
    }

    /// Empties the token lists for a new step (which wants logits unless told otherwise).
    /// The sequence slots stay, for [`Batch::push_part`] to refill without allocating.
    pub fn clear_tokens(&mut self) {
        self.output = Output::Logits;
        self.invariant = false;
        self.tokens_on_device = false;
        self.tokens.clear();
        self.positions.clear();
        self.seq_of.clear();
        self.logit_rows.clear();
    }

    /// Appends one sequence's `tokens` at consecutive positions from `start` as slot `slot`
    /// (slots are filled in order from 0; an existing slot's block-table vector is reused),
    /// with a logit row for each of its last `logit_rows` tokens. The caller truncates
    /// `seqs` to the slots it filled.
    pub fn push_part(
        &mut self,
        slot: usize,
        tokens: &[u32],
        start: usize,
        block_table: &[u32],
        logit_rows: usize,
    ) {
        let (first, n) = (self.tokens.len(), tokens.len());
        self.tokens.extend_from_slice(tokens);
        self.positions.extend((start..start + n).map(|p| p as u32));
        self.seq_of.extend(std::iter::repeat_n(slot as u32, n));
        self.logit_rows
            .extend((first + n - logit_rows.min(n)..first + n).map(|r| r as u32));
        if self.seqs.len() <= slot {
            self.seqs.resize_with(slot + 1, SeqSlot::default);
        }
        let s = &mut self.seqs[slot];
        s.block_table.clear();
        s.block_table.extend_from_slice(block_table);
        s.kv_len = start + n;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_part_lays_out_parts_and_reuses_slots() {
        let mut b = Batch::default();
        b.push_part(0, &[7, 8, 9], 4, &[1, 2], 3);
        b.push_part(1, &[5], 0, &[3], 1);
        b.push_part(2, &[6, 6], 10, &[4], 0);
        assert_eq!(b.tokens, [7, 8, 9, 5, 6, 6]);
        assert_eq!(b.positions, [4, 5, 6, 0, 10, 11]);
        assert_eq!(b.seq_of, [0, 0, 0, 1, 2, 2]);
        assert_eq!(b.logit_rows, [0, 1, 2, 3]);
        assert_eq!(b.seqs.len(), 3);
        assert_eq!(
            (b.seqs[0].block_table.clone(), b.seqs[0].kv_len),
            (vec![1, 2], 7)
        );
        assert_eq!(
            (b.seqs[2].block_table.clone(), b.seqs[2].kv_len),
            (vec![4], 12)
        );
        // A new step refills slot 0 in place; the caller drops the slots it did not fill.
        b.clear_tokens();
        b.push_part(0, &[1, 2], 7, &[1, 2, 9], 1);
        b.seqs.truncate(1);
        assert_eq!(b.tokens, [1, 2]);
        assert_eq!(b.logit_rows, [1]);
        assert_eq!(b.seqs[0].block_table, [1, 2, 9]);
        assert_eq!(b.seqs[0].kv_len, 9);
        let single = Batch::single(&[1, 2], 7, vec![1, 2, 9], false);
        assert_eq!(
            (&b.tokens, &b.positions, &b.seq_of, &b.logit_rows),
            (
                &single.tokens,
                &single.positions,
                &single.seq_of,
                &single.logit_rows
            )
        );
    }
}
