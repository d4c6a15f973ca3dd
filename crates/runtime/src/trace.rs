//! W3C trace context across Kedge: one trace from submit to result.
//!
//! A client's `traceparent` (the bridge's HTTP header, or the `traceparent` NATS header of a task
//! published directly) is recorded by intake in `run.created`
//! ([`kedge_core::event::RunCreated::traceparent`]). The journal is how it travels: the step
//! service reads it from the run it folds and makes its `drive` and `step` spans children of that
//! context with [`set_parent`]. Each message the journal appends carries the context of the span
//! it was appended in ([`current`], the `traceparent` header): the tool service makes its `tool`
//! span a child of the step that requested the operation (or, for a request without the header,
//! of the run's context). A run that came without one gets no parent: its spans are roots.
//!
//! The spans leave the process only when `kedge` installs the OpenTelemetry layer
//! (`otlp_endpoint`); without it [`set_parent`] is a no-op and nothing here costs more than a
//! parse.
//!
//! Invariant: a malformed `traceparent` is ignored (never an error, never recorded): tracing must
//! not refuse work.

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The NATS header (and HTTP header) that carries the W3C trace context.
pub use kedge_journal::TRACEPARENT_HEADER;

/// A parsed W3C `traceparent` (version 00): `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl TraceParent {
    /// Parses a `traceparent` value; `None` when it is not a valid one (all-zero ids included).
    pub fn parse(value: &str) -> Option<TraceParent> {
        let mut parts = value.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        // Version 00 has exactly four fields; a later version may append more.
        if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        u8::from_str_radix(version, 16).ok()?;
        let trace_id: [u8; 16] = hex(trace)?.try_into().ok()?;
        let span_id: [u8; 8] = hex(span)?.try_into().ok()?;
        let flags: [u8; 1] = hex(flags)?.try_into().ok()?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            sampled: flags[0] & 1 == 1,
        })
    }

    /// The trace id as 32 lowercase hex digits (as OTLP/JSON writes it).
    pub fn trace_id_hex(&self) -> String {
        self.trace_id.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn context(&self) -> opentelemetry::Context {
        let flags = if self.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let remote = SpanContext::new(
            TraceId::from_bytes(self.trace_id),
            SpanId::from_bytes(self.span_id),
            flags,
            true,
            TraceState::default(),
        );
        opentelemetry::Context::new().with_remote_span_context(remote)
    }
}

fn hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2)
        || !s
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// `value` (a header, say) if it is a valid `traceparent`, rewritten in its 55-character
/// version-00 form (so what a caller sends is never stored as given: a later version's extra
/// fields, of any length, are dropped); `None` if absent or malformed.
pub fn accept(value: Option<&str>) -> Option<String> {
    TraceParent::parse(value?).map(|t| t.to_header())
}

impl TraceParent {
    /// The version-00 header: `00-<trace id>-<span id>-<flags>`.
    pub fn to_header(&self) -> String {
        let span: String = self.span_id.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "00-{}-{span}-{}",
            self.trace_id_hex(),
            if self.sampled { "01" } else { "00" }
        )
    }
}

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Says spans leave this process (`kedge` installed the OpenTelemetry layer): only then is a
/// run's trace context worth a journal read.
pub fn set_exporting() {
    EXPORTING.store(true, Ordering::Relaxed);
}

/// Whether [`set_exporting`] was called.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Makes `span` a child of the trace context in `traceparent` (when there is a valid one).
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(parent) = traceparent.and_then(TraceParent::parse) {
        // Only fails when no OpenTelemetry layer is installed: then there is nothing to join.
        let _ = span.set_parent(parent.context());
    }
}

/// The `traceparent` of the current span, when spans are exported: what the journal puts on the
/// messages it appends ([`kedge_journal::Journal::with_trace_context`]).
pub fn current() -> Option<String> {
    if exporting() {
        of_span(&tracing::Span::current())
    } else {
        None
    }
}

/// The `traceparent` that makes the next hop a child of `span` (its OpenTelemetry context);
/// `None` when spans are not exported (the span has no valid context).
pub fn of_span(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_w3c_example_and_refuses_the_malformed() {
        let tp = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("valid");
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(tp.sampled);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        assert_eq!(accept(Some(" x ")), None);
        assert_eq!(
            accept(Some(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
            ))
            .as_deref(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
        );
        // A later version's extra fields, however long, are not stored: the value is rewritten.
        let long = format!(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-{}",
            "x".repeat(10_000)
        );
        assert_eq!(
            accept(Some(&long)).as_deref(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
    }
}
