//! libFuzzer target: [`longctx_fuzz::dataset_arrow`] on each input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    longctx_fuzz::keep_caught_panics();
    longctx_fuzz::dataset_arrow(data)
});
