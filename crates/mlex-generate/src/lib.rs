//! # mlex-generate
//!
//! Everything between a loaded model and text: [`tokenizer::Tokenizer`]
//! (tokenizer.json or GGUF metadata), [`chat::ChatTemplate`] (Jinja via
//! minijinja), [`sampler::Sampler`] (on-device sampling),
//! [`detok::StreamingDetokenizer`] (UTF-8-safe streaming),
//! [`text_stream::TextStream`] (tokens to the text a front end shows: cut
//! at stop strings, a possible stop held back), and
//! [`generate::Generator`] (the pipelined decode loop with prompt-cache
//! reuse and compiled segments, and speculative decoding with a
//! [`speculative::Drafter`]) and [`batch::BatchGenerator`] (continuous
//! batching: many sequences in one forward).
#![deny(missing_docs)]

mod batch;
mod chat;
mod detok;
mod generate;
mod sampler;
mod speculative;
mod stop;
mod text_stream;
mod tokenizer;

pub use batch::{BatchGenerator, BatchOutput, BatchStats, SeqId};
pub use chat::{ChatTemplate, Message};
pub use detok::StreamingDetokenizer;
pub use generate::{
    Finish, Flow, GenerateOptions, Generation, Generator, DEFAULT_CHECKPOINT_EVERY,
};
/// The prompt cache a [`Generator`] and a [`BatchGenerator`] reuse prefixes from.
pub use mlex_cache::PromptCache;
pub use sampler::{Sampler, SamplerConfig};
pub use speculative::{
    accept_or_replace, check_draft_tokens, Draft, DraftModel, DraftRequest, Drafter, PromptLookup,
    ScriptedDrafter, SpecStats, Spoil, MAX_DRAFT_TOKENS,
};
pub use stop::{cut_at_stop, shown_len};
pub use text_stream::{Pushed, TextStream};
pub use tokenizer::Tokenizer;
