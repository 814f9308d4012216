//! A history of who believed they held which key, when: each process appends its holds to a
//! file of its own; the checker reads them all and looks for two beliefs at one instant.
//!
//! Instants are `CLOCK_MONOTONIC` nanoseconds, one clock for every process of the machine.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

/// Now, on the clock every process of this machine shares.
pub fn now_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

/// One hold as its holder saw it: from the moment `acquire` returned to the moment it stopped
/// believing it held the key (before calling `release`, or when `lost()` fired).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub process: u32,
    pub key: String,
    pub remote: bool,
    pub start: u64,
    pub end: u64,
    pub fence: u64,
}

/// Appends holds to this process's history file.
#[derive(Debug)]
pub struct Recorder {
    file: std::sync::Mutex<std::fs::File>,
}

impl Recorder {
    /// The history file of this process in `dir`.
    pub fn create(dir: &Path) -> Self {
        let path = dir.join(format!("{}.history", std::process::id()));
        Self {
            file: std::sync::Mutex::new(std::fs::File::create(path).unwrap()),
        }
    }

    pub fn hold(&self, key: &str, remote: bool, start: u64, end: u64, fence: u64) {
        let line = format!(
            "{} {key} {} {start} {end} {fence}\n",
            std::process::id(),
            u8::from(remote)
        );
        self.file
            .lock()
            .unwrap()
            .write_all(line.as_bytes())
            .unwrap();
    }
}

/// Every hold recorded in `dir`.
pub fn read(dir: &Path) -> Vec<Hold> {
    let mut holds = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            holds.push(Hold {
                process: f[0].parse().unwrap(),
                key: f[1].to_owned(),
                remote: f[2] == "1",
                start: f[3].parse().unwrap(),
                end: f[4].parse().unwrap(),
                fence: f[5].parse().unwrap(),
            });
        }
    }
    holds
}

/// Panics with the first pair of `Remote` holds of one key that overlap in time (two
/// holders at one instant), and checks that fences rise with grant order per key. Returns
/// how many holds it checked.
pub fn check_no_two_holders(holds: &[Hold]) -> usize {
    let mut by_key: HashMap<&str, Vec<&Hold>> = HashMap::new();
    for h in holds.iter().filter(|h| h.remote) {
        // A key may be recorded as `key@shard`: holds on any shard count.
        let key = h.key.split('@').next().unwrap_or(&h.key);
        by_key.entry(key).or_default().push(h);
    }
    for (key, holds) in &mut by_key {
        holds.sort_by_key(|h| h.start);
        for pair in holds.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            assert!(
                a.end <= b.start,
                "two holders of {key} at once: {a:?} until {} ns after {b:?} began",
                a.end - b.start
            );
            assert!(
                b.fence > a.fence,
                "fences of {key} went backwards in grant order: {a:?} then {b:?}"
            );
        }
    }
    by_key.values().map(Vec::len).sum()
}
