//! Hostile metadata: sizes that disagree with each other or with the file's tensors are
//! refused by `ModelConfig::from_gguf` before anything is allocated from them.

use kestrel_gguf::{GgufFile, GgufWriter, Value};
use kestrel_model::ModelConfig;
use kestrel_model::config::Arch;
use kestrel_model::synth::{SynthConfig, WeightType, write_synth_to};

fn tiny(arch: Arch) -> GgufFile {
    let cfg = SynthConfig::tiny(arch);
    let (bytes, _) = write_synth_to(Vec::new(), &cfg, WeightType::F32, 1).expect("synth");
    GgufFile::from_bytes(bytes).expect("parse")
}

/// `file` with one metadata value replaced (tensors and data kept).
fn with_metadata(file: &GgufFile, key: &str, value: Value) -> GgufFile {
    let mut writer = GgufWriter::from_gguf(file).expect("writer");
    writer.set_metadata(key, value).expect("set");
    let mut stream = writer.stream_to(Vec::new()).expect("stream");
    for info in file.tensors() {
        stream.write_tensor(file.tensor_data(info)).expect("data");
    }
    GgufFile::from_bytes(stream.finish().expect("finish")).expect("parse")
}

#[test]
fn inconsistent_sizes_are_refused_with_the_key_named() {
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Gemma3] {
        let good = tiny(arch);
        // The oracle: the untouched file is accepted with the sizes it was written with.
        let cfg = ModelConfig::from_gguf(&good).expect("the synthetic model loads");
        assert_eq!((cfg.n_layer, cfg.n_embd, cfg.vocab_size), (2, 256, 512));

        let a = arch.name();
        let cases: &[(&str, Value, &str)] = &[
            ("block_count", Value::U32(1 << 31), "block_count"),
            ("block_count", Value::U64(u64::MAX), "block_count"),
            ("context_length", Value::U64(1 << 40), "context_length"),
            ("context_length", Value::U32(0), "context_length"),
            ("embedding_length", Value::U32(512), "token_embd.weight"),
            ("vocab_size", Value::U32(1 << 30), "token_embd.weight"),
            ("attention.head_count", Value::U32(8), "blk.0.attn_"),
            ("attention.head_count", Value::U64(1 << 62), "head"),
            ("attention.head_count_kv", Value::U32(4), "attn_k"),
            ("attention.key_length", Value::U64(1 << 62), "overflow"),
            ("feed_forward_length", Value::U32(1 << 31), "ffn_up"),
        ];
        for (key, value, expect) in cases {
            let bad = with_metadata(&good, &format!("{a}.{key}"), value.clone());
            let err = ModelConfig::from_gguf(&bad).expect_err(key).to_string();
            assert!(err.contains(expect), "{a}.{key}: {err}");
        }

        let tokens = (0..513).map(|i| Value::String(format!("t{i}"))).collect();
        let bad = with_metadata(
            &good,
            "tokenizer.ggml.tokens",
            Value::Array(kestrel_gguf::ValueType::String, tokens),
        );
        let err = ModelConfig::from_gguf(&bad)
            .expect_err("tokens")
            .to_string();
        assert!(err.contains("tokenizer has 513 tokens"), "{err}");
    }
}

#[test]
fn inconsistent_linear_attention_sizes_are_refused() {
    for arch in [Arch::Qwen3Next, Arch::Qwen35] {
        let good = tiny(arch);
        let cfg = ModelConfig::from_gguf(&good).expect("the synthetic model loads");
        let dn = cfg.delta_net.expect("linear attention");
        assert_eq!((dn.n_k_heads, dn.n_v_heads, dn.head_k_dim), (2, 4, 64));
        let a = arch.name();
        let cases: &[(&str, Value, &str)] = &[
            ("ssm.group_count", Value::U32(3), "key heads"),
            ("ssm.group_count", Value::U32(0), "key heads"),
            ("ssm.conv_kernel", Value::U32(0), "conv kernel"),
            ("ssm.inner_size", Value::U32(100), "inner size"),
            ("ssm.state_size", Value::U64(1 << 62), "inner size"),
            ("ssm.inner_size", Value::U64(u64::MAX), "inner size"),
            (
                "full_attention_interval",
                Value::U32(0),
                "full_attention_interval",
            ),
            (
                "nextn_predict_layers",
                Value::U32(9),
                "nextn_predict_layers",
            ),
        ];
        for (key, value, expect) in cases {
            let bad = with_metadata(&good, &format!("{a}.{key}"), value.clone());
            let err = ModelConfig::from_gguf(&bad).expect_err(key).to_string();
            assert!(err.contains(expect), "{a}.{key}: {err}");
        }
    }
}
