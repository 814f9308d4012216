//! The pure logic of shardlock: configuration, errors, lock keys, the routing ring and backoff.
//!
//! Nothing in this crate performs I/O; the MySQL backend (`shardlock-mysql`) and the facade
//! (`shardlock`) build on it. Users depend on the facade, which re-exports what they need.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod backoff;
mod breaker;
pub mod config;
mod error;
mod hotkeys;
mod key;
mod ring;

pub use backoff::Backoff;
pub use breaker::{
    Admission, Breaker, BreakerConfig, BreakerState, CallOutcome, CallTicket, ProbeTicket, Ticket,
    Transition,
};
pub use config::{Config, ConfigError};
pub use error::{BackendError, BackendErrorKind, Error, Report, Result};
pub use hotkeys::HotKeys;
pub use key::{LockKey, MAX_KEY_BYTES, MAX_STORED_KEY_BYTES};
pub use ring::{bucket_for, Ring, RingHash};
