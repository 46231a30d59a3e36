//! libFuzzer target: [`longctx_fuzz::dataset_jsonl_compressed`] on each input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    longctx_fuzz::keep_caught_panics();
    longctx_fuzz::dataset_jsonl_compressed(data)
});
