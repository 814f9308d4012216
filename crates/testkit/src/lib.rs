//! Throwaway MariaDB shards on loopback and real fault injection, for shardlock's tests and
//! for `shardlock dev`.
//!
//! [`Cluster::start`] starts N `mariadbd` processes on free loopback ports, each in its own
//! temporary data directory copied from one initialised template (made once per machine by
//! `mariadb-install-db`, under a file lock so parallel test processes share it). Servers are
//! killed and their directories removed when the [`Cluster`] is dropped, and also when the
//! process that started them dies: each server runs under a small `sh` guardian that kills it
//! as soon as our end of its stdin closes.
//!
//! Faults are real: [`Shard::kill`] (SIGKILL), [`Shard::pause`] / [`Shard::resume`]
//! (SIGSTOP / SIGCONT) and [`Shard::restart`]; a [`Proxy`] in front of a shard blackholes,
//! delays or resets its connections; a [`Competitor`] transaction holds lease rows locked
//! (lock waits, 1205) or closes a deadlock with the library's statements (1213). A
//! [`GaleraCluster`] is one shard served by three synchronously replicated nodes, each a
//! [`Shard`] to kill, pause or restart. [`Worker`] runs a second OS process (the test
//! binary itself, re-entered at a named function) that tests can signal in the same ways.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod certs;
mod competitor;
mod galera;
mod proxy;
mod server;
mod worker;

pub use certs::TestCerts;
pub use competitor::Competitor;
pub use galera::GaleraCluster;
pub use proxy::{HeldRequest, Proxy, ProxyMode};
pub use server::{Cluster, DevCluster, Shard, DATABASE, ROW_WRITES};
pub use worker::{worker_main, Worker, WORKER_ENV};
