//! Trace context carried across processes through the lease row. A waiter polls the shard, not
//! the holder, so no request ever travels from one to the other for a tracer to follow: the
//! holder stores its span's W3C `traceparent` with its lease, and a waiter that reads it links
//! its own span there, so a trace shows whom it waited for.
//!
//! All of it is a no-op unless the host installed an OpenTelemetry `tracing` layer (see
//! [`TelemetryGuard::layer`](super::TelemetryGuard::layer)): spans then have no valid context.

/// The current span's OpenTelemetry context as a W3C traceparent, when it is recorded and has
/// a valid context (an OpenTelemetry layer is installed).
pub(crate) fn current_traceparent() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let span = tracing::Span::current();
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    let sc = context.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// Whether the current span is recorded (so that a link is worth a statement).
pub(crate) fn tracing_current() -> bool {
    !tracing::Span::current().is_disabled()
}

/// Links the current span to the span of a W3C `traceparent` (the holder's, read from its
/// lease row).
pub(crate) fn link_current_to(traceparent: &str) {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let mut parts = traceparent.split('-');
    let (Some("00"), Some(trace), Some(span), Some(flags)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    let (Ok(trace), Ok(span), Ok(flags)) = (
        TraceId::from_hex(trace),
        SpanId::from_hex(span),
        u8::from_str_radix(flags, 16),
    ) else {
        return;
    };
    let context = SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    tracing::Span::current().add_link(context);
}
