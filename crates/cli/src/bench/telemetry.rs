//! The `telemetry` and `telemetry-hot-key` scenarios: the same load on a router with live
//! instruments against one with no-op instruments, in the same run.

use shardlock::telemetry::TelemetryGuard;
use shardlock::LockRouter;

use super::harness::Round;
use super::report::Measurement;
use super::{hot_key, uncontended};
use crate::{AnyError, ConfigSource};

/// A router with live instruments, and the guard that keeps their provider installed.
pub(super) struct MetricsOn {
    _provider: TelemetryGuard,
    pub(super) router: LockRouter,
}

impl MetricsOn {
    /// `off` was built without a meter provider and keeps no-op instruments; the router built
    /// here from its config records into the provider `init` made.
    pub(super) async fn start(source: &ConfigSource, off: &LockRouter) -> Result<Self, AnyError> {
        let provider = shardlock::telemetry::init(&source.config.telemetry).await?;
        let router = LockRouter::builder(off.config().as_ref().clone())
            .meter_provider(provider.meter_provider())
            .build()
            .await?;
        Ok(MetricsOn {
            _provider: provider,
            router,
        })
    }

    /// The uncontended cycle with metrics on, then off; each side on keys of its own, so that
    /// neither finds rows the other left.
    pub(super) async fn uncontended(
        &self,
        off: &LockRouter,
        round: Round<'_>,
    ) -> Result<(Measurement, Measurement), AnyError> {
        let tag = format!("{}:on", round.tag);
        let mut on =
            uncontended::shardlock_swept(&self.router, Round { tag: &tag, ..round }).await?;
        on.name = "distinct keys, metrics on".into();
        let tag = format!("{}:off", round.tag);
        let mut off = uncontended::shardlock_swept(off, Round { tag: &tag, ..round }).await?;
        off.name = "distinct keys, metrics off".into();
        Ok((on, off))
    }

    /// One hot key with metrics on, then off.
    pub(super) async fn hot_key(
        &self,
        off: &LockRouter,
        round: Round<'_>,
    ) -> Result<(Measurement, Measurement), AnyError> {
        let mut on = hot_key::shardlock(&self.router, round).await?;
        on.name = "one hot key, metrics on".into();
        let mut off = hot_key::shardlock(off, round).await?;
        off.name = "one hot key, metrics off".into();
        Ok((on, off))
    }
}
