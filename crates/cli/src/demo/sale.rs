//! Act 1: the flash sale, sold by buyer processes started from this command (`--worker`).

use std::process::Stdio;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use shardlock::mysql_async::Pool;
use shardlock::LockRouter;
use tokio::io::AsyncReadExt;

use super::buyers::WorkerReport;
use super::summary::summarize;
use super::tables::count_orders;
use super::DemoArgs;
use crate::{AnyError, ConfigSource};

/// The buyers run in processes of their own, so that the locks are contended across
/// processes as in production; this one only counts orders for the progress bar.
pub(super) async fn act(
    source: &ConfigSource,
    router: &LockRouter,
    shards: &[(String, Pool)],
    args: &DemoArgs,
) -> Result<(), AnyError> {
    let total = u64::from(args.skus) * u64::from(args.stock);
    println!(
        "Flash sale: {} SKUs x {} units, {} processes x {} buyers, {} shards",
        args.skus,
        args.stock,
        args.processes,
        args.buyers,
        shards.len()
    );
    let started = Instant::now();
    let mut children = Vec::new();
    for _ in 0..args.processes {
        let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
        cmd.args(source.child_args())
            .args([
                "demo",
                "--worker",
                "--skus",
                &args.skus.to_string(),
                "--buyers",
                &args.buyers.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        children.push(cmd.spawn()?);
    }
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template(
            "{spinner} selling [{bar:40}] {pos}/{len} units {per_sec} {elapsed}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let mut reports = Vec::new();
    let mut outputs: Vec<_> = children
        .iter_mut()
        .map(|c| c.stdout.take().expect("piped"))
        .collect();
    let waits = children
        .into_iter()
        .map(|mut c| tokio::spawn(async move { c.wait().await }));
    let waits: Vec<_> = waits.collect();
    while !waits.iter().all(|w| w.is_finished()) {
        bar.set_position(count_orders(shards).await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bar.set_position(count_orders(shards).await?);
    bar.finish();
    let elapsed = started.elapsed();
    for (wait, out) in waits.into_iter().zip(outputs.iter_mut()) {
        let status = wait.await??;
        let mut text = String::new();
        out.read_to_string(&mut text).await?;
        if !status.success() {
            return Err(format!("a buyer process failed ({status})").into());
        }
        let line = text
            .lines()
            .last()
            .ok_or("a buyer process printed no report")?;
        reports.push(serde_json::from_str::<WorkerReport>(line)?);
    }
    summarize(router, shards, args, &reports, elapsed).await
}
