//! The integration tests of `longctx`, one module per former `tests/*.rs` file, built as
//! one test binary: each file used to be its own binary linked against the crate and
//! Candle, which made building the suite take longer than running it. Run one module
//! with `cargo test --test all NAME::` (e.g. `hub_load::`).
//!
//! Every module shares this process and runs in parallel with the others: a test must
//! not change process-wide state (environment variables, the working directory, signal
//! handlers, fixed file names or ports); give a child process its environment through
//! `Command::env` instead (see `hub_load::env_vars_select_cache_and_offline_mode`).
//! A new test file needs its `mod` line here.

mod common;

mod bos_real_tokenizer;
mod check_cli;
mod cli;
mod data;
mod data_documents;
mod data_errors;
mod deepspeed;
mod demo_retrieval;
mod dist_collective_timeout;
mod dist_documents;
mod dist_launch;
mod dist_layout;
mod dist_rendezvous_auth;
mod dist_rendezvous_flood;
mod dist_shared_dir;
mod dist_train;
mod engine;
mod eval_cli;
mod eval_lib;
mod eval_plot;
mod eval_ruler;
mod golden;
mod golden_gemma3;
mod golden_rope;
mod golden_window;
mod hub_errors;
mod hub_export;
mod hub_load;
mod loss_averaging;
mod memory_scaling;
mod model_config;
mod model_documents;
mod model_modes;
mod newcomer;
mod numeric_guards;
mod packed_docs;
mod plan;
mod reliability_eval;
mod resume;
mod resume_config;
mod run_dir;
mod settings_validation;
mod stage_eval;
mod stage_rope;
mod stages;
mod untrusted_files;
mod zero_stages;
