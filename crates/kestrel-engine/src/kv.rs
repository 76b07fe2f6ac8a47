//! The paged KV cache's block manager: hands out fixed-size blocks of cache slots and
//! takes them back, with reference counts so sequences can share a prefix's blocks.

/// Not enough free blocks for a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KV cache full: need {needed} more blocks, {free} free")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub free: usize,
}

#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    free: Vec<u32>,
    refs: Vec<u32>,
}

impl BlockManager {
    pub fn new(n_blocks: usize, block_size: usize) -> BlockManager {
        BlockManager {
            block_size,
            // Pop from the end: hand out low block numbers first.
            free: (0..n_blocks as u32).rev().collect(),
            refs: vec![0; n_blocks],
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn n_free(&self) -> usize {
        self.free.len()
    }

    pub fn n_used(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// Grows `table` so it holds at least `positions` positions; all or nothing.
    pub fn ensure(&mut self, table: &mut Vec<u32>, positions: usize) -> Result<(), OutOfBlocks> {
        let needed = self.blocks_for(positions).saturating_sub(table.len());
        if needed > self.free.len() {
            return Err(OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        for _ in 0..needed {
            let b = self.free.pop().expect("checked above");
            self.refs[b as usize] = 1;
            table.push(b);
        }
        Ok(())
    }

    /// Adds a reference to each block of `table` (a sequence sharing them).
    pub fn share(&mut self, table: &[u32]) {
        for &b in table {
            self.refs[b as usize] += 1;
        }
    }

    /// Drops one reference to each block of `table`, freeing blocks nobody holds.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            let r = &mut self.refs[b as usize];
            debug_assert!(*r > 0, "block {b} released more often than taken");
            *r = r.saturating_sub(1);
            if *r == 0 {
                self.free.push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_and_returned() {
        let mut m = BlockManager::new(4, 16);
        let mut a = Vec::new();
        m.ensure(&mut a, 17).unwrap();
        assert_eq!(a.len(), 2);
        assert_eq!(m.n_free(), 2);
        let mut b = Vec::new();
        assert_eq!(
            m.ensure(&mut b, 48),
            Err(OutOfBlocks { needed: 3, free: 2 })
        );
        assert!(b.is_empty(), "a failed ensure takes nothing");
        m.share(&a);
        let mut a2 = a.clone();
        m.release(&mut a);
        assert_eq!(m.n_free(), 2, "shared blocks stay while referenced");
        m.release(&mut a2);
        assert_eq!(m.n_free(), 4);
        assert_eq!(m.n_used(), 0);
    }
}
