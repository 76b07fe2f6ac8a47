//! The storage types of the KV cache (llama.cpp's `--cache-type-k` / `--cache-type-v`
//! names): which type keys and values are kept in, and the bytes a cached position takes.

use std::fmt;
use std::str::FromStr;

use kestrel_gguf::GgmlType;

/// How one of the cache's two tensors (keys or values) stores a position's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum KvType {
    #[default]
    F16,
    Bf16,
    /// ggml's Q8_0 blocks: 32 values along the head dimension, an f16 scale and 32 i8.
    Q8_0,
    /// ggml's Q4_0 blocks: 32 values, an f16 scale and 32 4-bit values.
    Q4_0,
    /// FP8 E4M3 (CUDA only; no ggml type): blocks of 32 values along the head dimension, an
    /// f16 scale `amax / 448` and 32 E4M3 bytes of `x · 448 / amax` (rounded to nearest
    /// even, saturating at ±448).
    Fp8,
}

impl KvType {
    /// llama.cpp's types (ggml block formats): the ones the CPU backend reads.
    pub const ALL: [KvType; 4] = [KvType::F16, KvType::Bf16, KvType::Q8_0, KvType::Q4_0];

    /// Every type, llama.cpp's and fp8.
    pub const EVERY: [KvType; 5] = [
        KvType::F16,
        KvType::Bf16,
        KvType::Q8_0,
        KvType::Q4_0,
        KvType::Fp8,
    ];

    /// llama.cpp's name of the type (`f16`, `bf16`, `q8_0`, `q4_0`; `fp8` as vLLM's
    /// `--kv-cache-dtype`).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
            KvType::Fp8 => "fp8",
        }
    }

    /// The ggml block format the values are kept in (`None` for fp8, which ggml lacks).
    pub fn ggml(self) -> Option<GgmlType> {
        match self {
            KvType::F16 => Some(GgmlType::F16),
            KvType::Bf16 => Some(GgmlType::BF16),
            KvType::Q8_0 => Some(GgmlType::Q8_0),
            KvType::Q4_0 => Some(GgmlType::Q4_0),
            KvType::Fp8 => None,
        }
    }

    /// Values per block: a head's slice of a row must be whole blocks.
    pub fn block_values(self) -> usize {
        match self {
            KvType::F16 | KvType::Bf16 => 1,
            KvType::Q8_0 | KvType::Q4_0 | KvType::Fp8 => 32,
        }
    }

    /// Bytes of one block.
    fn block_bytes(self) -> usize {
        match self {
            KvType::F16 | KvType::Bf16 => 2,
            KvType::Q8_0 | KvType::Fp8 => 34,
            KvType::Q4_0 => 18,
        }
    }

    /// Bytes of `n` values (`n` a whole number of blocks).
    pub fn bytes(self, n: usize) -> usize {
        n / self.block_values() * self.block_bytes()
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvType {
    type Err = String;

    fn from_str(s: &str) -> Result<KvType, String> {
        let s = s.to_ascii_lowercase();
        let s = if s == "fp8_e4m3" { "fp8" } else { s.as_str() };
        KvType::EVERY
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown cache type {s:?} (expected {})",
                    names(&KvType::EVERY)
                )
            })
    }
}

/// The storage types of keys and of values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvTypes {
    pub k: KvType,
    pub v: KvType,
}

impl KvTypes {
    /// Bytes one position takes in one layer with `kv_dim` values of keys and of values.
    pub fn bytes_per_position(self, kv_dim: usize) -> usize {
        self.k.bytes(kv_dim) + self.v.bytes(kv_dim)
    }

    /// An error unless both types are in `supported` and a head (`head_dim` values) is a
    /// whole number of their blocks.
    pub fn check(self, supported: &[KvType], head_dim: usize, backend: &str) -> anyhow::Result<()> {
        for (what, t) in [("keys", self.k), ("values", self.v)] {
            if !supported.contains(&t) {
                anyhow::bail!(
                    "{backend}: cache type {t} for {what} is not supported (supported: {})",
                    names(supported)
                );
            }
            if !head_dim.is_multiple_of(t.block_values()) {
                anyhow::bail!(
                    "cache type {t} for {what}: head size {head_dim} is not a whole number of \
                     {}-value blocks",
                    t.block_values()
                );
            }
        }
        Ok(())
    }
}

fn names(types: &[KvType]) -> String {
    types
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_sizes_follow_the_blocks() {
        for t in KvType::EVERY {
            assert_eq!(t.name().parse::<KvType>(), Ok(t));
            assert_eq!(t.name().to_uppercase().parse::<KvType>(), Ok(t));
            // The ggml types' sizes are ggml's.
            if let Some(g) = t.ggml() {
                assert_eq!(t.block_values(), g.block_size(), "{t}");
                assert_eq!(t.bytes(64), 64 / g.block_size() * g.type_size(), "{t}");
            }
        }
        assert_eq!("fp8_e4m3".parse::<KvType>(), Ok(KvType::Fp8));
        assert_eq!(KvType::Fp8.bytes(256), 8 * 34);
        assert!("q4_1".parse::<KvType>().is_err());
        // Qwen2.5-1.5B: 2 kv heads of 128.
        assert_eq!(KvType::F16.bytes(256), 512);
        assert_eq!(KvType::Q8_0.bytes(256), 8 * 34);
        assert_eq!(KvType::Q4_0.bytes(256), 8 * 18);
        let kv = KvTypes {
            k: KvType::Q8_0,
            v: KvType::Q4_0,
        };
        assert_eq!(kv.bytes_per_position(256), 8 * 34 + 8 * 18);
    }

    #[test]
    fn check_names_the_unsupported_type_and_the_awkward_head() {
        let q8 = KvTypes {
            k: KvType::F16,
            v: KvType::Q8_0,
        };
        let e = q8
            .check(&[KvType::F16], 128, "cuda")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("q8_0 for values") && e.contains("supported: f16"),
            "{e}"
        );
        let e = q8.check(&KvType::ALL, 48, "cpu").unwrap_err().to_string();
        assert!(e.contains("head size 48"), "{e}");
        assert!(q8.check(&KvType::ALL, 64, "cpu").is_ok());
        assert!(KvTypes::default().check(&[KvType::F16], 48, "cuda").is_ok());
    }
}
