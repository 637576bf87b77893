//! Reasoning apart from the answer: text between `<think>` and `</think>`
//! is reasoning, the rest the answer. As in mlx-lm
//! (`mlx_lm/generate.py`, its text state machine), an answer starts inside
//! reasoning when the prompt opened a think block it did not close (a
//! template that ends the generation prompt with `<think>\n`); the markers
//! themselves are shown to nobody. Unlike mlx-lm, the blank lines that
//! follow `</think>` do not begin the answer.

use crate::stop::held_back;

/// Opens reasoning.
pub const THINK_START: &str = "<think>";
/// Ends it.
pub const THINK_END: &str = "</think>";

/// True when `prompt` leaves the model inside a think block.
pub fn starts_in_reasoning(prompt: &str) -> bool {
    match (prompt.rfind(THINK_START), prompt.rfind(THINK_END)) {
        (Some(s), Some(e)) => s > e,
        (Some(_), None) => true,
        _ => false,
    }
}

/// One piece of split output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// Reasoning text.
    Reasoning(String),
    /// Answer text.
    Content(String),
}

/// Splits text as it streams.
pub struct ReasoningSplit {
    reasoning: bool,
    pending: String,
    /// Just after `</think>`: whitespace is dropped until the answer begins.
    after_end: bool,
    /// Nothing shown yet in the current part (whitespace leading a
    /// reasoning block is dropped).
    fresh: bool,
}

impl ReasoningSplit {
    /// A splitter that starts in reasoning when `in_reasoning`.
    pub fn new(in_reasoning: bool) -> Self {
        Self {
            reasoning: in_reasoning,
            pending: String::new(),
            after_end: false,
            fresh: true,
        }
    }

    /// Takes new text; returns the parts that can be shown now.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            let marker = if self.reasoning {
                THINK_END
            } else {
                THINK_START
            };
            match self.pending.find(marker) {
                Some(at) => {
                    let before = self.pending[..at].to_owned();
                    self.pending.drain(..at + marker.len());
                    self.emit(&before, &mut out);
                    self.reasoning = !self.reasoning;
                    self.after_end = !self.reasoning;
                    self.fresh = true;
                }
                None => {
                    let keep = held_back(&self.pending, &[marker.to_owned()]);
                    let show: String = self.pending[..self.pending.len() - keep].to_owned();
                    self.pending.drain(..show.len());
                    self.emit(&show, &mut out);
                    return out;
                }
            }
        }
    }

    /// The end of the answer: what is left.
    pub fn finish(&mut self) -> Vec<Part> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        self.emit(&rest, &mut out);
        out
    }

    fn emit(&mut self, text: &str, out: &mut Vec<Part>) {
        let mut text = text;
        if self.after_end || (self.reasoning && self.fresh) {
            text = text.trim_start();
        }
        if text.is_empty() {
            return;
        }
        self.after_end = false;
        self.fresh = false;
        out.push(if self.reasoning {
            Part::Reasoning(text.to_owned())
        } else {
            Part::Content(text.to_owned())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(start: bool, text: &str, step: usize) -> (String, String) {
        let mut s = ReasoningSplit::new(start);
        let mut parts = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for c in chars.chunks(step) {
            parts.extend(s.push(&c.iter().collect::<String>()));
        }
        parts.extend(s.finish());
        let (mut r, mut c) = (String::new(), String::new());
        for p in parts {
            match p {
                Part::Reasoning(t) => r.push_str(&t),
                Part::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    #[test]
    fn think_blocks_are_reasoning_in_any_cut() {
        for step in [1, 2, 5, 100] {
            assert_eq!(
                split(false, "<think>\nWhy? Because.\n</think>\n\nParis.", step),
                ("Why? Because.\n".into(), "Paris.".into())
            );
            assert_eq!(
                split(true, "It is Paris.</think>\n\nParis.", step),
                ("It is Paris.".into(), "Paris.".into())
            );
            assert_eq!(
                split(false, "No thinking: a < b </thin", step),
                (String::new(), "No thinking: a < b </thin".into())
            );
        }
    }

    #[test]
    fn the_prompt_decides_where_an_answer_starts() {
        assert!(starts_in_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!starts_in_reasoning("assistant\n<think>\n\n</think>\n\n"));
        assert!(!starts_in_reasoning("<|im_start|>assistant\n"));
    }
}
