//! The fault suite: runs the check-in service while breaking everything
//! around it, then checks that nothing was lost and nothing applied twice.
//!
//! ```text
//! cargo build --example checkin_service
//! cargo test --test fault_suite -- [--batch-size N] [--wire masstransit]   # or: bash tests/fault_suite.sh
//! ```
//!
//! A harness, not a test `cargo test` runs (`test = false` in Cargo.toml):
//! it restarts the machine's PostgreSQL and RabbitMQ.
//!
//! It starts `examples/checkin_service` (built in the same target folder) on a
//! fresh queue and database, publishes 5,000 check-ins (20% re-using an id)
//! plus malformed deliveries and events with a negative attendee id (which
//! the service refuses), and while they are consumed: SIGKILLs the service
//! at random moments (restarting it each time), force-closes its AMQP
//! connection, restarts PostgreSQL, restarts the RabbitMQ application and
//! raises a memory alarm for a few seconds (the broker blocks publishing;
//! the service must log it).
//! Once all that is consumed, it publishes one poison message, a check-in
//! the service aborts on (`--abort-on-attendee`), and restarts the service
//! after every crash until the broker's delivery limit moves the message
//! to the error queue.
//! The service serves its HTTP endpoints (`--http`) all along: it must be
//! ready after each start, unready but live while PostgreSQL and while
//! RabbitMQ are stopped, and its `/metrics` must name every metric.
//! Then it stops the service with SIGTERM (which must exit 0) and checks the
//! database and the queues. It prints one line and fails unless `lost=0`,
//! `duplicated=0` and every other check holds. With `--batch-size N` the
//! service runs batches of up to N deliveries.
//!
//! It restarts the machine's PostgreSQL and RabbitMQ: run it where nothing
//! else uses them. Honours `DATABASE_URL` (a server, whose `postgres`
//! database it connects to) and `AMQP_URL`.
//!
//! With `--wire masstransit` the service speaks MassTransit 8
//! (docs/masstransit.md), and so does the suite: it publishes check-ins in
//! MassTransit's envelope to the exchange `Conference.Contracts:AttendeeCheckedIn`,
//! breaks envelopes in six ways, reads the forwards as envelopes, and finds
//! failures in `Q_error`. Same faults, same line. With
//! `--masstransit-endpoint` too, the suite first declares the endpoint as
//! MassTransit 8.5 does by default (`Q` and `Q_error` classic, without
//! arguments, behind their exchanges, the check-in's exchange bound to `Q`'s):
//! the service takes it over as it is. With `--masstransit-after`, the
//! service declares the endpoint (as MassTransit would) and the suite then
//! declares it again as MassTransit does, while the service runs, as a
//! .NET consumer starting beside it or after it would. On MassTransit's
//! wire the crash-looping message is set aside by the runtime's own count
//! of its deliveries (`x-inbox-handler: delivery limit`), not by the
//! broker: its queues limit none.
//!
//! With `--cluster` (run by `tests/cluster.sh run`, which starts the nodes
//! and passes their URLs in `CLUSTER_AMQP_URLS`), the service and the suite
//! connect to the nodes of a RabbitMQ cluster, and instead of restarting
//! PostgreSQL and RabbitMQ the suite SIGKILLs the node that leads the
//! service's queue, brings it back, then SIGKILLs the node the service's
//! consumer is connected to and brings it back; the service's own SIGKILLs
//! and the crash loop run as usual. The line ends with `node_kills=2`.
//!
//! With `--ops`, the service runs with the operator plane
//! (`--ops-tokens`): it drains its error queue into the failures table
//! while it is killed with the rest, and the suite finds the failures
//! there: exactly one row per failed message (failing, malformed, the
//! crash-looping one), and the error queue empty.
//!
//! With `--tls` (run by tests/fault_suite.sh with `DATABASE_URL` and
//! `AMQP_URL` naming the servers of tests/tls_servers.sh: `verify-full` and
//! `amqps://`), the service and the suite reach a PostgreSQL that takes TLS
//! only and a RabbitMQ node with a TLS listener only; the suite restarts
//! those two (the cluster `tls`, the node `rabbit_tls@localhost`).

#[path = "../examples/common/mod.rs"]
mod common;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{AttendeeCheckedIn, Seeded};
use common::{BoxError as Error, Result};
use rabbit_inbox::tools;
use rabbit_inbox::tools::AmqpPublisher;
use rabbit_inbox::tools::lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use rabbit_inbox::tools::lapin::types::FieldTable;
use rabbit_inbox::tools::lapin::{BasicProperties, Connection};
use rabbit_inbox::{Message, QueueSettings, Settings, Wire};

const DATABASE: &str = "inbox_faults";
const EVENTS: usize = 5000;
const DUP_RATIO: f64 = 0.2;
const FAILING: usize = 20;
const KILLS: usize = 5;
/// Fast failure path, so failing events reach the error queue in seconds.
const DELAYS: &str = "1s,2s";
/// The whole run's bound; past it the suite fails.
const DEADLINE: Duration = Duration::from_secs(240);
/// With `--cluster`: a killed node takes 10-25 s to come back, twice, and
/// a retry tier whose dead-lettering back to the queue was cut by a kill
/// re-sends after RabbitMQ's dead-letter confirm timeout, once per kill at
/// worst (`dead_letter_worker_publisher_confirm_timeout`: three minutes).
const CLUSTER_DEADLINE: Duration = Duration::from_secs(600);
/// The attendee the service aborts on: the poison message's.
const POISON: i64 = 1_000_000;
/// The queue's delivery limit (the default): the poison message is handed
/// out this many times and once more, then dead-lettered.
const DELIVERY_LIMIT: usize = 20;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("fault_suite: {e}");
            ExitCode::FAILURE
        }
    }
}

fn fail(what: impl Into<String>) -> Error {
    Error::from(what.into())
}

/// What was published, to check against.
#[derive(Default)]
struct Published {
    /// Every publish, duplicates included.
    count: usize,
    /// Unique well-formed events with a positive attendee id.
    good: HashMap<rabbit_inbox::uuid::Uuid, AttendeeCheckedIn>,
    /// Events the service refuses (negative attendee id).
    failing: HashSet<rabbit_inbox::uuid::Uuid>,
    /// Markers of the malformed deliveries, found in their bodies.
    malformed: HashSet<String>,
}

struct Suite {
    started: Instant,
    settings: Settings,
    queue: String,
    service: std::path::PathBuf,
    database_url: String,
    /// `--batch-size`, passed on to the service.
    batch_size: u16,
    /// `--wire`, passed on to the service: how both sides publish, and
    /// the names of the queues failures go to.
    wire: Wire,
    kills: usize,
    db_restarts: usize,
    broker_restarts: usize,
    alarms: usize,
    /// Times the service aborted on the poison message.
    crashes: usize,
    /// Where this run's part of the service log starts.
    log_start: u64,
    /// The service's `--http` address.
    http: String,
    /// What its health endpoints said at each fault, and whether that was
    /// right.
    health: Vec<(bool, String)>,
    /// `--tls`: the servers are tests/tls_servers.sh's.
    tls: bool,
    /// `--cluster`: the broker is a cluster of tests/cluster.sh.
    cluster: bool,
    /// Cluster nodes SIGKILLed (and brought back).
    node_kills: usize,
    /// `--ops`: the service's token file; it drains its error queue into
    /// the failures table.
    ops: Option<std::path::PathBuf>,
}

async fn run() -> Result<bool> {
    let started = Instant::now();
    let mut settings = common::settings()?.into_inner();
    let cluster = std::env::args().any(|arg| arg == "--cluster");
    if cluster {
        let urls = std::env::var("CLUSTER_AMQP_URLS")
            .map_err(|_| fail("--cluster needs CLUSTER_AMQP_URLS: run it through tests/cluster.sh run"))?;
        settings.message_bus.amqp_urls = urls.split(',').map(str::to_owned).collect();
    }
    let queue = format!("faults.checkin.{}", rabbit_inbox::uuid::Uuid::now_v7());
    settings.queues = vec![QueueSettings::new(&queue)];
    settings.failure.delays = vec![Duration::from_secs(1), Duration::from_secs(2)];
    settings.database.set_dbname(DATABASE)?;
    // This binary is target/<profile>/deps/fault_suite-<hash>; the example
    // is target/<profile>/examples/checkin_service.
    let exe = std::env::current_exe().map_err(|e| fail(format!("where am I: {e}")))?;
    let service = exe
        .parent()
        .and_then(std::path::Path::parent)
        .map(|profile| profile.join("examples").join("checkin_service"))
        .ok_or_else(|| fail(format!("no target folder above {}", exe.display())))?;
    if !service.exists() {
        return Err(fail(format!(
            "{} is missing: cargo build --example checkin_service",
            service.display()
        )));
    }
    let tls = std::env::args().any(|arg| arg == "--tls");
    if tls {
        eprintln!("fault_suite: over TLS to both servers (tests/tls_servers.sh)");
    }
    let server = settings.pg_config()?;
    let database_url = if tls {
        settings.database.url.clone()
    } else {
        format!(
            "postgres://{}@{}:{}/{DATABASE}",
            server.get_user().unwrap_or("postgres"),
            "127.0.0.1",
            server.get_ports().first().copied().unwrap_or(5432)
        )
    };
    common::recreate_database(&settings, DATABASE).await?;

    let batch_size: u16 = common::parsed_arg("--batch-size", 1);
    if batch_size > 1 {
        eprintln!("fault_suite: the service runs batches of up to {batch_size}");
    }
    let wire = settings.message_bus.wire;
    if wire == Wire::Masstransit {
        eprintln!("fault_suite: the service and the suite speak MassTransit's wire");
    }
    let masstransit_endpoint = std::env::args().any(|arg| arg == "--masstransit-endpoint");
    if masstransit_endpoint {
        if wire != Wire::Masstransit {
            return Err(fail("--masstransit-endpoint goes with --wire masstransit"));
        }
        declare_as_masstransit(&settings, &queue, false).await?;
        eprintln!("fault_suite: the endpoint was declared first, as MassTransit declares it (classic)");
    }
    let masstransit_after = std::env::args().any(|arg| arg == "--masstransit-after");
    if masstransit_after && wire != Wire::Masstransit {
        return Err(fail("--masstransit-after goes with --wire masstransit"));
    }
    let ops = match std::env::args().any(|arg| arg == "--ops") {
        false => None,
        true => {
            let tokens = std::env::temp_dir().join(format!(
                "fault-suite-tokens-{}",
                rabbit_inbox::uuid::Uuid::now_v7()
            ));
            std::fs::write(&tokens, "suite operator fault-suite-token-0123456789\n")?;
            eprintln!(
                "fault_suite: the service drains its error queue into the failures table (--ops-tokens)"
            );
            Some(tokens)
        }
    };
    let mut suite = Suite {
        started,
        settings,
        queue,
        service,
        database_url,
        batch_size,
        wire,
        kills: 0,
        db_restarts: 0,
        broker_restarts: 0,
        alarms: 0,
        crashes: 0,
        log_start: std::fs::metadata(service_log_path()).map_or(0, |m| m.len()),
        http: free_address()?,
        health: Vec::new(),
        tls,
        cluster,
        node_kills: 0,
        ops,
    };
    let mut child = suite.start_service()?;
    wait_for_queue(&suite.settings, &suite.queue).await?;
    suite.expect_ready("after the start").await;
    if masstransit_after {
        // A .NET consumer of the endpoint starts beside the service (or in
        // its place, on a rollback): its declarations must all be taken.
        declare_as_masstransit(&suite.settings, &suite.queue, true)
            .await
            .map_err(|e| {
                fail(format!(
                    "a MassTransit endpoint cannot start on the queues the service declared: {e}"
                ))
            })?;
        suite.say("declared the endpoint again as MassTransit does, beside the running service");
    }

    // Publish in the background, a little at a time, while the faults happen.
    let publishing = {
        let (settings, queue) = (suite.settings.clone(), suite.queue.clone());
        tokio::spawn(async move { publish_all(&settings, &queue).await })
    };
    let mut random = Seeded::new(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(7, |d| d.as_nanos() as u64)
            | 1,
    );
    let pause = |random: &mut Seeded| Duration::from_millis(500 + random.below(1500));
    for round in 0..KILLS {
        tokio::time::sleep(pause(&mut random)).await;
        child = suite.kill_and_restart(child)?;
        tokio::time::sleep(pause(&mut random)).await;
        match (suite.cluster, round) {
            (false, 0) => suite.close_service_connections()?,
            (false, 1) => suite.restart_postgres().await?,
            (false, 2) => suite.restart_rabbitmq().await?,
            (false, 3) => suite.raise_memory_alarm().await?,
            (true, 0) => {
                let leader = suite.queue_leader()?;
                suite.kill_node(&leader, "the queue's leader").await?;
            }
            (true, 1) => {
                let connected = suite.consumer_node()?;
                suite.kill_node(&connected, "the consumer's node").await?;
            }
            _ => {}
        }
    }
    let published = publishing
        .await
        .map_err(|e| fail(format!("the publisher died: {e}")))??;
    suite.say(&format!(
        "published {} ({} unique good)",
        published.count,
        published.good.len()
    ));

    // Let it finish; then a crash loop; then stop it as an operator would.
    wait_until_settled(&suite, &published, started, &mut child).await?;
    let poison = suite.crash_loop(&mut child, &published).await?;
    suite.expect_ready("after the crash loop").await;
    suite.expect_metrics().await;
    suite.say("settled; stopping the service with SIGTERM");
    let status = stop_service(child)?;
    let ok_exit = status == Some(0);
    if !ok_exit {
        eprintln!("fault_suite: SIGTERM exit status {status:?}, expected 0");
    }
    check(&suite, &published, poison, ok_exit).await
}

impl Suite {
    /// How many copies were set aside: those in `error_queue`, and with
    /// `--ops` those drained into the failures table (a copy whose row is
    /// committed and whose ack is not yet counts twice: "at least").
    async fn set_aside(&self, error_queue: &str) -> Result<u32> {
        let in_queue = ready(&self.settings, error_queue).await?;
        if self.ops.is_none() {
            return Ok(in_queue);
        }
        let pool = rabbit_inbox::tools::create_pool(&self.settings)?;
        let rows: i64 = pool
            .get()
            .await?
            .query_one(
                "SELECT count(*) FROM inbox_failures WHERE queue = $1",
                &[&self.queue],
            )
            .await?
            .get(0);
        Ok(in_queue + u32::try_from(rows).unwrap_or(u32::MAX))
    }

    /// The whole run's bound; past it the suite fails.
    fn deadline(&self) -> Duration {
        if self.cluster { CLUSTER_DEADLINE } else { DEADLINE }
    }

    /// A progress line, with the time since the start.
    fn say(&self, what: &str) {
        eprintln!(
            "fault_suite: [{:5.1}s] {what}",
            self.started.elapsed().as_secs_f64()
        );
    }

    fn start_service(&self) -> Result<Child> {
        let mut service = Command::new(&self.service);
        if self.cluster {
            service.env(
                "INBOX__MESSAGE_BUS__AMQP_URLS",
                self.settings.message_bus.amqp_urls.join(","),
            );
        }
        service
            .args([
                "--queue",
                &self.queue,
                "--batch-size",
                &self.batch_size.to_string(),
                "--abort-on-attendee",
                &POISON.to_string(),
                "--forward-to",
                &forward_queue(&self.queue),
                "--http",
                &self.http,
                "--wire",
                match self.wire {
                    Wire::Inbox => "inbox",
                    Wire::Masstransit => "masstransit",
                },
            ])
            .args(
                self.ops
                    .iter()
                    .flat_map(|tokens| [std::ffi::OsStr::new("--ops-tokens"), tokens.as_os_str()]),
            )
            .env("DATABASE_URL", &self.database_url)
            .env("AMQP_URL", &self.settings.message_bus.amqp_urls[0])
            .env("INBOX__FAILURE__DELAYS", DELAYS)
            .env("INBOX__FAILURE__IMMEDIATE_RETRIES", "1")
            .env("INBOX__RUNTIME__SHUTDOWN_TIMEOUT", "10s")
            .env("RUST_LOG", "warn")
            .stdout(self.service_log()?)
            // Its own crash messages too: twenty-one of them per run.
            .stderr(self.service_log()?)
            .spawn()
            .map_err(|e| fail(format!("cannot start {}: {e}", self.service.display())))
    }

    /// The service's log (stdout and stderr), appended to across restarts;
    /// read it when a check fails.
    fn service_log(&self) -> Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(service_log_path())
            .map_err(|e| fail(format!("service log: {e}")))
    }

    /// What the service logged during this run.
    fn service_logged(&self) -> String {
        let text = std::fs::read(service_log_path()).unwrap_or_default();
        let start = usize::try_from(self.log_start).unwrap_or(0).min(text.len());
        String::from_utf8_lossy(&text[start..]).into_owned()
    }

    /// A memory alarm for a few seconds: the broker blocks every
    /// publishing connection, then lifts it. The watermark goes back to
    /// what it was.
    async fn raise_memory_alarm(&mut self) -> Result<()> {
        let before = sh(&format!(
            "{} eval 'vm_memory_monitor:get_vm_memory_high_watermark().'",
            self.rabbitmqctl()
        ))?;
        let restore = match before.trim() {
            relative if relative.parse::<f64>().is_ok() => relative.to_owned(),
            other => match other.strip_prefix("{absolute,").and_then(|n| n.strip_suffix('}')) {
                Some(bytes) => format!("absolute {bytes}"),
                None => return Err(fail(format!("unexpected memory watermark `{other}`"))),
            },
        };
        // The broker tells a connection it is blocked when it publishes, and
        // the service may have nothing to publish just then (the suite's
        // own publishing is blocked): a row staged as another process
        // would gives its outbox something to send.
        let probe_queue = alarm_queue(&self.queue);
        let connection = connect(&self.settings).await?;
        tools::declare_queue(
            &connection.create_channel().await?,
            &probe_queue,
            rabbit_inbox::QueueKind::Classic,
        )
        .await?;
        let _ = connection.close(200, "done".into()).await;
        sh(&format!(
            "{} -q set_vm_memory_high_watermark 0.000001",
            self.rabbitmqctl()
        ))?;
        self.say("raised a memory alarm");
        let pool = rabbit_inbox::tools::create_pool(&self.settings)?;
        pool.get()
            .await?
            .execute(
                "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body)
                 VALUES (gen_random_uuid(), '', $1, 'AlarmProbe', '{}')",
                &[&probe_queue],
            )
            .await?;
        pool.close();
        tokio::time::sleep(Duration::from_secs(3)).await;
        sh(&format!(
            "{} -q set_vm_memory_high_watermark {restore}",
            self.rabbitmqctl()
        ))?;
        self.alarms += 1;
        self.say("cleared the memory alarm");
        Ok(())
    }

    /// SIGKILL (what `Child::kill` sends on Unix), then a fresh process.
    fn kill_and_restart(&mut self, mut child: Child) -> Result<Child> {
        child.kill().map_err(|e| fail(format!("kill: {e}")))?;
        let _ = child.wait();
        self.kills += 1;
        self.say(&format!("SIGKILL {}", self.kills));
        self.start_service()
    }

    /// Publishes the poison message and restarts the service each time it
    /// aborts on it, until the message is in the error queue. Returns its id.
    async fn crash_loop(
        &mut self,
        child: &mut Child,
        published: &Published,
    ) -> Result<rabbit_inbox::uuid::Uuid> {
        let poison = Message::new(AttendeeCheckedIn {
            attendee_id: POISON,
            session_id: 1,
        });
        let connection = connect(&self.settings).await?;
        let publisher = AmqpPublisher::new(&connection, "").await?.with_wire(self.wire);
        publish_event(&publisher, &self.queue, &poison).await?;
        let _ = connection.close(200, "done".into()).await;
        self.say("published a message the service aborts on");
        let set_aside = (published.failing.len() + published.malformed.len()) as u32 + 1;
        let error_queue = self.wire.error_queue(&self.queue);
        // Since when the service has consumed with nothing left in the queue.
        let mut calm_since: Option<Instant> = None;
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                self.crashes += 1;
                calm_since = None;
                *child = self.start_service()?;
            }
            // Done once it is set aside: the error queue holds as many as
            // were set aside (or more: a move whose confirm was lost with a
            // node is sent twice, so the count alone proves nothing), and
            // the service restarted after the last crash has consumed for
            // two seconds with the queue empty and without crashing (the
            // poison message would crash it at once). It listens for
            // SIGTERM before it consumes: one earlier would kill it before
            // it drains.
            let main = probe(&self.settings, &self.queue).await?;
            let calm = self.set_aside(&error_queue).await? >= set_aside
                && main.message_count() == 0
                && main.consumer_count() > 0;
            if !calm {
                calm_since = None;
            } else if calm_since.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(2) {
                self.say(&format!(
                    "the poison message is set aside after {} crashes",
                    self.crashes
                ));
                return Ok(poison.id);
            }
            if self.started.elapsed() > self.deadline() {
                return Err(fail(format!(
                    "the poison message was not set aside after {} crashes",
                    self.crashes
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// rabbitmqctl for the node the service uses (the machine's, or the
    /// TLS node of tests/tls_servers.sh).
    fn rabbitmqctl(&self) -> &'static str {
        match self.tls {
            true => "rabbitmqctl -n rabbit_tls@localhost",
            false => "rabbitmqctl",
        }
    }

    fn close_service_connections(&self) -> Result<()> {
        let listing = sh(&format!(
            "{} list_connections -q pid client_properties",
            self.rabbitmqctl()
        ))?;
        let mut closed = 0;
        for line in listing.lines().filter(|l| l.contains("inbox faults.checkin")) {
            if let Some(pid) = line.split_whitespace().next() {
                sh(&format!(
                    "{} close_connection '{pid}' 'fault suite'",
                    self.rabbitmqctl()
                ))?;
                closed += 1;
            }
        }
        self.say(&format!("force-closed {closed} AMQP connection(s)"));
        Ok(())
    }

    /// The node that leads the service's queue (`rabbit2@localhost`).
    fn queue_leader(&self) -> Result<String> {
        let listing = sh("rabbitmqctl -q list_queues name leader")?;
        listing
            .lines()
            .filter_map(|line| line.split_once('\t'))
            .find(|(name, _)| *name == self.queue)
            .map(|(_, leader)| leader.trim().to_owned())
            .ok_or_else(|| fail(format!("no leader listed for {}:\n{listing}", self.queue)))
    }

    /// The node the service's consumer is connected to: the node in the
    /// pid of its connection (`<rabbit3@localhost.1.2.3>`).
    fn consumer_node(&self) -> Result<String> {
        let name = format!("inbox {}", self.queue);
        let listing = sh("rabbitmqctl -q list_connections pid client_properties")?;
        listing
            .lines()
            .filter(|line| line.contains(&name))
            .find_map(|line| {
                let pid = line.split_whitespace().next()?;
                let node = pid.trim_start_matches('<').split('.').next()?;
                Some(node.to_owned())
            })
            .ok_or_else(|| fail(format!("no connection named {name}:\n{listing}")))
    }

    /// SIGKILLs a node of tests/cluster.sh (`rabbit2@localhost` or
    /// `rabbit3@localhost`, never the machine's own), waits a few seconds
    /// while the others carry on, and starts it again.
    async fn kill_node(&mut self, node: &str, which: &str) -> Result<()> {
        let n = node
            .strip_prefix("rabbit")
            .and_then(|rest| rest.strip_suffix("@localhost"))
            .filter(|n| ["2", "3"].contains(n))
            .ok_or_else(|| fail(format!("{which} is {node}, which the suite may not kill")))?;
        sh(&format!("bash tests/cluster.sh kill {n}"))?;
        self.node_kills += 1;
        self.say(&format!("SIGKILLed {node}, {which}"));
        tokio::time::sleep(Duration::from_secs(5)).await;
        sh(&format!("bash tests/cluster.sh start {n}"))?;
        self.say(&format!("{node} is back"));
        Ok(())
    }

    async fn restart_postgres(&mut self) -> Result<()> {
        self.expect_ready("before PostgreSQL stops").await;
        let cluster = if self.tls { "tls" } else { "main" };
        sh(&format!(
            "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql | sort -V | tail -n 1) {cluster} stop"
        ))?;
        self.expect_unready("database", "while PostgreSQL is stopped")
            .await;
        sh(&format!(
            "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql | sort -V | tail -n 1) {cluster} start"
        ))?;
        self.db_restarts += 1;
        self.say("restarted PostgreSQL");
        Ok(())
    }

    async fn restart_rabbitmq(&mut self) -> Result<()> {
        self.expect_ready("before RabbitMQ stops").await;
        let ctl = self.rabbitmqctl();
        sh(&format!("{ctl} -q stop_app"))?;
        self.expect_unready("not connected", "while RabbitMQ is stopped")
            .await;
        sh(&format!("{ctl} -q start_app && {ctl} -q await_startup"))?;
        self.broker_restarts += 1;
        self.say("restarted RabbitMQ");
        Ok(())
    }

    /// Waits (up to 30 s) for `GET /health/ready` to answer 200.
    async fn expect_ready(&mut self, when: &str) {
        let started = Instant::now();
        let ok = loop {
            if let Ok((200, _)) = http_get(&self.http, "/health/ready").await {
                break true;
            }
            if started.elapsed() > Duration::from_secs(30) {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        self.health
            .push((ok, format!("/health/ready answered 200 {when}")));
    }

    /// Waits (up to 15 s) for `GET /health/ready` to answer 503 with a
    /// reason containing `reason`, then asks `GET /health/live`, which must
    /// still answer 200.
    async fn expect_unready(&mut self, reason: &str, when: &str) {
        let started = Instant::now();
        let unready = loop {
            if let Ok((503, body)) = http_get(&self.http, "/health/ready").await
                && body.contains(reason)
            {
                break true;
            }
            if started.elapsed() > Duration::from_secs(15) {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        self.health.push((
            unready,
            format!("/health/ready answered 503 naming `{reason}` {when}"),
        ));
        let live = matches!(http_get(&self.http, "/health/live").await, Ok((200, _)));
        self.health
            .push((live, format!("/health/live answered 200 {when}")));
    }

    /// `GET /metrics` names every metric of docs/operations.md.
    async fn expect_metrics(&mut self) {
        let text = match http_get(&self.http, "/metrics").await {
            Ok((200, text)) => text,
            other => {
                self.health
                    .push((false, format!("/metrics answered 200 (got {other:?})")));
                return;
            }
        };
        let ops: &[&str] = match self.ops {
            Some(_) => OPS_METRICS,
            None => &[],
        };
        for name in METRICS.iter().chain(ops) {
            let present = text
                .lines()
                .any(|line| line.starts_with(name) && !line.starts_with('#'));
            self.health.push((present, format!("/metrics has {name}")));
        }
    }
}

/// What the operator plane adds, with `--ops`: the drainer's count and
/// the operator actor's samples.
const OPS_METRICS: &[&str] = &[
    "inbox_failures_ingested_total",
    "inbox_failures_open",
    "inbox_failures_oldest_open_seconds",
    "inbox_operator_jobs_running",
];

/// Every metric the runtime exports (docs/operations.md).
const METRICS: &[&str] = &[
    "inbox_messages_total",
    "inbox_process_duration_seconds",
    "inbox_handler_duration_seconds",
    "inbox_claim_wait_seconds",
    "inbox_in_flight",
    "inbox_consumer_connected",
    "inbox_database_available",
    "inbox_database_connection_limit",
    "inbox_outbox_pending",
    "inbox_outbox_oldest_pending_seconds",
    "inbox_outbox_dispatched_total",
    "inbox_outbox_dead",
    "inbox_rows",
    "inbox_oldest_row_seconds",
    "inbox_swept_rows_total",
];

/// A loopback address with a free port, for the service's `--http`.
fn free_address() -> Result<String> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| fail(format!("no free port: {e}")))?;
    let address = listener
        .local_addr()
        .map_err(|e| fail(format!("no free port: {e}")))?;
    Ok(address.to_string())
}

/// `GET path` from `address` over HTTP/1.1: the status and the body,
/// within two seconds.
async fn http_get(address: &str, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        let response = String::from_utf8_lossy(&response).into_owned();
        let status = response
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map_or(String::new(), |(_, body)| body.to_owned());
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::other("no answer within 2 s")))
}

fn sh(command: &str) -> Result<String> {
    let output = Command::new("sh")
        .args(["-c", command])
        .output()
        .map_err(|e| fail(format!("{command}: {e}")))?;
    if !output.status.success() {
        return Err(fail(format!(
            "{command}: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Where the row staged during the memory alarm goes.
fn alarm_queue(queue: &str) -> String {
    format!("{queue}.alarm")
}

/// Where the service forwards a `CheckinRecorded` per check-in.
fn forward_queue(queue: &str) -> String {
    format!("{queue}.forward")
}

/// Rows the service's outbox still has to publish.
async fn pending_forwards(settings: &Settings) -> Result<i64> {
    let pool = rabbit_inbox::tools::create_pool(settings)?;
    let count = pool
        .get()
        .await?
        .query_one("SELECT count(*) FROM outbox_messages WHERE dead_at IS NULL", &[])
        .await
        .map(|row| row.get(0))
        // Before the service's first start migrated, there is no table.
        .unwrap_or(0);
    pool.close();
    Ok(count)
}

/// What the forward queue holds, checked against what was published.
#[derive(Debug, Default)]
struct Forwards {
    /// Distinct forward message_ids.
    unique: usize,
    /// Good check-ins with no forward.
    lost: usize,
    /// Good check-ins with two distinct forward message_ids or more.
    doubled: usize,
    /// Forwards of anything but a good check-in.
    leaked: usize,
    /// Deliveries beyond one per distinct forward message_id (allowed).
    copies: usize,
}

/// Takes every message of the forward queue and counts them.
async fn read_forwards(settings: &Settings, queue: &str, published: &Published) -> Result<Forwards> {
    let wire = settings.message_bus.wire;
    let connection = connect(settings).await?;
    let channel = connection.create_channel().await?;
    let mut deliveries = 0;
    let mut ids: HashSet<String> = HashSet::new();
    let mut by_source: HashMap<rabbit_inbox::uuid::Uuid, HashSet<String>> = HashMap::new();
    let mut leaked = 0;
    while let Some(message) = channel
        .basic_get(
            forward_queue(queue).as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await?
    {
        deliveries += 1;
        let delivery = message.delivery;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .unwrap_or_default();
        ids.insert(id.clone());
        match forwarded_source(wire, &delivery) {
            Some(source) if published.good.contains_key(&source) => {
                by_source.entry(source).or_default().insert(id);
            }
            _ => leaked += 1,
        }
    }
    let _ = connection.close(200, "done".into()).await;
    Ok(Forwards {
        unique: ids.len(),
        lost: published
            .good
            .keys()
            .filter(|id| !by_source.contains_key(id))
            .count(),
        doubled: by_source.values().filter(|ids| ids.len() > 1).count(),
        leaked,
        copies: deliveries - ids.len(),
    })
}

/// The check-in a forward was staged for: its `sourceMessageId`, read in
/// `wire`'s format.
fn forwarded_source(
    wire: Wire,
    delivery: &rabbit_inbox::tools::lapin::message::Delivery,
) -> Option<rabbit_inbox::uuid::Uuid> {
    match wire {
        Wire::Inbox => serde_json::from_slice::<common::CheckinRecorded>(&delivery.data)
            .ok()
            .map(|recorded| recorded.source_message_id),
        Wire::Masstransit => {
            let decoded =
                rabbit_inbox::internal::masstransit::decode(&delivery.properties, &delivery.data, false)
                    .ok()?;
            let is_recorded = decoded.context.message_types.first().map(String::as_str)
                == Some(<common::masstransit::CheckinRecorded as rabbit_inbox::IntegrationEvent>::TYPE);
            let recorded: common::masstransit::CheckinRecorded =
                serde_json::from_slice(&decoded.message).ok()?;
            is_recorded.then_some(recorded.source_message_id)
        }
    }
}

fn service_log_path() -> std::path::PathBuf {
    std::env::temp_dir().join("inbox-fault-suite-service.log")
}

/// SIGTERM, and the exit code once it has drained.
fn stop_service(child: Child) -> Result<Option<i32>> {
    sh(&format!("kill -TERM {}", child.id()))?;
    let output = child.wait_with_output().map_err(|e| fail(format!("wait: {e}")))?;
    Ok(output.status.code())
}

/// The service declares its queues at start; publishing waits for that.
async fn wait_for_queue(settings: &Settings, queue: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if ready(settings, queue).await.is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(fail("the service did not declare its queue in 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A connection to the first broker (or cluster node) that takes one, as
/// the runtime connects (TLS included).
async fn connect(settings: &Settings) -> Result<Arc<Connection>> {
    // Briefly: the callers try again themselves, or report a broker down.
    let mut settings = settings.clone();
    settings.message_bus.connect_timeout = Duration::from_secs(3);
    Ok(tools::connect(&settings, "fault suite").await?)
}

/// Messages ready in `queue`.
async fn ready(settings: &Settings, queue: &str) -> Result<u32> {
    Ok(probe(settings, queue).await?.message_count())
}

/// `queue` as the broker sees it (a passive declare).
async fn probe(settings: &Settings, queue: &str) -> Result<rabbit_inbox::tools::lapin::Queue> {
    let connection = connect(settings).await?;
    let channel = connection.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let found = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await?;
    let _ = connection.close(200, "done".into()).await;
    Ok(found)
}

/// Publishes the workload, riding through broker restarts: a publish that
/// fails is repeated (a duplicate at worst, which the inbox absorbs).
async fn publish_all(settings: &Settings, queue: &str) -> Result<Published> {
    let wire = settings.message_bus.wire;
    let mut random = Seeded::new(0x5eed_cafe_f00d_0001);
    let mut published = Published::default();
    let mut sent: Vec<Message<AttendeeCheckedIn>> = Vec::new();
    let mut publisher: Option<(Arc<Connection>, AmqpPublisher)> = None;
    let total = EVENTS + FAILING + 6;
    for i in 0..total {
        let item = if i % (EVENTS / FAILING) == 7 && published.failing.len() < FAILING {
            let message = Message::new(AttendeeCheckedIn {
                attendee_id: -1 - random.below(100) as i64,
                session_id: 1 + random.below(10) as i64,
            });
            published.failing.insert(message.id);
            Item::Event(message)
        } else if i % (EVENTS / 6) == 3 && published.malformed.len() < 6 {
            let marker = format!("malformed-{}", published.malformed.len());
            published.malformed.insert(marker.clone());
            let kind = published.malformed.len() - 1;
            Item::Malformed(Box::new(match wire {
                Wire::Inbox => malformed(kind, &marker),
                Wire::Masstransit => malformed_envelope(kind, &marker),
            }))
        } else if !sent.is_empty() && random.chance(DUP_RATIO) {
            Item::Event(sent[random.below(sent.len() as u64) as usize].clone())
        } else {
            let message = Message::new(AttendeeCheckedIn {
                attendee_id: 1 + random.below(1000) as i64,
                session_id: 1 + random.below(20) as i64,
            });
            published.good.insert(message.id, message.event.clone());
            sent.push(message.clone());
            Item::Event(message)
        };
        // Until the broker confirms it.
        loop {
            if publisher.is_none() {
                match connect(settings).await {
                    Ok(connection) => match AmqpPublisher::new(&connection, "").await {
                        Ok(p) => publisher = Some((connection, p.with_wire(wire))),
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    },
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
                continue;
            }
            let Some((_, p)) = &publisher else { continue };
            let result = match &item {
                Item::Event(message) => publish_event(p, queue, message).await,
                Item::Malformed(raw) => p.publish_raw(queue, raw.0.clone(), &raw.1).await,
            };
            match result {
                Ok(()) => break,
                Err(_) => {
                    publisher = None;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        published.count += 1;
        // About 5,000 in 12 s: the faults land while messages flow.
        if i % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(120)).await;
        }
    }
    if let Some((connection, _)) = publisher {
        let _ = connection.close(200, "done".into()).await;
    }
    Ok(published)
}

enum Item {
    Event(Message<AttendeeCheckedIn>),
    Malformed(Box<(BasicProperties, Vec<u8>)>),
}

/// Six kinds of broken delivery, each carrying `marker` in its body.
fn malformed(kind: usize, marker: &str) -> (BasicProperties, Vec<u8>) {
    let id = rabbit_inbox::uuid::Uuid::now_v7().to_string();
    let json = BasicProperties::default().with_content_type("application/json".into());
    let body = format!(r#"{{"marker": "{marker}"}}"#).into_bytes();
    match kind {
        0 => (json.with_type("AttendeeCheckedIn".into()), body),
        1 => (
            json.with_message_id("not-a-uuid".into())
                .with_type("AttendeeCheckedIn".into()),
            body,
        ),
        2 => (json.with_message_id(id.as_str().into()), body),
        3 => (
            json.with_message_id(id.as_str().into())
                .with_type("AttendeeCheckedIn".into()),
            body,
        ),
        4 => (
            BasicProperties::default()
                .with_content_type("text/plain".into())
                .with_message_id(id.as_str().into())
                .with_type("AttendeeCheckedIn".into()),
            body,
        ),
        _ => (
            json.with_message_id(id.as_str().into())
                .with_type("AttendeeCheckedIn".into()),
            format!(r#"{{"attendee_id": "{marker}", "session_id": 1}}"#).into_bytes(),
        ),
    }
}

/// Publishes a check-in in the publisher's wire: to `queue` in this
/// library's format, or as a MassTransit producer publishes its contract
/// (the same id and fields) to the type's exchange.
async fn publish_event(
    publisher: &AmqpPublisher,
    queue: &str,
    message: &Message<AttendeeCheckedIn>,
) -> rabbit_inbox::Result<()> {
    match publisher.wire() {
        Wire::Inbox => publisher.publish(queue, message).await,
        Wire::Masstransit => {
            let contract = Message::with_id(
                message.id,
                common::masstransit::AttendeeCheckedIn {
                    attendee_id: message.event.attendee_id,
                    session_id: message.event.session_id,
                },
            );
            publisher.publish(queue, &contract).await
        }
    }
}

/// Six kinds of broken MassTransit delivery, each carrying `marker` in
/// its body, each one MassTransit would send to `Q_error`: no `messageId`,
/// one that is not a GUID, no `message`, an AMQP `message_id` that is not
/// the envelope's, a body that is not JSON, a message whose fields do not
/// fit the contract. All persistent, as MassTransit publishes: a classic
/// queue drops a transient message when the broker restarts.
fn malformed_envelope(kind: usize, marker: &str) -> (BasicProperties, Vec<u8>) {
    let id = rabbit_inbox::uuid::Uuid::now_v7();
    let envelope = |id: &str, types: &str, message: &str| {
        format!(
            r#"{{"messageId": "{id}", "messageType": [{types}], "message": {message}, "marker": "{marker}"}}"#
        )
        .into_bytes()
    };
    let checked_in = r#""urn:message:Conference.Contracts:AttendeeCheckedIn""#;
    let good = r#"{"attendeeId": 1, "sessionId": 1}"#;
    let properties = rabbit_inbox::internal::masstransit::properties(id);
    match kind {
        0 => (
            BasicProperties::default()
                .with_content_type(rabbit_inbox::internal::masstransit::ENVELOPE_CONTENT_TYPE.into())
                .with_delivery_mode(2),
            format!(r#"{{"messageType": [{checked_in}], "message": {good}, "marker": "{marker}"}}"#)
                .into_bytes(),
        ),
        1 => (
            BasicProperties::default()
                .with_content_type(rabbit_inbox::internal::masstransit::ENVELOPE_CONTENT_TYPE.into())
                .with_delivery_mode(2),
            envelope("not-a-guid", checked_in, good),
        ),
        // No message: MassTransit sends it to Q_error. (No type would go to
        // Q_skipped, as MassTransit skips it.)
        2 => (
            properties,
            format!(r#"{{"messageId": "{id}", "messageType": [{checked_in}], "marker": "{marker}"}}"#)
                .into_bytes(),
        ),
        // A message that is no object of the type (MassTransit's
        // deserializer throws, and the message faults).
        3 => (properties, envelope(&id.to_string(), checked_in, "[1, 2]")),
        // Not JSON at all. (Another content type is no fault: MassTransit
        // reads it as the envelope.)
        4 => (properties, format!("not json {marker}").into_bytes()),
        _ => (
            properties,
            envelope(
                &id.to_string(),
                checked_in,
                &format!(r#"{{"attendeeId": "{marker}", "sessionId": 1}}"#),
            ),
        ),
    }
}

/// Waits until the main and retry queues are empty and the error queue
/// holds every failing and malformed message; the service dying on its own
/// is a failure.
async fn wait_until_settled(
    suite: &Suite,
    published: &Published,
    started: Instant,
    child: &mut Child,
) -> Result<()> {
    let expected_errors = (published.failing.len() + published.malformed.len()) as u32;
    let mut last_report = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(fail(format!("the service exited on its own ({status})")));
        }
        let mut busy = ready(&suite.settings, &suite.queue).await?;
        for tier in 1..=suite.settings.failure.delays.len() {
            busy += ready(&suite.settings, &suite.wire.retry_queue(&suite.queue, tier)).await?;
        }
        let errors = suite.set_aside(&suite.wire.error_queue(&suite.queue)).await?;
        if last_report.elapsed() > Duration::from_secs(10) {
            suite.say(&format!(
                "settling: {busy} waiting, {errors} of {expected_errors} in the error queue"
            ));
            last_report = Instant::now();
        }
        // The outbox too: what committed is forwarded before the checks.
        busy += u32::try_from(pending_forwards(&suite.settings).await?).unwrap_or(u32::MAX);
        if busy == 0 && errors >= expected_errors {
            // Settled as far as the broker shows; unacked ones would show
            // after the service stops, and the checks count them.
            tokio::time::sleep(Duration::from_secs(1)).await;
            return Ok(());
        }
        if started.elapsed() > suite.deadline() {
            return Err(fail(format!(
                "not settled after {:?}: {busy} waiting, {errors} of {expected_errors} in the error queue",
                suite.deadline()
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn check(
    suite: &Suite,
    published: &Published,
    poison: rabbit_inbox::uuid::Uuid,
    ok_exit: bool,
) -> Result<bool> {
    let pool = rabbit_inbox::tools::create_pool(&suite.settings)?;
    let db = pool.get().await?;
    let inbox_ids: HashSet<rabbit_inbox::uuid::Uuid> = db
        .query(
            "SELECT message_id FROM inbox_messages WHERE consumer = $1",
            &[&suite.queue],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let checkins: HashMap<i64, i64> = db
        .query("SELECT attendee_id, checkins FROM attendee_checkins", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let attendance: HashMap<i64, i64> = db
        .query("SELECT session_id, attendees FROM session_attendance", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    // What the unique good events must have added up to.
    let mut want_checkins: HashMap<i64, i64> = HashMap::new();
    let mut want_attendance: HashMap<i64, i64> = HashMap::new();
    for event in published.good.values() {
        *want_checkins.entry(event.attendee_id).or_default() += 1;
        *want_attendance.entry(event.session_id).or_default() += 1;
    }
    let (mut lost, mut duplicated) = (0i64, 0i64);
    for key in want_checkins
        .keys()
        .chain(checkins.keys())
        .collect::<HashSet<_>>()
    {
        let diff = checkins.get(key).copied().unwrap_or(0) - want_checkins.get(key).copied().unwrap_or(0);
        if diff > 0 {
            duplicated += diff;
        } else {
            lost -= diff;
        }
    }
    let effects: i64 = checkins.values().sum();
    let attendance_agrees = attendance == want_attendance;
    let good_ids: HashSet<_> = published.good.keys().copied().collect();
    let rows_match = inbox_ids == good_ids;

    // The error queue: every failing event and every malformed delivery.
    let connection = connect(&suite.settings).await?;
    let channel = connection.create_channel().await?;
    let error_queue = suite.wire.error_queue(&suite.queue);
    let (mut in_error, mut error_ids, mut markers) = (0u32, HashSet::new(), HashSet::new());
    let mut poison_death = None;
    while let Some(message) = channel
        .basic_get(error_queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await?
    {
        in_error += 1;
        let delivery = message.delivery;
        if let Some(id) = delivery.properties.message_id()
            && let Ok(id) = rabbit_inbox::uuid::Uuid::try_parse(id.as_str())
        {
            if id == poison {
                // Set aside by the broker's delivery limit, or, on a queue
                // without one, by the runtime's count.
                poison_death = death_reason(&delivery.properties).or_else(|| {
                    let handler = delivery
                        .properties
                        .headers()
                        .as_ref()?
                        .inner()
                        .get("x-inbox-handler")?;
                    match handler {
                        rabbit_inbox::tools::lapin::types::AMQPValue::LongString(text) => {
                            Some(String::from_utf8_lossy(text.as_bytes()).replace(' ', "_"))
                        }
                        _ => None,
                    }
                });
            }
            error_ids.insert(id);
        }
        let body = String::from_utf8_lossy(&delivery.data);
        if let Some(marker) = published.malformed.iter().find(|m| body.contains(m.as_str())) {
            markers.insert(marker.clone());
        }
    }
    // With --ops, the drainer moved them into the failures table: one row
    // each, and none left in the queue.
    let mut drained = None;
    if suite.ops.is_some() {
        let rows = db
            .query(
                "SELECT message_id, body, headers FROM inbox_failures WHERE queue = $1 AND kind = 'error'",
                &[&suite.queue],
            )
            .await?;
        let expected_rows = published.failing.len() + published.malformed.len() + 1;
        drained = Some((rows.len(), expected_rows, in_error));
        in_error = u32::try_from(rows.len()).unwrap_or(u32::MAX);
        for row in &rows {
            let id: Option<rabbit_inbox::uuid::Uuid> = row.get(0);
            let body: Vec<u8> = row.get(1);
            let headers: serde_json::Value = row.get(2);
            if let Some(id) = id {
                if id == poison {
                    poison_death = headers["x-death"][0]["reason"]
                        .as_str()
                        .map(str::to_owned)
                        .or_else(|| headers["x-inbox-handler"].as_str().map(|h| h.replace(' ', "_")));
                }
                error_ids.insert(id);
            }
            let body = String::from_utf8_lossy(&body);
            if let Some(marker) = published.malformed.iter().find(|m| body.contains(m.as_str())) {
                markers.insert(marker.clone());
            }
        }
    }
    let failing_in_error = published.failing.iter().all(|id| error_ids.contains(id));
    let malformed_in_error = markers == published.malformed;
    let forwards = read_forwards(&suite.settings, &suite.queue, published).await?;
    let mut waiting = ready(&suite.settings, &suite.queue).await?;
    for tier in 1..=suite.settings.failure.delays.len() {
        waiting += ready(&suite.settings, &suite.wire.retry_queue(&suite.queue, tier)).await?;
    }

    let node_kills = if suite.cluster {
        format!(" node_kills={}", suite.node_kills)
    } else {
        String::new()
    };
    println!(
        "kills={} db_restarts={} broker_restarts={} published={} unique={} effects={effects} lost={lost} duplicated={duplicated} error_queue={in_error} crashes={} forward_unique={} forward_lost={} forward_doubled={} forward_leaked={} forward_copies={}{node_kills}",
        suite.kills,
        suite.db_restarts,
        suite.broker_restarts,
        published.count,
        published.good.len(),
        suite.crashes,
        forwards.unique,
        forwards.lost,
        forwards.doubled,
        forwards.leaked,
        forwards.copies,
    );
    let mut checks = vec![
        (
            drained.is_none_or(|(rows, expected, left)| rows == expected && left == 0),
            "with --ops: one failures row per failed message, and the error queue drained",
        ),
        (lost == 0, "no effect lost"),
        (duplicated == 0, "no effect applied twice"),
        (attendance_agrees, "session_attendance agrees"),
        (
            rows_match,
            "every inbox row has its effects and every effect its row",
        ),
        (failing_in_error, "every failing event is in the error queue"),
        (
            malformed_in_error,
            "every malformed delivery is in the error queue",
        ),
        (waiting == 0, "the main and retry queues are empty"),
        (ok_exit, "SIGTERM drained and exited 0"),
        (forwards.lost == 0, "every check-in was forwarded"),
        (forwards.doubled == 0, "no check-in was forwarded under two ids"),
        (forwards.leaked == 0, "nothing refused or malformed was forwarded"),
        (
            poison_death.as_deref() == Some("delivery_limit")
                && if suite.wire == Wire::Masstransit {
                    // MassTransit's queues limit no deliveries: the runtime
                    // sets it aside on its 20th delivery, the 19 before it
                    // each a crash.
                    suite.crashes == DELIVERY_LIMIT - 1
                } else {
                    suite.crashes > DELIVERY_LIMIT
                },
            "the crash-looping message is in the error queue, set aside by the delivery limit",
        ),
        (
            suite.kills >= KILLS
                && if suite.cluster {
                    suite.node_kills == 2
                } else {
                    suite.db_restarts == 1 && suite.broker_restarts == 1 && suite.alarms == 1
                },
            "every fault happened",
        ),
    ];
    if !suite.cluster {
        checks.push((
            suite
                .service_logged()
                .contains("the broker blocked the connection"),
            "the service logged the broker's alarm",
        ));
    }
    let health = suite.health.iter().map(|(ok, what)| (*ok, what.as_str()));
    let (mut failed, mut passed) = (0, 0);
    for (ok, what) in checks.into_iter().chain(health) {
        if ok {
            passed += 1;
        } else {
            eprintln!("fault_suite: FAILED: {what}");
            failed += 1;
        }
    }
    println!("fault_suite: {passed} passed, {failed} failed");
    // Clean up what this run created.
    let wire = suite.wire;
    for name in [
        suite.queue.clone(),
        wire.retry_queue(&suite.queue, 1),
        wire.retry_queue(&suite.queue, 2),
        error_queue,
        wire.skipped_queue(&suite.queue),
        forward_queue(&suite.queue),
        alarm_queue(&suite.queue),
    ] {
        let _ = channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await;
        if wire == Wire::Masstransit {
            // MassTransit's endpoints have an exchange of their name.
            let _ = channel
                .exchange_delete(name.as_str().into(), Default::default())
                .await;
        }
    }
    let _ = connection.close(200, "done".into()).await;
    drop(db);
    pool.close();
    Ok(failed == 0)
}

/// Declares receive endpoint `queue` as MassTransit 8.5 does by default
/// (RabbitMqReceiveEndpointBuilder.cs, RabbitMqErrorSettings.cs): `Q` and
/// `Q_error` classic and durable with no arguments, each behind a fanout
/// exchange of its name, and the check-in's exchange bound to `Q`'s.
async fn declare_as_masstransit(settings: &Settings, queue: &str, skipped_too: bool) -> Result<()> {
    use rabbit_inbox::tools::lapin::ExchangeKind;
    use rabbit_inbox::tools::lapin::options::ExchangeDeclareOptions;
    let connection = connect(settings).await?;
    let channel = connection.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let fanout = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let error = Wire::Masstransit.error_queue(queue);
    let skipped = Wire::Masstransit.skipped_queue(queue);
    let mut names = vec![queue, error.as_str()];
    if skipped_too {
        names.push(skipped.as_str());
    }
    for name in names {
        channel
            .queue_declare(name.into(), durable, FieldTable::default())
            .await?;
        channel
            .exchange_declare(name.into(), ExchangeKind::Fanout, fanout, FieldTable::default())
            .await?;
        channel
            .queue_bind(
                name.into(),
                name.into(),
                "".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await?;
    }
    let checked_in = <common::masstransit::AttendeeCheckedIn as rabbit_inbox::IntegrationEvent>::TYPE;
    channel
        .exchange_declare(
            checked_in.into(),
            ExchangeKind::Fanout,
            fanout,
            FieldTable::default(),
        )
        .await?;
    channel
        .exchange_bind(
            queue.into(),
            checked_in.into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await?;
    let _ = connection.close(200, "declared".into()).await;
    Ok(())
}

/// The reason of the newest `x-death` entry the broker stamped.
fn death_reason(properties: &BasicProperties) -> Option<String> {
    use rabbit_inbox::tools::lapin::types::AMQPValue;
    let AMQPValue::FieldArray(deaths) = properties.headers().as_ref()?.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(newest) = deaths.as_slice().first()? else {
        return None;
    };
    match newest.inner().get("reason")? {
        AMQPValue::LongString(reason) => Some(String::from_utf8_lossy(reason.as_bytes()).into_owned()),
        _ => None,
    }
}
