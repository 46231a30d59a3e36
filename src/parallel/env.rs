//! Who am I in a distributed run: read the rank environment.
//!
//! Two sources, first match wins:
//! 1. torchrun style (also what `longctx launch` sets): `RANK`, `WORLD_SIZE`,
//!    `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`. Present as soon
//!    as `RANK` or `WORLD_SIZE` is set; then all six are required.
//! 2. Slurm (one task per GPU, e.g. `srun --ntasks-per-node=8 longctx train ...`):
//!    `SLURM_PROCID` → rank, `SLURM_NTASKS` → world, `SLURM_LOCALID` → local rank,
//!    `SLURM_NTASKS_PER_NODE`, else this node's entry of `SLURM_TASKS_PER_NODE`
//!    (`"4(x2),3"` form, indexed by `SLURM_NODEID`) → local world. A step with a single
//!    task is not distributed.
//!    Master address: `MASTER_ADDR` when set; otherwise the first host of
//!    `SLURM_STEP_NODELIST` (or `SLURM_JOB_NODELIST`, `SLURM_NODELIST`), expanded from
//!    the simple bracket forms `node07`, `node[07-10,12]`, `a,b` (the first range bound
//!    keeps its zero padding). Any other form is an error asking for `MASTER_ADDR`.
//!    `MASTER_PORT` is always required (no port is guessed).
//!
//! The GPU of a rank is ordinal `local_rank` among the visible devices.

use crate::{Error, Result};

/// The rank environment of one process of a distributed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub local_rank: usize,
    pub world: usize,
    pub local_world: usize,
    pub master_addr: String,
    pub master_port: u16,
}

fn bad(msg: String) -> Error {
    Error::Setting(msg)
}

impl DistEnv {
    /// Read the process environment. `Ok(None)`: not a distributed run.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Same as [`Self::from_env`] with the variables given by `get` (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let get = |k: &str| get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let env = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            Self::torchrun(&get)?
        } else if get("SLURM_PROCID").is_some() {
            match Self::slurm(&get)? {
                Some(e) => e,
                None => return Ok(None),
            }
        } else {
            return Ok(None);
        };
        env.validate()?;
        Ok(Some(env))
    }

    fn torchrun(get: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let need = |k: &str| {
            get(k).ok_or_else(|| {
                bad(format!(
                    "distributed environment: `{k}` is not set (torchrun style needs RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; start ranks with `longctx launch`)"
                ))
            })
        };
        Ok(Self {
            rank: parse_count("RANK", &need("RANK")?)?,
            world: parse_count("WORLD_SIZE", &need("WORLD_SIZE")?)?,
            local_rank: parse_count("LOCAL_RANK", &need("LOCAL_RANK")?)?,
            local_world: parse_count("LOCAL_WORLD_SIZE", &need("LOCAL_WORLD_SIZE")?)?,
            master_addr: need("MASTER_ADDR")?,
            master_port: parse_port(&need("MASTER_PORT")?)?,
        })
    }

    fn slurm(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let need = |k: &str| get(k).ok_or_else(|| bad(format!("Slurm environment: SLURM_PROCID is set but `{k}` is not")));
        let world = parse_count("SLURM_NTASKS", &need("SLURM_NTASKS")?)?;
        if world == 1 {
            return Ok(None);
        }
        let rank = parse_count("SLURM_PROCID", &need("SLURM_PROCID")?)?;
        let local_rank = parse_count("SLURM_LOCALID", &need("SLURM_LOCALID")?)?;
        let local_world = match get("SLURM_NTASKS_PER_NODE") {
            Some(v) => parse_count("SLURM_NTASKS_PER_NODE", &v)?,
            None => {
                let per_node = need("SLURM_TASKS_PER_NODE")?;
                let node = parse_count("SLURM_NODEID", &need("SLURM_NODEID")?)?;
                tasks_on_node(&per_node, node)?
            }
        };
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a,
            None => {
                let (name, list) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                    .iter()
                    .find_map(|k| get(k).map(|v| (*k, v)))
                    .ok_or_else(|| {
                        bad("Slurm environment: neither MASTER_ADDR nor a node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) is set"
                            .into())
                    })?;
                first_host(&list).ok_or_else(|| {
                    bad(format!(
                        "Slurm environment: cannot take the master host from {name}=`{list}`; set MASTER_ADDR to the first node's address"
                    ))
                })?
            }
        };
        let port = get("MASTER_PORT").ok_or_else(|| {
            bad("Slurm environment: MASTER_PORT is not set (export a free TCP port, e.g. MASTER_PORT=29500, for the rendezvous)".into())
        })?;
        Ok(Some(Self { rank, local_rank, world, local_world, master_addr, master_port: parse_port(&port)? }))
    }

    fn validate(&self) -> Result<()> {
        let Self { rank, local_rank, world, local_world, .. } = *self;
        if world == 0 {
            return Err(bad("distributed environment: WORLD_SIZE must be at least 1".into()));
        }
        if rank >= world {
            return Err(bad(format!("distributed environment: RANK = {rank} is not below WORLD_SIZE = {world}")));
        }
        if local_world == 0 || local_world > world {
            return Err(bad(format!("distributed environment: LOCAL_WORLD_SIZE = {local_world} must be in 1..={world} (WORLD_SIZE)")));
        }
        if local_rank >= local_world {
            return Err(bad(format!("distributed environment: LOCAL_RANK = {local_rank} is not below LOCAL_WORLD_SIZE = {local_world}")));
        }
        if self.master_port == 0 {
            return Err(bad("distributed environment: MASTER_PORT must not be 0".into()));
        }
        Ok(())
    }

    /// `host:port` of the rendezvous master.
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

fn parse_count(name: &str, v: &str) -> Result<usize> {
    v.parse::<usize>().map_err(|_| bad(format!("distributed environment: {name} = `{v}` is not a non-negative integer")))
}

fn parse_port(v: &str) -> Result<u16> {
    match v.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(bad(format!("distributed environment: MASTER_PORT = `{v}` is not a TCP port (1..=65535)"))),
    }
}

/// Tasks on node `node` from Slurm's compressed `SLURM_TASKS_PER_NODE`, e.g. `"4(x2),3"`
/// = nodes 0 and 1 run 4 tasks, node 2 runs 3.
pub fn tasks_on_node(spec: &str, node: usize) -> Result<usize> {
    let err = || bad(format!("Slurm environment: cannot read SLURM_TASKS_PER_NODE = `{spec}` (expected e.g. `4(x2),3`)"));
    let mut first = 0usize;
    for part in spec.split(',') {
        let (count, repeat) = match part.split_once('(') {
            Some((c, rest)) => {
                let r = rest.strip_prefix('x').and_then(|r| r.strip_suffix(')')).ok_or_else(err)?;
                (c, r.parse::<usize>().map_err(|_| err())?)
            }
            None => (part, 1),
        };
        let count = count.parse::<usize>().map_err(|_| err())?;
        if node < first + repeat {
            return Ok(count);
        }
        first += repeat;
    }
    Err(bad(format!("Slurm environment: SLURM_NODEID = {node} but SLURM_TASKS_PER_NODE = `{spec}` describes only {first} node(s)")))
}

/// First host of a Slurm host list in the simple forms `node07`, `node[07-10,12]`,
/// `gpu[3]-ib`, `a,b`; `None` for anything else (nested brackets, empty names).
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    // First entry: up to the first comma outside brackets.
    let mut depth = 0i32;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return None;
        }
    }
    let entry = &list[..end];
    let host = match entry.split_once('[') {
        None => entry.to_string(),
        Some((prefix, rest)) => {
            let (inside, suffix) = rest.split_once(']')?;
            if suffix.contains('[') || suffix.contains(']') {
                return None;
            }
            let first = inside.split(',').next()?.split('-').next()?;
            if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            format!("{prefix}{first}{suffix}")
        }
    };
    let ok = !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || "-._".contains(c));
    ok.then_some(host)
}
