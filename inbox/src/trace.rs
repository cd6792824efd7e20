//! W3C trace context (`traceparent`, `tracestate`) in AMQP headers, so that
//! a trace follows a message from its publisher through the broker (and
//! through the outbox, however late it is dispatched) to its consumer.
//!
//! - **On publish**, [`TraceContext::current`] is what goes out: with the
//!   `opentelemetry` feature, the context of the current `tracing` span as
//!   OpenTelemetry sees it; else, inside a handler, a child of the message
//!   being handled (same trace, a new parent id), so that traces stay
//!   connected across services even where this one exports none.
//! - **On consume**, [`TraceContext::from_headers`] reads it back: the
//!   message's span is made a child of it (with the feature), and its
//!   trace id is a field of the span (for logs) either way.
//!
//! Headers come from anyone: a `traceparent` that is not version `00` in
//! the exact W3C format, or whose ids are all zeros, is ignored, and a
//! `tracestate` longer than [`MAX_TRACESTATE_BYTES`] is dropped.

use lapin::types::{AMQPValue, FieldTable};
use uuid::Uuid;

/// The W3C header carrying the trace id, the parent span id and the flags.
pub(crate) const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor-specific trace state.
pub(crate) const TRACESTATE: &str = "tracestate";
/// The longest `tracestate` kept (W3C: 32 members of up to 256 bytes are
/// allowed, vendors are told to keep it to 512).
pub(crate) const MAX_TRACESTATE_BYTES: usize = 512;

/// A valid W3C trace context: the `traceparent` (and `tracestate`) a
/// message carried, as [`MessageContext::trace`](crate::MessageContext::trace)
/// gives it to a handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

impl TraceContext {
    /// `traceparent` (and `tracestate`) if it is a valid version `00`
    /// context: `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`,
    /// lowercase, neither id all zeros.
    pub(crate) fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let parts: Vec<&str> = traceparent.split('-').collect();
        let [version, trace_id, parent_id, flags] = parts.as_slice() else {
            return None;
        };
        let hex = |part: &str, len: usize| {
            part.len() == len
                && part
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        let zeros = |part: &str| part.bytes().all(|b| b == b'0');
        if *version != "00"
            || !hex(trace_id, 32)
            || !hex(parent_id, 16)
            || !hex(flags, 2)
            || zeros(trace_id)
            || zeros(parent_id)
        {
            return None;
        }
        let tracestate = tracestate
            .filter(|state| !state.is_empty() && state.len() <= MAX_TRACESTATE_BYTES && state.is_ascii())
            .map(str::to_owned);
        Some(Self {
            traceparent: traceparent.to_owned(),
            tracestate,
        })
    }

    /// The context in `headers`, if there is a valid one.
    pub(crate) fn from_headers(headers: &FieldTable) -> Option<Self> {
        let text = |key: &str| match headers.inner().get(key)? {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        };
        let traceparent = text(TRACEPARENT)?;
        Self::parse(&traceparent, text(TRACESTATE).as_deref())
    }

    /// The `traceparent` header's value.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` header's value, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The trace id: 32 hex digits.
    pub fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }

    /// The parent (span) id: 16 hex digits.
    pub fn parent_id(&self) -> &str {
        &self.traceparent[36..52]
    }

    /// A context in the same trace, with a fresh parent id: what a message
    /// sent while this one is handled carries when no tracer names the
    /// span that sends it.
    pub(crate) fn child(&self) -> Self {
        let parent = Uuid::new_v4().simple().to_string();
        Self {
            traceparent: format!(
                "00-{}-{}-{}",
                self.trace_id(),
                &parent[..16],
                &self.traceparent[53..55]
            ),
            tracestate: self.tracestate.clone(),
        }
    }

    /// The headers it travels in, as text pairs.
    pub(crate) fn headers(&self) -> impl Iterator<Item = (&'static str, String)> + '_ {
        std::iter::once((TRACEPARENT, self.traceparent.clone()))
            .chain(self.tracestate.iter().map(|state| (TRACESTATE, state.clone())))
    }

    /// Writes it into `headers`, replacing any context there.
    pub(crate) fn insert_into(&self, headers: &mut FieldTable) {
        headers.insert(
            TRACEPARENT.into(),
            AMQPValue::LongString(self.traceparent.as_str().into()),
        );
        match &self.tracestate {
            Some(state) => {
                headers.insert(TRACESTATE.into(), AMQPValue::LongString(state.as_str().into()));
            }
            None => {
                let mut inner = headers.inner().clone();
                inner.remove(TRACESTATE);
                *headers = FieldTable::from(inner);
            }
        }
    }

    /// The context a message published now carries. With the
    /// `opentelemetry` feature: the current `tracing` span's, when
    /// OpenTelemetry has a valid one for it. Otherwise a child of `cause`
    /// (the message being handled), if any.
    pub(crate) fn current(cause: Option<&TraceContext>) -> Option<Self> {
        #[cfg(feature = "opentelemetry")]
        if let Some(current) = otel::current() {
            return Some(current);
        }
        cause.map(TraceContext::child)
    }

    /// Makes `span` a child of this context (with the `opentelemetry`
    /// feature), and records the trace id in its `trace_id` field (for
    /// logs) either way.
    pub(crate) fn adopt(&self, span: &tracing::Span) {
        span.record("trace_id", tracing::field::display(self.trace_id()));
        #[cfg(feature = "opentelemetry")]
        otel::set_parent(span, self);
    }
}

impl std::fmt::Display for TraceContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.traceparent)
    }
}

/// The bridge to OpenTelemetry, through `tracing-opentelemetry`: the
/// service installs its tracer provider, a `tracing_opentelemetry` layer
/// and the W3C propagator (`opentelemetry::global::set_text_map_propagator`).
#[cfg(feature = "opentelemetry")]
mod otel {
    use std::collections::HashMap;

    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::{TRACEPARENT, TRACESTATE, TraceContext};

    /// The current span's context, through the global propagator.
    pub(super) fn current() -> Option<TraceContext> {
        let context = tracing::Span::current().context();
        if !context.span().span_context().is_valid() {
            return None;
        }
        let mut carrier: HashMap<String, String> = HashMap::new();
        opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.inject_context(&context, &mut carrier);
        });
        TraceContext::parse(
            carrier.get(TRACEPARENT)?,
            carrier.get(TRACESTATE).map(String::as_str),
        )
    }

    /// Makes `span` a child of `parent`, through the global propagator.
    pub(super) fn set_parent(span: &tracing::Span, parent: &TraceContext) {
        let carrier: HashMap<String, String> = parent.headers().map(|(k, v)| (k.to_owned(), v)).collect();
        let context =
            opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&carrier));
        // Only fails once the span has started, and spans are adopted as
        // they are made.
        let _ = span.set_parent(context);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_taken_with_its_ids() {
        let context = TraceContext::parse(VALID, Some("vendor=value")).unwrap();
        assert_eq!(context.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(context.parent_id(), "00f067aa0ba902b7");
        assert_eq!(context.tracestate(), Some("vendor=value"));
    }

    #[test]
    fn untrusted_traceparents_are_ignored() {
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
        ] {
            assert_eq!(TraceContext::parse(bad, None), None, "{bad}");
        }
        let long = "a".repeat(MAX_TRACESTATE_BYTES + 1);
        let context = TraceContext::parse(VALID, Some(&long)).unwrap();
        assert_eq!(context.tracestate(), None, "an oversized tracestate is dropped");
    }

    #[test]
    fn a_child_keeps_the_trace_and_flags_with_a_new_parent() {
        let parent = TraceContext::parse(VALID, None).unwrap();
        let child = parent.child();
        assert_eq!(child.trace_id(), parent.trace_id());
        assert_ne!(child.parent_id(), parent.parent_id());
        assert!(child.traceparent().ends_with("-01"));
        assert_eq!(TraceContext::parse(child.traceparent(), None), Some(child));
    }

    #[test]
    fn it_round_trips_through_amqp_headers() {
        let context = TraceContext::parse(VALID, Some("a=b")).unwrap();
        let mut headers = FieldTable::default();
        context.insert_into(&mut headers);
        assert_eq!(TraceContext::from_headers(&headers), Some(context));
    }
}
