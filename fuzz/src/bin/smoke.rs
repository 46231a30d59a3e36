//! A mutation fuzzer on stable Rust over the target bodies of `longctx_fuzz` (for machines
//! without nightly/cargo-fuzz): start from each target's seeds (and files in
//! `corpus/<target>/` when present), mutate (bit flips, byte changes, inserted and
//! deleted runs, interesting integers and JSON tokens, splices of two inputs), run the
//! body, and stop at the first panic, writing the input to `artifacts/<target>/`.
//!
//! `smoke TARGET SECONDS [SEED]`, or `smoke all SECONDS` (each target in turn);
//! `smoke TARGET --replay FILE` runs one input (a crash found before);
//! `smoke TARGET --write-seeds DIR` writes the target's seed inputs (a libFuzzer corpus).
//! Inputs that made a dependency panic where longctx caught it are kept as
//! `artifacts/<target>/caught-*` (regression inputs, not crashes).

use longctx_fuzz::{Target, TARGETS};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Panics seen by the hook (caught ones included).
static PANICS: AtomicU64 = AtomicU64::new(0);

/// xorshift64*: deterministic for a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const TOKENS: &[&[u8]] = &[
    b"0", b"-1", b"1e308", b"-0", b"NaN", b"null", b"true", b"[]", b"{}", b"\"\"", b"18446744073709551615", b"4294967296",
    b"9223372036854775807", b"-9223372036854775808", b"1e-400", b"\"..\"", b"\"/\"", b"[[[[[[[[", b"\"\\u0000\"", b"65536",
];

/// A structural mutation of a JSON input: one value (found by a random walk) replaced by
/// an interesting one, or one key removed. `None` when the input is not JSON.
fn mutate_json(rng: &mut Rng, input: &[u8]) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(input).ok()?;
    let interesting = || -> Vec<serde_json::Value> {
        use serde_json::json;
        vec![
            json!(null),
            json!(0),
            json!(-1),
            json!(1),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(4294967296u64),
            json!(1e308),
            json!(-1e-308),
            json!(0.5),
            json!(""),
            json!(".."),
            json!("../x"),
            json!("a/b"),
            json!([]),
            json!({}),
            json!([1, 2]),
            json!({"type": "x"}),
            json!(true),
            json!("F32"),
            json!([0, 18446744073709551615u64]),
        ]
    };
    // A random walk down from the root, as a JSON pointer.
    let mut pointer = String::new();
    let mut node = &v;
    for _ in 0..1 + rng.below(6) {
        let step = match node {
            serde_json::Value::Object(m) if !m.is_empty() => {
                let k = m.keys().nth(rng.below(m.len())).cloned().unwrap_or_default();
                Some((k.replace('~', "~0").replace('/', "~1"), &m[&k]))
            }
            serde_json::Value::Array(a) if !a.is_empty() => {
                let i = rng.below(a.len());
                Some((i.to_string(), &a[i]))
            }
            _ => None,
        };
        let Some((part, next)) = step else { break };
        pointer.push('/');
        pointer.push_str(&part);
        node = next;
    }
    if !pointer.is_empty() && rng.below(5) == 0 {
        // Remove the key (or element) instead.
        let (parent, last) = pointer.rsplit_once('/').unwrap_or(("", ""));
        match v.pointer_mut(parent) {
            Some(serde_json::Value::Object(m)) => {
                m.remove(&last.replace("~1", "/").replace("~0", "~"));
            }
            Some(serde_json::Value::Array(a)) => {
                if let Ok(i) = last.parse::<usize>() {
                    a.remove(i);
                }
            }
            _ => {}
        }
        return serde_json::to_vec(&v).ok();
    }
    let choices = interesting();
    let pick = choices[rng.below(choices.len())].clone();
    if let Some(slot) = v.pointer_mut(&pointer) {
        *slot = pick;
    }
    serde_json::to_vec(&v).ok()
}

fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    if rng.below(2) == 0 {
        if let Some(m) = mutate_json(rng, input) {
            return m;
        }
    }
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(8) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 => {
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(at..at, bytes);
            }
            3 if !v.is_empty() => {
                let end = (at + 1 + rng.below(32)).min(v.len());
                let start = at.min(end);
                v.drain(start..end);
            }
            4 => {
                let t = TOKENS[rng.below(TOKENS.len())];
                let end = (at + rng.below(8)).min(v.len());
                v.splice(at.min(end)..end, t.iter().copied());
            }
            5 if v.len() >= 8 => {
                // An interesting little-endian integer (sizes, offsets, lengths).
                let vals = [0u64, 1, 7, 8, u32::MAX as u64, u64::MAX, 1 << 31, 1 << 40, v.len() as u64];
                let x = vals[rng.below(vals.len())].to_le_bytes();
                let i = rng.below(v.len() - 7);
                v[i..i + 8].copy_from_slice(&x);
            }
            6 if !other.is_empty() => {
                let a = rng.below(other.len());
                let b = (a + rng.below(other.len() - a + 1)).min(other.len());
                v.splice(at..at, other[a..b].iter().copied());
            }
            _ => v.truncate(at),
        }
    }
    v
}

fn corpus(t: &Target) -> Vec<Vec<u8>> {
    let mut inputs = (t.seeds)();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(t.name);
    if let Ok(entries) = std::fs::read_dir(&dir) {
        inputs.extend(entries.flatten().filter_map(|e| std::fs::read(e.path()).ok()));
    }
    inputs
}

/// Runs `t` for `secs`; `Err(path)` of the saved input on a panic.
fn fuzz(t: &Target, secs: f64, seed: u64) -> Result<u64, PathBuf> {
    let seeds = corpus(t);
    let mut pool = seeds.clone();
    let mut rng = Rng(seed | 1);
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let (mut n, mut caught) = (0u64, 0);
    while Instant::now() < until {
        // Half the parents are the valid seeds: without coverage feedback the pool drifts
        // towards inputs rejected at the first byte.
        let a = if rng.below(2) == 0 { &seeds[rng.below(seeds.len())] } else { &pool[rng.below(pool.len())] };
        let b = &pool[rng.below(pool.len())];
        let input = mutate(&mut rng, a, b);
        let before = PANICS.load(Ordering::SeqCst);
        let result = std::panic::catch_unwind(|| (t.run)(&input));
        if result.is_ok() && PANICS.load(Ordering::SeqCst) != before && caught < 3 {
            // A panic inside a dependency that longctx caught and turned into an error:
            // kept as a regression input (`caught-*`), not a crash.
            caught += 1;
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts").join(t.name);
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::write(dir.join(format!("caught-{n}-{seed}")), &input);
        }
        if result.is_err() {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts").join(t.name);
            let _ = std::fs::create_dir_all(&dir);
            let path = dir.join(format!("crash-{n}-{seed}"));
            let _ = std::fs::write(&path, &input);
            return Err(path);
        }
        n += 1;
        // Keep some mutants as parents (no coverage feedback: a bounded random pool).
        if pool.len() < 256 {
            pool.push(input);
        } else if rng.below(4) == 0 {
            let i = rng.below(pool.len());
            pool[i] = input;
        }
    }
    Ok(n)
}

fn main() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: smoke TARGET|all SECONDS [SEED] | smoke TARGET --replay FILE | smoke TARGET --write-seeds DIR";
    let (Some(name), Some(arg)) = (args.first(), args.get(1)) else {
        eprintln!("{usage}\ntargets: {}", TARGETS.iter().map(|t| t.name).collect::<Vec<_>>().join(", "));
        std::process::exit(2);
    };
    let chosen: Vec<&Target> = TARGETS.iter().filter(|t| name == "all" || t.name == name).collect();
    if chosen.is_empty() {
        eprintln!("unknown target `{name}`; {usage}");
        std::process::exit(2);
    }
    if arg == "--write-seeds" {
        let dir = args.get(2).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("corpus"));
        for t in &chosen {
            let _ = std::fs::create_dir_all(&dir);
            for (i, s) in (t.seeds)().iter().enumerate() {
                let _ = std::fs::write(dir.join(format!("seed-{i}")), s);
            }
        }
        return;
    }
    if arg == "--replay" {
        let file = args.get(2).map(PathBuf::from).unwrap_or_default();
        let input = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        chosen.iter().for_each(|t| (t.run)(&input));
        println!("replayed {} without a crash", file.display());
        return;
    }
    let secs: f64 = arg.parse().unwrap_or_else(|_| panic!("{usage}"));
    let seed: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(0x5EED);
    let mut failed = false;
    for t in chosen {
        match fuzz(t, secs, seed) {
            Ok(n) => println!("{}: {n} inputs, no crash", t.name),
            Err(p) => {
                println!("{}: CRASH, input saved to {} (replay: smoke {} --replay FILE)", t.name, p.display(), t.name);
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
