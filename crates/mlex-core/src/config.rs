//! Model configuration (`config.json`) with errors that name file and key.
//!
//! Architectures deserialize their own `#[derive(Deserialize)]` structs from
//! a [`ModelConfig`]; [`ModelConfig::parse`] routes serde's errors through
//! `serde_path_to_error`, so a wrong or missing key is reported as
//! `config.json: text_config.hidden_size: invalid type ...`.

use crate::error::{Error, Result};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A parsed JSON config and the file it came from.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    value: Value,
    file: PathBuf,
}

impl ModelConfig {
    /// Wraps an already parsed value (`file` is used in errors).
    pub fn new(value: Value, file: impl Into<PathBuf>) -> Self {
        Self {
            value,
            file: file.into(),
        }
    }

    /// Reads and parses a JSON file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            file: path.to_owned(),
            key: format!("line {}", e.line()),
            message: e.to_string(),
        })?;
        if !value.is_object() {
            return Err(Error::Config {
                file: path.to_owned(),
                key: "(root)".into(),
                message: "expected a JSON object".into(),
            });
        }
        Ok(Self::new(value, path))
    }

    /// The raw JSON.
    pub fn value(&self) -> &Value {
        &self.value
    }

    /// Mutable raw JSON (architectures normalise configs before parsing).
    pub fn value_mut(&mut self) -> &mut Value {
        &mut self.value
    }

    /// The file the config came from.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// `model_type`, required.
    pub fn model_type(&self) -> Result<&str> {
        self.value
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| self.error("model_type", "missing (every config.json needs one)"))
    }

    /// Deserializes into `T`; errors name the key path.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T> {
        parse_value(&self.value, &self.file, "")
    }

    /// Deserializes the object under `key` (e.g. `text_config`).
    pub fn parse_at<T: DeserializeOwned>(&self, key: &str) -> Result<T> {
        let v = self
            .value
            .get(key)
            .ok_or_else(|| self.error(key, "missing"))?;
        parse_value(v, &self.file, key)
    }

    /// A config error for `key` of this file.
    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::Config {
            file: self.file.clone(),
            key: key.to_owned(),
            message: message.into(),
        }
    }

    /// The sub-config under `key` as its own [`ModelConfig`] (same file).
    pub fn sub(&self, key: &str) -> Option<ModelConfig> {
        self.value.get(key).filter(|v| v.is_object()).map(|v| Self {
            value: v.clone(),
            file: self.file.clone(),
        })
    }
}

/// Deserializes `value` into `T`, naming `file` and the key path on error.
pub fn parse_value<T: DeserializeOwned>(value: &Value, file: &Path, prefix: &str) -> Result<T> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let key = match (prefix.is_empty(), path.as_str()) {
            (true, ".") => "(root)".to_owned(),
            (true, p) => p.to_owned(),
            (false, ".") => prefix.to_owned(),
            (false, p) => format!("{prefix}.{p}"),
        };
        Error::Config {
            file: file.to_owned(),
            key,
            message: e.into_inner().to_string(),
        }
    })
}

/// A count or size (heads, widths, kernel sizes, layers): `v` as an `i32`
/// from 1 to `i32::MAX`, or what is wrong with it.
pub fn count(v: i64) -> std::result::Result<i32, String> {
    if (1..=i64::from(i32::MAX)).contains(&v) {
        Ok(v as i32)
    } else {
        Err(format!("must be from 1 to {}, got {v}", i32::MAX))
    }
}
