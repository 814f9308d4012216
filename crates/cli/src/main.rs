//! `shardlock`: operate shardlock deployments and try it out locally.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

#[cfg(feature = "dev-tools")]
mod bench;
#[cfg(feature = "dev-tools")]
mod demo;
#[cfg(feature = "dev-tools")]
mod dev;
mod failure;
mod output;
#[cfg(feature = "dev-tools")]
mod plot;
mod watch;

use std::path::PathBuf;
use std::process::ExitCode;

use tokio::signal::unix::{signal, SignalKind};

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use shardlock::{Config, LockKey, LockRouter};

/// Distributed locks stored in MySQL, spread over shards.
#[derive(Debug, Parser)]
#[command(name = "shardlock", version, about, propagate_version = true)]
struct Cli {
    /// The YAML config; every operator command needs it. Without it, `demo` and `bench` use
    /// the three local dev shards of `config/local.yaml` (started by `shardlock dev up`, or
    /// by `demo` and `bench` themselves).
    #[arg(long, short, global = true, env = "SHARDLOCK_CONFIG")]
    config: Option<PathBuf>,
    /// Print machine-readable JSON instead of text (read commands; errors too, on stderr).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade shardlock's tables on every shard (idempotent).
    Migrate,
    /// Per shard: reachable, live leases, and this command's own breaker and pool (an
    /// application's: --watch --metrics); and the instances in the registry with their last
    /// heartbeat.
    Status {
        /// Redraw every second (Ctrl-C stops): a live view of shards and instances.
        #[arg(long)]
        watch: bool,
        /// With --watch: an application's Prometheus endpoint
        /// (`telemetry.prometheus-listen`), for its acquire rate, p99 wait, breakers, pools and
        /// hot keys.
        #[arg(long, requires = "watch", value_name = "URL")]
        metrics: Option<String>,
    },
    /// Where a key lives and who holds it: shard, holder, fence, expiry.
    Inspect {
        /// The lock: its whole name as `list` shows it, or with --namespace the key as the
        /// application passes it.
        key: String,
        #[command(flatten)]
        scope: KeyScope,
    },
    /// Lease rows on every shard in key order: holder, fence, time left, data.
    List {
        /// Live leases only.
        #[arg(long)]
        held: bool,
        /// Keys starting with this (after the namespace's key-prefix).
        #[arg(long, value_name = "P", default_value = "")]
        prefix: String,
        /// Keys of this namespace's scope (its key-prefix).
        #[arg(long, value_name = "NAME")]
        namespace: Option<String>,
        /// At most this many leases.
        #[arg(long, default_value_t = shardlock::DEFAULT_LIST_LIMIT)]
        limit: usize,
    },
    /// Remove a stuck lock whoever holds it, fenced: its fence is raised, so the evicted
    /// holder's later writes through the fence are rejected and it sees its lease lost.
    Release {
        /// The lock: its whole name as `list` shows it, or with --namespace the key as the
        /// application passes it.
        key: String,
        #[command(flatten)]
        scope: KeyScope,
        /// Required: a lock is normally released by its holder; this evicts the holder.
        #[arg(long)]
        force: bool,
        /// Do not ask for confirmation.
        #[arg(long, short)]
        yes: bool,
    },
    /// Run the lease cleaner until SIGTERM or Ctrl-C; one instance of a deployment cleans at a
    /// time (elected through a shardlock lock), the others stand by. It is an instance of the
    /// fleet: reload it with the services (SIGHUP rereads the config file).
    Cleaner {
        /// One pass, then exit.
        #[arg(long)]
        once: bool,
    },
    /// Start or stop the three local MariaDB shards of `config/local.yaml`.
    #[cfg(feature = "dev-tools")]
    Dev {
        #[command(subcommand)]
        action: dev::DevAction,
    },
    /// The quickstart story: a flash sale sold by several processes under shardlock locks.
    #[cfg(feature = "dev-tools")]
    Demo(demo::DemoArgs),
    /// Measure lock throughput against raw SQL and hand-rolled baselines on the same shards.
    #[cfg(feature = "dev-tools")]
    Bench(bench::BenchArgs),
}

/// Which lock a key names, as the application takes it.
#[derive(Debug, clap::Args)]
struct KeyScope {
    /// The namespace the application takes the key in: its key-prefix is put before KEY.
    #[arg(long, value_name = "NAME")]
    namespace: Option<String>,
    /// One bucket of the key, as `list` shows it (`[bucket N]`): a hot key's sub-lock, a
    /// semaphore's permit, a rw-lock's reader slot, or 4294967295 for a rw-lock writer's
    /// intent.
    #[arg(long, value_name = "N")]
    bucket: Option<u32>,
}

impl KeyScope {
    /// The lock `key` names under this scope in `router`'s config.
    fn lock(&self, router: &LockRouter, key: &str) -> shardlock::Result<LockKey> {
        router.scoped_key(key, self.namespace.as_deref(), self.bucket)
    }
}

/// Whether `key` reads as a key's label (`#` and 16 lowercase hex digits, as `list` and
/// telemetry show a key stored as a digest) rather than a key.
fn is_label(key: &str) -> bool {
    key.strip_prefix('#').is_some_and(|hex| {
        hex.len() == 16
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

impl Command {
    /// The tools that try shardlock out locally run on the dev shards without a config; an
    /// operator command never guesses which deployment it acts on.
    fn needs_config(&self) -> bool {
        #[cfg(feature = "dev-tools")]
        if matches!(self, Command::Demo(_) | Command::Bench(_)) {
            return false;
        }
        true
    }
}

/// The config in force and where it came from (for messages and for child processes).
#[derive(Debug, Clone)]
pub(crate) struct ConfigSource {
    pub(crate) path: Option<PathBuf>,
    pub(crate) config: Config,
    text: String,
}

/// The embedded default of `demo` and `bench`: the local dev shards.
#[cfg(feature = "dev-tools")]
pub(crate) const LOCAL_YAML: &str = include_str!("../local.yaml");

impl ConfigSource {
    fn load(path: Option<PathBuf>, command: &Command) -> Result<Self, AnyError> {
        if path.is_none() && command.needs_config() {
            return Err(failure::fail(
                failure::Exit::Usage,
                "this command needs the deployment's config: --config FILE or SHARDLOCK_CONFIG \
                 (the local dev shards: --config config/local.yaml)",
            ));
        }
        match path {
            Some(p) => {
                let text = shardlock::config::read_file(&p)?;
                let config = Config::from_yaml_text(&text, &p)?;
                Ok(Self {
                    path: Some(p),
                    config,
                    text,
                })
            }
            #[cfg(feature = "dev-tools")]
            None => Ok(Self {
                path: None,
                config: Config::from_yaml_str(LOCAL_YAML)?,
                text: LOCAL_YAML.to_owned(),
            }),
            #[cfg(not(feature = "dev-tools"))]
            None => unreachable!("every command needs a config without dev-tools"),
        }
    }

    #[cfg(feature = "dev-tools")]
    pub(crate) fn is_local_default(&self) -> bool {
        self.path.is_none()
    }

    /// An application's router (it registers in the instance registry).
    #[cfg(feature = "dev-tools")]
    pub(crate) async fn router(&self) -> shardlock::Result<LockRouter> {
        self.router_with(None).await
    }

    /// A router whose metrics go to `telemetry`'s provider, when given.
    async fn router_with(
        &self,
        telemetry: Option<&shardlock::telemetry::TelemetryGuard>,
    ) -> shardlock::Result<LockRouter> {
        let mut builder = LockRouter::builder(self.config.clone())
            .yaml_source(self.text.as_str(), self.path.as_deref());
        if let Some(telemetry) = telemetry {
            builder = builder.meter_provider(telemetry.meter_provider());
        }
        builder.build().await
    }

    /// A router for one-shot operator commands: it holds no leases of an application, so it
    /// does not register in the instance registry.
    pub(crate) async fn tool_router(&self) -> shardlock::Result<LockRouter> {
        let mut config = self.config.clone();
        config.cleaner.registry = shardlock::config::RegistryKind::Static;
        // Errors of the config that only building finds (a URL, a TLS file) name its file.
        LockRouter::builder(config)
            .yaml_source(self.text.as_str(), self.path.as_deref())
            .operator_tool()
            .build()
            .await
    }

    /// Arguments that make a child `shardlock` process use the same config.
    #[cfg(feature = "dev-tools")]
    pub(crate) fn child_args(&self) -> Vec<String> {
        match &self.path {
            Some(p) => vec!["--config".into(), p.display().to_string()],
            None => vec![],
        }
    }
}

fn main() -> ExitCode {
    quiet_on_closed_stdout();
    let (cli, config_from_env) = match parse() {
        Ok(parsed) => parsed,
        Err(e) => return e,
    };
    if config_from_env && !cli.command.needs_config() {
        let e = failure::fail(
            failure::Exit::Usage,
            "SHARDLOCK_CONFIG is set, and demo and bench write to the shards they run on (the \
             demo's tables, the bench's rows): they take a deployment's config only from \
             --config FILE; unset the variable to run them on the local dev shards",
        );
        return failure::report(&e, cli.json);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let json = cli.json;
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => failure::report(&e, json),
    }
}

pub(crate) type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// The command line, and whether its config came from `SHARDLOCK_CONFIG` rather than
/// `--config`. A usage error is printed as clap prints it, or as JSON with `--json`; help and
/// the version are printed as asked.
fn parse() -> Result<(Cli, bool), ExitCode> {
    let parsed = Cli::command()
        .try_get_matches()
        .and_then(|m| Ok((Cli::from_arg_matches(&m)?, m)));
    match parsed {
        Ok((cli, matches)) => {
            let from_env =
                matches.value_source("config") == Some(clap::parser::ValueSource::EnvVariable);
            Ok((cli, from_env))
        }
        Err(e) if e.use_stderr() && std::env::args_os().any(|a| a == "--json") => {
            let message = e.kind().as_str().map_or_else(
                || e.to_string().trim().to_owned(),
                |kind| format!("{kind}: {}", e.to_string().trim()),
            );
            Err(failure::report(
                &failure::fail(failure::Exit::Usage, message),
                true,
            ))
        }
        Err(e) => {
            let _ = e.print();
            Err(ExitCode::from(e.exit_code() as u8))
        }
    }
}

/// Output piped into a reader that stops early (`shardlock list | head`): Rust ignores
/// SIGPIPE, so the next `println!` panics with "failed printing to stdout". The command ends
/// there, quietly, as a command killed by SIGPIPE would (exit 141); every other panic is
/// reported as before.
fn quiet_on_closed_stdout() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = (info.payload().downcast_ref::<String>().map(String::as_str))
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        report(info);
    }));
}

/// Asks `question` on stderr; true only for an answer of `y` or `yes`.
fn confirm(question: &str) -> Result<bool, AnyError> {
    eprint!("{question} [y/N] ");
    let mut answer = String::new();
    if std::io::stdin().read_line(&mut answer)? == 0 {
        // No answer (stdin closed): whatever is printed next starts a line of its own.
        eprintln!();
    }
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// Completes on SIGTERM or SIGINT (received from now on).
fn stop_signal() -> Result<impl std::future::Future<Output = ()>, AnyError> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Logs to stderr (`SHARDLOCK_LOG`, default `warn`), and spans to OTLP when `telemetry` says.
fn init_tracing(telemetry: Option<&shardlock::telemetry::TelemetryGuard>) {
    use tracing_subscriber::prelude::*;
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHARDLOCK_LOG")
                .unwrap_or_else(|_| "warn".into()),
        );
    let spans = telemetry
        .and_then(|t| t.layer())
        .map(|l| l.with_filter(tracing_subscriber::EnvFilter::new("shardlock=info")));
    tracing_subscriber::registry().with(logs).with(spans).init();
}

async fn run(cli: Cli) -> Result<(), AnyError> {
    #[cfg(feature = "dev-tools")]
    if let Command::Dev { action } = &cli.command {
        init_tracing(None);
        return dev::run(action, cli.json).await;
    }
    let source = ConfigSource::load(cli.config.clone(), &cli.command);
    let source = match source {
        Ok(source) => source,
        Err(e) => {
            init_tracing(None);
            return Err(e);
        }
    };
    // The daemon exports telemetry as the config says (Prometheus endpoint, OTLP); its router
    // records into the provider made here.
    let telemetry = match cli.command {
        Command::Cleaner { .. } => {
            Some(shardlock::telemetry::init(&source.config.telemetry).await?)
        }
        _ => None,
    };
    init_tracing(telemetry.as_ref());
    let result = run_command(cli, &source, telemetry.as_ref()).await;
    if let Some(telemetry) = telemetry {
        telemetry.shutdown();
    }
    result
}

async fn run_command(
    cli: Cli,
    source: &ConfigSource,
    telemetry: Option<&shardlock::telemetry::TelemetryGuard>,
) -> Result<(), AnyError> {
    match cli.command {
        Command::Migrate => {
            let router = source.tool_router().await?;
            let reports = router.migrate_each().await;
            output::migrate(&reports, cli.json);
            if reports.iter().any(|(_, r)| r.is_err()) {
                return Err(failure::fail(
                    failure::Exit::Unavailable,
                    "some shards were not migrated (see above); the others were",
                ));
            }
        }
        Command::Status {
            watch: true,
            metrics,
        } => {
            if cli.json {
                return Err(failure::fail(
                    failure::Exit::Usage,
                    "status --watch redraws a screen; for JSON run `status --json` (once per \
                     read)",
                ));
            }
            let router = source.tool_router().await?;
            watch::run(
                &router,
                metrics.as_deref(),
                std::time::Duration::from_secs(1),
            )
            .await?;
        }
        Command::Status { .. } => {
            let router = source.tool_router().await?;
            let status = router.status().await;
            let instances = router.instances().await;
            output::status(&router, &status, &instances, cli.json);
            if status.iter().any(|s| !s.reachable) {
                return Err(failure::fail(
                    failure::Exit::Unavailable,
                    "some shards are unreachable",
                ));
            }
            if status.iter().any(|s| s.error.is_some()) || instances.iter().any(|(_, r)| r.is_err())
            {
                return Err(failure::fail(
                    failure::Exit::Failure,
                    "some shards answered with an error (see above)",
                ));
            }
        }
        Command::Inspect { key, scope } => {
            let router = source.tool_router().await?;
            let lock = scope.lock(&router, &key)?;
            let (shard, row) = router.inspect_key(&lock).await?;
            // Held elsewhere too (a fleet's move, a config older or newer than the fleet's):
            // where `release --force` would look. Not read is said, not an error: the row
            // on the key's own shard is the answer asked for.
            let (elsewhere, unread) = match router.search_holders(&lock).await {
                Ok(found) => (
                    Ok((found.held.into_iter())
                        .filter(|(on, row)| *on != shard && row.is_held())
                        .collect()),
                    found.unread,
                ),
                Err(e) => (Err(shardlock::Report(&e).to_string()), Vec::new()),
            };
            let registry = source.config.cleaner.registry;
            let doubts = output::Doubts::of(&router, registry, unread).await;
            output::inspect(&lock, &shard, row.as_ref(), &elsewhere, &doubts, cli.json);
            if elsewhere.is_err() {
                return Err(failure::fail(
                    failure::Exit::Unavailable,
                    "the other shards were not searched (see above): a holder there was not \
                     looked for",
                ));
            }
            doubts.unread_failure()?;
        }
        Command::List {
            held,
            prefix,
            namespace,
            limit,
        } => {
            let router = source.tool_router().await?;
            let mut opts = shardlock::ListOptions::new().prefix(prefix).limit(limit);
            if let Some(namespace) = namespace {
                opts = opts.namespace(namespace);
            }
            if held {
                opts = opts.held_only();
            }
            let listing = router.list(opts).await?;
            output::list(&listing, cli.json);
            if !listing.failed.is_empty() {
                return Err(failure::fail(
                    failure::Exit::Unavailable,
                    "some shards could not be read",
                ));
            }
        }
        Command::Release {
            key,
            scope,
            force,
            yes,
        } => {
            if !force {
                return Err(failure::fail(
                    failure::Exit::Usage,
                    "a lock is released by its holder; `shardlock release --force KEY` \
                     evicts whoever holds it (fenced)",
                ));
            }
            let router = source.tool_router().await?;
            let lock = scope.lock(&router, &key)?;
            // Wherever the config reaches: during a fleet's move, or with a config older or
            // newer than the fleet's, the holder may be on another shard than this config
            // places the key on.
            let found = router.search_holders(&lock).await?;
            let held = found.held;
            let registry = source.config.cleaner.registry;
            let doubts = output::Doubts::of(&router, registry, found.unread).await;
            if held.is_empty() && is_label(&key) {
                // Said, not refused: it may be a key of its own, and a cleanup script's
                // `release --force` of a free key succeeds.
                eprintln!(
                    "note: nobody holds `{key}`, which reads as the label `list` shows for a key \
                     too long to show (a digest); a label cannot name that key: give the key \
                     itself"
                );
            }
            let home = router.shard_for_key(&lock);
            if held.is_empty() {
                output::force_released(&lock, &home, &[], &doubts, cli.json);
                return doubts.unread_failure();
            }
            let holders: Vec<String> = held
                .iter()
                .map(|(shard, row)| {
                    // An owner is the shard's text: shown escaped, as everywhere else.
                    let owner = output::shown(row.owner.as_deref().unwrap_or_default());
                    format!("by {owner} on {shard}")
                })
                .collect();
            // Before the question, in text: they may change the answer (and are not said again).
            let unread = doubts.unread_failure();
            let doubts = if !yes && !cli.json {
                doubts.warn();
                output::Doubts::default()
            } else {
                doubts
            };
            if !yes
                && !confirm(&format!(
                    "Force-release `{}`, held {}?",
                    output::lock_name(&lock),
                    holders.join(", ")
                ))?
            {
                return Err(failure::fail(failure::Exit::Refused, "not released"));
            }
            let released = if yes {
                router.force_release_key_everywhere(&lock).await?
            } else {
                // The holders confirmed, not whoever took the key since (each owner once: a
                // lease of a moved key has rows on several shards).
                let mut owners: Vec<&str> = held
                    .iter()
                    .filter_map(|(_, row)| row.owner.as_deref())
                    .collect();
                owners.sort_unstable();
                owners.dedup();
                let mut released = Vec::new();
                for owner in owners {
                    match router
                        .force_release_owner_key_everywhere(&lock, owner)
                        .await
                    {
                        Ok(evicted) => released.extend(evicted),
                        // Whom the owners before it were evicted from is said first.
                        Err(e) => {
                            if !released.is_empty() {
                                output::force_released(&lock, &home, &released, &doubts, cli.json);
                            }
                            return Err(e.into());
                        }
                    }
                }
                if released.is_empty() {
                    return Err(failure::fail(
                        failure::Exit::Refused,
                        format!(
                            "`{}` is no longer held {}: not released (run again to see \
                             its holder now)",
                            output::lock_name(&lock),
                            holders.join(", ")
                        ),
                    ));
                }
                released
            };
            output::force_released(&lock, &home, &released, &doubts, cli.json);
            unread?;
        }
        Command::Cleaner { once } => {
            // Before the router is built (its first heartbeat may take a while): a SIGTERM or
            // SIGHUP meanwhile would otherwise end the process by its default action, leaving
            // its registry row live. A SIGHUP then is a reload once the router runs.
            let stop = stop_signal()?;
            let mut hangups = signal(SignalKind::hangup())?;
            let router = source.router_with(telemetry).await?;
            let mut uncleaned = false;
            if once {
                let report = tokio::select! {
                    report = router.clean_once() => report,
                    _ = stop => {
                        if let Err(down) = router.shutdown().await {
                            tracing::warn!(error = %shardlock::Report(&down), "shardlock cleaner shutdown failed");
                        }
                        return Err(failure::fail(
                            failure::Exit::Failure,
                            "stopped (SIGTERM or Ctrl-C) before the pass ended",
                        ));
                    }
                };
                if let Ok(report) = &report {
                    output::cleaner_report(report, cli.json);
                    // A cron job or a runbook step sees a pass that left shards uncleaned.
                    uncleaned = report.shards.iter().any(|s| s.error.is_some());
                }
                if let Err(e) = report {
                    if let Err(down) = router.shutdown().await {
                        tracing::warn!(error = %shardlock::Report(&down), "shardlock cleaner shutdown failed");
                    }
                    return Err(e.into());
                }
            } else {
                // The cleaner is a member of its fleet like any service: a topology it never
                // reloaded would keep every other process's move in force and hold back every
                // process (re)started with the new one. It reloads its file with them.
                // Each reload's outcome goes where the passes' reports go, a failed one too (the
                // old topology stays): a script reading the daemon sees it. A SIGHUP that came
                // while the router was built is the first one received.
                let reloads = async {
                    let Some(path) = &source.path else {
                        return std::future::pending().await;
                    };
                    while hangups.recv().await.is_some() {
                        let reloaded = router.reload_from_file(path).await;
                        if let Err(e) = &reloaded {
                            tracing::error!(error = %shardlock::Report(e), "shardlock reload failed; the old topology stays");
                        }
                        output::cleaner_reloaded(reloaded.map(|()| router.epoch()), cli.json);
                    }
                };
                eprintln!(
                    "shardlock cleaner: instance {}, a pass every {:?}; SIGHUP reloads the \
                     config file, SIGTERM or Ctrl-C stops it",
                    router.instance_id(),
                    router.config().cleaner.interval
                );
                let passes = router.run_cleaner_passes(stop, |pass| match pass {
                    Ok(report) => output::cleaner_report(report, cli.json),
                    Err(e) => output::cleaner_failed(e, cli.json),
                });
                tokio::select! {
                    () = passes => {}
                    () = reloads => {}
                }
                if router.is_replaced() {
                    if let Err(down) = router.shutdown().await {
                        tracing::warn!(error = %shardlock::Report(&down), "shardlock cleaner shutdown failed");
                    }
                    return Err(failure::fail(
                        failure::Exit::Failure,
                        format!(
                            "another process took instance id `{}` over: this cleaner stopped \
                             (give each process its own id, or `auto`)",
                            router.instance_id()
                        ),
                    ));
                }
            }
            let down = router.shutdown().await;
            if uncleaned {
                if let Err(down) = down {
                    tracing::warn!(error = %shardlock::Report(&down), "shardlock cleaner shutdown failed");
                }
                return Err(failure::fail(
                    failure::Exit::Unavailable,
                    "some shards were not cleaned (see the report)",
                ));
            }
            down?;
        }
        #[cfg(feature = "dev-tools")]
        Command::Demo(args) => demo::run(source, args).await?,
        #[cfg(feature = "dev-tools")]
        Command::Bench(args) => bench::run(source, args, cli.json).await?,
        #[cfg(feature = "dev-tools")]
        Command::Dev { .. } => unreachable!("handled above"),
    }
    Ok(())
}
