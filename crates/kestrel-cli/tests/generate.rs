//! `kestrel run` and `kestrel perplexity` end to end on the real Gemma model, against
//! llama.cpp's reference output.

use std::process::Command;

fn kestrel() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kestrel"))
}

fn reference() -> serde_json::Value {
    let dir = kestrel_hub::reference_dir().expect("reference dir");
    let text = std::fs::read_to_string(dir.join("gemma-3-270m-q4_k_m.llamacpp.json"))
        .expect("reference file");
    serde_json::from_str(&text).expect("json")
}

#[test]
fn run_json_gives_the_reference_prompt_ids_and_greedy_start() {
    let reference = reference();
    let case = &reference["greedy"][0];
    let out = kestrel()
        .args([
            "run",
            "-m",
            "gemma-3-270m",
            "--temp",
            "0",
            "-n",
            "8",
            "--json",
        ])
        .arg(case["prompt"].as_str().unwrap())
        .output()
        .expect("kestrel runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let obj: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!(obj["prompt_ids"], case["prompt_ids"]);
    let ids = obj["ids"].as_array().expect("ids");
    assert_eq!(ids.len(), 8);
    // llama.cpp's greedy continuation of this prompt agrees with ours for 15 tokens.
    assert_eq!(ids[..8], case["greedy_ids"].as_array().unwrap()[..8]);
    assert!(!obj["text"].as_str().unwrap().is_empty());
}

#[test]
fn run_streams_text_and_honours_stop_strings() {
    let out = kestrel()
        .args([
            "run",
            "-m",
            "gemma-3-270m",
            "--temp",
            "0",
            "-n",
            "32",
            "--stop",
            ".",
        ])
        .arg("The capital of France is")
        .output()
        .expect("kestrel runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.trim().is_empty());
    assert!(
        !text.contains('.'),
        "output runs past the stop string: {text:?}"
    );
}

#[test]
fn perplexity_json_has_the_reference_schema_and_value() {
    let reference = reference();
    let dir = kestrel_hub::reference_dir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let json_path = tmp.path().join("scores.json");
    let out = kestrel()
        .args([
            "perplexity",
            "-m",
            "gemma-3-270m",
            "-c",
            "128",
            "--chunks",
            "3",
            "-f",
        ])
        .arg(dir.join("text_json_decoder.py.txt"))
        .arg("--json")
        .arg(&json_path)
        .output()
        .expect("kestrel runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ours: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let theirs = &reference["texts"]["json_decoder"];
    assert_eq!(
        ours["ids"].as_array().unwrap()[..],
        theirs["ids"].as_array().unwrap()[..128]
    );
    let positions = ours["positions"].as_array().unwrap();
    assert_eq!(positions.len(), 127);
    for p in positions {
        assert_eq!(p["top_ids"].as_array().unwrap().len(), 16);
        assert_eq!(p["top_logprobs"].as_array().unwrap().len(), 16);
        assert!(p["next_logprob"].as_f64().unwrap() <= 0.0);
    }
    assert!(ours["ppl"].as_f64().unwrap() > 1.0);

    // The first window's running value is llama.cpp's: the second half's predictions only.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let values: Vec<f64> = stdout
        .lines()
        .next()
        .unwrap()
        .split(',')
        .filter(|v| !v.is_empty())
        .map(|v| v.split(']').nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(values.len(), 3, "{stdout}");
    let second_half: Vec<f64> = positions[64..]
        .iter()
        .map(|p| p["next_logprob"].as_f64().unwrap())
        .collect();
    let expected = (-second_half.iter().sum::<f64>() / second_half.len() as f64).exp();
    assert!(
        (values[0] - expected).abs() < 1e-3,
        "{} vs {expected}",
        values[0]
    );
    let last = stdout.lines().last().unwrap();
    assert!(last.starts_with("Final estimate: PPL = "), "{stdout}");
    let (ppl, se) = last["Final estimate: PPL = ".len()..]
        .split_once(" +/- ")
        .unwrap();
    let (ppl, se): (f64, f64) = (ppl.parse().unwrap(), se.parse().unwrap());
    assert!(
        (ppl - values[2]).abs() < 1e-3 && se > 0.0 && se < ppl,
        "{last}"
    );
}

/// Token ids given with --ids are scored as the text's tokens are.
#[test]
fn perplexity_of_ids_equals_perplexity_of_their_text() {
    let dir = kestrel_hub::reference_dir().unwrap();
    let text = dir.join("text_json_decoder.py.txt");
    let reference = reference();
    let tmp = tempfile::tempdir().unwrap();
    let ids = tmp.path().join("ids.json");
    let first: Vec<u64> = reference["texts"]["json_decoder"]["ids"]
        .as_array()
        .unwrap()[..256]
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    std::fs::write(&ids, serde_json::to_string(&first).unwrap()).unwrap();
    let run = |input: &[&std::ffi::OsStr]| {
        let out = kestrel()
            .args([
                "perplexity",
                "-m",
                "gemma-3-270m",
                "-c",
                "64",
                "--chunks",
                "4",
            ])
            .args(input)
            .output()
            .expect("kestrel runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let from_text = run(&["-f".as_ref(), text.as_os_str()]);
    let from_ids = run(&["--ids".as_ref(), ids.as_os_str()]);
    assert_eq!(from_text, from_ids);
    assert_eq!(from_text.lines().next().unwrap().matches('[').count(), 4);
}

#[test]
fn prompts_longer_than_the_context_are_a_clear_error() {
    let out = kestrel()
        .args(["run", "-m", "gemma-3-270m", "-c", "8", "-n", "4"])
        .arg("one two three four five six seven eight nine ten eleven twelve")
        .output()
        .expect("kestrel runs");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("context"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `kestrel run --json` with extra arguments: the parsed object, or the stderr of a failure.
fn run_json(extra: &[&str], prompt: &str) -> Result<serde_json::Value, String> {
    let out = kestrel()
        .args([
            "run",
            "-m",
            "gemma-3-270m",
            "--temp",
            "0",
            "-n",
            "48",
            "--json",
        ])
        .args(extra)
        .arg(prompt)
        .output()
        .expect("kestrel runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    Ok(serde_json::from_str(stdout.trim()).expect("one JSON object"))
}

/// `kestrel synth ARGS -o DIR/NAME`; the file's path.
fn synth(dir: &tempfile::TempDir, name: &str, args: &[&str]) -> String {
    let path = dir.path().join(name);
    let made = kestrel()
        .arg("synth")
        .args(args)
        .arg("-o")
        .arg(&path)
        .output()
        .expect("kestrel synth runs");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    path.to_str().expect("utf-8 path").to_string()
}

#[test]
fn speculative_runs_give_the_plain_ids_and_report_their_drafts() {
    // A prompt the model continues by copying, with a random part so each run differs.
    let words: Vec<String> = (0..12)
        .map(|_| format!("w{}", rand::random::<u16>()))
        .collect();
    let list = words.join(", ");
    let prompt = format!("List: {list}.\nThe same list again: {list}.\nOnce more: ");
    let plain = run_json(&[], &prompt).expect("plain run");
    assert_eq!(plain["timings"]["drafted"], 0);
    let dir = tempfile::tempdir().expect("temp dir");
    let draft = synth(
        &dir,
        "draft.gguf",
        &["--from", "gemma-3-270m", "--layers", "4"],
    );
    let draft = draft.as_str();
    for extra in [
        &["--spec", "ngram"][..],
        &["-md", draft],
        &["--draft", draft, "--draft-max", "3"],
    ] {
        let fast = run_json(extra, &prompt).expect("speculative run");
        assert_eq!(fast["ids"], plain["ids"], "{extra:?}");
        let t = &fast["timings"];
        assert_eq!(t["gen_tokens"], 48);
        assert!(t["drafted"].as_u64().unwrap() > 0, "{extra:?}: {t}");
        assert!(t["accepted"].as_u64().unwrap() <= t["drafted"].as_u64().unwrap());
        assert!(t["prompt_tokens"].as_u64().unwrap() > 0 && t["gen_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn speculative_options_that_do_not_fit_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let other = synth(&dir, "other.gguf", &["--arch", "llama", "--type", "f32"]);
    let other = other.as_str();
    for (extra, says) in [
        (&["--spec", "draft"][..], "needs a draft model"),
        (&["--spec", "fast"][..], "unknown speculation"),
        (
            &["--spec", "ngram", "--draft", other][..],
            "goes with --spec draft",
        ),
        (&["--draft", other][..], "vocabulary"),
        (&["--spec", "ngram", "--draft-max", "0"][..], "--draft-max"),
        (
            &["--spec", "ngram", "--ngram-min", "3", "--ngram-max", "2"][..],
            "n-gram sizes",
        ),
    ] {
        let err = run_json(extra, "Hello").expect_err("refused");
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
    }
}
