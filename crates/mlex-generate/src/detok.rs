//! Streaming detokenization that never splits a UTF-8 character.
//!
//! Byte-level BPE tokens can end in the middle of a multi-byte character;
//! decoding such a prefix yields U+FFFD. The detokenizer decodes the tokens
//! since the last emitted point and holds text back while it ends in an
//! incomplete character, so every emitted piece is valid text and the
//! concatenation equals the full decode.

use crate::tokenizer::Tokenizer;
use mlex_core::error::Result;

/// Turns a token stream into text pieces.
pub struct StreamingDetokenizer<'t> {
    tokenizer: &'t Tokenizer,
    tokens: Vec<u32>,
    /// Tokens already represented in `emitted`.
    start: usize,
    /// Text emitted from `tokens[..start]` plus pending offsets.
    text: String,
}

impl<'t> StreamingDetokenizer<'t> {
    /// A detokenizer over `tokenizer`.
    pub fn new(tokenizer: &'t Tokenizer) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            start: 0,
            text: String::new(),
        }
    }

    /// Adds a token; returns the new text that is safe to show (maybe empty).
    pub fn push(&mut self, token: u32) -> Result<String> {
        self.tokens.push(token);
        let pending = self.tokenizer.decode(&self.tokens[self.start..])?;
        if pending.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        // Decoding a suffix alone can lose a leading space that belongs to
        // it (SentencePiece-style decoders); decode with one token of
        // context and keep what follows.
        let piece = if self.start > 0 {
            let ctx = self
                .tokenizer
                .decode(&self.tokens[self.start - 1..self.start])?;
            let both = self.tokenizer.decode(&self.tokens[self.start - 1..])?;
            both.strip_prefix(ctx.as_str())
                .map(str::to_owned)
                .unwrap_or(pending)
        } else {
            pending
        };
        self.start = self.tokens.len();
        self.text.push_str(&piece);
        Ok(piece)
    }

    /// Whatever is still held back (an incomplete character at the end).
    pub fn finish(&mut self) -> Result<String> {
        if self.start == self.tokens.len() {
            return Ok(String::new());
        }
        let rest = self.tokenizer.decode(&self.tokens[self.start..])?;
        self.start = self.tokens.len();
        self.text.push_str(&rest);
        Ok(rest)
    }
}
