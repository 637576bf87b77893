//! # mlex-generate
//!
//! Everything between a loaded model and text: [`tokenizer::Tokenizer`]
//! (tokenizer.json or GGUF metadata), [`chat::ChatTemplate`] (Jinja via
//! minijinja), [`sampler::Sampler`] (on-device sampling),
//! [`detok::StreamingDetokenizer`] (UTF-8-safe streaming), the agent
//! pieces a server needs ([`tool_calls`] read from text in each chat
//! format, [`reasoning`] apart from the answer, [`constraint`]ed decoding
//! with llguidance),
//! [`text_stream::TextStream`] (tokens to the text a front end shows: cut
//! at stop strings, a possible stop held back), and
//! [`generate::Generator`] (the pipelined decode loop with prompt-cache
//! reuse and compiled segments, and speculative decoding with a
//! [`speculative::Drafter`]) and [`batch::BatchGenerator`] (continuous
//! batching: many sequences in one forward).
#![deny(missing_docs)]

mod batch;
mod chat;
mod constraint;
mod detok;
mod generate;
mod reasoning;
mod sampler;
mod speculative;
mod stop;
mod text_stream;
mod tokenizer;
mod tool_calls;

pub use batch::{
    BatchGenerator, BatchOutput, BatchSpeculation, BatchStats, Emitted, SeqId, TokenLogprob,
};
pub use chat::{ChatTemplate, FunctionCall, Message, RenderOptions, ToolCall};
pub use constraint::{Constraint, Grammar, Grammars, CLOSING_RESERVE};
pub use detok::StreamingDetokenizer;
pub use generate::{
    Finish, Flow, GenerateOptions, Generation, Generator, DEFAULT_CHECKPOINT_EVERY,
};
/// The prompt cache a [`Generator`] and a [`BatchGenerator`] reuse prefixes from.
pub use mlex_cache::PromptCache;
pub use reasoning::{starts_in_reasoning, Part, ReasoningSplit, THINK_END, THINK_START};
pub use sampler::{LogprobArrays, Sampler, SamplerConfig};
pub use speculative::{
    accept_or_replace, check_draft_tokens, Draft, DraftModel, DraftRequest, Drafter, ForcedKeep,
    MtpDrafter, PromptLookup, ScriptedDrafter, SpecStats, Spoil, MAX_DRAFT_TOKENS,
};
pub use stop::{cut_at_stop, shown_len};
pub use text_stream::{Pushed, TextStream};
pub use tokenizer::Tokenizer;
pub use tool_calls::{ParsedCall, ToolCallStream, ToolDef, ToolFormat, ToolPiece};
