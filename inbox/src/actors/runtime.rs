//! The runtime: wires the actors from [`Settings`] and runs them until
//! shutdown.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use actix::prelude::*;
use deadpool_postgres::Pool;
use futures_util::future::join_all;
use tokio::sync::Notify;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::actors::availability::DatabaseGate;
use crate::actors::consumer::{ConsumerActor, ConsumerFlags, Disconnect, Drain};
use crate::actors::dedup::{DedupActor, Routes};
use crate::actors::drainer::{FailureDrainer, StopDraining};
use crate::actors::handler::{Decodes, HandledTypes, HandlerRoute, HandlerSource, Route};
use crate::actors::health::{Health, HealthState};
use crate::actors::link::Link;
use crate::actors::monitor::Monitor;
use crate::actors::operator::{OperatorActor, StopOperating};
use crate::actors::outbox::{OutboxActor, StopDispatching};
use crate::actors::publisher::Publisher;
use crate::actors::retention::{RetentionActor, StopSweeping};
use crate::actors::stats::{Stats, StatsSnapshot};
use crate::db::Connections;
use crate::handler::DynEventHandler;
use crate::store::{DynInboxStore, InboxStore, NoopInboxStore, PgInboxStore};
use crate::unit_of_work::Outbox;
use crate::{
    Error, ErrorKind, EventHandler, IntegrationEvent, Migration, Provider, Result, Settings, UnitOfWork,
    ValidSettings,
};

/// The consumer id in-process publishing uses when no queue is configured.
const IN_PROCESS_CONSUMER: &str = "in_process";

/// Collects handlers, then [`start`](Self::start)s the runtime.
pub struct RuntimeBuilder {
    settings: ValidSettings,
    routes: HashMap<&'static str, Box<dyn Registered>>,
    store: Option<Arc<dyn DynInboxStore>>,
    migrations: Vec<Migration>,
    error: Option<Error>,
}

impl RuntimeBuilder {
    /// Registers `handler` for its event type `E`. Handlers of one type run
    /// in registration order, in one transaction. It is shared: it lives as
    /// long as the runtime, restarts of its actor included.
    pub fn handler<E, H>(self, handler: H) -> Self
    where
        E: IntegrationEvent,
        H: EventHandler<E>,
    {
        self.register(HandlerSource::Value(Arc::new(handler)))
    }

    /// Registers a handler for `E` that `factory` builds, now and again
    /// each time its actor restarts after a handler panicked: a client or a
    /// cache it holds starts fresh instead of carrying on from a panic.
    pub fn handler_factory<E, H, F>(self, factory: F) -> Self
    where
        E: IntegrationEvent,
        H: EventHandler<E>,
        F: Fn() -> H + Send + Sync + 'static,
    {
        let build = move || -> Arc<dyn DynEventHandler<E>> { Arc::new(factory()) };
        self.register(HandlerSource::Factory(Arc::new(build)))
    }

    fn register<E: IntegrationEvent>(mut self, source: HandlerSource<E>) -> Self {
        let route = self
            .routes
            .entry(E::TYPE)
            .or_insert_with(|| Box::new(HandlerSet::<E>(Vec::new())));
        match route.as_any().downcast_mut::<HandlerSet<E>>() {
            Some(set) => set.0.push(source),
            None => {
                self.error.get_or_insert(Error::new(
                    ErrorKind::Usage,
                    format!(
                        "two event types share the type name `{}`: {} and another",
                        E::TYPE,
                        std::any::type_name::<E>()
                    ),
                ));
            }
        }
        self
    }

    /// The service's own schema, applied by [`start`](Self::start) after
    /// the inbox's migrations, in the same transaction and under the same
    /// advisory lock: replicas that start together take turns instead of
    /// racing (concurrent `CREATE TABLE IF NOT EXISTS` fails in
    /// PostgreSQL). Each [`Migration`] is applied once, in version order,
    /// and recorded in `inbox_service_migrations`. Applied whatever
    /// `database.run_migrations` says (that setting is for the inbox's
    /// tables).
    pub fn migrations(mut self, migrations: &[Migration]) -> Self {
        self.migrations.extend_from_slice(migrations);
        self
    }

    /// Uses `store` instead of the one `message_bus.enable_inbox` resolves
    /// to ([`PgInboxStore`] when on, [`NoopInboxStore`] when off).
    pub fn inbox_store<S: InboxStore>(mut self, store: S) -> Self {
        self.store = Some(Arc::new(store));
        self
    }

    /// Starts the runtime: checks the handlers, waits for the database and
    /// runs the migrations (the inbox's, then [`migrations`](Self::migrations)),
    /// starts the actors and, for `rabbitmq`, connects, declares the
    /// exchange and every queue's topology and starts consuming. Call it
    /// inside an actix `System` (`#[actix::main]`, `#[actix::test]`); end
    /// it with [`Runtime::run_until`] or [`Runtime::shutdown`].
    pub async fn start(self) -> Result<Runtime> {
        let mut runtime = self.build().await?;
        if let Err(e) = runtime.consume().await {
            runtime.shutdown().await;
            return Err(e);
        }
        Ok(runtime)
    }

    /// Everything [`start`](Self::start) does but consuming.
    async fn build(self) -> Result<Runtime> {
        let Self {
            settings,
            routes,
            store,
            migrations,
            error,
        } = self;
        if let Some(error) = error {
            return Err(error);
        }
        check_handlers(&settings, &routes)?;
        warn_when_off(&settings);
        let pool = prepare_database(&settings, &migrations).await?;
        let store = store.unwrap_or_else(|| match settings.is_inbox_enabled() {
            true => Arc::new(PgInboxStore),
            false => Arc::new(NoopInboxStore),
        });

        crate::actors::metrics::describe();
        // Every connection the runtime takes goes through this one gate,
        // built once: a connection limit learnt by one part holds for all.
        let connections = Connections::gated(pool);
        let database = Arc::new(DatabaseGate::new(connections.clone(), &settings));
        let consumed = match settings.message_bus.provider {
            Provider::Rabbitmq => settings.queues.iter().map(|q| q.name.clone()).collect(),
            Provider::InProcess => Vec::new(),
        };
        let health = Arc::new(HealthState::new(consumed, Arc::clone(&database)));
        // For the wire's topology and decoding: which types have handlers.
        let handled = HandledTypes::new(
            routes
                .iter()
                .map(|(event_type, route)| ((*event_type).to_owned(), route.decodes()))
                .collect(),
        );
        let routes: Routes = routes
            .into_iter()
            .map(|(event_type, route)| (event_type.to_owned(), route.start()))
            .collect();
        for (event_type, route) in &routes {
            health.watch_actor(format!("handler actor of {event_type}"), route.liveness());
        }
        let stats = Arc::new(Stats::default());
        let (outbox, handed_over) = outbox_of(&settings);
        let dedup = {
            let (connections, stats, outbox) = (connections.clone(), Arc::clone(&stats), outbox.clone());
            let timeout = settings.database.transaction_timeout;
            let queues = settings.queues.clone();
            Supervisor::start(move |_| {
                DedupActor::new(connections, store, routes, stats, timeout, outbox, &queues)
            })
        };
        health.watch_actor("dedup actor", running(&dedup));
        // Rows of an enabled period stay while the inbox is off: nothing
        // deletes them until it is on again.
        let retention = settings.is_inbox_enabled().then(|| {
            RetentionActor::new(
                connections.clone(),
                settings.retention.clone(),
                settings.failures.drain,
                Arc::clone(&stats),
            )
            .start()
        });
        if let Some(retention) = &retention {
            health.watch_actor("retention actor", running(retention));
        }

        let operations = crate::ops::Operations::in_runtime(
            connections.pool().clone(),
            &settings,
            Arc::clone(&outbox.wake),
        );
        let runtime = Runtime {
            stopped: false,
            publisher: Publisher::in_process(
                dedup.clone().recipient(),
                settings
                    .queues
                    .first()
                    .map_or(IN_PROCESS_CONSUMER, |q| q.consumer_id())
                    .into(),
                Arc::clone(&stats),
            ),
            settings,
            handled,
            connections,
            dedup,
            outbox,
            dispatcher: None,
            consumers: Vec::new(),
            drainer: None,
            operations,
            operator: None,
            retention,
            stats,
            database,
            health,
        };
        let mut runtime = if runtime.settings.message_bus.provider == Provider::Rabbitmq {
            match runtime.connect_broker().await {
                Ok(runtime) => runtime,
                Err((runtime, e)) => {
                    runtime.shutdown().await;
                    return Err(e);
                }
            }
        } else {
            runtime
        };
        match handed_over {
            // The outbox is off: what a commit hands over goes out now.
            Some(handed_over) => hand_over(handed_over, runtime.publisher.clone()),
            // In process, the handlers take the rows.
            None if runtime.dispatcher.is_none() => runtime.start_dispatcher(runtime.publisher.clone()),
            None => {}
        }
        Ok(runtime)
    }
}

/// Refuses to consume with no handler at all: every message, retries in
/// progress included, would go to its skipped queue; and a queue that
/// names a type no handler is registered for (`queues[].event_types`).
fn check_handlers(settings: &Settings, routes: &HashMap<&'static str, Box<dyn Registered>>) -> Result<()> {
    for (i, queue) in settings.queues.iter().enumerate() {
        if let Some(missing) = queue
            .event_types
            .iter()
            .find(|name| !routes.contains_key(name.as_str()))
        {
            let mut registered: Vec<&str> = routes.keys().copied().collect();
            registered.sort_unstable();
            return Err(Error::new(
                ErrorKind::Usage,
                format!(
                    "queues[{i}].event_types names `{missing}` for queue `{}`, but no handler is registered for \
                     it (registered: {})",
                    queue.name,
                    registered.join(", ")
                ),
            ));
        }
    }
    if settings.message_bus.provider == Provider::Rabbitmq && routes.is_empty() && !settings.queues.is_empty()
    {
        let queues: Vec<&str> = settings.queues.iter().map(|q| q.name.as_str()).collect();
        return Err(Error::new(
            ErrorKind::Usage,
            format!(
                "no handler is registered, so consuming {} would move every message to its skipped queue: \
                 register handlers with `.handler(..)` before `start`",
                queues.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Warns once at start about a broker host with the inbox or the outbox
/// turned off (ADR-021's startup warning).
fn warn_when_off(settings: &Settings) {
    if settings.message_bus.provider != Provider::Rabbitmq {
        return;
    }
    if !settings.is_inbox_enabled() {
        tracing::warn!(
            "message_bus.enable_inbox is false on a rabbitmq host: every redelivery (a lost ack, a crash, a \
             redeploy) will reach the handlers again. The inbox_messages table already exists, so turning \
             the inbox on is a settings change and a restart."
        );
    }
    if !settings.is_outbox_enabled() {
        tracing::warn!(
            "message_bus.enable_outbox is false on a rabbitmq host: what units of work publish is sent right \
             after their commit, and a crash in between loses it. The outbox_messages table already exists, \
             so turning the outbox on is a settings change and a restart."
        );
    }
}

/// The pool, once the database answers and the migrations (the inbox's,
/// then the service's) have run.
async fn prepare_database(settings: &Settings, migrations: &[Migration]) -> Result<Pool> {
    for unverified in settings.insecure_connections() {
        tracing::warn!("connection not verified: {unverified}");
    }
    // With the outbox on, this process dispatches it and wakes its
    // dispatcher itself: its commits need not notify others.
    let pool = match settings.is_outbox_enabled() {
        true => crate::db::create_dispatching_pool(settings)?,
        false => crate::db::create_pool(settings)?,
    };
    let mut connection = crate::db::wait_for_database(&pool, settings).await?;
    if settings.database.run_migrations || !migrations.is_empty() {
        let database = &settings.database;
        crate::migrations::migrate(
            &mut connection,
            database.run_migrations,
            migrations,
            database.migration_lock_timeout,
        )
        .await?;
    }
    Ok(pool)
}

/// Where units of work stage what they publish: rows the dispatcher sends
/// once committed or, with the outbox off, messages handed over after the
/// commit, through the receiver returned beside it.
fn outbox_of(settings: &Settings) -> (Outbox, Option<UnboundedReceiver<crate::outbox::Outgoing>>) {
    let (after_commit, handed_over) = match settings.is_outbox_enabled() {
        true => (None, None),
        false => {
            let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
            (Some(sender), Some(receiver))
        }
    };
    let outbox = Outbox {
        exchange: settings.message_bus.exchange.as_str().into(),
        max_message_size: settings.message_bus.max_message_size,
        wire: settings.message_bus.wire,
        wake: Arc::new(Notify::new()),
        after_commit,
    };
    (outbox, handed_over)
}

impl std::fmt::Debug for RuntimeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeBuilder")
            .field("settings", &self.settings)
            .field("event_types", &self.routes.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// A started runtime, consuming. Keep it for as long as the service runs;
/// end it with [`run_until`](Self::run_until) (a signal, say), or with
/// [`shutdown`](Self::shutdown) when the service ends it itself. Dropped
/// without either, it starts its shutdown in the background and returns at
/// once: nothing waits for the messages in flight (see its `Drop`).
///
/// ```no_run
/// use rabbit_inbox::{EventHandler, HandlerError, IntegrationEvent, MessageContext, Runtime, Settings, UnitOfWork};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct OrderPlaced { order_id: i64 }
///
/// impl IntegrationEvent for OrderPlaced {
///     const TYPE: &'static str = "OrderPlaced";
/// }
///
/// struct RecordOrder;
///
/// impl EventHandler<OrderPlaced> for RecordOrder {
///     async fn handle(&self, event: &OrderPlaced, _context: &MessageContext, uow: &mut UnitOfWork) -> Result<(), HandlerError> {
///         uow.client().execute("INSERT INTO orders (id) VALUES ($1)", &[&event.order_id]).await?;
///         Ok(())
///     }
/// }
///
/// #[actix::main]
/// async fn main() -> rabbit_inbox::Result<()> {
///     let settings = Settings::load()?;
///     let signal = rabbit_inbox::shutdown_signal()?;
///     let runtime = Runtime::builder(settings).handler(RecordOrder).start().await?;
///     runtime.run_until(signal).await;
///     Ok(())
/// }
/// ```
#[must_use = "a runtime dropped at once stops again: keep it, then `run_until` or `shutdown` it"]
pub struct Runtime {
    /// Whether [`shutdown`](Self::shutdown) has run: a drop has nothing
    /// left to do.
    stopped: bool,
    settings: ValidSettings,
    /// The event types handlers are registered for.
    handled: HandledTypes,
    /// Where units of work stage the messages they publish.
    outbox: Outbox,
    /// Publishes what they staged, once committed.
    dispatcher: Option<Addr<OutboxActor>>,
    /// The pool, behind the gate every connection the runtime takes goes
    /// through.
    connections: Connections,
    dedup: Addr<DedupActor>,
    consumers: Vec<Addr<ConsumerActor>>,
    retention: Option<Addr<RetentionActor>>,
    /// Moves what the queues set aside into `inbox_failures`, with
    /// `failures.drain`.
    drainer: Option<Addr<FailureDrainer>>,
    /// The operator plane's actions, shared with its actor: a request
    /// through any clone wakes it.
    operations: crate::ops::Operations,
    /// Runs redrive jobs and operators' pauses, with `failures.drain`.
    operator: Option<Addr<OperatorActor>>,
    publisher: Publisher,
    stats: Arc<Stats>,
    /// Waits out database outages; shared by the consumers.
    database: Arc<DatabaseGate>,
    health: Arc<HealthState>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("settings", &self.settings)
            .field("consuming", &!self.consumers.is_empty())
            .field("stats", &self.stats.snapshot())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// A builder over `settings`, validated: [`Settings::load`] gives
    /// them so, and [`Settings::validate`] makes them so.
    pub fn builder(settings: ValidSettings) -> RuntimeBuilder {
        RuntimeBuilder {
            settings,
            routes: HashMap::new(),
            store: None,
            migrations: Vec::new(),
            error: None,
        }
    }

    /// Connects the publisher, declares the exchange and every queue's
    /// topology. On failure, hands the runtime back for a shutdown.
    async fn connect_broker(mut self) -> std::result::Result<Self, (Self, Error)> {
        let declared = async {
            // Publishing has a connection of its own; each queue has another.
            let publisher = crate::amqp::AmqpPublisher::connect(&self.settings, "inbox publisher").await?;
            publisher.declare_exchange().await?;
            let connection = publisher.connection().await;
            for queue in &self.settings.queues {
                let handled = self.handled.only(&queue.event_types);
                let types = handled.names();
                let (failure, wire) = (
                    queue.failure_policy(&self.settings.failure),
                    self.settings.message_bus.wire,
                );
                let declared =
                    crate::amqp::declare_wire_topology(&connection, queue, &failure, wire, &types).await?;
                say_what_guards(queue, wire, &declared);
            }
            // The outbox dispatches over a connection of its own.
            let dispatching = match self.settings.is_outbox_enabled() {
                true => Some(crate::amqp::AmqpPublisher::connect(&self.settings, "inbox outbox").await?),
                false => None,
            };
            Ok::<_, Error>((publisher, dispatching))
        };
        match declared.await {
            Ok((publisher, dispatching)) => {
                self.publisher = Publisher::amqp(publisher);
                if let Some(dispatching) = dispatching {
                    self.start_dispatcher(Publisher::amqp(dispatching));
                }
                Ok(self)
            }
            Err(e) => Err((self, e)),
        }
    }

    /// Starts the outbox's dispatcher, sending to `sink`.
    fn start_dispatcher(&mut self, sink: Publisher) {
        let (connections, settings, outbox) = (
            self.connections.clone(),
            self.settings.outbox.clone(),
            self.outbox.clone(),
        );
        let stats = Arc::clone(&self.stats);
        let listen_to = crate::outbox::ListenTo::of(&self.settings).ok();
        let dispatcher = Supervisor::start(move |_| {
            OutboxActor::new(connections, sink, settings, outbox, stats, listen_to)
        });
        self.health.watch_actor("outbox dispatcher", running(&dispatcher));
        self.dispatcher = Some(dispatcher);
    }

    /// Starts consuming every configured queue (`rabbitmq`; nothing to do
    /// for `in_process`, or when it consumes already).
    async fn consume(&mut self) -> Result<()> {
        if self.settings.message_bus.provider != Provider::Rabbitmq || !self.consumers.is_empty() {
            return Ok(());
        }
        if self.settings.queues.is_empty() {
            tracing::warn!(
                "no queue to consume: the settings list no [[queues]] (is INBOX_CONFIG_DIR, or config/ under the \
                 working directory, the folder with the service's settings?); publishing only"
            );
            return Ok(());
        }
        let queues: Vec<&str> = self.settings.queues.iter().map(|q| q.name.as_str()).collect();
        tracing::info!(queues = %queues.join(", "), broker = %self.settings.broker_endpoint(), "starting to consume");
        for queue in &self.settings.queues {
            let link = Link::open(&self.settings, queue, self.handled.only(&queue.event_types)).await?;
            let connected = Arc::new(AtomicBool::new(false));
            let paused = Arc::new(AtomicBool::new(false));
            let actor = ConsumerActor::new(
                &self.settings,
                queue,
                link,
                self.dedup.clone(),
                Arc::clone(&self.stats),
                Arc::clone(&self.database),
                ConsumerFlags {
                    connected: Arc::clone(&connected),
                    paused: Arc::clone(&paused),
                },
            )
            .start();
            self.health.watch_consumer(&queue.name, connected, paused);
            self.health
                .watch_actor(format!("consumer of {}", queue.name), running(&actor));
            self.consumers.push(actor);
        }
        // After the consumers: their links have declared the queues it
        // drains.
        if self.settings.failures.drain {
            let (settings, connections) = (Arc::new((*self.settings).clone()), self.connections.clone());
            let drainer = Supervisor::start(move |_| FailureDrainer::new(settings, connections));
            self.health.watch_actor("failures drainer", running(&drainer));
            self.drainer = Some(drainer);
            let operations = self.operations.clone();
            let consumers: HashMap<String, Addr<ConsumerActor>> = self
                .settings
                .queues
                .iter()
                .map(|q| q.name.clone())
                .zip(self.consumers.iter().cloned())
                .collect();
            let operator = Supervisor::start(move |_| OperatorActor::new(operations, consumers));
            self.health.watch_actor("operator actor", running(&operator));
            self.operator = Some(operator);
        }
        Ok(())
    }

    /// Publishes events: through the broker with confirms for `rabbitmq`,
    /// straight to the handlers for `in_process`.
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    /// Liveness and readiness now, with the reasons (see [`Health`]).
    pub async fn health(&self) -> Health {
        self.monitor().health().await
    }

    /// What the runtime has done so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// [`health`](Self::health) and [`stats`](Self::stats) on a handle to
    /// keep after the runtime has moved into [`run_until`](Self::run_until):
    /// give it to the health endpoints or a progress log.
    pub fn monitor(&self) -> Monitor {
        Monitor {
            health: Arc::clone(&self.health),
            stats: Arc::clone(&self.stats),
        }
    }

    /// A unit of work on the inbox's pool, for application code (an HTTP
    /// endpoint, a job, a command): write through it, stage messages with
    /// [`UnitOfWork::publish`], then commit it. What it staged is published
    /// once it commits, never before. Its connection counts against the
    /// runtime's connection limit like a message's: where the server grants
    /// fewer connections than `database.pool_size`, it waits for one.
    pub async fn unit_of_work(&self) -> Result<UnitOfWork> {
        let uow = UnitOfWork::begin(self.connections.get().await.map_err(Error::client)?).await?;
        Ok(uow.with_outbox(self.outbox.clone()))
    }

    /// The inbox's pool, for a service's own setup queries. Messages in
    /// flight hold its connections; do not keep one for long. A connection
    /// taken here bypasses the runtime's connection limit: where the
    /// server grants fewer connections than `database.pool_size`, prefer
    /// [`unit_of_work`](Self::unit_of_work), which waits its turn.
    pub fn pool(&self) -> &Pool {
        self.connections.pool()
    }

    /// The operator plane's actions on this service's database
    /// ([`crate::ops`]): what its HTTP scope serves. Redrive jobs and
    /// queue pauses are carried out by the instances that run with
    /// `failures.drain`.
    pub fn operations(&self) -> crate::ops::Operations {
        self.operations.clone()
    }

    /// The dedup actor, for this repository's tests (`internal::dedup_of`).
    pub(crate) fn dedup(&self) -> &Addr<DedupActor> {
        &self.dedup
    }

    /// The retention actor, while the inbox is on: send it
    /// [`Sweep`](crate::Sweep) to sweep now.
    pub fn retention(&self) -> Option<&Addr<RetentionActor>> {
        self.retention.as_ref()
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Runs until `shutdown` resolves, then [`shutdown`](Self::shutdown)s:
    /// the messages in flight finish within one `runtime.shutdown_timeout`.
    /// `shutdown` is whatever ends the service: [`shutdown_signal`], an
    /// HTTP server's end, a channel.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) {
        shutdown.await;
        self.shutdown().await;
    }

    /// Stops consuming, lets the messages in flight finish (at most
    /// `runtime.shutdown_timeout`; what does not finish is redelivered
    /// later), then closes the broker connections and the pool.
    pub async fn shutdown(mut self) {
        self.stopped = true;
        self.stopping().await;
    }

    /// The shutdown, on handles of its own: [`shutdown`](Self::shutdown)
    /// awaits it, a drop spawns it.
    fn stopping(&self) -> impl Future<Output = ()> + 'static {
        let health = Arc::clone(&self.health);
        let consumers = self.consumers.clone();
        let retention = self.retention.clone();
        let drainer = self.drainer.clone();
        let operator = self.operator.clone();
        let dispatcher = self.dispatcher.clone();
        let publisher = self.publisher.clone();
        let connections = self.connections.clone();
        let stats = Arc::clone(&self.stats);
        let timeout = self.settings.runtime.shutdown_timeout;
        // Closing waits for the broker's answer, which a broker whose
        // packets vanish never gives: bounded, like every wait.
        let patience = self.settings.message_bus.connect_timeout;
        async move {
            health.draining.store(true, Ordering::Relaxed);
            let drains = join_all(consumers.iter().map(|consumer| consumer.send(Drain)));
            if tokio::time::timeout(timeout, drains).await.is_err() {
                tracing::warn!(
                    ?timeout,
                    "messages still in flight at the shutdown timeout; they will be redelivered"
                );
            }
            let closing = async {
                join_all(consumers.iter().map(|consumer| consumer.send(Disconnect))).await;
                if let Some(retention) = &retention {
                    let _ = retention.send(StopSweeping).await;
                }
                if let Some(drainer) = &drainer {
                    let _ = drainer.send(StopDraining).await;
                }
                if let Some(operator) = &operator {
                    let _ = operator.send(StopOperating).await;
                }
                if let Some(dispatcher) = &dispatcher {
                    let _ = dispatcher.send(StopDispatching).await;
                }
                if let Err(e) = publisher.close().await {
                    tracing::warn!(error = %e, "closing the publishing connection failed");
                }
            };
            if tokio::time::timeout(patience, closing).await.is_err() {
                tracing::warn!(
                    ?patience,
                    "the broker did not answer the close; leaving without it"
                );
            }
            connections.close();
            tracing::info!(stats = ?stats.snapshot(), "runtime stopped");
        }
    }
}

/// A runtime dropped without [`Runtime::shutdown`] (or
/// [`Runtime::run_until`]) starts the same shutdown in the background, on
/// the actix system it was started on: it stops consuming, lets the
/// messages in flight finish and closes its connections, and says so in a
/// WARN. Nothing waits for it: a process that exits right after the drop
/// leaves its messages in flight to be redelivered.
impl Drop for Runtime {
    fn drop(&mut self) {
        if self.stopped {
            return;
        }
        if actix_rt::Arbiter::try_current().is_none() {
            tracing::warn!(
                "the runtime was dropped outside its actix system without `shutdown`: its actors stop with the system"
            );
            return;
        }
        tracing::warn!(
            "the runtime was dropped without `shutdown`: stopping it in the background (await `shutdown` or `run_until` to wait for the messages in flight)"
        );
        actix_rt::spawn(self.stopping());
    }
}

/// Says, once at start, what sets aside a message that crashes the
/// consumer at every delivery on `queue`, when the broker does not.
fn say_what_guards(queue: &crate::QueueSettings, wire: crate::Wire, declared: &crate::amqp::Declared) {
    use crate::amqp::EndpointForm;
    if declared.broker_limits_deliveries {
        return;
    }
    let error_queue = wire.error_queue(&queue.name);
    let limit = declared.delivery_limit(queue.delivery_limit);
    let which = if limit < queue.delivery_limit {
        format!(
            "RabbitMQ 4's default limit for a quorum queue, below queues[].delivery_limit ({}), so that the \
             runtime sets the message aside before the broker drops it",
            queue.delivery_limit
        )
    } else {
        "queues[].delivery_limit".to_owned()
    };
    let instead = format!(
        "the runtime counts the deliveries the broker marks redelivered and moves a message to {error_queue} \
         on its delivery number {limit} ({which}) without running its handlers"
    );
    match declared.endpoint {
        // MassTransit's default form: what the wire declares unless told
        // otherwise, nothing to warn of.
        Some(form @ EndpointForm::Classic) => tracing::info!(
            queue = %queue.name,
            "the queue is in MassTransit's form: {}; {instead}",
            form.describe()
        ),
        Some(form) => tracing::warn!(
            queue = %queue.name,
            "the queue is in MassTransit's form, or another client's, and is used as it is: {}; {instead}",
            form.describe()
        ),
        None => tracing::info!(
            queue = %queue.name,
            "a classic queue: the broker does not limit a message's deliveries; {instead}"
        ),
    }
}

/// With the outbox off: sends what each commit hands over, as it comes. A
/// message the broker (or the handlers) do not take is lost, and said so.
fn hand_over(mut handed_over: UnboundedReceiver<crate::outbox::Outgoing>, sink: Publisher) {
    use crate::outbox::Sink;
    actix_rt::spawn(async move {
        while let Some(outgoing) = handed_over.recv().await {
            if let Err(e) = sink.send(&outgoing).await {
                tracing::error!(
                    message_id = %outgoing.message_id,
                    error = %e,
                    "a message published after its commit was not taken, and is lost: the outbox is off"
                );
            }
        }
    });
}

/// Whether the actor at `address` runs, asked without keeping it alive.
fn running<A: Actor>(address: &Addr<A>) -> impl Fn() -> bool + Send + Sync + 'static {
    let weak = address.downgrade();
    move || weak.upgrade().is_some_and(|address| address.connected())
}

/// A future that resolves on SIGINT or SIGTERM (Ctrl-C on other systems),
/// listened for from this call on, for [`Runtime::run_until`]. A signal
/// handler that cannot be installed is an error now; one that fails later
/// ends the wait. A service that also serves HTTP hands it to one task
/// that stops the server and ends the runtime's `run_until` future, so
/// that one signal drains both at once.
pub fn shutdown_signal() -> Result<impl Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let listen = |kind: SignalKind, name: &str| {
            signal(kind).map_err(|e| Error::new(ErrorKind::Stopped, format!("cannot listen for {name}: {e}")))
        };
        let mut terminate = listen(SignalKind::terminate(), "SIGTERM")?;
        let mut interrupt = listen(SignalKind::interrupt(), "SIGINT")?;
        Ok(async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
            tracing::info!("shutdown signal received");
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C; shutting down");
        }
    })
}

/// The handlers of one event type, before their actor starts.
trait Registered {
    fn as_any(&mut self) -> &mut dyn Any;
    fn decodes(&self) -> Decodes;
    fn start(self: Box<Self>) -> Route;
}

struct HandlerSet<E>(Vec<HandlerSource<E>>);

impl<E: IntegrationEvent> Registered for HandlerSet<E> {
    fn as_any(&mut self) -> &mut dyn Any {
        self
    }

    fn decodes(&self) -> Decodes {
        crate::actors::handler::decodes::<E>
    }

    fn start(self: Box<Self>) -> Route {
        HandlerRoute::start(self.0)
    }
}
