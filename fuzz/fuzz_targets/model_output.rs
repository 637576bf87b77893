#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| mlex_fuzz::model_output(data));
