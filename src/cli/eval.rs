//! `longctx eval ppl` and `longctx eval needle`: perplexity against context length and a
//! needle / passkey depth × length grid, each with JSON (and CSV) results and a PNG,
//! the forward run through any sequence-parallel mode (in-process ranks with
//! `--world-size`, or one process per rank under `longctx launch`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{parse_dtype, parse_mode, tokens_arg};
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use longctx::data::TokenWidth;
use longctx::eval::forward::{with_ranks, RanksSpec};
use longctx::eval::needle::{self, Cell, Format, TextTask};
use longctx::eval::ppl::{self, DocSource, Method, PplPoint};
use longctx::eval::ruler::{self, RulerTask, Task};
use longctx::eval::{output, plot, EvalModel, Ranks};
use longctx::hub::HubOptions;

/// The demo's export, what every command evaluates by default.
pub const DEMO_EXPORT: &str = "runs/demo/export";

#[derive(Subcommand, Debug)]
pub enum EvalCmd {
    /// Perplexity of long documents at a grid of context lengths (sliding windows or
    /// truncation), one line per model: ppl.csv, ppl.json, ppl.png in --output-dir.
    Ppl(PplArgs),
    /// Needle in a haystack (or --passkey) at a grid of depths × lengths, scored by
    /// teacher-forced exact match and greedy generation: needle.json, needle.png
    /// (teacher-forced) and needle_greedy.png in --output-dir.
    Needle(NeedleArgs),
    /// RULER-style tasks (needles single, multikey, multivalue, multiquery; variable
    /// tracking; common- and frequent-words extraction) at a grid of lengths, on a model
    /// with tokenizer.json, scored by the recall of the expected strings in the greedy
    /// output and by teacher-forced exact match: ruler.json, ruler.csv, ruler.png (greedy
    /// recall) and ruler_teacher_forced.png.
    Ruler(RulerArgs),
}

/// Where and how the forward runs (shared by both evaluations).
#[derive(Args, Debug, Clone)]
pub struct RunFlags {
    /// cpu, cuda or cuda:N (under `longctx launch`: cuda means cuda:LOCAL_RANK).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weights and activations dtype on a GPU: f32, bf16 or f16 (the CPU runs f32).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Sequence-parallel mode of the forward: data_parallel (one rank), zigzag_ring_attn,
    /// ulysses_attn, fpdt or usp. Lengths the mode cannot split are padded at the end
    /// (ignored tokens; causal attention makes them change nothing before them).
    #[arg(long, default_value = "data_parallel")]
    pub parallel_mode: String,
    /// Ranks as threads of this process sharing the device (under `longctx launch`: one
    /// rank per process instead).
    #[arg(long, default_value_t = 1)]
    pub world_size: usize,
    /// USP: Ulysses degree inside a ring group.
    #[arg(long)]
    pub ulysses_size: Option<usize>,
    /// FPDT chunk in global tokens (shortened to the sequence when longer).
    #[arg(long, default_value_t = 65536, value_parser = tokens_arg)]
    pub fpdt_chunk_size: usize,
    /// Tokens per chunk of the head and loss (the [tokens × vocab] logits never exist whole).
    #[arg(long, default_value_t = 4096, value_parser = tokens_arg)]
    pub token_chunk: usize,
    /// Seconds a collective waits for the other ranks before every rank aborts; 0 = no limit.
    #[arg(long, default_value_t = 600.0, allow_negative_numbers = true)]
    pub collective_timeout: f64,
    /// Allow lengths beyond what a model's config.json says it handles (its
    /// max_position_embeddings, or more with rope scaling); refused otherwise.
    #[arg(long)]
    pub allow_extrapolation: bool,
    /// Seed of synthetic documents, needles and distractors.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CUDA attention kernel: auto (per call the faster of the two on that shape), cudnn, or
    /// native (longctx's own Hopper kernel, sm_90a builds; shapes it does not cover run
    /// cuDNN). No effect on the CPU.
    #[arg(long, default_value = "auto")]
    pub attention_kernel: longctx_attention::kernel::CudaKernel,
}

impl RunFlags {
    fn spec(&self) -> Result<RanksSpec> {
        if self.world_size == 0 {
            bail!("--world-size: must be at least 1");
        }
        let t = self.collective_timeout;
        if !(t >= 0.0 && t.is_finite()) {
            bail!("--collective-timeout: got {t}, expected seconds ≥ 0 (0 = no limit)");
        }
        Ok(RanksSpec {
            mode: parse_mode(&self.parallel_mode, "parallel-mode")?,
            world_size: self.world_size,
            ulysses: self.ulysses_size,
            fpdt_chunk: self.fpdt_chunk_size.max(1),
            token_chunk: self.token_chunk.max(1),
            collective_timeout: (t > 0.0 && t.is_finite()).then(|| Duration::from_secs_f64(t)),
        })
    }

    /// The ranks and dtype of the run, with the output directory created.
    fn prepare(&self, output_dir: &std::path::Path) -> Result<(RanksSpec, candle_core::DType)> {
        let (spec, dtype) = (self.spec()?, self.dtype()?);
        self.attention_kernel.select();
        output::ensure_dir(output_dir).with_context(|| format!("creating the output directory {}", output_dir.display()))?;
        Ok((spec, dtype))
    }

    fn dtype(&self) -> Result<candle_core::DType> {
        parse_dtype(&self.dtype, "dtype")
    }
}

#[derive(Args, Debug)]
pub struct PplArgs {
    /// Model(s): a directory (a run's export), a hub id, or builtin:NAME; repeat to
    /// compare (e.g. a base model and its extended export), one line each in the plot.
    #[arg(long, default_value = DEMO_EXPORT)]
    pub model: Vec<String>,
    /// Documents: `synthetic:passkey`, or any dataset `train` reads (jsonl, txt, parquet,
    /// raw .bin tokens; a file, a directory or a hub dataset id). Text needs the model's tokenizer.json.
    #[arg(long, default_value = "synthetic:passkey")]
    pub dataset: String,
    /// Column or field with token ids or text (input_ids or text).
    #[arg(long)]
    pub dataset_column: Option<String>,
    /// Only the files of this split when the dataset's file names name splits (a hub
    /// dataset's `validation/…`, `test-00000.parquet`); `*` reads every file.
    #[arg(long, default_value = "test")]
    pub dataset_split: String,
    /// Width of raw .bin token files: u16 or u32.
    #[arg(long, default_value = "u16")]
    pub token_width: String,
    /// Where ppl.csv, ppl.json and ppl.png go.
    #[arg(long, default_value = "runs/eval")]
    pub output_dir: PathBuf,
    /// Context lengths, comma-separated (e.g. 1K,4K,16K) [default: 1/8, 1/4, 1/2 and all
    /// of the largest trained context; a default length beyond a model's context is
    /// skipped for it unless --allow-extrapolation].
    #[arg(long, value_delimiter = ',', value_parser = tokens_arg)]
    pub lengths: Vec<usize>,
    /// sliding: windows over the document stream every --stride tokens, each scoring what
    /// the previous did not (every length scores the same tokens); truncate: each
    /// document cut to the length, all its tokens scored (shorter documents skipped);
    /// documents: the documents packed into windows of the length, each token attending
    /// to its own document only, positions restarting per document (what training with
    /// data.packing = "documents" sees).
    #[arg(long, default_value = "sliding")]
    pub method: String,
    /// Sliding windows start every this many tokens [default: half the length].
    #[arg(long, value_parser = tokens_arg)]
    pub stride: Option<usize>,
    /// Tokens of the document stream scored (sliding, documents) [default: 4 × the longest length];
    /// with truncate, stop reading documents after this many tokens [default: no limit].
    #[arg(long, value_parser = tokens_arg)]
    pub max_tokens: Option<usize>,
    /// At most this many documents read (truncate: scored per length).
    #[arg(long, default_value_t = 16)]
    pub max_docs: usize,
    #[command(flatten)]
    pub run: RunFlags,
}

#[derive(Args, Debug)]
pub struct NeedleArgs {
    /// Model: a directory (a run's export), a hub id, or builtin:NAME. Without
    /// tokenizer.json the synthetic passkey token format it was trained on is used.
    #[arg(long, default_value = DEMO_EXPORT)]
    pub model: String,
    /// Where needle.json, needle.png and needle_greedy.png go.
    #[arg(long, default_value = "runs/eval")]
    pub output_dir: PathBuf,
    /// Haystack lengths in tokens, comma-separated [default: 1/8, 1/4, 1/2 and all of
    /// the trained context].
    #[arg(long, value_delimiter = ',', value_parser = tokens_arg)]
    pub lengths: Vec<usize>,
    /// Needle depths in [0, 1], comma-separated (0 = start of the haystack, 1 = its end).
    #[arg(long, value_delimiter = ',', default_value = "0,0.25,0.5,0.75,1", allow_negative_numbers = true)]
    pub depths: Vec<f64>,
    /// Cases (different needles) per grid cell.
    #[arg(long, default_value_t = 4)]
    pub trials: usize,
    /// Digits of the number to retrieve (token format: 1 to 8).
    #[arg(long, default_value_t = 5)]
    pub digits: usize,
    /// The classic passkey task ("The pass key is N. Remember it." in "The grass is
    /// green..." filler); on a model without tokenizer, the demo's passkey token format.
    #[arg(long)]
    pub passkey: bool,
    /// Text file for the haystack (repeated to the length) [default: generated filler].
    #[arg(long)]
    pub haystack: Option<PathBuf>,
    /// Distractor needles: sentences (text) or digit runs (tokens) with other numbers.
    #[arg(long, default_value_t = 0)]
    pub distractors: usize,
    /// Skip greedy generation (teacher-forced scoring only).
    #[arg(long)]
    pub no_generate: bool,
    #[command(flatten)]
    pub run: RunFlags,
}

#[derive(Args, Debug)]
pub struct RulerArgs {
    /// Model: a directory (a run's export), a hub id, or builtin:NAME. With tokenizer.json
    /// the tasks are text; without one (the demo's export) they are in the built-in token
    /// vocabulary it trained on (`synthetic:retrieval`), where the tasks are single and vt.
    #[arg(long, default_value = DEMO_EXPORT)]
    pub model: String,
    /// Where ruler.json, ruler.csv, ruler.png and ruler_teacher_forced.png go.
    #[arg(long, default_value = "runs/eval")]
    pub output_dir: PathBuf,
    /// Tasks, comma-separated: single, multikey, multivalue, multiquery, vt (variable
    /// tracking), cwe (common-words extraction), fwe (frequent-words extraction) [default:
    /// all; single,vt in the token format].
    #[arg(long, value_delimiter = ',')]
    pub tasks: Vec<String>,
    /// Context lengths in tokens, comma-separated [default: 1/8, 1/4, 1/2 and all of the
    /// trained context].
    #[arg(long, value_delimiter = ',', value_parser = tokens_arg)]
    pub lengths: Vec<usize>,
    /// Cases per task and length.
    #[arg(long, default_value_t = 4)]
    pub trials: usize,
    /// Digits of the numbers to recall [default: 7; 5 in the token format, as the demo
    /// trains (1 to 8 there)].
    #[arg(long)]
    pub digits: Option<usize>,
    /// Needles of multikey (keys), multivalue (values) and multiquery (keys asked).
    #[arg(long, default_value_t = 4)]
    pub needles: usize,
    /// Variable tracking: assignments after the first (hops + 1 variables hold the value)
    /// [default: 4; 2 in the token format, as the demo trains (1 to 15 there)].
    #[arg(long)]
    pub hops: Option<usize>,
    /// Common-words extraction: the common words asked for (RULER's 10).
    #[arg(long, default_value_t = ruler::COMMON_WORDS)]
    pub common_words: usize,
    /// Text file for the haystack (repeated to the length) [default: generated filler].
    #[arg(long)]
    pub haystack: Option<PathBuf>,
    /// Skip greedy generation (teacher-forced scoring only).
    #[arg(long)]
    pub no_generate: bool,
    #[command(flatten)]
    pub run: RunFlags,
}

pub fn eval(cmd: EvalCmd) -> Result<()> {
    match cmd {
        EvalCmd::Ppl(a) => ppl_cmd(a),
        EvalCmd::Needle(a) => needle_cmd(a),
        EvalCmd::Ruler(a) => ruler_cmd(a),
    }
}

/// 1/8, 1/4, 1/2 and all of `ctx`, at least `min`.
fn default_lengths(ctx: usize, min: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [ctx / 8, ctx / 4, ctx / 2, ctx].into_iter().filter(|&l| l >= min).collect();
    v.dedup();
    if v.is_empty() {
        v.push(ctx.max(min));
    }
    v
}

fn bar(len: u64, show: bool, what: &str) -> Option<ProgressBar> {
    if !show || !std::io::stderr().is_terminal() {
        return None;
    }
    let b = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed}<{eta} {msg}") {
        b.set_style(style.progress_chars("=> "));
    }
    b.set_prefix(what.to_string());
    Some(b)
}

/// Refuses, before any model is loaded, lengths that cannot run: beyond 32-bit positions,
/// or a window whose activations (with the weights of every model) exceed the device's
/// memory (`eval_memory`: a lower bound). Models whose config.json is not at hand without
/// a download (a hub model not yet cached) are not checked. `min`: the shortest default length.
fn check_lengths(specs: &[String], lengths: &[usize], run: &RunFlags, dtype: candle_core::DType, min: usize) -> Result<()> {
    use longctx::eval::model::{check_eval_size, eval_memory};
    let hub = HubOptions::from_env();
    let dt = if run.device.trim() == "cpu" { candle_core::DType::F32 } else { dtype };
    let mut cfgs = Vec::new();
    for spec in specs {
        if let Some(m) = longctx::hub::model_config(spec, &hub, false)? {
            cfgs.push(m.cfg);
        }
    }
    let Some(ctx) = cfgs.iter().map(|c| c.max_position_embeddings).max() else { return Ok(()) };
    let lengths = if lengths.is_empty() { default_lengths(ctx, min) } else { lengths.to_vec() };
    // Ranks as processes each hold a share of the window; threads share one process.
    let world = longctx::parallel::DistEnv::from_env()?.map_or(1, |e| e.world as u64).max(1);
    let have = longctx::eval::model::eval_memory_available(&run.device)?;
    for &l in &lengths {
        let (mut weights, mut act) = (0u64, 0u64);
        for c in &cfgs {
            let m = eval_memory(c, dt, l as u64, 0)?;
            weights = weights.saturating_add(m.weights);
            act = act.max(m.activations.div_ceil(world));
        }
        let parts = [("weights", weights), ("activations of one window", act)];
        check_eval_size(l as u64, &parts, have, &run.device, "--lengths", "use shorter --lengths, or more ranks (longctx launch)")?;
    }
    Ok(())
}

fn load_models(specs: &[String], dev: &candle_core::Device, dtype: candle_core::DType) -> longctx::Result<Vec<EvalModel>> {
    let (dev, dt) = if dev.is_cpu() { (dev.clone(), candle_core::DType::F32) } else { (dev.clone(), dtype) };
    specs.iter().map(|s| EvalModel::load(s, &dev, dt, &HubOptions::from_env())).collect()
}

/// What perplexity on an answer-only synthetic dataset measures: the answers only (its
/// training loss mask), one sample of each length per window, whatever `--method`.
fn passkey_answer_note(dataset: &str) -> Option<String> {
    longctx::data::synthetic::answer_only(dataset).map(|_| {
        format!(
            "{dataset}: perplexity of the answers only (the loss mask it trains with), over samples generated at each \
             length, one window each (--method and --stride do not apply); synthetic:passkey scores every token, filler \
             included, which a model trained on the answers only (the demo) never learnt"
        )
    })
}

fn ppl_cmd(a: PplArgs) -> Result<()> {
    let method = match a.method.as_str() {
        "sliding" => Method::Sliding,
        "truncate" => Method::Truncate,
        "documents" => Method::Documents,
        m => bail!("--method: unknown method `{m}`, expected sliding, truncate or documents"),
    };
    let token_width = match a.token_width.as_str() {
        "u16" => TokenWidth::U16,
        "u32" => TokenWidth::U32,
        w => bail!("--token-width: expected u16 or u32, got `{w}`"),
    };
    if a.lengths.contains(&0) {
        bail!("--lengths: a length must be at least 1 token");
    }
    if a.max_docs == 0 {
        bail!("--max-docs: got 0, expected at least 1 document (it caps how many documents are read)");
    }
    if a.stride == Some(0) {
        bail!("--stride: must be at least 1 token");
    }
    check_lengths(&a.model, &a.lengths, &a.run, a.run.dtype()?, 16)?;
    let (spec, dtype) = a.run.prepare(&a.output_dir)?;
    if let (Some(n), true) = (passkey_answer_note(&a.dataset), std::env::var("RANK").map_or(true, |r| r == "0")) {
        eprintln!("note: {n}");
    }
    let started = Instant::now();
    let result = with_ranks(
        &spec,
        &a.run.device,
        |dev| load_models(&a.model, dev, dtype),
        |ms: &Vec<EvalModel>| ms.first().map(|m| (m.cfg().num_attention_heads, m.cfg().num_key_value_heads)).unwrap_or((1, 1)),
        |ranks: &Ranks, models: &Vec<EvalModel>| ppl_ranks(&a, method, token_width, ranks, models),
    )
    .context("evaluating perplexity")?;
    let Some((points, models_meta, lengths)) = result else { return Ok(()) };
    let csv = a.output_dir.join("ppl.csv");
    let json = a.output_dir.join("ppl.json");
    let png = a.output_dir.join("ppl.png");
    // The three files are replaced together (see `OutputSet`).
    let mut set = output::OutputSet::default();
    set.write(&csv, ppl::to_csv(&points).as_bytes())?;
    let doc = serde_json::json!({
        "models": models_meta,
        "dataset": a.dataset,
        "method": method,
        "stride": a.stride,
        "lengths": lengths,
        "parallel_mode": a.run.parallel_mode,
        "world_size": a.run.world_size,
        "points": points,
        "seconds": started.elapsed().as_secs_f64(),
    });
    set.write_json(&json, &doc)?;
    let series: Vec<(String, Vec<(f64, f64)>)> =
        a.model.iter().map(|m| (m.clone(), points.iter().filter(|p| &p.model == m).map(|p| (p.length as f64, p.ppl)).collect())).collect();
    plot::lines(
        &set.stage(&png),
        &format!("Perplexity vs context length ({})", a.dataset),
        "context length (tokens)",
        "perplexity",
        &series,
    )?;
    set.commit(&[])?;
    for p in &points {
        println!("{}\tlength {}\tppl {:.4}\t({} tokens, {} windows, {:.1} s)", p.model, p.length, p.ppl, p.tokens, p.windows, p.seconds);
    }
    println!("wrote {}, {}, {}", csv.display(), json.display(), png.display());
    for n in worse_than_uniform(&points, &models_meta, &a.dataset) {
        eprintln!("note: {n}");
    }
    Ok(())
}

/// For each model whose perplexity exceeds its vocabulary size somewhere (worse than a
/// uniform guess): why that can be, and, on `synthetic:passkey`, what the demo was trained on.
fn worse_than_uniform(points: &[PplPoint], meta: &[serde_json::Value], dataset: &str) -> Vec<String> {
    let vocab = |name: &str| meta.iter().find(|m| m["model"] == name).and_then(|m| m["vocab_size"].as_f64());
    let mut notes = Vec::new();
    for m in meta.iter().filter_map(|m| m["model"].as_str()) {
        let Some(v) = vocab(m) else { continue };
        let worst = points.iter().filter(|p| p.model == m).map(|p| p.ppl).fold(0.0, f64::max);
        if worst <= v {
            continue;
        }
        let why = if dataset == "synthetic:passkey" {
            "; a model trained with the answer-only loss (synthetic:passkey-answer, or synthetic:retrieval-answer as the demo is) \
             never learnt the filler that synthetic:passkey scores: --dataset synthetic:passkey-answer scores the answer digits \
             it was trained on"
        } else {
            ": this text is not what it was trained on, or the tokenizer is not the model's"
        };
        notes.push(format!("{m}: perplexity up to {worst:.0}, above its vocabulary of {v} tokens (worse than a uniform guess){why}"));
    }
    notes
}

type PplOut = (Vec<PplPoint>, Vec<serde_json::Value>, Vec<usize>);

fn ppl_ranks(a: &PplArgs, method: Method, token_width: TokenWidth, ranks: &Ranks, models: &[EvalModel]) -> longctx::Result<PplOut> {
    let lead = ranks.rank() == 0;
    let explicit = !a.lengths.is_empty();
    let lengths =
        if explicit { a.lengths.clone() } else { default_lengths(models.iter().map(|m| m.trained_context()).max().unwrap_or(1024), 16) };
    let longest = lengths.iter().copied().max().unwrap_or(1);
    let mut points = Vec::new();
    let mut meta = Vec::new();
    for m in models {
        if lead {
            eprintln!("{}", m.describe());
        }
        meta.push(serde_json::json!({"model": m.name, "trained_context": m.trained_context(), "max_context": m.max_context(),
            "vocab_size": m.cfg().vocab_size,
            "rope_theta": m.cfg().rope_theta, "rope_scaling": m.cfg().rope_scaling.as_ref().map(|s| s.type_name())}));
        let mut run_lengths = Vec::new();
        for &l in &lengths {
            match m.check_length(l, a.run.allow_extrapolation, "--lengths") {
                Ok(()) => run_lengths.push(l),
                Err(e) if explicit => return Err(e),
                Err(_) => {
                    if lead {
                        eprintln!(
                            "note: {}: length {l} skipped, beyond its context {} (pass --allow-extrapolation to measure it)",
                            m.name,
                            m.max_context()
                        );
                    }
                }
            }
        }
        let src = DocSource {
            dataset: a.dataset.clone(),
            column: a.dataset_column.clone(),
            split: a.dataset_split.clone(),
            token_width,
            // Truncation reads whole documents (up to --max-docs); sliding reads the stream it scores.
            max_tokens: match method {
                Method::Sliding | Method::Documents => a.max_tokens.unwrap_or(longest.saturating_mul(4).saturating_add(1)).max(2),
                Method::Truncate => a.max_tokens.unwrap_or(usize::MAX).max(2),
            },
            max_docs: a.max_docs.max(1),
            seed: a.run.seed,
        };
        // synthetic:passkey-answer and retrieval-answer keep their answer-only mask:
        // samples of each length, scored on their answers (`ppl::passkey_answer_windows`).
        let answer_only = longctx::data::synthetic::answer_only(&a.dataset);
        let docs = if answer_only.is_some() { Vec::new() } else { ppl::read_docs(&src, &m.model, m.tokenizer.as_ref(), longest)? };
        let stream: Vec<u32> = docs.concat();
        for &l in &run_lengths {
            let t0 = Instant::now();
            let windows = match method {
                _ if answer_only.is_some() => {
                    let n = src.max_docs.min(src.max_tokens.div_ceil(l.saturating_add(1))).max(1);
                    ppl::passkey_answer_windows(m.cfg().vocab_size, src.seed, l, n, answer_only.unwrap_or(0))?
                }
                Method::Sliding => ppl::sliding_windows(&stream, l, a.stride.unwrap_or((l / 2).max(1)), src.max_tokens),
                Method::Truncate => ppl::truncated_windows(&docs, l, src.max_docs),
                Method::Documents => ppl::document_windows(&docs, l, src.max_tokens),
            };
            let pb = bar(windows.len() as u64, lead, &format!("ppl {} @{l}", short(&m.name)));
            let (sum, n) = ppl::score_windows(ranks, &m.model, &windows, || {
                if let Some(b) = &pb {
                    b.inc(1);
                }
            })?;
            if let Some(b) = pb {
                b.finish_and_clear();
            }
            let what = format!("{} at length {l}", m.name);
            let ppl_v = ppl::perplexity(sum, n, &what)?;
            let p = PplPoint {
                model: m.name.clone(),
                length: l,
                ppl: ppl_v,
                loss: sum / n as f64,
                tokens: n,
                windows: windows.len(),
                seconds: t0.elapsed().as_secs_f64(),
            };
            points.push(p);
        }
    }
    Ok((points, meta, lengths))
}

fn short(name: &str) -> String {
    let p = Path::new(name);
    let parts: Vec<_> = p.components().rev().take(2).collect();
    let mut v: Vec<String> = parts.into_iter().rev().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if v.is_empty() {
        v.push(name.to_string());
    }
    v.join("/")
}

fn read_haystack(path: Option<&Path>) -> Result<Option<String>> {
    path.map(|p| {
        std::fs::read_to_string(p).with_context(|| {
            format!(
                "--haystack: cannot read the text file {} (give a UTF-8 text file, or omit --haystack for generated filler)",
                p.display()
            )
        })
    })
    .transpose()
}

fn ruler_cmd(a: RulerArgs) -> Result<()> {
    let tasks: Vec<Task> = a.tasks.iter().map(|t| Task::parse(t)).collect::<longctx::Result<_>>()?;
    if a.trials == 0 {
        bail!("--trials: must be at least 1");
    }
    if a.lengths.contains(&0) {
        bail!("--lengths: a length must be at least 1 token");
    }
    let haystack = read_haystack(a.haystack.as_deref())?;
    check_lengths(std::slice::from_ref(&a.model), &a.lengths, &a.run, a.run.dtype()?, 256)?;
    let (spec, dtype) = a.run.prepare(&a.output_dir)?;
    let started = Instant::now();
    let result = with_ranks(
        &spec,
        &a.run.device,
        |dev| load_models(std::slice::from_ref(&a.model), dev, dtype),
        |ms: &Vec<EvalModel>| ms.first().map(|m| (m.cfg().num_attention_heads, m.cfg().num_key_value_heads)).unwrap_or((1, 1)),
        |ranks: &Ranks, models: &Vec<EvalModel>| ruler_ranks(&a, &tasks, haystack.as_deref(), ranks, &models[0]),
    )
    .context("evaluating the RULER-style tasks")?;
    let Some((cells, lengths, meta, tasks)) = result else { return Ok(()) };
    let (json, csv) = (a.output_dir.join("ruler.json"), a.output_dir.join("ruler.csv"));
    let (png, png_tf) = (a.output_dir.join("ruler.png"), a.output_dir.join("ruler_teacher_forced.png"));
    let mut doc = meta;
    let per_task: serde_json::Map<String, serde_json::Value> = tasks
        .iter()
        .map(|t| {
            let c: Vec<&ruler::TaskCell> = cells.iter().filter(|c| c.task == *t).collect();
            let mean = |f: &dyn Fn(&ruler::TaskCell) -> Option<f64>| {
                let v: Vec<f64> = c.iter().filter_map(|c| f(c)).collect();
                (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
            };
            (t.name().to_string(), serde_json::json!({"recall": mean(&|c| c.recall), "teacher_forced": mean(&|c| Some(c.teacher_forced))}))
        })
        .collect();
    doc["cells"] = serde_json::to_value(&cells)?;
    doc["summary"] = serde_json::Value::Object(per_task);
    doc["seconds"] = serde_json::json!(started.elapsed().as_secs_f64());
    // The files are replaced together; with --no-generate an earlier run's recall map goes.
    let mut set = output::OutputSet::default();
    set.write_json(&json, &doc)?;
    set.write(&csv, ruler::to_csv(&cells).as_bytes())?;
    let grid = |f: &dyn Fn(&ruler::TaskCell) -> Option<f64>| -> Vec<Vec<Option<f64>>> {
        tasks.iter().map(|t| lengths.iter().map(|&l| cells.iter().find(|c| c.task == *t && c.length == l).and_then(f)).collect()).collect()
    };
    let (tf_grid, recall_grid) = (grid(&|c| Some(c.teacher_forced)), grid(&|c| c.recall));
    let title = format!("RULER-style tasks, teacher-forced exact match (%): {}", short(&a.model));
    let mut map = plot::Heatmap {
        title: &title,
        lengths: &lengths,
        rows: tasks.iter().map(|t| t.name().to_string()).collect(),
        row_desc: "task",
        values: &tf_grid,
        trials: a.trials,
        trained_context: doc["trained_context"].as_u64().map(|c| c as usize),
    };
    let title = format!("RULER-style tasks, recall of the expected strings in greedy output (%): {}", short(&a.model));
    let generated = (!a.no_generate).then_some((title.as_str(), recall_grid.as_slice()));
    let mut written = vec![json.display().to_string(), csv.display().to_string()];
    written.extend(write_maps(set, &mut map, &png_tf, &png, generated)?);
    let pct = |v: Option<f64>| v.map(|v| format!("{:.1} %", v * 100.0)).unwrap_or_else(|| "-".into());
    for t in &tasks {
        let s = &doc["summary"][t.name()];
        println!("{}\trecall {}\tteacher-forced exact {}", t.name(), pct(s["recall"].as_f64()), pct(s["teacher_forced"].as_f64()));
    }
    println!("wrote {}", written.join(", "));
    Ok(())
}

/// The cells, the lengths, the JSON's metadata and the tasks run.
type RulerOut = (Vec<ruler::TaskCell>, Vec<usize>, serde_json::Value, Vec<Task>);

fn ruler_ranks(a: &RulerArgs, tasks: &[Task], haystack: Option<&str>, ranks: &Ranks, m: &EvalModel) -> longctx::Result<RulerOut> {
    let lead = ranks.rank() == 0;
    if lead {
        eprintln!("{}", m.describe());
    }
    // A model without tokenizer.json: the built-in token vocabulary (`single` and `vt`).
    let tok = m.tokenizer.as_ref();
    let tasks: Vec<Task> = match (tasks.is_empty(), tok) {
        (true, Some(_)) => Task::ALL.to_vec(),
        (true, None) => ruler::TOKEN_TASKS.to_vec(),
        (false, _) => tasks.to_vec(),
    };
    let digits = a.digits.unwrap_or(if tok.is_some() { 7 } else { 5 });
    let hops = a.hops.unwrap_or(if tok.is_some() { 4 } else { longctx::data::synthetic::RETRIEVAL_HOPS });
    let suite = match tok {
        Some(tok) => Some(RulerTask::new(tok, haystack, digits, a.needles, hops)?.with_common_words(a.common_words)?),
        None => {
            if a.haystack.is_some() {
                return Err(longctx::Error::config(
                    "--haystack",
                    "haystack",
                    format!(
                        "{} has no tokenizer.json: its tasks are in the built-in token vocabulary, whose filler is fixed; omit --haystack",
                        m.name
                    ),
                ));
            }
            None
        }
    };
    let case = |t: Task, l: usize, index: u64| match &suite {
        Some(s) => s.case(t, l, a.run.seed, index),
        None => ruler::token_case(t, l, m.cfg().vocab_size, digits, hops, a.run.seed, index),
    };
    let lengths = if a.lengths.is_empty() { default_lengths(m.trained_context(), 256) } else { a.lengths.clone() };
    for &l in &lengths {
        m.check_length(l, a.run.allow_extrapolation, "--lengths")?;
    }
    let eos = m.cfg().eos_token_id();
    let total = (lengths.len() * tasks.len() * a.trials) as u64;
    let pb = bar(total, lead, &format!("ruler {}", short(&m.name)));
    let mut cells = Vec::new();
    for &t in &tasks {
        for &l in &lengths {
            let (mut tf, mut tok_acc, mut rec) = (0usize, 0f64, 0f64);
            let cases: longctx::Result<Vec<_>> = (0..a.trials).map(|i| case(t, l, ((l as u64) << 20) ^ i as u64)).collect();
            // A length of the default grid too short for a task is skipped for that task
            // (the same on every rank); a length given with --lengths is an error.
            let cases = match cases {
                Err(e) if a.lengths.is_empty() && ruler::is_too_short(&e) => {
                    if lead {
                        eprintln!("note: {} skipped at length {l} of the default grid: {e}", t.name());
                    }
                    if let Some(b) = &pb {
                        b.inc(a.trials as u64);
                    }
                    continue;
                }
                c => c?,
            };
            for case in cases {
                let scores = ranks.token_scores(&m.model, &case.sample.ids, &case.sample.targets)?;
                let pred = &scores.argmax[case.answer_start..];
                tf += needle::exact_match(pred, &case.answer) as usize;
                tok_acc += needle::token_accuracy(pred, &case.answer);
                if !a.no_generate && lead {
                    let out = longctx::eval::generate::generate(
                        &m.model,
                        &case.prompt(),
                        // Text may format the answer its own way; tokens have one way only
                        // (and a longer output would find a variable by chance more often).
                        case.answer.len() + if tok.is_some() { 8 } else { 0 },
                        eos,
                        &longctx::eval::generate::Sampling::GREEDY,
                        true,
                        |_| Ok(()),
                    )?;
                    rec += match tok {
                        Some(tok) => {
                            let text =
                                tok.decode(&out, true).map_err(|e| longctx::Error::Setting(format!("tokenizer failed to decode: {e}")))?;
                            ruler::recall(&text, &case.expected)
                        }
                        None => ruler::recall_ids(&out, &case.expected_ids),
                    };
                }
                if let Some(b) = &pb {
                    b.inc(1);
                }
            }
            let n = a.trials as f64;
            cells.push(ruler::TaskCell {
                task: t,
                length: l,
                trials: a.trials,
                teacher_forced: tf as f64 / n,
                token_accuracy: tok_acc / n,
                recall: (!a.no_generate).then_some(rec / n),
            });
        }
    }
    if let Some(b) = pb {
        b.finish_and_clear();
    }
    let meta = serde_json::json!({
        "model": m.name, "trained_context": m.trained_context(), "max_context": m.max_context(),
        "rope_theta": m.cfg().rope_theta, "tasks": tasks, "digits": digits, "needles": a.needles, "hops": hops,
        "format": if tok.is_some() { "text" } else { "tokens" },
        "common_words": a.common_words,
        "trials": a.trials, "lengths": lengths, "haystack": a.haystack.as_ref().map(|p| p.display().to_string()),
        "parallel_mode": a.run.parallel_mode, "world_size": a.run.world_size,
    });
    Ok((cells, lengths, meta, tasks))
}

fn needle_cmd(a: NeedleArgs) -> Result<()> {
    needle::check_depths(&a.depths)?;
    if a.trials == 0 {
        bail!("--trials: must be at least 1");
    }
    if a.lengths.contains(&0) {
        bail!("--lengths: a length must be at least 1 token");
    }
    let haystack = read_haystack(a.haystack.as_deref())?;
    check_lengths(std::slice::from_ref(&a.model), &a.lengths, &a.run, a.run.dtype()?, 2 * a.digits + 4)?;
    let (spec, dtype) = a.run.prepare(&a.output_dir)?;
    let started = Instant::now();
    let result = with_ranks(
        &spec,
        &a.run.device,
        |dev| load_models(std::slice::from_ref(&a.model), dev, dtype),
        |ms: &Vec<EvalModel>| ms.first().map(|m| (m.cfg().num_attention_heads, m.cfg().num_key_value_heads)).unwrap_or((1, 1)),
        |ranks: &Ranks, models: &Vec<EvalModel>| needle_ranks(&a, haystack.as_deref(), ranks, &models[0]),
    )
    .context("evaluating needle retrieval")?;
    let Some((cells, lengths, meta)) = result else { return Ok(()) };
    let json = a.output_dir.join("needle.json");
    let png = a.output_dir.join("needle.png");
    let png_greedy = a.output_dir.join("needle_greedy.png");
    let tf = needle::mean(&cells, |c| Some(c.teacher_forced));
    let tok = needle::mean(&cells, |c| Some(c.token_accuracy));
    let greedy = needle::mean(&cells, |c| c.greedy);
    let mut doc = meta;
    doc["cells"] = serde_json::to_value(&cells)?;
    doc["summary"] = serde_json::json!({"teacher_forced": tf, "token_accuracy": tok, "greedy": greedy});
    doc["seconds"] = serde_json::json!(started.elapsed().as_secs_f64());
    // The files are replaced together; with --no-generate an earlier run's greedy map goes.
    let mut set = output::OutputSet::default();
    set.write_json(&json, &doc)?;
    let grid = |f: &dyn Fn(&Cell) -> Option<f64>| -> Vec<Vec<Option<f64>>> {
        a.depths
            .iter()
            .map(|&d| lengths.iter().map(|&l| cells.iter().find(|c| c.length == l && c.depth == d).and_then(f)).collect())
            .collect()
    };
    let task = if a.passkey { "passkey" } else { "needle" };
    let trained_context = doc["trained_context"].as_u64().map(|c| c as usize);
    let rows: Vec<String> = a.depths.iter().map(|d| format!("{:.0}%", d * 100.0)).collect();
    let (tf_grid, greedy_grid) = (grid(&|c| Some(c.teacher_forced)), grid(&|c| c.greedy));
    let title = format!("{task} retrieval, teacher-forced exact match (%): {}", short(&a.model));
    let mut map =
        plot::Heatmap { title: &title, lengths: &lengths, rows, row_desc: "depth", values: &tf_grid, trials: a.trials, trained_context };
    let title = format!("{task} retrieval, greedy generation exact match (%): {}", short(&a.model));
    let generated = (!a.no_generate).then_some((title.as_str(), greedy_grid.as_slice()));
    let mut written = vec![json.display().to_string()];
    written.extend(write_maps(set, &mut map, &png, &png_greedy, generated)?);
    let pct = |v: Option<f64>| v.map(|v| format!("{:.1} %", v * 100.0)).unwrap_or_else(|| "-".into());
    println!("teacher-forced exact match {}, answer tokens right {}, greedy exact match {}", pct(tf), pct(tok), pct(greedy));
    println!("wrote {}", written.join(", "));
    Ok(())
}

/// The heatmaps of a grid command, then the whole output set committed: `map` (the
/// teacher-forced one) at `first`; with `generated` (its title and values) the generation
/// map at `second`, else an earlier run's map there is removed. The paths written.
fn write_maps<'a>(
    mut set: output::OutputSet,
    map: &mut plot::Heatmap<'a>,
    first: &Path,
    second: &Path,
    generated: Option<(&'a str, &'a [Vec<Option<f64>>])>,
) -> longctx::Result<Vec<String>> {
    plot::heatmap(&set.stage(first), map)?;
    let mut written = vec![first.display().to_string()];
    match generated {
        Some((title, values)) => {
            (map.title, map.values) = (title, values);
            plot::heatmap(&set.stage(second), map)?;
            written.push(second.display().to_string());
            set.commit(&[])?;
        }
        None => set.commit(&[second.to_path_buf()])?,
    }
    Ok(written)
}

type NeedleOut = (Vec<Cell>, Vec<usize>, serde_json::Value);

fn needle_ranks(a: &NeedleArgs, haystack: Option<&str>, ranks: &Ranks, m: &EvalModel) -> longctx::Result<NeedleOut> {
    let lead = ranks.rank() == 0;
    let cfg = m.cfg();
    let format = if m.tokenizer.is_some() { Format::Text } else { Format::Tokens };
    if lead {
        eprintln!("{}", m.describe());
        if format == Format::Tokens {
            eprintln!("no tokenizer.json: the synthetic passkey token format (built-in vocabulary) is used");
        }
    }
    if format == Format::Tokens && haystack.is_some() {
        return Err(longctx::Error::config(
            "--haystack",
            "haystack",
            "the model has no tokenizer.json, so a text haystack cannot be read; omit --haystack (the synthetic token format is used)",
        ));
    }
    let min = if format == Format::Tokens { 2 * a.digits + 4 } else { 32 };
    let lengths = if a.lengths.is_empty() { default_lengths(m.trained_context(), min) } else { a.lengths.clone() };
    for &l in &lengths {
        m.check_length(l, a.run.allow_extrapolation, "--lengths")?;
    }
    let task = match (&m.tokenizer, format) {
        (Some(tok), Format::Text) => Some(TextTask::new(tok, haystack, a.passkey, a.digits, a.distractors)?),
        _ => None,
    };
    let total = (lengths.len() * a.depths.len() * a.trials) as u64;
    let pb = bar(total, lead, &format!("needle {}", short(&m.name)));
    let mut cells = Vec::new();
    for &l in &lengths {
        for &d in &a.depths {
            let (mut tf, mut tok_acc, mut greedy) = (0usize, 0f64, 0usize);
            for t in 0..a.trials {
                let index = ((l as u64) << 20) ^ (((d * 1000.0) as u64) << 8) ^ t as u64;
                let case = match &task {
                    Some(task) => task.case(l, d, a.run.seed, index)?,
                    None => needle::token_case(l, d, a.digits, cfg.vocab_size, a.run.seed, index, a.distractors)?,
                };
                let scores = ranks.token_scores(&m.model, &case.sample.ids, &case.sample.targets)?;
                let pred = &scores.argmax[case.answer_start..];
                tf += needle::exact_match(pred, &case.answer) as usize;
                tok_acc += needle::token_accuracy(pred, &case.answer);
                if !a.no_generate && lead {
                    let out = longctx::eval::generate::generate(
                        &m.model,
                        &case.prompt(),
                        case.answer.len(),
                        None,
                        &longctx::eval::generate::Sampling::GREEDY,
                        true,
                        |_| Ok(()),
                    )?;
                    greedy += needle::exact_match(&out, &case.answer) as usize;
                }
                if let Some(b) = &pb {
                    b.inc(1);
                }
            }
            let n = a.trials as f64;
            cells.push(Cell {
                length: l,
                depth: d,
                trials: a.trials,
                teacher_forced: tf as f64 / n,
                token_accuracy: tok_acc / n,
                greedy: (!a.no_generate).then_some(greedy as f64 / n),
            });
        }
    }
    if let Some(b) = pb {
        b.finish_and_clear();
    }
    let meta = serde_json::json!({
        "model": m.name, "trained_context": m.trained_context(), "max_context": m.max_context(),
        "rope_theta": cfg.rope_theta, "format": format, "passkey": a.passkey, "digits": a.digits,
        "trials": a.trials, "distractors": a.distractors, "lengths": lengths, "depths": a.depths,
        "parallel_mode": a.run.parallel_mode, "world_size": a.run.world_size,
        "chance_token_accuracy": if format == Format::Tokens { Some(0.1) } else { None },
    });
    Ok((cells, lengths, meta))
}

#[cfg(test)]
mod tests {
    use super::RunFlags;
    use clap::Parser;
    use longctx_attention::kernel::CudaKernel;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        run: RunFlags,
    }

    fn parse(v: &[&str]) -> Result<RunFlags, clap::Error> {
        Cmd::try_parse_from(std::iter::once("eval").chain(v.iter().copied())).map(|c| c.run)
    }

    #[test]
    fn attention_kernel_flag() {
        assert_eq!(parse(&[]).unwrap().attention_kernel, CudaKernel::Auto);
        assert_eq!(parse(&["--attention-kernel", "Native"]).unwrap().attention_kernel, CudaKernel::Native);
        let e = parse(&["--attention-kernel", "flash"]).map(|_| ()).expect_err("flash is no kernel").to_string();
        assert!(e.contains("--attention-kernel") && e.contains("flash") && e.contains("cudnn, native, auto"), "{e}");
    }
}
