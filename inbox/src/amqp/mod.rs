//! RabbitMQ: connections, the queues kept for each consumed queue, confirmed
//! publishing, and replay from the error queue.
//!
//! For a consumed queue `Q` the runtime keeps `Q` itself, one retry tier
//! `Q.retry.<n>` per `failure.delays` entry (messages wait out the delay,
//! then dead-letter back to `Q`), `Q.error` (messages that failed every
//! attempt, or can never succeed) and `Q.skipped` (no handler for their type).
//!
//! One concern a file: connecting here; `topology.rs` (the queues and
//! exchanges, as this library and MassTransit declare them), `publisher.rs`
//! (confirmed publishing, [`AmqpPublisher`]), `replay.rs` (moving set-aside
//! messages back).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::settings::Settings;

mod publisher;
mod replay;
mod topology;

pub use publisher::AmqpPublisher;
pub use replay::{ReplayReport, SetAside, replay, replay_on};
pub(crate) use topology::{Declared, EndpointForm};
pub use topology::{bind_to_fanout, declare_queue, declare_topology, declare_wire_topology};

/// The content type of this library's wire: the body is the event as JSON.
pub(crate) const JSON: &str = "application/json";

pub use crate::names::{error_queue, retry_queue, skipped_queue};

/// Which of `message_bus.amqp_urls` the next connection tries first: one
/// counter for the process, so that its connections spread over the nodes
/// of a cluster, and a reconnect starts at another node than the last.
static NEXT_BROKER: AtomicUsize = AtomicUsize::new(0);

/// Connects to the broker (`message_bus.amqp_urls`: the one URL, or the
/// nodes of a cluster in turn). `name` shows in the broker's
/// connection list.
///
/// Tries again for up to `message_bus.connect_timeout`: a broker that is
/// down or unreachable at start is a WARN per attempt naming its host and
/// port (never the password), then an error of kind [`Unreachable`](crate::ErrorKind::Unreachable), never a
/// silent hang. With several nodes, a failed attempt moves on to the next
/// node at once, each attempt bounded by its share of the timeout (a node
/// whose packets vanish must not take all of it), and a pause that grows
/// follows each round of them all. The connection logs the broker's
/// `connection.blocked` (a memory or disk alarm: publishing stops) and
/// `connection.unblocked`.
///
/// lapin's automatic recovery stays off: the runtime's own reconnect (a
/// consumer whose connection ended, a publisher's) comes here, with one
/// node or several (then it goes to the next node). One owner of
/// reconnection, not two: with both, a consumer that gave up waiting for
/// lapin's recovery and opened a new connection would find the old one
/// recovered behind it too, consuming deliveries nobody settles.
pub async fn connect(settings: &Settings, name: &str) -> Result<Arc<Connection>> {
    let urls = &settings.message_bus.amqp_urls;
    if urls.is_empty() {
        return Err(crate::settings::no_broker());
    }
    let timeout = settings.message_bus.connect_timeout;
    let per_node = match urls.len() {
        1 => timeout,
        n => (timeout / n as u32).max(MIN_NODE_ATTEMPT),
    };
    let started = std::time::Instant::now();
    let mut backoff = crate::backoff::Backoff::new(FIRST_CONNECT_PAUSE, MAX_CONNECT_PAUSE);
    let mut next = NEXT_BROKER.fetch_add(1, Ordering::Relaxed);
    let mut tried_in_round = 0;
    loop {
        let index = next % urls.len();
        let url = urls[index].as_str();
        next = next.wrapping_add(1);
        tried_in_round += 1;
        let endpoint = crate::settings::broker_endpoint(url);
        let left = timeout.saturating_sub(started.elapsed());
        let properties = ConnectionProperties::default().with_connection_name(LongString::from(name));
        // A setting that cannot work (a CA file that cannot be read) fails
        // the connection at once, naming it.
        let target = Target::of(settings, index)?;
        // Reach the port first, so that each failure is seen and logged
        // here, with the host it concerns.
        let connecting = async {
            reach(&target.uri).await.map_err(Failure::Retry)?;
            target
                .connect(properties)
                .await
                .map_err(|e| match crate::error::tls_failure(&e) {
                    Some(tls) => Failure::Tls(crate::tls::explain(tls)),
                    None => Failure::Retry(crate::error::describe(&e)),
                })
        };
        let limit = left.min(per_node);
        let cause = match tokio::time::timeout(limit, connecting).await {
            Ok(Ok(connection)) => {
                if urls.len() > 1 {
                    tracing::info!(broker = %endpoint, connection = name, "connected");
                }
                log_alarms(&connection, name, &endpoint);
                return Ok(Arc::new(connection));
            }
            // Trying again would meet the same certificate: this is the
            // settings' to fix (or the broker's), not an outage to wait out.
            Ok(Err(Failure::Tls(reason))) => {
                return Err(Error::new(
                    crate::ErrorKind::Broker,
                    format!("cannot connect to the broker {endpoint} over TLS: {reason}"),
                ));
            }
            Ok(Err(Failure::Retry(cause))) => cause,
            Err(_) => format!("no answer within {}", humantime::format_duration(limit)),
        };
        let remaining = timeout.saturating_sub(started.elapsed());
        if remaining.is_zero() {
            return Err(Error::unreachable(
                "broker",
                if urls.len() == 1 {
                    endpoint
                } else {
                    settings.broker_endpoint()
                },
                timeout,
                "message_bus.connect_timeout",
                cause,
            ));
        }
        if tried_in_round < urls.len() {
            tracing::warn!(broker = %endpoint, connection = name, %cause, "cannot connect to the broker; trying the next node");
            continue;
        }
        tried_in_round = 0;
        let pause = backoff.next_pause().min(remaining);
        tracing::warn!(broker = %endpoint, connection = name, %cause, "cannot connect to the broker; trying again in {pause:?}");
        tokio::time::sleep(pause).await;
    }
}

/// Why one connection attempt failed.
enum Failure {
    /// The broker could not be reached or did not let us in: worth another
    /// attempt (with the cause, for the log).
    Retry(String),
    /// TLS failed (the broker's certificate, or ours): another attempt
    /// would fail alike.
    Tls(String),
}

/// One broker of `message_bus.amqp_urls`, as a connection reaches it: its
/// URI (the password of `message_bus.password` or `password_file` in it,
/// no TLS parameter left), and for `amqps://` the TLS configuration and
/// the name its certificate must carry.
struct Target {
    uri: lapin::uri::AMQPUri,
    tls: Option<(Arc<rustls::ClientConfig>, String)>,
}

impl Target {
    /// The `index`th broker of `settings`. Reads the TLS files now, so that
    /// a rotated certificate is taken by the next connection.
    fn of(settings: &Settings, index: usize) -> Result<Self> {
        let bus = &settings.message_bus;
        let url = &bus.amqp_urls[index];
        let key = || format!("message_bus.amqp_urls[{index}]");
        let mut uri: lapin::uri::AMQPUri = crate::settings::without_amqp_tls_params(url)
            .parse()
            .map_err(|e| Error::setting(&key(), format!("not an AMQP URL: {e}")))?;
        if let Some(password) = bus.secret_password()? {
            uri.authority.userinfo.password = password;
        }
        let tls = match uri.scheme {
            lapin::uri::AMQPScheme::AMQP => None,
            lapin::uri::AMQPScheme::AMQPS => {
                let tls = crate::settings::BrokerTls::of(url, index, bus)?;
                let config = crate::tls::client_config(&tls.verify(), tls.identity()?.as_ref())?;
                let name = tls.server_name.unwrap_or_else(|| uri.authority.host.clone());
                Some((config, name))
            }
        };
        Ok(Self { uri, tls })
    }

    /// Opens the connection: over TLS with this library's configuration
    /// for `amqps://` (lapin's own would trust other CAs, and verify the
    /// URL's host only).
    async fn connect(self, properties: ConnectionProperties) -> lapin::Result<Connection> {
        let Some((config, server_name)) = self.tls else {
            return Connection::connect_uri(self.uri, properties).await;
        };
        use lapin::tcp::AMQPUriTcpExt;
        let connector = lapin::tcp::RustlsConnector::from(config);
        let runtime = lapin::runtime::default_runtime()?;
        Connection::connector(
            self.uri,
            runtime,
            async move |uri, runtime| {
                // The TCP connection as for amqp://, then the handshake.
                let mut plain = uri;
                plain.scheme = lapin::uri::AMQPScheme::AMQP;
                let stream = plain.connect_async(&runtime).await?;
                Ok(stream.into_rustls(&connector, &server_name).await?)
            },
            properties,
        )
        .await
    }
}

/// Opens (and closes) a TCP connection to the broker `uri` names.
async fn reach(uri: &lapin::uri::AMQPUri) -> std::result::Result<(), String> {
    let address = (uri.authority.host.as_str(), uri.authority.port);
    tokio::net::TcpStream::connect(address)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// The least time one attempt on one node of several may take.
const MIN_NODE_ATTEMPT: Duration = Duration::from_secs(2);

/// The first pause between connection attempts; doubled up to
/// [`MAX_CONNECT_PAUSE`].
pub(crate) const FIRST_CONNECT_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);
pub(crate) const MAX_CONNECT_PAUSE: std::time::Duration = std::time::Duration::from_secs(5);

/// Logs the broker's resource alarms as they reach `connection`: while one
/// lasts, the broker takes no publishes (moves to retry tiers and the error
/// queue wait, then hand their message back).
fn log_alarms(connection: &Connection, name: &str, endpoint: &str) {
    use futures_util::StreamExt;
    use lapin::Event;
    let mut events = connection.events_listener();
    let (name, endpoint) = (name.to_owned(), endpoint.to_owned());
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            match event {
                Event::ConnectionBlocked(reason) => tracing::warn!(
                    broker = %endpoint, connection = %name, %reason,
                    "the broker blocked the connection (a resource alarm): publishing waits until it lifts"
                ),
                Event::ConnectionUnblocked => {
                    tracing::warn!(broker = %endpoint, connection = %name, "the broker unblocked the connection")
                }
                _ => {}
            }
        }
    });
}

/// The properties of a message the runtime publishes: its id as
/// `message_id`, its type as `type`, JSON content and persistent delivery.
pub(crate) fn message_properties(message_id: Uuid, message_type: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(message_id.to_string().into())
        .with_type(message_type.into())
        .with_content_type(JSON.into())
        .with_delivery_mode(crate::fault::PERSISTENT)
}

/// The properties of a message as [`restored_json`] kept them, under
/// `message_id`: what a redrive publishes. Persistent whatever it was.
pub(crate) fn restored_properties(message_id: Uuid, json: &serde_json::Value) -> BasicProperties {
    let text = |key: &str| json.get(key).and_then(serde_json::Value::as_str);
    let mut properties = BasicProperties::default()
        .with_message_id(message_id.to_string().into())
        .with_delivery_mode(crate::fault::PERSISTENT);
    if let Some(value) = text("content_type") {
        properties = properties.with_content_type(value.into());
    }
    if let Some(value) = text("content_encoding") {
        properties = properties.with_content_encoding(value.into());
    }
    if let Some(value) = text("correlation_id") {
        properties = properties.with_correlation_id(value.into());
    }
    if let Some(value) = text("reply_to") {
        properties = properties.with_reply_to(value.into());
    }
    if let Some(value) = text("type") {
        properties = properties.with_type(value.into());
    }
    if let Some(value) = text("app_id") {
        properties = properties.with_app_id(value.into());
    }
    if let Some(value) = json.get("priority").and_then(serde_json::Value::as_u64) {
        properties = properties.with_priority(u8::try_from(value).unwrap_or(u8::MAX));
    }
    if let Some(value) = json.get("timestamp").and_then(serde_json::Value::as_u64) {
        properties = properties.with_timestamp(value);
    }
    if let Some(serde_json::Value::Object(headers)) = json.get("headers") {
        let mut table = FieldTable::default();
        for (key, value) in headers {
            table.insert(key.as_str().into(), json_amqp(value));
        }
        properties = properties.with_headers(table);
    }
    properties
}

/// What [`restored_properties`] reads: the properties of a message (as the
/// failures table keeps them: no TTL, no `user_id`, which the broker kept
/// when it dead-lettered and which would expire or refuse the copy) with
/// `headers`.
pub(crate) fn restored_json(
    properties: &serde_json::Value,
    headers: serde_json::Map<String, serde_json::Value>,
) -> serde_json::Value {
    let mut json = match properties {
        serde_json::Value::Object(map) => map.clone(),
        _ => serde_json::Map::new(),
    };
    json.remove("message_id");
    json.insert("headers".into(), serde_json::Value::Object(headers));
    serde_json::Value::Object(json)
}

/// A JSON value as AMQP: [`amqp_json`]'s way back, as near as JSON keeps
/// it (a timestamp comes back a number, bytes as text).
pub(crate) fn json_amqp(value: &serde_json::Value) -> AMQPValue {
    use serde_json::Value;
    match value {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(n) => AMQPValue::LongLongInt(n),
            None => AMQPValue::Double(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => AMQPValue::LongString(s.as_str().into()),
        Value::Array(items) => AMQPValue::FieldArray(items.iter().map(json_amqp).collect::<Vec<_>>().into()),
        Value::Object(map) => {
            let mut table = FieldTable::default();
            for (key, value) in map {
                table.insert(key.as_str().into(), json_amqp(value));
            }
            AMQPValue::FieldTable(table)
        }
    }
}

/// AMQP headers as a JSON object.
pub(crate) fn table_json(table: &FieldTable) -> serde_json::Value {
    serde_json::Value::Object(
        table
            .inner()
            .iter()
            .map(|(key, value)| (key.as_str().to_owned(), amqp_json(value)))
            .collect(),
    )
}

/// An AMQP value as JSON: text, numbers and flags as themselves, tables
/// and arrays in kind, bytes as text (lossy), the rest `null`.
pub(crate) fn amqp_json(value: &AMQPValue) -> serde_json::Value {
    use serde_json::Value;
    match value {
        AMQPValue::LongString(s) => Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::ByteArray(b) => Value::String(String::from_utf8_lossy(b.as_slice()).into_owned()),
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => (*n).into(),
        AMQPValue::Timestamp(n) => (*n).into(),
        AMQPValue::Float(n) => f64::from(*n).into(),
        AMQPValue::Double(n) => (*n).into(),
        AMQPValue::FieldTable(table) => table_json(table),
        AMQPValue::FieldArray(array) => Value::Array(array.as_slice().iter().map(amqp_json).collect()),
        _ => Value::Null,
    }
}
