//! Work that must run to its end even when whoever waits for it goes away — a grant
//! statement, a release — driven by the waiter's own poll: no task hop while the waiter is
//! there (a task spawned per call costs a wake-up of another worker thread, more than the
//! rest of a lone lock's client side), and a task of its own to finish it if the waiter drops
//! it first.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

/// `work`, polled by its waiter; dropped unfinished, it is finished by a task of its own and
/// its output handed to `unattended` (say, to give back a grant nobody takes). Without a
/// runtime to finish it on, it is dropped where it stands, as a task would be when its
/// runtime shuts down.
pub(crate) struct Finish<T: Send + 'static> {
    work: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    unattended: Option<Box<dyn FnOnce(T) + Send>>,
}

impl<T: Send + 'static> Finish<T> {
    pub(crate) fn new(
        work: impl Future<Output = T> + Send + 'static,
        unattended: impl FnOnce(T) + Send + 'static,
    ) -> Self {
        Self {
            work: Some(Box::pin(work)),
            unattended: Some(Box::new(unattended)),
        }
    }
}

impl<T: Send + 'static> Future for Finish<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let work = self
            .work
            .as_mut()
            .expect("a finished Finish is not polled again");
        let output = ready!(work.as_mut().poll(cx));
        self.work = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for Finish<T> {
    fn drop(&mut self) {
        let (Some(work), Some(unattended)) = (self.work.take(), self.unattended.take()) else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            drop(runtime.spawn(async move { unattended(work.await) }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn work_dropped_unfinished_is_finished_and_its_output_handed_on() {
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let (done, finished) = tokio::sync::oneshot::channel::<u32>();
        let work = Finish::new(
            async move {
                let _ = wait.await;
                7
            },
            move |output| {
                let _ = done.send(output);
            },
        );
        // Polled once (pending), then dropped: the waiter gave up.
        let mut work = Box::pin(work);
        std::future::poll_fn(|cx| {
            assert!(work.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        drop(work);
        go.send(()).unwrap();
        assert_eq!(finished.await.unwrap(), 7);
    }

    #[tokio::test]
    async fn work_its_waiter_finishes_is_not_handed_on() {
        let handed = Arc::new(AtomicBool::new(false));
        let flag = handed.clone();
        let output = Finish::new(async { 7 }, move |_| flag.store(true, Ordering::SeqCst)).await;
        assert_eq!(output, 7);
        tokio::task::yield_now().await;
        assert!(!handed.load(Ordering::SeqCst));
    }
}
