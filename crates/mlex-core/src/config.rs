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

    /// A config error for `key` of this file.
    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::Config {
            file: self.file.clone(),
            key: key.to_owned(),
            message: message.into(),
        }
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

/// The keys a serde struct reads (its field names, after renames), found
/// by asking its `Deserialize` impl: the generated docs list each
/// architecture's config keys from its typed config this way, so the list
/// cannot drift from the struct.
pub fn struct_fields<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Fields(std::cell::Cell<&'static [&'static str]>);
    #[derive(Debug)]
    struct Stop;
    impl std::fmt::Display for Stop {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("field names taken")
        }
    }
    impl std::error::Error for Stop {}
    impl serde::de::Error for Stop {
        fn custom<M: std::fmt::Display>(_: M) -> Self {
            Stop
        }
    }
    impl<'de> serde::Deserializer<'de> for &Fields {
        type Error = Stop;
        fn deserialize_any<V: serde::de::Visitor<'de>>(
            self,
            _: V,
        ) -> std::result::Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> std::result::Result<V::Value, Stop> {
            self.0.set(fields);
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }
    let d = Fields(std::cell::Cell::new(&[]));
    let _ = T::deserialize(&d);
    d.0.get()
}

#[cfg(test)]
mod tests {
    use super::struct_fields;

    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Example {
        hidden_size: i32,
        #[serde(rename = "n_layer")]
        layers: usize,
        #[serde(default)]
        tie: bool,
    }

    #[test]
    fn struct_fields_are_the_keys_serde_reads() {
        assert_eq!(
            struct_fields::<Example>(),
            ["hidden_size", "n_layer", "tie"]
        );
        // Not a struct: no fields.
        assert!(struct_fields::<Vec<i32>>().is_empty());
    }
}
