//! Tokenizers: Hugging Face `tokenizer.json` (with `tokenizer_config.json`,
//! `generation_config.json` and `chat_template.jinja` beside it), or one
//! built from a GGUF file's metadata: byte-level BPE (`gpt2`: tokens, merges
//! and token types) or SentencePiece BPE (`llama`: tokens, scores and token
//! types, built as transformers' GGUF loader builds it: merges recovered
//! from the scores, byte fallback, `▁` for spaces). Control tokens become
//! special tokens.

use crate::chat::ChatTemplate;
use mlex_core::error::{Error, Result};
use mlex_models::gguf::GgufTokenizer;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::AddedToken;

/// The merges a SentencePiece vocabulary implies, as transformers'
/// `generate_merges` recovers them: every split of a token into two tokens
/// of the vocabulary, ranked by the whole token's score (highest first),
/// then by the lengths of the halves; ties keep vocabulary order.
pub(crate) fn merges_from_scores(
    tokens: &[String],
    scores: &[f32],
) -> Result<Vec<(String, String)>> {
    if scores.len() != tokens.len() {
        return Err(Error::Other(format!(
            "the GGUF SentencePiece vocabulary has {} tokens but {} scores (tokenizer.ggml.scores)",
            tokens.len(),
            scores.len()
        )));
    }
    if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
        return Err(Error::Other(format!(
            "the GGUF SentencePiece vocabulary's score of token {i} is {} (tokenizer.ggml.scores)",
            scores[i]
        )));
    }
    // As Python's dicts: a token's id is its last position; it is visited
    // once, at its first position, with its last score.
    let index: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut visited = std::collections::HashSet::new();
    let mut merges: Vec<(usize, usize, f32, usize, usize)> = Vec::new();
    for token in tokens {
        if !visited.insert(token.as_str()) {
            continue;
        }
        let score = scores[index[token.as_str()]];
        let mut local = Vec::new();
        for (at, _) in token.char_indices().skip(1) {
            let (l, r) = token.split_at(at);
            if let (Some(&li), Some(&ri)) = (index.get(l), index.get(r)) {
                local.push((li, ri, score, l.chars().count(), r.chars().count()));
            }
        }
        local.sort_by_key(|m| (m.0, m.1));
        merges.extend(local);
    }
    // Stable, descending: equal keys keep their order (Python's
    // `sorted(..., reverse=True)` does the same).
    merges.sort_by(|a, b| b.2.total_cmp(&a.2).then(b.3.cmp(&a.3)).then(b.4.cmp(&a.4)));
    Ok(merges
        .into_iter()
        .map(|(l, r, ..)| (tokens[l].clone(), tokens[r].clone()))
        .collect())
}

/// A tokenizer with what generation needs around it.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Tokens that end generation.
    pub eos_ids: BTreeSet<u32>,
    /// The BOS token id, if any.
    pub bos_id: Option<u32>,
    /// The end token the tokenizer names first (`eos_token`), which
    /// `mlx_lm.perplexity` appends to each document.
    pub eos_id: Option<u32>,
    /// Prepend BOS when encoding a raw prompt.
    pub add_bos: bool,
    /// The chat template, if the model has one.
    pub chat_template: Option<ChatTemplate>,
    /// `tool_parser_type` of `tokenizer_config.json`: which tool-call
    /// format to read (else the template decides).
    pub tool_parser_type: Option<String>,
    /// Each token's bytes (made on first use).
    token_bytes: std::sync::OnceLock<Vec<Vec<u8>>>,
}

fn tok_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Other(format!("tokenizer: {what}: {e}"))
}

/// A token's text from a `tokenizer_config.json` entry (string or
/// `{"content": ...}`).
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Runs `f`, turning a panic inside it into its message, with the default
/// panic report silenced meanwhile (this is a bad input, not a bug of ours).
fn without_panic<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    out.map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panicked".into())
    })
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Config {
            file: path.to_owned(),
            key: format!("line {}", e.line()),
            message: e.to_string(),
        })
}

impl Tokenizer {
    /// Loads `tokenizer.json` and friends from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(Error::not_found(&path, "no tokenizer.json in the model directory (give token ids instead, or add a tokenizer)"));
        }
        let bad = |message: String| Error::BadWeightsFile {
            file: path.clone(),
            format: "tokenizer.json",
            message,
        };
        // The tokenizers crate panics on some malformed files (0.22.2:
        // `.expect("Helper")` deserialising a bad `decoder`; found by the
        // `tokenizer_json` fuzz target): a panic there is a bad file too.
        let inner = without_panic(|| tokenizers::Tokenizer::from_file(&path))
            .map_err(|p| bad(format!("the tokenizers crate failed on it: {p}")))?
            .map_err(|e| bad(e.to_string()))?;
        let cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let mut eos_ids = BTreeSet::new();
        if let Some(t) = token_text(cfg.get("eos_token")) {
            eos_ids.extend(inner.token_to_id(&t));
        }
        for file in ["generation_config.json", "config.json"] {
            if let Some(v) = read_json(&dir.join(file))? {
                match v.get("eos_token_id") {
                    Some(Value::Number(n)) => eos_ids.extend(n.as_u64().map(|x| x as u32)),
                    Some(Value::Array(a)) => {
                        eos_ids.extend(a.iter().filter_map(Value::as_u64).map(|x| x as u32))
                    }
                    _ => {}
                }
            }
        }
        let bos = token_text(cfg.get("bos_token"));
        let bos_id = bos.as_deref().and_then(|t| inner.token_to_id(t));
        let add_bos = cfg
            .get("add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let eos = token_text(cfg.get("eos_token"));
        let from_config = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            _ => None,
        };
        let jinja = dir.join("chat_template.jinja");
        let template_src = match from_config {
            // File names only: render errors reach a server's clients.
            Some(s) => Some(("tokenizer_config.json: chat_template".to_owned(), s)),
            None => std::fs::read_to_string(&jinja)
                .ok()
                .map(|s| ("chat_template.jinja".to_owned(), s)),
        };
        let chat_template = template_src
            .map(|(origin, s)| ChatTemplate::from_origin(&origin, &s, bos.clone(), eos.clone()))
            .transpose()?;
        let tool_parser_type = cfg
            .get("tool_parser_type")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let eos_id = eos
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or_else(|| eos_ids.iter().next().copied());
        let mut t = Self {
            inner,
            eos_ids,
            bos_id,
            eos_id,
            add_bos,
            chat_template,
            tool_parser_type,
            token_bytes: Default::default(),
        };
        t.add_template_stop_tokens();
        Ok(t)
    }

    /// Builds a byte-level BPE tokenizer from GGUF metadata.
    pub fn from_gguf(g: &GgufTokenizer) -> Result<Self> {
        if g.model != "gpt2" && g.model != "llama" {
            return Err(Error::Other(format!(
                "GGUF tokenizer model `{}` is not supported (byte-level BPE `gpt2` and SentencePiece `llama` are); pass a model directory with tokenizer.json",
                g.model
            )));
        }
        if g.tokens.is_empty() {
            return Err(Error::Other(
                "the GGUF file has no tokenizer.ggml.tokens".into(),
            ));
        }
        let vocab: tokenizers::models::bpe::Vocab = g
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let sentencepiece = g.model == "llama";
        let merges: Vec<(String, String)> = if sentencepiece && g.merges.is_empty() {
            merges_from_scores(&g.tokens, &g.scores)?
        } else {
            g.merges
                .iter()
                .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())))
                .collect()
        };
        let mut inner = if sentencepiece {
            let mut b = BPE::builder()
                .vocab_and_merges(vocab, merges)
                .fuse_unk(true)
                .byte_fallback(true);
            if g.tokens.iter().any(|t| t == "<unk>") {
                b = b.unk_token("<unk>".into());
            }
            let mut t = tokenizers::Tokenizer::new(
                b.build()
                    .map_err(|e| tok_err("building SentencePiece BPE from GGUF", e))?,
            );
            t.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, false)));
            t.with_decoder(Some(DecoderSequence::new(vec![
                Replace::new("▁", " ")
                    .map_err(|e| tok_err("decoder", e))?
                    .into(),
                ByteFallback::default().into(),
                Fuse::default().into(),
                Strip::new(' ', 1, 0).into(),
            ])));
            t
        } else {
            let bpe = BPE::builder()
                .vocab_and_merges(vocab, merges)
                .build()
                .map_err(|e| tok_err("building BPE from GGUF", e))?;
            let mut t = tokenizers::Tokenizer::new(bpe);
            t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
            t.with_decoder(Some(ByteLevelDecoder::default()));
            t
        };
        // Control (3) and user-defined (4) tokens match as whole tokens.
        let special: Vec<AddedToken> = g
            .tokens
            .iter()
            .zip(&g.token_types)
            .filter(|(_, t)| **t == 3 || **t == 4)
            .map(|(s, t)| AddedToken::from(s.clone(), *t == 3))
            .collect();
        inner.add_special_tokens(&special);
        let name = |id: Option<u32>| id.and_then(|i| g.tokens.get(i as usize)).cloned();
        let chat_template = g
            .chat_template
            .as_deref()
            .map(|s| {
                ChatTemplate::from_origin(
                    "the GGUF's tokenizer.chat_template",
                    s,
                    name(g.bos),
                    name(g.eos),
                )
            })
            .transpose()?;
        let mut t = Self {
            inner,
            eos_ids: g.eos.into_iter().collect(),
            bos_id: g.bos,
            eos_id: g.eos,
            // llama.cpp adds BOS to a SentencePiece vocabulary that does not
            // say otherwise.
            add_bos: g.add_bos.unwrap_or(sentencepiece),
            chat_template,
            tool_parser_type: None,
            token_bytes: Default::default(),
        };
        t.add_template_stop_tokens();
        Ok(t)
    }

    /// Chat templates end an assistant turn with a token of their own
    /// (`<|im_end|>`, `<|eot_id|>`, ...); generation stops there too.
    fn add_template_stop_tokens(&mut self) {
        for t in [
            "<|im_end|>",
            "<|eot_id|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
        ] {
            if let Some(id) = self.inner.token_to_id(t) {
                self.eos_ids.insert(id);
            }
        }
    }

    /// The ids of a chat: the messages through the chat template (with the
    /// generation prompt), or, without a template or with `use_template`
    /// false, their contents joined by newlines as raw text.
    pub fn chat_ids(
        &self,
        messages: &[crate::chat::Message],
        use_template: bool,
    ) -> Result<Vec<u32>> {
        match (&self.chat_template, use_template) {
            (Some(t), true) => self.encode(&t.render(messages, true)?, false),
            _ => {
                let text: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
                self.encode(&text.join("\n"), self.add_bos)
            }
        }
    }

    /// The ids of a chat rendered with tools and template arguments
    /// (`RenderOptions::add_generation_prompt` is set); without a template,
    /// as [`Tokenizer::chat_ids`] does.
    pub fn chat_ids_with(
        &self,
        messages: &[crate::chat::Message],
        opts: &crate::chat::RenderOptions,
    ) -> Result<Vec<u32>> {
        match &self.chat_template {
            Some(t) => {
                let opts = crate::chat::RenderOptions {
                    add_generation_prompt: true,
                    ..opts.clone()
                };
                self.encode(&t.render_with(messages, &opts)?, false)
            }
            None => self.chat_ids(messages, false),
        }
    }

    /// The bytes of every token (a special token's text), as llguidance
    /// reads them from the tokenizer's JSON; made on first use.
    pub fn token_bytes(&self) -> Result<&[Vec<u8>]> {
        if let Some(b) = self.token_bytes.get() {
            return Ok(b);
        }
        let json: Value = serde_json::from_str(
            &self
                .inner
                .to_string(false)
                .map_err(|e| tok_err("as JSON", e))?,
        )
        .map_err(|e| tok_err("as JSON", e))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| tok_err("token bytes", e))?;
        for w in words.iter_mut() {
            // llguidance marks special tokens with a leading 0xff.
            if w.first() == Some(&0xff) {
                w.remove(0);
            }
        }
        Ok(self.token_bytes.get_or_init(|| words))
    }

    /// The Hugging Face tokenizer inside.
    pub(crate) fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`; special-token text is matched as such.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| tok_err("encode", e))?;
        let mut ids = enc.get_ids().to_vec();
        if add_bos {
            if let Some(b) = self.bos_id {
                if ids.first() != Some(&b) {
                    ids.insert(0, b);
                }
            }
        }
        Ok(ids)
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| tok_err("decode", e))
    }

    /// The text of a token id, as the vocabulary spells it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token's text.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save_json(&self, path: &Path) -> Result<()> {
        self.inner
            .save(path, false)
            .map_err(|e| tok_err(&format!("saving {}", path.display()), e))
    }

    /// The chat template's Jinja source, if any.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_ref().map(|t| t.source())
    }
}

#[cfg(test)]
mod tests {
    use super::merges_from_scores;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    /// Worked by hand from transformers' `generate_merges`: "ab" (score 2)
    /// splits as a+b; "abc" (score 2, a tie with "ab") splits as a+bc
    /// (ids 0, 4) and ab+c (ids 3, 2), sorted by ids; "bc" (score 1) as b+c.
    /// Sorted by (score, len left, len right) descending, ties stable:
    /// (ab+c: 2,2,1), (a+bc: 2,1,2), (a+b: 2,1,1), (b+c: 1,1,1).
    #[test]
    fn merges_follow_the_score_then_the_lengths_and_keep_ties_in_order() {
        let tokens = v(&["a", "b", "c", "ab", "bc", "abc"]);
        let scores = [0.0, 0.0, 0.0, 2.0, 1.0, 2.0];
        let m = merges_from_scores(&tokens, &scores).unwrap();
        let m: Vec<(&str, &str)> = m.iter().map(|(l, r)| (l.as_str(), r.as_str())).collect();
        assert_eq!(m, [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]);
    }

    #[test]
    fn non_finite_scores_and_a_short_score_list_are_errors() {
        let tokens = v(&["a", "b", "ab"]);
        let e = merges_from_scores(&tokens, &[0.0, f32::NAN, 1.0]).unwrap_err();
        assert!(e.to_string().contains("score of token 1"), "{e}");
        let e = merges_from_scores(&tokens, &[0.0, 1.0]).unwrap_err();
        assert!(e.to_string().contains("3 tokens but 2 scores"), "{e}");
    }
}
