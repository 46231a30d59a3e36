//! The integration tests of `longctx-attention`, one module per former `tests/*.rs` file,
//! built as one test binary (one link against Candle instead of one per file). Run one
//! module with `cargo test -p longctx-attention --test all NAME::` (e.g. `ring::`).
//! A new test file needs its `mod` line here.

mod comm;
mod docs;
mod fpdt;
mod kernel;
mod ring;
mod ulysses;
mod usp;
mod window;
