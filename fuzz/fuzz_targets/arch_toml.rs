#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| mlex_fuzz::arch_toml(data));
