//! libFuzzer target: [`longctx_fuzz::config_json`] on each input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    longctx_fuzz::keep_caught_panics();
    longctx_fuzz::config_json(data)
});
