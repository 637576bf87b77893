//! mlex-cache
