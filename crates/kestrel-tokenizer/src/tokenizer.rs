//! The [`Tokenizer`]: vocabulary, special-token handling, encode and decode.

use std::collections::HashMap;

use kestrel_gguf::GgufFile;

use crate::TokenizerError;
use crate::bpe::BpeModel;
use crate::decode::{self, Pieces};
use crate::special::{Fragment, SpecialTokens};
use crate::spm::{self, SpmVocab};
use crate::vocab::{PreTokenizer, TokenAttrs, TokenType, TokenizerConfig, TokenizerKind};

// Tokens llama.cpp recognises by their text (llama-vocab.cpp, the version behind the
// reference data: llama-cpp-python 0.3.36). Where llama.cpp takes the first match of an
// unordered map, the first text of these lists that the vocabulary has wins.

/// End-of-turn token when the metadata names none.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// Tokens that end generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// gpt-oss markers that llama.cpp always renders (made user-defined).
const ALWAYS_RENDERED_TEXTS: &[&str] =
    &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// A tokenizer built from GGUF metadata that reproduces llama.cpp's tokenization.
///
/// Cheap to share between threads (`Sync`); encoding allocates only per call.
pub struct Tokenizer {
    kind: TokenizerKind,
    pre: Option<PreTokenizer>,
    tokens: Vec<String>,
    attrs: Vec<TokenAttrs>,
    scores: Vec<f32>,
    token_to_id: HashMap<String, u32>,
    bpe: Option<BpeModel>,
    byte_tokens: [Option<u32>; 256],
    special: SpecialTokens,
    pieces: Pieces,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("pre", &self.pre)
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("add_space_prefix", &self.add_space_prefix)
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    ///
    /// Files without a tokenizer (`tokenizer.ggml.model` absent or `none`) give
    /// [`TokenizerError::NoTokenizer`].
    pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_config(TokenizerConfig::from_gguf(gguf)?)
    }

    /// Builds a tokenizer from metadata already read into a [`TokenizerConfig`].
    pub fn from_config(config: TokenizerConfig) -> Result<Tokenizer, TokenizerError> {
        let kind = match config.model.as_str() {
            "gpt2" => TokenizerKind::Bpe,
            "llama" => TokenizerKind::Spm,
            "none" | "no_vocab" | "" => {
                return Err(TokenizerError::NoTokenizer(format!("'{}'", config.model)));
            }
            other => return Err(TokenizerError::UnknownModel(other.to_string())),
        };
        let n = config.tokens.len();
        if n == 0 {
            return Err(TokenizerError::BadMetadata(
                "tokenizer.ggml.tokens is empty".to_string(),
            ));
        }
        if n > u32::MAX as usize / 2 {
            return Err(TokenizerError::BadMetadata(format!(
                "tokenizer.ggml.tokens has {n} entries, too many"
            )));
        }
        // Like llama.cpp, extra entries are ignored and missing ones are an error.
        let check_len = |key: &str, len: usize| {
            if len >= n {
                Ok(())
            } else {
                Err(TokenizerError::BadMetadata(format!(
                    "{key} has {len} entries but tokenizer.ggml.tokens has {n}"
                )))
            }
        };
        if let Some(scores) = &config.scores {
            check_len("tokenizer.ggml.scores", scores.len())?;
        }
        if let Some(types) = &config.token_types {
            check_len("tokenizer.ggml.token_type", types.len())?;
        }

        // Defaults per vocabulary type, as llama.cpp sets them before reading metadata.
        let (pre, mut add_bos, mut add_eos, mut add_space_prefix, clean_spaces, bos, eos, unk) =
            match kind {
                TokenizerKind::Bpe => {
                    let settings = PreTokenizer::settings(config.pre.as_deref())?;
                    let add_bos = settings.add_bos;
                    let clean = settings.clean_spaces;
                    (
                        Some(settings),
                        add_bos,
                        false,
                        false,
                        clean,
                        Some(11),
                        Some(11),
                        None,
                    )
                }
                TokenizerKind::Spm => (None, true, false, true, false, Some(1), Some(2), Some(0)),
            };
        if let Some(v) = config.add_space_prefix {
            add_space_prefix = v;
        }
        if let Some(v) = config.add_bos_token {
            add_bos = v;
        }
        if let Some(v) = config.add_eos_token {
            add_eos = v;
        }

        let mut tokens = config.tokens;
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, text) in tokens.iter_mut().enumerate() {
            if text.is_empty() {
                *text = format!("[EMPTY_{i}]");
            }
            if token_to_id.insert(text.clone(), i as u32).is_some() {
                // llama.cpp asserts that token texts are unique.
                return Err(TokenizerError::BadMetadata(format!(
                    "tokenizer.ggml.tokens has the text {text:?} twice (again at id {i})"
                )));
            }
        }
        let mut attrs: Vec<TokenAttrs> = match &config.token_types {
            Some(t) => t[..n]
                .iter()
                .map(|&x| TokenAttrs::from_type(TokenType::from_gguf(x as i64)))
                .collect(),
            None => vec![TokenAttrs::NORMAL; n],
        };
        let mut scores = config.scores.unwrap_or_else(|| vec![0.0; n]);
        scores.truncate(n);

        // Default ids outside the vocabulary are disabled; metadata ids outside it are
        // ignored (llama.cpp warns and keeps the default).
        let valid = |id: Option<u32>| id.filter(|&x| (x as usize) < n);
        let pick = |meta: Option<u32>, default: Option<u32>| valid(meta).or(valid(default));
        let bos = pick(config.bos_token_id, bos);
        let eos = pick(config.eos_token_id, eos);
        let unk = pick(config.unknown_token_id, unk);
        let pad = valid(config.padding_token_id);

        // Special tokens recognised by their text become control tokens.
        let find = |texts: &[&str]| texts.iter().find_map(|t| token_to_id.get(*t).copied());
        let detect = |meta: Option<u32>, texts: &[&str], attrs: &mut Vec<TokenAttrs>| {
            valid(meta).or_else(|| {
                let id = find(texts)?;
                attrs[id as usize] |= TokenAttrs::CONTROL;
                Some(id)
            })
        };
        let eot = detect(config.eot_token_id, EOT_TEXTS, &mut attrs);
        let eom = detect(config.eom_token_id, EOM_TEXTS, &mut attrs);
        for texts in [FIM_PRE_TEXTS, FIM_SUF_TEXTS, FIM_MID_TEXTS] {
            detect(None, texts, &mut attrs);
        }
        let fim_pad = detect(None, FIM_PAD_TEXTS, &mut attrs);
        let fim_rep = detect(None, FIM_REP_TEXTS, &mut attrs);
        let fim_sep = detect(None, FIM_SEP_TEXTS, &mut attrs);

        // Control tokens named "unused" are also marked unused.
        for (text, attr) in tokens.iter().zip(attrs.iter_mut()) {
            if attr.intersects(TokenAttrs::CONTROL) && text.contains("unused") {
                *attr |= TokenAttrs::UNUSED;
            }
        }

        let mut eog: Vec<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        for text in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*text) {
                attrs[id as usize] |= TokenAttrs::CONTROL;
                eog.push(id);
            }
        }
        for text in ALWAYS_RENDERED_TEXTS {
            if let Some(&id) = token_to_id.get(*text) {
                attrs[id as usize] = TokenAttrs::USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();

        // Harmony-style vocabularies end turns with <|return|>/<|call|>, not <|end|>;
        // vocabularies with <|tool_response>/<|plamo:eos|> use </s> as ordinary text.
        let eog_has =
            |eog: &[u32], text: &str| token_to_id.get(text).filter(|id| eog.contains(id)).copied();
        let has_call = eog_has(&eog, "<|call|>")
            .or(eog_has(&eog, "<|calls|>"))
            .is_some();
        let has_return = eog_has(&eog, "<|return|>").is_some();
        let has_flush = eog_has(&eog, "<|flush|>").is_some();
        if let Some(end) = eog_has(&eog, "<|end|>")
            && has_call
            && (has_return || has_flush)
        {
            eog.retain(|&id| id != end);
            attrs[end as usize] = TokenAttrs::USER_DEFINED;
        }
        let normal_s = eog_has(&eog, "<|tool_response>").or(eog_has(&eog, "<|plamo:eos|>"));
        if let (Some(_), Some(s)) = (normal_s, eog_has(&eog, "</s>")) {
            eog.retain(|&id| id != s);
            attrs[s as usize] = TokenAttrs::NORMAL;
        }

        let bpe = match (kind, pre) {
            (TokenizerKind::Bpe, Some(settings)) => Some(BpeModel::new(
                settings.pre,
                settings.ignore_merges,
                &config.merges,
                &token_to_id,
                n as u32,
            )?),
            _ => None,
        };
        let pre = pre.map(|settings| settings.pre);

        let mut byte_tokens = [None; 256];
        if kind == TokenizerKind::Spm {
            for (b, slot) in byte_tokens.iter_mut().enumerate() {
                let hex = format!("<0x{b:02X}>");
                *slot = token_to_id.get(&hex).copied().or_else(|| {
                    let c = b as u8;
                    if c.is_ascii() {
                        token_to_id.get(&(c as char).to_string()).copied()
                    } else {
                        None
                    }
                });
            }
        }

        let special = SpecialTokens::new(&tokens, &attrs);
        let pieces = Pieces::build(kind, &tokens, &attrs);

        Ok(Tokenizer {
            kind,
            pre,
            tokens,
            attrs,
            scores,
            token_to_id,
            bpe,
            byte_tokens,
            special,
            pieces,
            bos,
            eos,
            eot,
            eom,
            unk,
            pad,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
        })
    }

    /// Converts text to token ids.
    ///
    /// - `add_special`: add BOS/EOS where the model asks for them
    ///   (`tokenizer.ggml.add_bos_token` / `add_eos_token`).
    /// - `parse_special`: text of control tokens (e.g. `<|im_start|>`) becomes those
    ///   tokens; otherwise it is tokenized as plain text. User-defined tokens are split
    ///   out either way, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let fragments = self.special.partition(text, &self.tokens, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special
            && self.add_bos
            && let Some(bos) = self.bos
        {
            out.push(bos);
        }
        match self.kind {
            TokenizerKind::Spm => {
                let vocab = SpmVocab {
                    token_to_id: &self.token_to_id,
                    scores: &self.scores,
                    byte_tokens: &self.byte_tokens,
                    unk_id: self.unk,
                };
                let mut prev_special = true;
                let mut buf = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(start, end) => {
                            buf.clear();
                            if self.add_space_prefix && prev_special {
                                buf.push('▁');
                            }
                            for c in text[start..end].chars() {
                                if c == ' ' {
                                    buf.push('▁');
                                } else {
                                    buf.push(c);
                                }
                            }
                            spm::encode(&vocab, &buf, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            TokenizerKind::Bpe => {
                if let Some(bpe) = &self.bpe {
                    for fragment in fragments {
                        match fragment {
                            Fragment::Text(start, end) => {
                                bpe.encode(&text[start..end], &self.token_to_id, &mut out)
                            }
                            Fragment::Token(id) => out.push(id),
                        }
                    }
                }
            }
        }
        if add_special
            && self.add_eos
            && let Some(eos) = self.eos
        {
            out.push(eos);
        }
        out
    }

    /// The bytes a token stands for. With `special = false`, control and unknown tokens
    /// give no bytes; with `true`, their text. Unused tokens and ids outside the
    /// vocabulary give no bytes.
    pub fn token_to_piece(&self, id: u32, special: bool) -> &[u8] {
        match self.attrs.get(id as usize) {
            None => &[],
            Some(a) if !special && a.intersects(TokenAttrs::CONTROL | TokenAttrs::UNKNOWN) => &[],
            Some(_) => self.pieces.get(id),
        }
    }

    /// Concatenated pieces of `ids` (control tokens render as nothing), with invalid
    /// UTF-8 replaced by U+FFFD. Equal to the concatenation of what a [`StreamDecoder`]
    /// emits.
    ///
    /// [`StreamDecoder`]: crate::StreamDecoder
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, false)).into_owned()
    }

    /// Concatenated pieces of `ids` as raw bytes; `special` renders control tokens as
    /// their text.
    pub fn decode_bytes(&self, ids: &[u32], special: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_to_piece(id, special));
        }
        out
    }

    /// llama.cpp's `llama_detokenize(remove_special = false, unparse_special = special)`:
    /// like [`decode`](Self::decode), but also drops the leading space of the first piece
    /// when the model adds a space prefix, and applies the vocabulary's
    /// `clean_up_tokenization_spaces` rules (" ," → ",", " 's" → "'s", ...) when it has them.
    pub fn detokenize(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let mut piece = self.token_to_piece(id, special);
            if i == 0 && self.add_space_prefix && piece.first() == Some(&b' ') {
                piece = &piece[1..];
            }
            bytes.extend_from_slice(piece);
        }
        if self.clean_spaces {
            bytes = decode::clean_up_spaces(&bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The tokenization algorithm.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// The pre-tokenizer of a BPE vocabulary (`None` for SentencePiece).
    pub fn pre_tokenizer(&self) -> Option<PreTokenizer> {
        self.bpe.as_ref().map(BpeModel::pre_tokenizer).or(self.pre)
    }

    /// Number of vocabulary entries (valid ids are `0..vocab_size()`).
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The vocabulary text of a token (`▁`/byte-encoded as stored in the file).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of the vocabulary entry with exactly this text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// The attributes of a token, after llama.cpp's fix-ups (end-of-turn, end-of-generation
    /// and FIM tokens recognised by their text become control tokens, ...).
    pub fn token_attrs(&self, id: u32) -> Option<TokenAttrs> {
        self.attrs.get(id as usize).copied()
    }

    /// The score of a token (SentencePiece merge priority; 0 when the file has none).
    pub fn token_score(&self, id: u32) -> Option<f32> {
        self.scores.get(id as usize).copied()
    }

    /// Whether a token is a control token (rendered as nothing by [`decode`](Self::decode)).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_attrs(id)
            .is_some_and(|a| a.intersects(TokenAttrs::CONTROL))
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token (metadata, else found by its text like `<|im_end|>`).
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }

    /// End-of-message token (`<|eom_id|>`).
    pub fn eom_id(&self) -> Option<u32> {
        self.eom
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether [`encode`](Self::encode) with `add_special` adds BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether [`encode`](Self::encode) with `add_special` adds EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether SentencePiece text fragments get a leading space.
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Whether generating this token ends generation (EOS, EOT, EOM and the tokens
    /// llama.cpp recognises by text, e.g. `<|im_end|>`, `<end_of_turn>`).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation tokens, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The text of a token id for display in templates (`bos_token`, `eos_token`).
    pub(crate) fn special_text(&self, id: Option<u32>) -> String {
        id.and_then(|id| self.token_text(id))
            .unwrap_or_default()
            .to_string()
    }
}
