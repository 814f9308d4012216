//! Mapping `mysql_async` errors onto shardlock's backend error kinds, by error number.

use deadpool::managed::{PoolError, TimeoutType};
use shardlock_core::{BackendError, BackendErrorKind};

/// Classifies a `mysql_async` error by its MySQL error number or transport failure.
///
/// `Io` and `Driver` errors carry no number, and mysql_async counts them all as fatal to the
/// connection: `Connection`, an outage for the breaker and a reason for the runner to try
/// another connection once. Most are (a lost socket, a packet out of order), but a few driver
/// errors are mistakes in the statement (a parameter count that does not match) and are
/// classified the same way. `Url` and `Other` are mistakes in what was asked.
pub fn classify(e: mysql_async::Error) -> BackendError {
    match e {
        mysql_async::Error::Server(ref s) => {
            let code = s.code;
            BackendError::new(BackendErrorKind::from_mysql_code(code), Some(code), e)
        }
        mysql_async::Error::Io(_) | mysql_async::Error::Driver(_) => {
            BackendError::new(BackendErrorKind::Connection, None, e)
        }
        mysql_async::Error::Other(_) | mysql_async::Error::Url(_) => {
            BackendError::new(BackendErrorKind::Other, None, e)
        }
    }
}

/// Classifies a failure to get a pooled connection. None of them sent anything. A wait
/// timeout is reported as `Timeout` (an exhausted pool is counted against the shard, like a
/// slow one); a create timeout as `Connection` (the shard did not let us in); a closed pool as
/// `ServerGone`, so that calls racing a shutdown or reload read as unavailable, not as bugs.
pub(crate) fn classify_pool(e: PoolError<mysql_async::Error>) -> BackendError {
    match e {
        PoolError::Backend(e) => classify(e),
        PoolError::Timeout(TimeoutType::Wait) => {
            BackendError::timeout("no pooled connection became free within pool.wait-timeout")
        }
        PoolError::Timeout(TimeoutType::Create) => BackendError::new(
            BackendErrorKind::Connection,
            None,
            "connecting took longer than pool.create-timeout",
        ),
        PoolError::Timeout(TimeoutType::Recycle) => BackendError::timeout(
            "checking a pooled connection took longer than pool.recycle-timeout",
        ),
        PoolError::Closed => BackendError::new(
            BackendErrorKind::ServerGone,
            None,
            "the shard's pool was closed",
        ),
        other => BackendError::new(BackendErrorKind::Other, None, other.to_string()),
    }
}
