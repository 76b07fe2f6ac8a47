//! Tokenization of both real models against llama.cpp's reference outputs
//! (shared/reference/<model>*.llamacpp.json).

mod common;

use common::{MODELS, ids, reference, reference_text, show, text, tokenizer};

#[test]
fn tokenize_strings_match_llama_cpp() {
    for model in MODELS {
        let tok = tokenizer(model);
        let reference = reference(model);
        let cases = reference["tokenize"].as_array().expect("tokenize[]");
        assert!(!cases.is_empty());
        let mut failures = Vec::new();
        for case in cases {
            let input = text(&case["text"]);
            for (key, add_special, parse_special) in
                [("ids_special", true, true), ("ids_plain", false, false)]
            {
                let expected = ids(&case[key]);
                let got = tok.encode(input, add_special, parse_special);
                if got != expected {
                    failures.push(format!(
                        "{model} {key} {input:?}\n  expected {}\n  got      {}",
                        show(tok, &expected),
                        show(tok, &got)
                    ));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        eprintln!("{model}: {} tokenize entries x 2 match", cases.len());
    }
}

#[test]
fn text_files_match_llama_cpp() {
    for model in MODELS {
        let tok = tokenizer(model);
        let reference = reference(model);
        let texts = reference["texts"].as_object().expect("texts{}");
        assert!(!texts.is_empty());
        for (name, entry) in texts {
            let expected = ids(&entry["ids"]);
            let full = reference_text(name);
            let got = tok.encode(&full, true, false);
            assert!(
                got.len() >= expected.len(),
                "{model} {name}: only {} tokens",
                got.len()
            );
            let first_diff = got.iter().zip(&expected).position(|(a, b)| a != b);
            if let Some(i) = first_diff {
                let lo = i.saturating_sub(3);
                panic!(
                    "{model} {name}: token {i} differs\n  expected {}\n  got      {}",
                    show(tok, &expected[lo..(i + 4).min(expected.len())]),
                    show(tok, &got[lo..(i + 4).min(got.len())])
                );
            }
            eprintln!("{model} {name}: first {} tokens match", expected.len());
        }
    }
}

#[test]
fn greedy_prompts_match_llama_cpp() {
    for model in MODELS {
        let tok = tokenizer(model);
        let reference = reference(model);
        let cases = reference["greedy"].as_array().expect("greedy[]");
        assert!(!cases.is_empty());
        for case in cases {
            let prompt = text(&case["prompt"]);
            let expected = ids(&case["prompt_ids"]);
            let got = tok.encode(prompt, true, true);
            assert_eq!(got, expected, "{model} prompt {prompt:?}");
        }
    }
}

#[test]
fn greedy_texts_decode_like_llama_cpp() {
    for model in MODELS {
        let tok = tokenizer(model);
        let reference = reference(model);
        for case in reference["greedy"].as_array().expect("greedy[]") {
            let greedy = ids(&case["greedy_ids"]);
            assert_eq!(tok.decode(&greedy), text(&case["greedy_text"]), "{model}");
        }
    }
}

#[test]
fn decode_round_trips_reference_strings() {
    for model in MODELS {
        let tok = tokenizer(model);
        let reference = reference(model);
        for case in reference["tokenize"].as_array().expect("tokenize[]") {
            let input = text(&case["text"]);
            // Plain encoding is lossless: every byte of the text is in some piece.
            assert_eq!(tok.decode(&ids(&case["ids_plain"])), input, "{model} plain");
            assert_eq!(
                tok.detokenize(&ids(&case["ids_plain"]), false),
                input,
                "{model} plain"
            );
            // With specials parsed, control tokens come back only when rendered.
            let mut special = ids(&case["ids_special"]);
            if tok.add_bos() && special.first() == tok.bos_id().as_ref() {
                special.remove(0);
            }
            let rendered = String::from_utf8(tok.decode_bytes(&special, true)).expect("utf-8");
            assert_eq!(rendered, input, "{model} special");
        }
        for name in ["gpl3", "json_decoder"] {
            let full = reference_text(name);
            assert_eq!(
                tok.decode(&tok.encode(&full, false, false)),
                full,
                "{model} {name}"
            );
        }
    }
}

#[test]
fn encoding_the_gpl_text_is_fast() {
    let full = reference_text("gpl3");
    for model in MODELS {
        let tok = tokenizer(model);
        for parse_special in [false, true] {
            let start = std::time::Instant::now();
            let ids = tok.encode(&full, true, parse_special);
            let elapsed = start.elapsed();
            eprintln!(
                "{model}: {} bytes -> {} tokens in {elapsed:?} (parse_special={parse_special})",
                full.len(),
                ids.len()
            );
            assert!(
                elapsed.as_secs_f64() < 0.5,
                "{model}: encoding took {elapsed:?}"
            );
        }
    }
}
