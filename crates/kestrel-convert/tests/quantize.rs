//! `kestrel quantize` against llama.cpp:
//! - the bytes of every Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 tensor equal gguf-py's quantizers' output
//!   (`tests/quant_oracle.py gguf-py`) on fresh random models of awkward shapes;
//! - the type chosen for every tensor of the catalog Gemma 3 Q4_K_M model equals the type
//!   llama-quantize chose when it made them (skipped with a notice if they are not cached);
//! - against llama-quantize itself (llama-cpp-python's `llama_model_quantize`; skipped with a
//!   notice when it is not importable): same types for every file type, same bytes for the
//!   32-block types, K-quant error no worse than 1.01x.
//!
//! Needs python3 with `gguf` and `numpy` (requirements-test.txt). KESTREL_TEST_SEED replays.

use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use kestrel_convert::FileType;
use kestrel_convert::ftype::choose_types;
use kestrel_convert::quantize::{Plan, QuantizeOptions, model_facts, write_quantized};
use kestrel_gguf::{GgmlType, GgufFile};
use kestrel_model::config::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth};

mod common;
use common::{quant_oracle as oracle, seed};

/// A random model: 9 layers (so that llama.cpp's "more bits" layers are irregular), rows of
/// 288 values (K-quants fall back to 32-block types) beside rows of 768 (they do not).
fn awkward(arch: Arch) -> SynthConfig {
    let mut cfg = SynthConfig::tiny(arch);
    cfg.n_layer = 9;
    cfg.n_embd = 288;
    cfg.n_ff = 768;
    cfg.n_head = 9;
    cfg.n_head_kv = 3;
    cfg.head_dim = 32;
    cfg.n_vocab = 300;
    cfg
}

fn synth(dir: &Path, name: &str, cfg: &SynthConfig, ty: WeightType, seed: u64) -> PathBuf {
    let path = dir.join(name);
    write_synth(&path, cfg, ty, seed).expect("synth model");
    path
}

fn quantize(input: &Path, output: &Path, ftype: FileType) -> Plan {
    let file = GgufFile::open(input).unwrap();
    let opts = QuantizeOptions {
        ftype,
        imatrix: None,
    };
    let plan = Plan::new(&file, &opts).unwrap();
    write_quantized(&file, &plan, &opts, output, &ProgressBar::hidden()).unwrap();
    plan
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn legacy_types_match_gguf_py_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let seed = seed();
    let cases = [
        (Arch::Llama, WeightType::F32),
        (Arch::Qwen2, WeightType::F16),
        (Arch::Gemma3, WeightType::Bf16),
    ];
    for (k, (arch, wt)) in cases.into_iter().enumerate() {
        let input = synth(
            dir.path(),
            &format!("in{k}.gguf"),
            &awkward(arch),
            wt,
            seed + k as u64,
        );
        for ftype in [
            FileType::Q8_0,
            FileType::Q4_0,
            FileType::Q4_1,
            FileType::Q5_0,
            FileType::Q5_1,
            FileType::F16,
            FileType::BF16,
        ] {
            if wt.base() == ftype.default_type() {
                continue; // nothing to convert
            }
            let out = dir.path().join(format!("out{k}-{ftype}.gguf"));
            let plan = quantize(&input, &out, ftype);
            let r = oracle(&["gguf-py", s(&input), s(&out)]).unwrap();
            let compared = r["compared"].as_array().unwrap();
            let mismatches = r["mismatches"].as_array().unwrap();
            assert!(
                mismatches.is_empty(),
                "{arch:?} {wt} -> {ftype}: differ from gguf-py: {mismatches:?}"
            );
            // Every matrix but the tied LM head (Q6_K/Q8_0) was compared.
            let changed = plan.types.iter().filter(|&&t| t != GgmlType::F32).count();
            assert!(
                compared.len() + 1 >= changed && !compared.is_empty(),
                "{ftype}: only {} of {changed} tensors compared",
                compared.len()
            );
        }
    }
}

/// The catalog Gemma 3 file is a recent llama-quantize's Q4_K_M output: its type choices are
/// in it. (The catalog Qwen2.5 file is not an oracle: an older llama-quantize made it, which
/// counted `attn_v`/`ffn_down` in name order, blk.0, blk.1, blk.10, ..., not layer order.)
#[test]
fn q4_k_m_types_match_the_catalog_model() {
    let models = kestrel_hub::models_dir();
    for name in ["gemma-3-270m.gguf"] {
        let path = models.join(name);
        if !path.is_file() {
            eprintln!("SKIP: {} is not cached (kestrel pull)", path.display());
            continue;
        }
        let file = GgufFile::open(&path).unwrap();
        let facts = model_facts(&file, false).unwrap();
        // As if from the original BF16 checkpoint: matrices were 16-bit, vectors F32.
        let list: Vec<(&str, &[u64], GgmlType)> = file
            .tensors()
            .iter()
            .map(|t| {
                let ty = if t.dims.len() >= 2 {
                    GgmlType::BF16
                } else {
                    t.ty
                };
                (t.name.as_str(), t.dims.as_slice(), ty)
            })
            .collect();
        let chosen = choose_types(&facts, FileType::Q4KM, &list).unwrap();
        for (t, ty) in file.tensors().iter().zip(chosen) {
            assert_eq!(ty, t.ty, "{name}: {}", t.name);
        }
    }
}

#[test]
fn agrees_with_llama_quantize() {
    let dir = tempfile::tempdir().unwrap();
    let seed = seed();
    let cfgs = [
        ("llama", awkward(Arch::Llama)),
        ("qwen2-tied", SynthConfig::tiny(Arch::Qwen2)),
    ];
    let (mut k_equal, mut k_total) = (0, 0);
    for (k, (label, cfg)) in cfgs.iter().enumerate() {
        // Every type on the first model; a few on the second (tied embeddings, 256-wide rows).
        let ftypes: Vec<FileType> = if k == 0 {
            FileType::ALL.to_vec()
        } else {
            vec![
                FileType::Q4_0,
                FileType::Q8_0,
                FileType::Q2K,
                FileType::Q4KM,
                FileType::Q6K,
            ]
        };
        let input = synth(
            dir.path(),
            &format!("{label}.gguf"),
            cfg,
            WeightType::F16,
            seed + k as u64,
        );
        for ftype in ftypes {
            let ours = dir.path().join(format!("{label}-{ftype}-ours.gguf"));
            let theirs = dir.path().join(format!("{label}-{ftype}-theirs.gguf"));
            let id = ftype.id().to_string();
            if ftype == FileType::Q2KS {
                continue; // needs an importance matrix
            }
            if oracle(&["llama-quantize", s(&input), s(&theirs), &id]).is_none() {
                return;
            }
            quantize(&input, &ours, ftype);
            let r = oracle(&["compare", s(&input), s(&ours), s(&theirs)]).unwrap();
            assert!(r["name_mismatch"].as_array().unwrap().is_empty());
            for t in r["tensors"].as_array().unwrap() {
                let (name, a, b) = (&t["name"], &t["ours"], &t["theirs"]);
                assert_eq!(a, b, "{label} {ftype}: type of {name}");
                let legacy = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32"];
                if legacy.contains(&a.as_str().unwrap()) {
                    assert!(
                        t["equal"].as_bool().unwrap(),
                        "{label} {ftype}: bytes of {name}"
                    );
                } else {
                    k_total += 1;
                    k_equal += t["equal"].as_bool().unwrap() as usize;
                    let (e_ours, e_theirs) = (
                        t["ours_wrms"].as_f64().unwrap(),
                        t["theirs_wrms"].as_f64().unwrap(),
                    );
                    assert!(
                        e_ours <= 1.01 * e_theirs,
                        "{label} {ftype}: {name} error {e_ours} vs llama-quantize {e_theirs}"
                    );
                }
            }
        }
    }
    eprintln!("K-quant tensors byte-identical to llama-quantize's: {k_equal} of {k_total}");
}
