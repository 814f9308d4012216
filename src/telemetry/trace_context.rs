//! Trace context carried across processes through the lease row. A waiter polls the shard, not
//! the holder, so no request ever travels from one to the other for a tracer to follow: the
//! holder stores its span's W3C `traceparent` with its lease, and a waiter that reads it links
//! its own span there, so a trace shows whom it waited for.
//!
//! All of it is a no-op unless the host installed an OpenTelemetry `tracing` layer (see
//! [`TelemetryGuard::layer`](super::TelemetryGuard::layer)): spans then have no valid context.

use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The current span's OpenTelemetry context as a W3C traceparent, when it is recorded and has
/// a valid context (an OpenTelemetry layer is installed); written by the SDK's propagator.
pub(crate) fn current_traceparent() -> Option<String> {
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let span = tracing::Span::current();
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    if !context.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = std::collections::HashMap::new();
    TraceContextPropagator::new().inject_context(&context, &mut carrier);
    carrier.remove("traceparent")
}

/// Whether the current span is recorded (so that a link is worth a statement).
pub(crate) fn tracing_current() -> bool {
    !tracing::Span::current().is_disabled()
}

/// Links the current span to the span of a W3C `traceparent` (the holder's, read from its
/// lease row), as the SDK's propagator reads it; an invalid one links nothing.
pub(crate) fn link_current_to(traceparent: &str) {
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let carrier =
        std::collections::HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    let context = TraceContextPropagator::new().extract(&carrier);
    let span_context = context.span().span_context().clone();
    if span_context.is_valid() {
        tracing::Span::current().add_link(span_context);
    }
}
