//! A [tower] layer that runs each request under the lock of a key taken from it: payment
//! callbacks, idempotent handlers, anything two requests must not do at once for one key.
//!
//! ```no_run
//! # #[derive(Clone)] struct Handler;
//! # impl tower_service::Service<String> for Handler {
//! #     type Response = String; type Error = std::convert::Infallible;
//! #     type Future = std::future::Ready<Result<String, std::convert::Infallible>>;
//! #     fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> { std::task::Poll::Ready(Ok(())) }
//! #     fn call(&mut self, r: String) -> Self::Future { std::future::ready(Ok(r)) }
//! # }
//! # fn demo(router: shardlock::LockRouter) {
//! use shardlock::tower::{LockLayer, Refused};
//! use tower_layer::Layer;
//!
//! // Requests are order ids here; with HTTP, take the key from the path or a header.
//! let layer = LockLayer::new(
//!     router,
//!     |order: &String| Some(format!("order:{order}")),
//!     |refused: Refused| match refused {
//!         Refused::Busy => "busy: try again".to_owned(),
//!         Refused::Failed(e) => format!("unavailable: {e}"),
//!         Refused::Lost => "lock lost: try again".to_owned(),
//!     },
//! );
//! let service = layer.layer(Handler);
//! # }
//! ```
//!
//! [tower]: https://docs.rs/tower

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower_layer::Layer;
use tower_service::Service;

use crate::{AcquireOptions, Error, LockRouter};

/// Why a request was answered without reaching the inner service.
#[derive(Debug)]
pub enum Refused {
    /// Another request (in this process or another) held the key for the whole wait.
    Busy,
    /// The lock could not be asked for: the key's shard is unavailable, the key is invalid.
    Failed(Error),
    /// The lock was lost while the request ran (its shard was unreachable for longer than the
    /// lease, or it was force-released): the inner service's future was dropped there, so the
    /// handler stopped at an `.await`. Work it did before is not undone; guard writes with
    /// fences where a second holder must not overwrite them.
    Lost,
}

type KeyFn<Req> = Arc<dyn Fn(&Req) -> Option<String> + Send + Sync>;
type RefusedFn<Resp> = Arc<dyn Fn(Refused) -> Resp + Send + Sync>;

/// Wraps a service so that each request whose key function returns a key runs while this
/// process holds that key's lock; requests without a key pass straight through. The lock is
/// held until the inner service's response future completes (or is dropped), then released:
/// for HTTP, until the response head is ready (a streamed body runs after the release). If the
/// lock is lost meanwhile, the inner future is dropped and the request answered with
/// [`Refused::Lost`].
/// By default a request that finds the key held is answered at once with the refused
/// response; [`LockLayer::options`] with a wait makes it queue for the lock instead.
pub struct LockLayer<Req, Resp> {
    router: LockRouter,
    key: KeyFn<Req>,
    refused: RefusedFn<Resp>,
    opts: AcquireOptions,
}

impl<Req, Resp> Clone for LockLayer<Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            router: self.router.clone(),
            key: self.key.clone(),
            refused: self.refused.clone(),
            opts: self.opts.clone(),
        }
    }
}

impl<Req, Resp> std::fmt::Debug for LockLayer<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockLayer")
            .field("router", &self.router)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl<Req, Resp> LockLayer<Req, Resp> {
    /// Locks the key `key` returns for each request (`None`: no lock for it), trying once; a
    /// request that does not get its lock is answered with `refused` (a 409 or a 503 for
    /// HTTP, say) without reaching the inner service.
    pub fn new(
        router: LockRouter,
        key: impl Fn(&Req) -> Option<String> + Send + Sync + 'static,
        refused: impl Fn(Refused) -> Resp + Send + Sync + 'static,
    ) -> Self {
        Self {
            router,
            key: Arc::new(key),
            refused: Arc::new(refused),
            opts: AcquireOptions::new().wait(std::time::Duration::ZERO),
        }
    }

    /// The options of each acquire: namespace, ttl, and how long a request waits for a held
    /// key (zero, the default, answers busy at once: options that set no wait keep it, not
    /// the namespace's).
    pub fn options(mut self, opts: AcquireOptions) -> Self {
        let wait = opts.wait.unwrap_or(std::time::Duration::ZERO);
        self.opts = opts.wait(wait);
        self
    }
}

impl<S, Req, Resp> Layer<S> for LockLayer<Req, Resp> {
    type Service = LockService<S, Req, Resp>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service made by [`LockLayer`].
pub struct LockService<S, Req, Resp> {
    inner: S,
    layer: LockLayer<Req, Resp>,
}

impl<S: Clone, Req, Resp> Clone for LockService<S, Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: std::fmt::Debug, Req, Resp> std::fmt::Debug for LockService<S, Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, Req> Service<Req> for LockService<S, Req, S::Response>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    Req: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        // The clone that was driven to readiness serves this request (tower's rule); a fresh
        // clone stays behind for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(key) = (self.layer.key)(&req) else {
            return Box::pin(inner.call(req));
        };
        let layer = self.layer.clone();
        Box::pin(async move {
            let acquired = match shardlock_core::LockKey::new(&key) {
                Ok(lock_key) => {
                    layer
                        .router
                        .acquire_inner(lock_key, &layer.opts, None)
                        .await
                }
                Err(e) => Err(e),
            };
            let refused = match acquired {
                Ok(Some(guard)) => {
                    let response = tokio::select! {
                        response = inner.call(req) => Some(response),
                        _ = guard.lost() => None,
                    };
                    // Released after the response is ready; a release error does not undo it.
                    let _ = guard.release().await;
                    match response {
                        Some(response) => return response,
                        None => Refused::Lost,
                    }
                }
                Ok(None) => Refused::Busy,
                Err(e) => Refused::Failed(e),
            };
            Ok((layer.refused)(refused))
        })
    }
}
