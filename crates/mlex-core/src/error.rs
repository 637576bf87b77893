//! The one error type of mlex.
//!
//! Every failure a user can cause (a bad file, a wrong config key, a prompt
//! that is too long) becomes a variant that names the file, key or tensor.
//! MLX's C++ exceptions arrive through mlx-rs as [`mlx_rs::error::Exception`]
//! and are converted here, so nothing escapes as a panic or an abort.

use std::path::PathBuf;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in mlex.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// MLX raised an exception (shape mismatch, unsupported dtype, ...).
    #[error("MLX error{}: {message}", context_suffix(.context))]
    Mlx {
        /// What mlex was doing, if known (e.g. the layer or tensor).
        context: Option<String>,
        /// MLX's own message.
        message: String,
    },

    /// A file could not be read or written.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// A config file is malformed or lacks a key.
    #[error("{}: {key}: {message}", .file.display())]
    Config {
        /// The config file (config.json, a TOML architecture, ...).
        file: PathBuf,
        /// The key path, e.g. `text_config.hidden_size`.
        key: String,
        /// What is wrong.
        message: String,
    },

    /// A weights file is not a valid safetensors/GGUF file.
    #[error("{}: not a valid {format} file: {message}", .file.display())]
    BadWeightsFile {
        /// The file.
        file: PathBuf,
        /// `safetensors` or `GGUF`.
        format: &'static str,
        /// What is wrong (truncated, bad header, ...).
        message: String,
    },

    /// A tensor the model needs is absent.
    #[error("missing tensor `{name}` (looked in {}){}", .files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "), if .nearest.is_empty() { String::new() } else { format!("; nearest names not used yet: {}", .nearest.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")) })]
    MissingTensor {
        /// The tensor name after sanitizing.
        name: String,
        /// The files that were searched.
        files: Vec<PathBuf>,
        /// The checkpoint's names closest to it (a weight-name template or
        /// a sanitize rule that is off by a part).
        nearest: Vec<String>,
    },

    /// Tensors were present that the model does not use.
    #[error("unexpected tensor{} {} in {}", if .names.len() > 1 { "s" } else { "" }, .names.iter().take(8).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "), .file.display())]
    UnexpectedTensors {
        /// The unused tensor names (first ones).
        names: Vec<String>,
        /// The file holding the first of them.
        file: PathBuf,
    },

    /// A tensor has the wrong shape or dtype.
    #[error("tensor `{name}` in {}: expected {expected}, found {found}", .file.display())]
    TensorMismatch {
        /// The tensor name.
        name: String,
        /// The file holding it.
        file: PathBuf,
        /// What the model expects.
        expected: String,
        /// What the file holds.
        found: String,
    },

    /// `model_type` names no registered architecture.
    #[error("unknown model_type `{model_type}`{}; registered architectures: {} (a spec file adds one: --arch-dir DIR or $MLEX_ARCH_PATH, see docs/architecture-specs.md)", .file.as_ref().map(|f| format!(" in {}", f.display())).unwrap_or_default(), .known.join(", "))]
    UnknownArchitecture {
        /// The requested name.
        model_type: String,
        /// Where it was read.
        file: Option<PathBuf>,
        /// What the registry holds.
        known: Vec<String>,
    },

    /// A layer kind name is not registered.
    #[error("unknown layer kind `{kind}`{}; registered layer kinds: {}", .context.as_ref().map(|c| format!(" ({c})")).unwrap_or_default(), .known.join(", "))]
    UnknownLayerKind {
        /// The requested kind.
        kind: String,
        /// Where it was requested.
        context: Option<String>,
        /// What the registry holds.
        known: Vec<String>,
    },

    /// Two registrations share a name.
    #[error("duplicate {what} `{name}` registered by {first} and by {second}")]
    DuplicateRegistration {
        /// `architecture` or `layer kind`.
        what: &'static str,
        /// The shared name.
        name: String,
        /// Where the first came from.
        first: String,
        /// Where the second came from.
        second: String,
    },

    /// A prompt does not fit the model's context.
    #[error("prompt of {len} tokens exceeds the context of {max} tokens{}", .hint.as_ref().map(|h| format!(" ({h})")).unwrap_or_default())]
    PromptTooLong {
        /// Prompt length.
        len: usize,
        /// The limit.
        max: usize,
        /// Where the limit comes from.
        hint: Option<String>,
    },

    /// An argument or option has an invalid value.
    #[error("invalid {name}: {message}")]
    InvalidArgument {
        /// The option, e.g. `--top-p`.
        name: String,
        /// Why.
        message: String,
    },

    /// A Hugging Face Hub lookup or download failed.
    #[error("Hugging Face Hub: {repo}{}: {message}", .file.as_ref().map(|f| format!(" ({f})")).unwrap_or_default())]
    Hub {
        /// The repo id, e.g. `mlx-community/Qwen3-0.6B-4bit`.
        repo: String,
        /// The file within the repo, when one is at fault.
        file: Option<String>,
        /// What went wrong and what to do about it.
        message: String,
    },

    /// A cache cannot do what was asked (e.g. trim recurrent state).
    #[error("cache: {0}")]
    Cache(String),

    /// Anything else, with a message that says what.
    #[error("{0}")]
    Other(String),
}

fn context_suffix(context: &Option<String>) -> String {
    context
        .as_ref()
        .map(|c| format!(" in {c}"))
        .unwrap_or_default()
}

impl Error {
    /// Adds context (what mlex was doing) to an MLX error; other errors
    /// pass through unchanged.
    pub fn context(self, what: impl Into<String>) -> Self {
        match self {
            Error::Mlx {
                context: None,
                message,
            } => Error::Mlx {
                context: Some(what.into()),
                message,
            },
            other => other,
        }
    }

    /// An [`Error::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// An [`Error::Io`] for a file that is not there, `why` saying what
    /// it is for.
    pub fn not_found(path: impl Into<PathBuf>, why: &str) -> Self {
        Self::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, why))
    }

    /// An [`Error::InvalidArgument`].
    pub fn invalid(name: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name: name.into(),
            message: message.into(),
        }
    }
}

impl From<mlx_rs::error::Exception> for Error {
    fn from(e: mlx_rs::error::Exception) -> Self {
        Error::Mlx {
            context: None,
            message: e.what().to_owned(),
        }
    }
}

impl From<mlx_rs::error::IoError> for Error {
    fn from(e: mlx_rs::error::IoError) -> Self {
        Error::Mlx {
            context: None,
            message: e.to_string(),
        }
    }
}

impl From<mlx_rs::error::AsSliceError> for Error {
    fn from(e: mlx_rs::error::AsSliceError) -> Self {
        Error::Mlx {
            context: None,
            message: e.to_string(),
        }
    }
}

impl From<mlx_rs::error::ConversionError> for Error {
    fn from(e: mlx_rs::error::ConversionError) -> Self {
        Error::Mlx {
            context: None,
            message: e.to_string(),
        }
    }
}

impl From<Error> for mlx_rs::error::Exception {
    /// Layer code runs inside compiled MLX closures, which must return
    /// MLX's exception type; the message survives the round trip.
    fn from(e: Error) -> Self {
        mlx_rs::error::Exception::custom(e.to_string())
    }
}

/// Adds context to MLX results: `op(...).ctx("layer 3 attention")?`.
pub trait ResultExt<T> {
    /// Converts the error and records what mlex was doing.
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<Error>> ResultExt<T> for std::result::Result<T, E> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| e.into().context(what()))
    }
}
