//! mlex-compile
