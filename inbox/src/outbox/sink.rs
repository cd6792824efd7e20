//! Where dispatched rows go: the broker, with confirms, or the handlers in
//! process.

use futures_util::future::BoxFuture;

use crate::amqp::AmqpPublisher;
use crate::error::Result;
use crate::settings::Wire;

use super::staging::Outgoing;

/// Where dispatched messages go: the broker ([`AmqpPublisher`], with
/// confirms), or, in process, the handlers.
pub trait Sink: Send + Sync + 'static {
    /// Sends `outgoing`; succeeds once it is taken (confirmed, or handled).
    fn send<'a>(&'a self, outgoing: &'a Outgoing) -> BoxFuture<'a, Result<()>>;
}

impl Sink for AmqpPublisher {
    fn send<'a>(&'a self, outgoing: &'a Outgoing) -> BoxFuture<'a, Result<()>> {
        // A row can come from any process, and one the broker cannot take
        // must fail alone: a name past 255 bytes would panic in the client,
        // round after round; headers past a frame would take the whole
        // connection down, and a body past the broker's limit the channel,
        // with every other publish in flight on them.
        // (Properties past a frame fail as `Unpublishable` in the publish.)
        if let Err(reason) = outgoing.check_names_and_body(self.max_message_size()) {
            return Box::pin(std::future::ready(Err(crate::Error::unpublishable(
                outgoing.message_id.to_string(),
                crate::fault::truncate(&outgoing.routing_key, 64).into_owned(),
                reason,
            ))));
        }
        match self.wire() {
            Wire::Inbox => Box::pin(self.publish_to(
                &outgoing.exchange,
                &outgoing.routing_key,
                outgoing.properties(),
                &outgoing.body,
            )),
            // A row to the default exchange (staged by hand, or by another
            // process) is sent to the queue its routing key names, which
            // must exist: as the inbox wire sends it, in MassTransit's
            // properties.
            Wire::Masstransit if outgoing.exchange.is_empty() => Box::pin(self.publish_to(
                "",
                &outgoing.routing_key,
                outgoing.masstransit_properties(),
                &outgoing.body,
            )),
            // To the type's exchange, for whoever subscribes, bound to the
            // exchanges of the types its envelope says it implements (read
            // once per exchange: the row may be another process's).
            Wire::Masstransit => Box::pin(async move {
                let implements = match self.knows_type_exchange(&outgoing.exchange) {
                    true => Vec::new(),
                    false => crate::masstransit::implemented_types(&outgoing.body),
                };
                let implements: Vec<&str> = implements.iter().map(String::as_str).collect();
                self.publish_to_subscribers(
                    &outgoing.exchange,
                    &implements,
                    outgoing.masstransit_properties(),
                    &outgoing.body,
                )
                .await
            }),
        }
    }
}
