//! Constrained decoding: a grammar (a JSON schema, or a Lark grammar in
//! llguidance's dialect) decides which tokens may come next, and the
//! sampler sets every other token's logit to -inf on the device.
//!
//! The grammar engine is [llguidance](https://github.com/guidance-ai/llguidance)
//! (the one llama.cpp and vLLM use): [`Grammars`] holds its token trie for
//! one tokenizer (built once; a 150k-token vocabulary takes a fraction of
//! a second), [`Grammars::compile`] makes a [`Constraint`] per request, and
//! the decode loop asks it for a mask before each token and tells it the
//! token drawn. When the grammar is complete only the end tokens stay
//! allowed, so a constrained answer ends where its grammar does.
//!
//! An answer must also end within its `max_tokens`, and a grammar such as
//! "any JSON object" lets a model write forever (a random-weight model
//! does). In the last [`CLOSING_RESERVE`] tokens of its budget a
//! constraint closes the answer: the end token as soon as the grammar
//! allows one, else the first allowed of `}` `]` `"` `:` `0`, the letters
//! of `true`, `false` and `null`, and `,` (`"` first inside a string: the
//! shortest way out of most JSON states), else what the model prefers
//! among the allowed tokens.
//!
//! A JSON schema without llguidance options of its own (`x-guidance`) is
//! laid out with one space after `,` and `:` and no other whitespace, so
//! that no answer spends its tokens on blank space.

use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use mlex_core::error::{Error, Result};
use mlx_rs::Array;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a constrained request's output must match.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Grammar {
    /// A JSON schema (`response_format: json_schema`, or `{"type":
    /// "object"}` for `json_object`).
    JsonSchema(Value),
    /// A Lark grammar in llguidance's dialect (tool calls).
    Lark(String),
}

/// The tokenizer as llguidance sees it: each token's bytes, and the
/// tokenizer itself for the strings a grammar holds.
struct Env {
    trie: TokTrie,
    hf: Arc<tokenizers::Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        let text = String::from_utf8_lossy(s);
        self.hf
            .encode(text.as_ref(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }
}

/// Tokens of the budget in which a constrained answer is closed.
pub const CLOSING_RESERVE: usize = 24;

/// The texts that close an answer soonest, in order of preference.
const CLOSERS: [&str; 15] = [
    "}", "]", "\"", ":", "0", "t", "r", "u", "e", "f", "a", "l", "s", "n", ",",
];

/// The grammar engine for one tokenizer and model vocabulary.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    vocab: usize,
    stop_ids: Vec<u32>,
    closers: Arc<Vec<u32>>,
    quote: Option<u32>,
}

impl Grammars {
    /// The engine for `tokenizer`, masks `vocab` wide (the model's output
    /// width, which may exceed the tokenizer's).
    pub fn new(tokenizer: &Tokenizer, vocab: usize) -> Result<Self> {
        let hf = tokenizer.hf();
        let json: Value = serde_json::from_str(
            &hf.to_string(false)
                .map_err(|e| Error::Other(format!("tokenizer as JSON: {e}")))?,
        )
        .map_err(|e| Error::Other(format!("tokenizer as JSON: {e}")))?;
        let words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| Error::Other(format!("the tokenizer's token bytes: {e}")))?;
        let eos = *tokenizer.eos_ids.iter().next().ok_or_else(|| {
            Error::invalid(
                "tokenizer",
                "has no end-of-sequence token, which a grammar needs",
            )
        })?;
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let quote = trie.token_id(b"\"");
        let closers = CLOSERS
            .iter()
            .filter_map(|c| trie.token_id(c.as_bytes()))
            .collect();
        let env: TokEnv = Arc::new(Env {
            trie,
            hf: Arc::new(hf.clone()),
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::Other(format!("the grammar engine: {e}")))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
            vocab,
            stop_ids: tokenizer.eos_ids.iter().copied().collect(),
            closers: Arc::new(closers),
            quote,
        })
    }

    /// A fresh constraint for `grammar`, or why the grammar is refused.
    pub fn compile(&self, grammar: &Grammar) -> std::result::Result<Constraint, String> {
        let top = match grammar {
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            matcher,
            vocab: self.vocab,
            stop_ids: self.stop_ids.clone(),
            closers: self.closers.clone(),
            quote: self.quote,
            in_string: false,
            escaped: false,
            mask_time: Duration::ZERO,
            masks: 0,
        })
    }
}

/// A schema with llguidance's layout set unless it sets its own.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
        });
    }
    schema
}

/// One request's grammar state.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    stop_ids: Vec<u32>,
    closers: Arc<Vec<u32>>,
    /// The `"` token.
    quote: Option<u32>,
    /// The output so far ends inside a JSON string (after an odd number of
    /// unescaped quotes), and just after a backslash there.
    in_string: bool,
    escaped: bool,
    /// Host time spent computing masks.
    pub mask_time: Duration,
    /// Masks computed.
    pub masks: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("vocab", &self.vocab)
            .field("masks", &self.masks)
            .finish()
    }
}

impl Constraint {
    /// The tokens allowed next, `vocab` wide (true = allowed): the end
    /// tokens once the grammar is complete, and beside what may continue it
    /// while it could end here.
    pub fn allowed(&mut self) -> Result<Vec<bool>> {
        let started = Instant::now();
        let mut allowed = vec![false; self.vocab];
        let stopped = self.matcher.is_stopped();
        if !stopped {
            let vob = self
                .matcher
                .compute_mask()
                .map_err(|e| Error::Other(format!("grammar: {e}")))?;
            for (t, a) in allowed.iter_mut().enumerate().take(vob.len()) {
                *a = vob.is_allowed(t as u32);
            }
        }
        let can_end = stopped
            || self
                .matcher
                .is_accepting()
                .map_err(|e| Error::Other(format!("grammar: {e}")))?;
        for &s in &self.stop_ids {
            if let Some(a) = allowed.get_mut(s as usize) {
                *a = can_end;
            }
        }
        self.mask_time += started.elapsed();
        self.masks += 1;
        Ok(allowed)
    }

    /// The tokens allowed next when `left` tokens of the budget remain:
    /// [`Constraint::allowed`], narrowed to one closing token in the last
    /// [`CLOSING_RESERVE`] (see the module).
    pub fn allowed_within(&mut self, left: usize) -> Result<Vec<bool>> {
        let mut allowed = self.allowed()?;
        if left > CLOSING_RESERVE {
            return Ok(allowed);
        }
        let ends = self
            .stop_ids
            .iter()
            .any(|&s| allowed.get(s as usize) == Some(&true));
        let quote_first = (self.in_string && !self.escaped)
            .then_some(self.quote)
            .flatten();
        let pick: Vec<u32> = if ends {
            self.stop_ids.clone()
        } else {
            quote_first
                .into_iter()
                .chain(self.closers.iter().copied())
                .find(|&t| allowed.get(t as usize) == Some(&true))
                .into_iter()
                .collect()
        };
        if !pick.is_empty() {
            allowed.iter_mut().for_each(|a| *a = false);
            for t in pick {
                if let Some(a) = allowed.get_mut(t as usize) {
                    *a = true;
                }
            }
        }
        Ok(allowed)
    }

    /// [`Constraint::allowed_within`] as a `[1, vocab]` bool array.
    pub fn mask(&mut self, left: usize) -> Result<Array> {
        let allowed = self.allowed_within(left)?;
        Ok(Array::from_slice(&allowed, &[1, self.vocab as i32]))
    }

    /// Advances the grammar by a drawn token (end tokens end it).
    pub fn consume(&mut self, token: u32) -> Result<()> {
        if self.stop_ids.contains(&token) || self.matcher.is_stopped() {
            return Ok(());
        }
        let env = self
            .matcher
            .tok_env()
            .map_err(|e| Error::Other(format!("grammar: {e}")))?;
        for &b in env.tok_trie().token(token) {
            if !self.in_string {
                self.in_string = b == b'"';
            } else if self.escaped {
                self.escaped = false;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
            }
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| Error::Other(format!("grammar refused token {token}: {e}")))
    }
}
