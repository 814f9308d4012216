//! `shardlock demo`: a flash sale. Buyer processes sell limited stock of several SKUs, each
//! purchase a read-modify-write under the SKU's shardlock lock; the summary proves nothing was
//! oversold and shows what the locks did.

mod buyers;
mod outage;
mod sale;
mod summary;
mod tables;

use clap::Args;

use crate::{dev, AnyError, ConfigSource};

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// SKUs on sale.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1000))]
    skus: u32,
    /// Units of stock per SKU.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    stock: u32,
    /// Buyer processes.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    processes: u32,
    /// Concurrent buyers in each process.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=512))]
    buyers: u32,
    /// Skip the second act (a shard killed mid-sale and restarted; local dev shards only).
    #[arg(long)]
    no_failure: bool,
    /// Internal: run as one buyer process.
    #[arg(long, hide = true)]
    worker: bool,
}

const NAMESPACE: &str = "stock";

fn sku_key(i: u32) -> String {
    format!("sku:{i}")
}

pub(crate) async fn run(source: &ConfigSource, args: DemoArgs) -> Result<(), AnyError> {
    if args.worker {
        return buyers::buyer_process(source, &args).await;
    }
    if source.is_local_default() {
        dev::ensure_up().await?;
    }
    let router = source.router().await?;
    router.migrate().await?;
    let shards = tables::shard_pools(source)?;
    tables::setup_tables(&router, &shards, &args).await?;

    sale::act(source, &router, &shards, &args).await?;
    if args.no_failure {
        return Ok(());
    }
    if !source.is_local_default() {
        println!(
            "\n(Act 2, a shard killed mid-sale, runs on the local dev shards only: omit --config.)"
        );
        return Ok(());
    }
    outage::act(source, &shards, &args).await
}
