//! mlex-models
