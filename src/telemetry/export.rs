//! The host's side (feature `exporters`): [`init`] makes the exporters and [`TelemetryGuard`]
//! keeps them.
//!
//! The lock paths only emit, through the OpenTelemetry API and `tracing`; where that goes is
//! the host's choice. `init` makes the common one in a single call — metrics kept for
//! Prometheus (which the `ops/` dashboard scrapes) and, when configured, spans and metrics
//! pushed over OTLP — so that a host need not wire exporters itself to get them. It installs
//! nothing globally: routers get its meter provider through
//! [`LockRouter::builder`](crate::LockRouter::builder), the `tracing` subscriber its
//! [`TelemetryGuard::layer`]. A host with providers of its own skips it.

use std::net::SocketAddr;
use std::time::Duration;

use shardlock_core::config::TelemetryConfig;
use shardlock_core::{ConfigError, Result};

use super::endpoint::{encode, serve};

/// What [`init`] set up; keep it for the life of the process. Dropping it stops the
/// Prometheus endpoint; [`TelemetryGuard::shutdown`] also flushes what OTLP still holds.
#[derive(Debug)]
#[must_use = "dropping the guard stops the Prometheus endpoint"]
pub struct TelemetryGuard {
    provider: opentelemetry_sdk::metrics::SdkMeterProvider,
    tracer: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
    registry: prometheus::Registry,
    server: Option<(SocketAddr, tokio::task::JoinHandle<()>)>,
}

impl TelemetryGuard {
    /// The meter provider to build routers with
    /// ([`LockRouter::builder`](crate::LockRouter::builder)`(..).meter_provider(..)`); `init`
    /// installs nothing globally.
    pub fn meter_provider(&self) -> &opentelemetry_sdk::metrics::SdkMeterProvider {
        &self.provider
    }

    /// Where the Prometheus endpoint listens (`/metrics`), if it was configured.
    pub fn prometheus_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(|(addr, _)| *addr)
    }

    /// The metrics in the Prometheus text format, as the endpoint serves them.
    pub fn prometheus_text(&self) -> String {
        encode(&self.registry)
    }

    /// The `tracing` layer that turns spans into OpenTelemetry spans exported over OTLP
    /// (`None` without `telemetry.otlp-endpoint`). Add it to the host's subscriber:
    ///
    /// ```no_run
    /// # async fn demo(config: shardlock::Config) -> shardlock::Result<()> {
    /// use tracing_subscriber::prelude::*;
    /// let telemetry = shardlock::telemetry::init(&config.telemetry).await?;
    /// tracing_subscriber::registry().with(telemetry.layer()).init();
    /// # Ok(()) }
    /// ```
    ///
    /// A waiter granted a lock handed over by its holder carries a span link to the holder's
    /// `shardlock.hold` span.
    pub fn layer<S>(
        &self,
    ) -> Option<tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        use opentelemetry::trace::TracerProvider as _;
        let tracer = self.tracer.as_ref()?.tracer("shardlock");
        Some(tracing_opentelemetry::layer().with_tracer(tracer))
    }

    /// Flushes what OTLP still holds and stops the providers.
    pub fn shutdown(self) {
        if let Some(tracer) = &self.tracer {
            let _ = tracer.force_flush();
            let _ = tracer.shutdown();
        }
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some((_, server)) = &self.server {
            server.abort();
        }
    }
}

/// The one-call setup for a host application: an OpenTelemetry meter provider whose metrics
/// are kept for Prometheus — served at `http://<prometheus-listen>/metrics` when the config
/// names an address — and, with `otlp-endpoint`, also pushed over OTLP, with a tracer provider
/// exporting spans there (add [`TelemetryGuard::layer`] to your `tracing` subscriber). Build
/// routers with its [`TelemetryGuard::meter_provider`]; nothing is installed globally.
///
/// ```no_run
/// # async fn demo() -> shardlock::Result<()> {
/// let config = shardlock::Config::from_yaml_file("config/local.yaml")?;
/// let telemetry = shardlock::telemetry::init(&config.telemetry).await?;
/// let router = shardlock::LockRouter::builder(config)
///     .meter_provider(telemetry.meter_provider())
///     .build()
///     .await?;
/// # Ok(()) }
/// ```
///
/// Cancellation: nothing is kept; dropped while it waits to bind the Prometheus listener, the
/// providers it made are dropped too. Call `init` again.
pub async fn init(config: &TelemetryConfig) -> Result<TelemetryGuard> {
    let registry = prometheus::Registry::new();
    let exporter = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .without_target_info()
        .build()
        .map_err(|e| {
            ConfigError::field(
                "telemetry",
                format!("cannot set up the Prometheus exporter: {e}"),
            )
        })?;
    // Which process a series is from: a collector keys series by their resource, so processes
    // of one service without it would write over each other's counters.
    let instance = format!("{}-{}", crate::registry::host_name(), std::process::id());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .with_attribute(opentelemetry::KeyValue::new(
            "service.instance.id",
            instance,
        ))
        .build();
    let otlp_error = |e: &dyn std::fmt::Display| {
        ConfigError::field(
            "telemetry.otlp-endpoint",
            format!("cannot set up the OTLP exporter: {e}"),
        )
    };
    let mut meters = opentelemetry_sdk::metrics::SdkMeterProvider::builder()
        .with_resource(resource.clone())
        .with_reader(exporter);
    let mut tracer = None;
    if let Some(endpoint) = &config.otlp_endpoint {
        use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
        use opentelemetry_sdk::trace::Sampler;
        let endpoint = endpoint.trim_end_matches('/');
        let client = http_client(endpoint, config.otlp_ca_file.as_deref())?;
        let mut spans = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .with_endpoint(format!("{endpoint}/v1/traces"));
        let mut metrics = opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .with_endpoint(format!("{endpoint}/v1/metrics"));
        if let Some(client) = client {
            spans = spans.with_http_client(client.clone());
            metrics = metrics.with_http_client(client);
        }
        let spans = spans.build().map_err(|e| otlp_error(&e))?;
        let metrics = metrics.build().map_err(|e| otlp_error(&e))?;
        meters = meters.with_reader(
            opentelemetry_sdk::metrics::PeriodicReader::builder(metrics)
                .with_interval(Duration::from_secs(10))
                .build(),
        );
        let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.trace_sample_ratio,
        )));
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_resource(resource)
            .with_sampler(sampler)
            .with_batch_exporter(spans)
            .build();
        tracer = Some(provider);
    }
    let provider = meters.build();
    let server = match &config.prometheus_listen {
        None => None,
        Some(addr) => {
            let listen_error = |e: std::io::Error| {
                ConfigError::field(
                    "telemetry.prometheus-listen",
                    format!("cannot listen on {addr}: {e}"),
                )
            };
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(listen_error)?;
            let addr = listener.local_addr().map_err(listen_error)?;
            Some((addr, tokio::spawn(serve(listener, registry.clone()))))
        }
    };
    Ok(TelemetryGuard {
        provider,
        tracer,
        registry,
        server,
    })
}

/// How long one OTLP export may take: `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds) as
/// opentelemetry-otlp reads it for its own client, else its default of 10 s.
#[cfg(feature = "otlp-https")]
fn otlp_timeout() -> Duration {
    std::env::var("OTEL_EXPORTER_OTLP_TIMEOUT")
        .ok()
        .and_then(|ms| ms.trim().parse().ok())
        .map_or(Duration::from_secs(10), Duration::from_millis)
}

/// The HTTP client OTLP exports go through: rustls with the ring provider (as for the
/// shards), trusting the CA in `ca_file` alone when given, else the system's roots. For every
/// endpoint, https or not: with reqwest's `rustls-no-provider` on, opentelemetry-otlp's own
/// client would need a process-wide crypto provider, which shardlock does not install.
#[cfg(feature = "otlp-https")]
fn http_client(
    _endpoint: &str,
    ca_file: Option<&std::path::Path>,
) -> Result<Option<reqwest::blocking::Client>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    use std::sync::Arc;
    let field = if ca_file.is_some() {
        "telemetry.otlp-ca-file"
    } else {
        "telemetry.otlp-endpoint"
    };
    let error = |e: &dyn std::fmt::Display| ConfigError::field(field, e.to_string());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| error(&e))?;
    let tls = match ca_file {
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            let unreadable = |e: &dyn std::fmt::Display| {
                ConfigError::field(field, format!("cannot read {}: {e}", path.display()))
            };
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| unreadable(&e))? {
                roots
                    .add(cert.map_err(|e| unreadable(&e))?)
                    .map_err(|e| unreadable(&e))?;
            }
            if roots.is_empty() {
                return Err(unreadable(&"no certificate in it").into());
            }
            tls.with_root_certificates(roots)
        }
        None => {
            let verifier =
                rustls_platform_verifier::Verifier::new(provider).map_err(|e| error(&e))?;
            tls.dangerous()
                .with_custom_certificate_verifier(Arc::new(verifier))
        }
    }
    .with_no_client_auth();
    // A blocking client runs a runtime of its own, which may not be started from inside the
    // caller's: built on a thread of its own, as opentelemetry-otlp builds its default one.
    std::thread::spawn(move || {
        reqwest::blocking::Client::builder()
            .timeout(otlp_timeout())
            .tls_backend_preconfigured(tls)
            .build()
    })
    .join()
    .map_err(|_| error(&"building the HTTP client panicked"))?
    .map(Some)
    .map_err(|e| error(&e).into())
}

/// Without the `otlp-https` feature: opentelemetry-otlp's own client, plain HTTP only; an
/// `https://` endpoint is refused by name.
#[cfg(not(feature = "otlp-https"))]
fn http_client(
    endpoint: &str,
    _ca_file: Option<&std::path::Path>,
) -> Result<Option<reqwest::blocking::Client>> {
    if endpoint.to_ascii_lowercase().starts_with("https://") {
        return Err(ConfigError::field(
            "telemetry.otlp-endpoint",
            "this build of shardlock has no OTLP over https: enable its `otlp-https` feature",
        )
        .into());
    }
    Ok(None)
}
