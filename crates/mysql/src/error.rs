//! Mapping `mysql_async` errors onto shardlock's backend error kinds, by error number.

use deadpool::managed::{PoolError, TimeoutType};
use shardlock_core::{BackendError, BackendErrorKind};

/// Classifies a `mysql_async` error by its MySQL error number or transport failure.
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
