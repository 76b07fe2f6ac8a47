//! Tokenizer configuration as stored in GGUF metadata (`tokenizer.ggml.*`).

use kestrel_gguf::{GgufFile, Value};

use crate::TokenizerError;

/// The tokenization algorithm of a vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenizerKind {
    /// Byte-level BPE with merges (`tokenizer.ggml.model = "gpt2"`).
    Bpe,
    /// SentencePiece-style BPE with scores and byte fallback (`"llama"`).
    Spm,
}

/// The type of a vocabulary entry (`tokenizer.ggml.token_type`, llama.cpp's numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 0, or any value outside the known range.
    Undefined,
    /// 1: ordinary text piece.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: control token (BOS, EOS, chat markers): only produced from text when special
    /// tokens are parsed, rendered as empty text unless special rendering is asked for.
    Control,
    /// 4: user-defined token: always split out of the text before tokenization.
    UserDefined,
    /// 5: unused slot.
    Unused,
    /// 6: byte fallback token `<0xXX>` (SentencePiece vocabularies).
    Byte,
}

impl TokenType {
    /// Maps the GGUF integer to a type; unknown values become [`TokenType::Undefined`].
    pub fn from_gguf(value: i64) -> TokenType {
        match value {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }
}

/// Token attributes as llama.cpp keeps them: a bit set that starts from the file's
/// [`TokenType`] and gains flags from llama.cpp's fix-ups (e.g. `</s>` or `<|im_end|>`
/// become control tokens, control tokens named `unused` also get [`TokenAttrs::UNUSED`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TokenAttrs(u16);

impl TokenAttrs {
    pub const UNDEFINED: TokenAttrs = TokenAttrs(0);
    pub const UNKNOWN: TokenAttrs = TokenAttrs(1 << 0);
    pub const UNUSED: TokenAttrs = TokenAttrs(1 << 1);
    pub const NORMAL: TokenAttrs = TokenAttrs(1 << 2);
    pub const CONTROL: TokenAttrs = TokenAttrs(1 << 3);
    pub const USER_DEFINED: TokenAttrs = TokenAttrs(1 << 4);
    pub const BYTE: TokenAttrs = TokenAttrs(1 << 5);

    /// The attributes llama.cpp starts from for a token type.
    pub fn from_type(ty: TokenType) -> TokenAttrs {
        match ty {
            TokenType::Undefined => TokenAttrs::UNDEFINED,
            TokenType::Normal => TokenAttrs::NORMAL,
            TokenType::Unknown => TokenAttrs::UNKNOWN,
            TokenType::Control => TokenAttrs::CONTROL,
            TokenType::UserDefined => TokenAttrs::USER_DEFINED,
            TokenType::Unused => TokenAttrs::UNUSED,
            TokenType::Byte => TokenAttrs::BYTE,
        }
    }

    /// Whether any flag of `other` is set.
    pub fn intersects(self, other: TokenAttrs) -> bool {
        self.0 & other.0 != 0
    }

    pub fn bits(self) -> u16 {
        self.0
    }
}

impl std::ops::BitOr for TokenAttrs {
    type Output = TokenAttrs;
    fn bitor(self, rhs: TokenAttrs) -> TokenAttrs {
        TokenAttrs(self.0 | rhs.0)
    }
}

impl std::ops::BitOrAssign for TokenAttrs {
    fn bitor_assign(&mut self, rhs: TokenAttrs) {
        self.0 |= rhs.0;
    }
}

/// The regex-based pre-tokenizer of a byte-level BPE vocabulary, chosen by
/// `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreTokenizer {
    /// llama.cpp's fallback (`default` or no `tokenizer.ggml.pre`): four successive
    /// splits (punctuation runs, the GPT-2 regex, digit runs, groups of three digits).
    Default,
    /// The original GPT-2 regex (`gpt-2`, `phi-2`, `roberta-bpe`, `mpt`, `olmo`, ...).
    Gpt2,
    /// Llama 3 (`llama3`, `llama-v3`, `llama-bpe`, `falcon3`, ...): digits in groups of
    /// up to three; whole pre-tokens that are vocabulary entries skip the merges.
    Llama3,
    /// Qwen 2 (`qwen2`, `stablelm2`, `deepseek-r1-qwen`, `megrez`, ...): like Llama 3 but
    /// every digit is its own pre-token.
    Qwen2,
    /// Qwen 3.5 (`qwen35`): like Qwen 2, with combining marks kept inside words.
    Qwen35,
}

/// What a `tokenizer.ggml.pre` name selects in llama.cpp.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PreSettings {
    pub pre: PreTokenizer,
    /// Apply `clean_up_tokenization_spaces` when detokenizing.
    pub clean_spaces: bool,
    /// A pre-token that is itself a vocabulary entry skips the merges.
    pub ignore_merges: bool,
    /// BOS is added by default (before `tokenizer.ggml.add_bos_token` is read).
    pub add_bos: bool,
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` value (`None`: absent).
    pub fn from_name(name: Option<&str>) -> Result<PreTokenizer, TokenizerError> {
        Ok(PreTokenizer::settings(name)?.pre)
    }

    pub(crate) fn settings(name: Option<&str>) -> Result<PreSettings, TokenizerError> {
        let (pre, clean_spaces, ignore_merges, add_bos) = match name {
            None | Some("default") => (PreTokenizer::Default, true, false, false),
            Some(
                "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
                | "midm-2.0" | "lfm2" | "jina-v5-nano",
            ) => (PreTokenizer::Llama3, true, true, true),
            Some("dbrx" | "smaug-bpe") => (PreTokenizer::Llama3, true, false, false),
            Some("qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2") => {
                (PreTokenizer::Qwen2, false, false, false)
            }
            Some("stablelm2" | "megrez") => (PreTokenizer::Qwen2, true, false, false),
            Some("qwen35") => (PreTokenizer::Qwen35, false, false, false),
            Some(
                "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v1-en"
                | "jina-v2-es" | "jina-v2-de" | "jina-v2-code" | "roberta-bpe" | "a.x-4.0"
                | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo" | "jais",
            ) => (PreTokenizer::Gpt2, true, false, false),
            Some(other) => return Err(TokenizerError::UnknownPreTokenizer(other.to_string())),
        };
        Ok(PreSettings {
            pre,
            clean_spaces,
            ignore_merges,
            add_bos,
        })
    }

    /// The regexes applied one after the other; each splits the pieces of the previous.
    pub(crate) fn regexes(self) -> &'static [&'static str] {
        const GPT2: &str =
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
        match self {
            PreTokenizer::Default => {
                &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
            }
            PreTokenizer::Gpt2 => &[GPT2],
            PreTokenizer::Llama3 => &[
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ],
            PreTokenizer::Qwen2 => &[
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ],
            PreTokenizer::Qwen35 => &[
                r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ],
        }
    }
}

/// Everything a tokenizer is built from: the `tokenizer.ggml.*` metadata of a GGUF file,
/// in plain Rust types (so tokenizers can also be built without a file, e.g. in tests).
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    /// `tokenizer.ggml.model`: `gpt2` or `llama`.
    pub model: String,
    /// `tokenizer.ggml.pre` (BPE pre-tokenizer name).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores` (SentencePiece merge priorities).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type` (see [`TokenType::from_gguf`]).
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`, `"left right"` strings in rank order.
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub eot_token_id: Option<u32>,
    pub eom_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

const KEY_MODEL: &str = "tokenizer.ggml.model";

impl TokenizerConfig {
    /// Reads the `tokenizer.ggml.*` keys of a GGUF file.
    ///
    /// Fails with [`TokenizerError::NoTokenizer`] when `tokenizer.ggml.model` is absent or
    /// `none`, and with [`TokenizerError::BadMetadata`] when a key has the wrong type.
    pub fn from_gguf(gguf: &GgufFile) -> Result<TokenizerConfig, TokenizerError> {
        let model = match gguf.get(KEY_MODEL) {
            None => return Err(TokenizerError::NoTokenizer("absent".to_string())),
            Some(value) => value
                .as_str()
                .ok_or_else(|| bad_type(KEY_MODEL, "a string", value))?,
        };
        if model == "none" || model == "no_vocab" {
            return Err(TokenizerError::NoTokenizer(format!("'{model}'")));
        }
        let tokens = string_array(gguf, "tokenizer.ggml.tokens")?.ok_or_else(|| {
            TokenizerError::BadMetadata(format!(
                "tokenizer.ggml.tokens is missing (tokenizer.ggml.model is '{model}')"
            ))
        })?;
        let scores = match array(gguf, "tokenizer.ggml.scores")? {
            None => None,
            Some(values) => Some(
                values
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_f32()
                            .ok_or_else(|| bad_element("tokenizer.ggml.scores", i, v))
                    })
                    .collect::<Result<Vec<f32>, _>>()?,
            ),
        };
        let token_types = match array(gguf, "tokenizer.ggml.token_type")? {
            None => None,
            Some(values) => Some(
                values
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_i64()
                            .and_then(|x| i32::try_from(x).ok())
                            .ok_or_else(|| bad_element("tokenizer.ggml.token_type", i, v))
                    })
                    .collect::<Result<Vec<i32>, _>>()?,
            ),
        };
        let merges = string_array(gguf, "tokenizer.ggml.merges")?.unwrap_or_default();
        let pre = match gguf.get("tokenizer.ggml.pre") {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .ok_or_else(|| bad_type("tokenizer.ggml.pre", "a string", v))?
                    .to_string(),
            ),
        };
        Ok(TokenizerConfig {
            model: model.to_string(),
            pre,
            tokens,
            scores,
            token_types,
            merges,
            bos_token_id: token_id(gguf, "tokenizer.ggml.bos_token_id")?,
            eos_token_id: token_id(gguf, "tokenizer.ggml.eos_token_id")?,
            eot_token_id: token_id(gguf, "tokenizer.ggml.eot_token_id")?,
            eom_token_id: token_id(gguf, "tokenizer.ggml.eom_token_id")?,
            unknown_token_id: token_id(gguf, "tokenizer.ggml.unknown_token_id")?,
            padding_token_id: token_id(gguf, "tokenizer.ggml.padding_token_id")?,
            add_bos_token: flag(gguf, "tokenizer.ggml.add_bos_token")?,
            add_eos_token: flag(gguf, "tokenizer.ggml.add_eos_token")?,
            add_space_prefix: flag(gguf, "tokenizer.ggml.add_space_prefix")?,
        })
    }
}

fn bad_type(key: &str, expected: &str, found: &Value) -> TokenizerError {
    TokenizerError::BadMetadata(format!(
        "{key} should be {expected}, found a value of type {:?}",
        found.value_type()
    ))
}

fn bad_element(key: &str, index: usize, found: &Value) -> TokenizerError {
    TokenizerError::BadMetadata(format!(
        "{key}[{index}] has an unexpected value of type {:?}",
        found.value_type()
    ))
}

fn array<'a>(gguf: &'a GgufFile, key: &str) -> Result<Option<&'a [Value]>, TokenizerError> {
    match gguf.get(key) {
        None => Ok(None),
        Some(value) => value
            .as_array()
            .map(Some)
            .ok_or_else(|| bad_type(key, "an array", value)),
    }
}

fn string_array(gguf: &GgufFile, key: &str) -> Result<Option<Vec<String>>, TokenizerError> {
    let Some(values) = array(gguf, key)? else {
        return Ok(None);
    };
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| bad_element(key, i, v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn token_id(gguf: &GgufFile, key: &str) -> Result<Option<u32>, TokenizerError> {
    match gguf.get(key) {
        None => Ok(None),
        Some(value) => value
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| bad_type(key, "a token id (unsigned integer)", value)),
    }
}

fn flag(gguf: &GgufFile, key: &str) -> Result<Option<bool>, TokenizerError> {
    match gguf.get(key) {
        None => Ok(None),
        Some(value) => value
            .as_bool()
            .map(Some)
            .ok_or_else(|| bad_type(key, "a boolean", value)),
    }
}
