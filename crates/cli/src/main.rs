//! `shardlock`: operate shardlock deployments and try it out locally.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod bench;
mod demo;
mod dev;
mod output;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use shardlock::{Config, LockRouter};

/// Distributed locks stored in MySQL, spread over shards.
#[derive(Debug, Parser)]
#[command(name = "shardlock", version, about, propagate_version = true)]
struct Cli {
    /// The YAML config. Without it, the three local dev shards of `config/local.yaml`
    /// (started by `shardlock dev up`, or by `demo` and `bench` themselves).
    #[arg(long, short, global = true, env = "SHARDLOCK_CONFIG")]
    config: Option<PathBuf>,
    /// Print machine-readable JSON instead of text (read commands).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade shardlock's tables on every shard (idempotent).
    Migrate,
    /// Per shard: reachable, pool size/available/waiting, live leases.
    Status,
    /// Where a key lives and who holds it: shard, holder, fence, expiry.
    Inspect {
        /// The lock key, exactly as the application passes it.
        key: String,
    },
    /// Start or stop the three local MariaDB shards of `config/local.yaml`.
    Dev {
        #[command(subcommand)]
        action: dev::DevAction,
    },
    /// The quickstart story: a flash sale sold by several processes under shardlock locks.
    Demo(demo::DemoArgs),
    /// Measure lock throughput against raw SQL and hand-rolled baselines on the same shards.
    Bench(bench::BenchArgs),
}

/// The config in force and where it came from (for messages and for child processes).
#[derive(Debug, Clone)]
pub(crate) struct ConfigSource {
    pub(crate) path: Option<PathBuf>,
    pub(crate) config: Config,
    text: String,
}

/// The embedded default: the local dev shards.
pub(crate) const LOCAL_YAML: &str = include_str!("../../../config/local.yaml");

impl ConfigSource {
    fn load(path: Option<PathBuf>) -> shardlock::Result<Self> {
        match path {
            Some(p) => {
                let text = std::fs::read_to_string(&p).map_err(|e| shardlock::ConfigError {
                    path: Some(p.clone()),
                    message: format!("cannot read the file: {e}"),
                    ..Default::default()
                })?;
                let config = Config::from_yaml_file(&p)?;
                Ok(Self {
                    path: Some(p),
                    config,
                    text,
                })
            }
            None => Ok(Self {
                path: None,
                config: Config::from_yaml_str(LOCAL_YAML)?,
                text: LOCAL_YAML.to_owned(),
            }),
        }
    }

    pub(crate) fn is_local_default(&self) -> bool {
        self.path.is_none()
    }

    pub(crate) async fn router(&self) -> shardlock::Result<LockRouter> {
        match &self.path {
            Some(p) => LockRouter::from_yaml_file(p).await,
            None => LockRouter::from_yaml_str(&self.text).await,
        }
    }

    /// Arguments that make a child `shardlock` process use the same config.
    pub(crate) fn child_args(&self) -> Vec<String> {
        match &self.path {
            Some(p) => vec!["--config".into(), p.display().to_string()],
            None => vec![],
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHARDLOCK_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            let mut source = std::error::Error::source(e.as_ref());
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}

pub(crate) type AnyError = Box<dyn std::error::Error + Send + Sync>;

async fn run(cli: Cli) -> Result<(), AnyError> {
    if let Command::Dev { action } = &cli.command {
        return dev::run(action, cli.json).await;
    }
    let source = ConfigSource::load(cli.config)?;
    match cli.command {
        Command::Migrate => {
            let router = source.router().await?;
            let reports = router.migrate().await?;
            output::migrate(&reports, cli.json);
        }
        Command::Status => {
            let router = source.router().await?;
            let status = router.status().await;
            output::status(&router, &status, cli.json);
            if status.iter().any(|s| !s.reachable) {
                return Err("some shards are unreachable".into());
            }
        }
        Command::Inspect { key } => {
            let router = source.router().await?;
            let (shard, row) = router.inspect(&key).await?;
            output::inspect(&key, &shard, row.as_ref(), cli.json);
        }
        Command::Demo(args) => demo::run(&source, args).await?,
        Command::Bench(args) => bench::run(&source, args, cli.json).await?,
        Command::Dev { .. } => unreachable!("handled above"),
    }
    Ok(())
}
