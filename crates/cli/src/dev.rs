//! `shardlock dev up|down`: the three local shards of `config/local.yaml`.

use std::path::PathBuf;

use clap::Subcommand;
use serde_json::json;
use shardlock_testkit::DevCluster;

use crate::AnyError;

/// The ports of `config/local.yaml`.
pub(crate) const DEV_PORTS: [u16; 3] = [33061, 33062, 33063];

#[derive(Debug, Subcommand)]
pub(crate) enum DevAction {
    /// Start the shards (initialising their data the first time) and wait until they answer.
    Up,
    /// Stop the shards.
    Down {
        /// Also delete their data.
        #[arg(long)]
        wipe: bool,
    },
}

/// Where the dev shards keep their data: `$SHARDLOCK_DEV_DIR`, else
/// `~/.local/share/shardlock/dev`.
fn dev_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SHARDLOCK_DEV_DIR") {
        return dir.into();
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".local/share/shardlock/dev")
}

pub(crate) fn cluster() -> DevCluster {
    DevCluster::new(dev_dir(), DEV_PORTS.to_vec())
}

/// Starts the dev shards unless they already answer; says so on stderr.
pub(crate) async fn ensure_up() -> Result<(), AnyError> {
    let cluster = cluster();
    if cluster.is_up().await {
        return Ok(());
    }
    eprintln!(
        "starting 3 local MariaDB shards on 127.0.0.1:{:?} (data in {})",
        DEV_PORTS,
        dev_dir().display()
    );
    cluster.up().await?;
    Ok(())
}

pub(crate) async fn run(action: &DevAction, as_json: bool) -> Result<(), AnyError> {
    let cluster = cluster();
    match action {
        DevAction::Up => {
            let started = cluster.up().await?;
            if as_json {
                println!(
                    "{}",
                    json!({"started": started, "ports": DEV_PORTS, "dir": dev_dir()})
                );
            } else {
                println!(
                    "3 shards up on 127.0.0.1:{:?} ({started} started now); data in {}",
                    DEV_PORTS,
                    dev_dir().display()
                );
                println!("try: shardlock migrate && shardlock status");
            }
        }
        DevAction::Down { wipe } => {
            let stopped = cluster.down(*wipe)?;
            if as_json {
                println!("{}", json!({"stopped": stopped, "wiped": wipe}));
            } else {
                println!(
                    "stopped {stopped} shards{}",
                    if *wipe { ", data deleted" } else { "" }
                );
            }
        }
    }
    Ok(())
}
