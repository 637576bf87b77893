//! Token ids in, text a front end may show out: the one place where
//! generated tokens become text, for `mlex generate`, `chat`,
//! `--prompts-file` and `serve` alike.
//!
//! Each token is detokenized incrementally ([`StreamingDetokenizer`] holds
//! back an incomplete UTF-8 sequence); the text is cut at the first stop
//! string ([`cut_at_stop`]), and the last characters that could still
//! become the start of one are held back ([`shown_len`]) until the next
//! token or the end.

use crate::detok::StreamingDetokenizer;
use crate::generate::Finish;
use crate::stop::{cut_at_stop, shown_len};
use crate::tokenizer::Tokenizer;
use mlex_core::error::Result;

/// The text of one generated sequence as it streams.
pub struct TextStream<'t> {
    detok: StreamingDetokenizer<'t>,
    stops: Vec<String>,
    text: String,
    shown: usize,
    stopped: bool,
}

/// What one token added.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pushed {
    /// Text that became safe to show (often empty).
    pub text: String,
    /// A stop string ended the text: generation should stop.
    pub stop: bool,
}

impl<'t> TextStream<'t> {
    /// A stream that cuts at the first of `stops` (empty strings ignored).
    pub fn new(tokenizer: &'t Tokenizer, stops: Vec<String>) -> Self {
        TextStream {
            detok: StreamingDetokenizer::new(tokenizer),
            stops,
            text: String::new(),
            shown: 0,
            stopped: false,
        }
    }

    /// Adds `token`. After a stop string has ended the text, further tokens
    /// add nothing.
    pub fn push(&mut self, token: u32) -> Result<Pushed> {
        if self.stopped {
            return Ok(Pushed {
                text: String::new(),
                stop: true,
            });
        }
        self.text.push_str(&self.detok.push(token)?);
        let safe = match cut_at_stop(&self.text, &self.stops) {
            Some(cut) => {
                self.text.truncate(cut);
                self.stopped = true;
                cut
            }
            None => shown_len(&self.text, &self.stops),
        };
        Ok(Pushed {
            text: self.take_shown(safe),
            stop: self.stopped,
        })
    }

    /// The end of generation: what is left to show. That is the held-back
    /// tail, and, when the sequence ended on its own (end of sequence,
    /// length, context), the detokenizer's held bytes too; a sequence cut
    /// short (a stop string, an interrupt, a cancel) drops an incomplete
    /// last character.
    pub fn finish(&mut self, why: Finish) -> Result<String> {
        let on_its_own = !matches!(why, Finish::Stop | Finish::Cancelled);
        if on_its_own && !self.stopped {
            self.text.push_str(&self.detok.finish()?);
        }
        self.stopped = true;
        let all = self.text.len();
        Ok(self.take_shown(all))
    }

    /// The text so far (up to a stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    fn take_shown(&mut self, upto: usize) -> String {
        if upto > self.shown {
            let piece = self.text[self.shown..upto].to_owned();
            self.shown = upto;
            piece
        } else {
            String::new()
        }
    }
}
