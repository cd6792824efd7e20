//! `--service`: the example service as users run it, its own process,
//! drained from outside, beside the hand-written loop and the broker's
//! limit, interleaved round by round.
//!
//! Each round runs, in turn, on the same pre-published workload:
//!
//! - `raw` (consume and ack, no database) in this process at the service's
//!   default prefetch (32), `raw_64` at 64, and `raw_masstransit` at 32 on
//!   MassTransit's messages as a MassTransit producer publishes them, from
//!   a classic queue as the service's on that wire (the broker's limit
//!   for that wire);
//! - `handwritten` (the loop) in this process at [`LOOP_PREFETCH`];
//! - the example service (`examples/checkin_service.rs`, built in release)
//!   at its defaults (`service_default`), with `--batch-size 1`
//!   (`service_one`), with `--wire masstransit` (`service_masstransit`),
//!   at the defaults before Performance IV (`service_16_8`: prefetch 16,
//!   batches of 8) and with a wider window (`service_64_16`);
//! - with `--against REV[,REV...]`, each revision's example service with
//!   `--batch-size 1` (`REV:one`), built in a worktree of its own under
//!   `target/against/`: the one-message path across revisions.
//!
//! A service run: the service started once to declare its queues, then
//! stopped; the queue filled; the service started again. The clock starts
//! when the queue's depth first drops and stops when every unique message's
//! inbox row is there; the service's CPU (user + system, from
//! /proc/PID/stat) is read at both ends, as PostgreSQL's and RabbitMQ's.
//! The rounds end with a `goal` line per target: `service_one` at least
//! the loop's rate at no more of its CPU a message, `service_default` at
//! least 2.0 × the loop and 70% of `raw`, MassTransit's wire within 5% of
//! the inbox wire.
//!
//! `--retention ROWS` then runs the service on inboxes holding ROWS rows
//! (template databases made once and kept, of random ids and of ids as
//! MassTransit makes them), with nothing due and with every row due (the
//! sweep running as it consumes), each against an empty inbox and a
//! workload of the same kind of ids: see [`retention`].

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rabbit_inbox::tools::lapin::options::QueueDeclareOptions;
use rabbit_inbox::tools::lapin::types::FieldTable;
use rabbit_inbox::tools::lapin::{Channel, Connection};
use rabbit_inbox::{QueueKind, QueueSettings, Settings, Wire};

use super::{CpuSplit, Error, Measured, Pool, Result, Workload};

/// The loop's prefetch: where it runs best here. It runs a transaction per
/// delivery in flight, and at 32 (the service's default window) its
/// PostgreSQL spends more CPU a message on as many backends competing for
/// two cores than at 16, and drains no faster: comparing the service with
/// the loop at 32 would flatter the service.
const LOOP_PREFETCH: u16 = 16;

/// The database each service run gets afresh.
const SERVICE_DATABASE: &str = "inbox_service_bench";

/// One example service binary and what it was built from.
#[derive(Debug, Clone)]
pub(super) struct Build {
    /// `HEAD` (the checkout) or a short revision.
    pub(super) label: String,
    binary: PathBuf,
    /// Where it runs from: its own checkout, for its `config/`.
    root: PathBuf,
}

/// What one service run is given.
#[derive(Debug, Clone)]
pub(super) struct Run {
    pub(super) name: String,
    pub(super) build: Build,
    pub(super) args: Vec<String>,
    pub(super) wire: Wire,
    /// Settings given as `INBOX__…` variables.
    pub(super) env: Vec<(String, String)>,
    /// The database it runs on.
    pub(super) database: Database,
    /// How the workload's message ids are made.
    pub(super) ids: Ids,
}

/// The database a service run starts from.
#[derive(Debug, Clone)]
pub(super) enum Database {
    /// Made afresh, empty.
    Empty,
    /// A fresh copy of this template (an inbox already holding rows), for
    /// a run that changes them (a sweep).
    CopyOf(String),
    /// This template itself, for a run that only adds rows: its own
    /// queue's, deleted after it, and the example's tables emptied before
    /// it (copying a hundred million rows would take minutes a run).
    Template(String),
}

/// How a workload's message ids are made, and so where in the inbox's
/// primary key each new row goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ids {
    /// As this crate makes them (`Message::new`: version 7, time first):
    /// every new row at the key's right end.
    TimeOrdered,
    /// Random (version 4) UUIDs: every new row anywhere in the key.
    Random,
    /// As MassTransit's `NewId.NextGuid()` makes them ([`NewIds`]).
    NewId,
}

/// Message ids laid out as MassTransit's `NewId.NextGuid()` lays them out
/// (NewId's `NewIdGenerator`, which MassTransit 8 uses for every message
/// id): the producer's worker id and a per-tick sequence come first, the
/// .NET tick count (100 ns since 0001-01-01) last, low 16 bits before the
/// rest, so that in PostgreSQL's byte order a producer's ids follow its
/// clock's low bits, not its time.
#[derive(Debug, Default)]
pub(super) struct NewIds {
    last_tick: u64,
    sequence: u16,
}

impl NewIds {
    /// This process's stand-in for a host's network address.
    const WORKER: [u8; 6] = [0x52, 0x75, 0x73, 0x74, 0x0b, 0x17];
    /// .NET ticks at the Unix epoch.
    const UNIX_EPOCH_TICKS: u64 = 621_355_968_000_000_000;

    pub(super) fn next(&mut self) -> uuid::Uuid {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|since| since.as_nanos() as u64 / 100)
            .unwrap_or_default();
        let tick = Self::UNIX_EPOCH_TICKS + now;
        // As NewIdGenerator: a new tick restarts the sequence; a sequence
        // about to roll over takes the next tick.
        if tick > self.last_tick {
            (self.last_tick, self.sequence) = (tick, 0);
        } else if self.sequence == u16::MAX {
            (self.last_tick, self.sequence) = (self.last_tick + 1, 0);
        }
        let [high, low] = self.sequence.to_be_bytes();
        self.sequence += 1;
        let (w, t) = (Self::WORKER, self.last_tick.to_be_bytes());
        uuid::Uuid::from_bytes([
            w[4], w[5], low, high, w[2], w[3], w[0], w[1], t[6], t[7], t[0], t[1], t[2], t[3], t[4], t[5],
        ])
    }
}

/// The workspace's root: where `cargo` builds and the worktrees go from.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"))
}

/// Runs `command`, failing with `what` and its status unless it succeeds.
fn succeed(command: &mut Command, what: &str) -> Result<()> {
    let status = command
        .status()
        .map_err(|e| Error::from(format!("{what}: {e}")))?;
    match status.success() {
        true => Ok(()),
        false => Err(Error::from(format!("{what}: {status}"))),
    }
}

/// `cargo build --release --example checkin_service`, without the variables
/// cargo set for this bench's own process (`CARGO_MANIFEST_DIR`,
/// `CARGO_PKG_*`, ...): build scripts that watch them (ring's does) would
/// see them change, and this build and the next `cargo bench` would each
/// rebuild the dependency tree.
fn cargo_build_example() -> Command {
    let mut command = Command::new("cargo");
    command.args(["build", "--release", "--example", "checkin_service"]);
    let set_for_a_target = |name: &str| {
        name.starts_with("CARGO_PKG_")
            || matches!(
                name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
            )
    };
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_for_a_target) {
            command.env_remove(name);
        }
    }
    command
}

/// The example service of this checkout, built in release.
pub(super) fn build_head() -> Result<Build> {
    let root = workspace();
    eprintln!("service: building the example service (release)");
    succeed(
        cargo_build_example().current_dir(&root),
        "cargo build --release --example checkin_service",
    )?;
    Ok(Build {
        label: "HEAD".into(),
        binary: target_dir().join("release/examples/checkin_service"),
        root,
    })
}

/// The example service of `revision`, built in release in a worktree of
/// its own (`target/against/REV`), with a target directory shared by every
/// revision built so, and copied out of it (the next build overwrites it).
pub(super) fn build_revision(revision: &str) -> Result<Build> {
    let output = Command::new("git")
        .args(["rev-parse", "--short", &format!("{revision}^{{commit}}")])
        .current_dir(workspace())
        .output()?;
    if !output.status.success() {
        return Err(Error::from(format!("--against: no revision `{revision}`")));
    }
    let label = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let against = target_dir().join("against");
    let tree = against.join(&label);
    if !tree.exists() {
        succeed(
            Command::new("git")
                .args(["worktree", "add", "--detach", "--force"])
                .arg(&tree)
                .arg(&label)
                .current_dir(workspace()),
            "git worktree add",
        )?;
    }
    eprintln!("service: building {label}'s example service (release)");
    succeed(
        cargo_build_example()
            .env("CARGO_TARGET_DIR", against.join("target"))
            .current_dir(&tree),
        &format!("building {label}"),
    )?;
    let binary = against.join(format!("checkin_service-{label}"));
    std::fs::copy(against.join("target/release/examples/checkin_service"), &binary)?;
    Ok(Build {
        label,
        binary,
        root: tree,
    })
}

/// A running example service.
struct Service {
    child: Child,
}

impl Service {
    fn start(run: &Run, queue: &str, settings: &Settings) -> Result<Self> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(target_dir().join("service-bench.log"))?;
        let child = Command::new(&run.build.binary)
            .args(["--queue", queue])
            .args(&run.args)
            .env("DATABASE_URL", &settings.database.url)
            .env("AMQP_URL", &settings.message_bus.amqp_urls[0])
            // Its own revision's settings files (cargo gives this process
            // the checkout's).
            .env("INBOX_CONFIG_DIR", run.build.root.join("config"))
            .envs(run.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&run.build.root)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| Error::from(format!("starting {}: {e}", run.build.binary.display())))?;
        Ok(Self { child })
    }

    /// Waits until the service consumes `queue`. Asking for a queue that
    /// is not there yet closes the channel asked on: each ask has its own.
    async fn consuming(&mut self, connection: &Connection, queue: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Err(Error::from(format!(
                    "the example service ended at start ({status}): see target/service-bench.log"
                )));
            }
            let channel = connection.create_channel().await?;
            if let Ok((_, consumers)) = depth(&channel, queue).await {
                channel.close(200, "asked".into()).await?;
                if consumers > 0 {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(Error::from("the example service did not consume within 60 s"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Its CPU time so far, in seconds.
    fn cpu(&self) -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).ok()?;
        super::process_cpu(&stat, false)
    }

    /// Stops it with SIGTERM, as an orchestrator would, and waits.
    async fn stop(mut self) -> Result<()> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                self.child.kill()?;
                self.child.wait()?;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}

/// Ready messages in `queue` and its consumers (a passive declare:
/// RabbitMQ's own count, without the management plugin).
async fn depth(channel: &Channel, queue: &str) -> Result<(u32, u32)> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await?;
    Ok((declared.message_count(), declared.consumer_count()))
}

/// Runs `run` once on `workload`: the service drains it from outside.
pub(super) async fn drain(
    run: &Run,
    settings: &Settings,
    connection: &Connection,
    workload: &Workload,
) -> Result<Measured> {
    let mut settings = settings.clone();
    let queue = format!("bench.service.{}", uuid::Uuid::now_v7());
    match &run.database {
        Database::Empty => {
            settings.database.set_dbname(SERVICE_DATABASE)?;
            crate::common::recreate_database(&settings, SERVICE_DATABASE).await?;
        }
        Database::CopyOf(template) => {
            settings.database.set_dbname(SERVICE_DATABASE)?;
            copy_database(&settings, template, SERVICE_DATABASE).await?;
        }
        Database::Template(template) => {
            settings.database.set_dbname(template)?;
            let pool = rabbit_inbox::tools::create_pool(&settings)?;
            pool.get()
                .await?
                .batch_execute("TRUNCATE attendee_checkins, session_attendance")
                .await?;
        }
    }
    let channel = connection.create_channel().await?;

    // Declared by the service itself, as its revision declares it.
    let mut service = Service::start(run, &queue, &settings)?;
    service.consuming(connection, &queue).await?;
    service.stop().await?;
    match run.wire {
        Wire::Inbox => super::prefill(connection, &queue, workload).await?,
        Wire::Masstransit => super::prefill_masstransit(connection, workload).await?,
    }
    let pool = rabbit_inbox::tools::create_pool(&settings)?;
    checkpoint(&pool).await?;

    let count = workload.messages.len();
    let mut service = Service::start(run, &queue, &settings)?;
    let measured = measure(&mut service, &channel, &pool, &queue, count, workload.unique).await;
    service.stop().await?;
    let measured = measured?;
    let measured = Measured {
        effects_ok: super::effects_ok(&pool, workload.unique).await?,
        ..measured
    };
    if let Database::Template(_) = run.database {
        // The template as it was: later runs copy it.
        pool.get()
            .await?
            .batch_execute(&format!(
                "DELETE FROM inbox_messages WHERE consumer = '{queue}';
                 TRUNCATE attendee_checkins, session_attendance"
            ))
            .await?;
    }
    delete_topology(&channel, run.wire, &queue, settings.failure.delays.len()).await?;
    channel.close(200, "done".into()).await?;
    drop(pool);
    Ok(measured)
}

/// From the queue's first drop to the last unique message's inbox row.
async fn measure(
    service: &mut Service,
    channel: &Channel,
    pool: &Pool,
    queue: &str,
    count: usize,
    unique: usize,
) -> Result<Measured> {
    let deadline = Instant::now() + Duration::from_secs(600);
    let late = || Error::from("the example service did not drain the queue within 10 minutes");
    while depth(channel, queue).await?.0 as usize >= count {
        if service.child.try_wait()?.is_some() || Instant::now() > deadline {
            return Err(late());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (started, cpu_before, service_before) = (Instant::now(), CpuSplit::sample(), service.cpu());
    while depth(channel, queue).await?.0 > 0 {
        if Instant::now() > deadline {
            return Err(late());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let client = pool.get().await?;
    // The queue's rows, through the primary key: the inbox may hold
    // millions of others.
    let rows = client
        .prepare("SELECT count(*) FROM inbox_messages WHERE consumer = $1")
        .await?;
    while client.query_one(&rows, &[&queue]).await?.get::<_, i64>(0) < unique as i64 {
        if Instant::now() > deadline {
            return Err(late());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = match (cpu_before, CpuSplit::sample(), service_before, service.cpu()) {
        (Some(before), Some(after), Some(service_before), Some(service_after)) => {
            let mut split = after.since(&before, count);
            split.service = (service_after - service_before) * 1e6 / count as f64;
            Some(split)
        }
        _ => None,
    };
    Ok(Measured {
        seconds,
        p50: Duration::ZERO,
        p99: Duration::ZERO,
        effects_ok: true,
        cpu,
    })
}

/// The runs of a round, in the order they take turns: this checkout's
/// service at its defaults, with one message per transaction and on
/// MassTransit's wire, then each `against` revision's at one message per
/// transaction.
pub(super) fn runs(head: &Build, against: &[Build]) -> Vec<Run> {
    let run = |name: String, build: &Build, args: &[&str], wire| Run {
        name,
        build: build.clone(),
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        wire,
        env: Vec::new(),
        database: Database::Empty,
        ids: Ids::TimeOrdered,
    };
    let mut runs = vec![
        run("service_default".into(), head, &[], Wire::Inbox),
        run("service_one".into(), head, &["--batch-size", "1"], Wire::Inbox),
        run(
            "service_masstransit".into(),
            head,
            &["--wire", "masstransit"],
            Wire::Masstransit,
        ),
        // A wider window and larger batches: the lever in-process runs
        // found for the defaults.
        // The defaults before Performance IV, and a wider window than
        // today's: what the default prefetch buys either way.
        run(
            "service_16_8".into(),
            head,
            &["--prefetch", "16", "--batch-size", "8"],
            Wire::Inbox,
        ),
        run(
            "service_64_16".into(),
            head,
            &["--prefetch", "64", "--batch-size", "16"],
            Wire::Inbox,
        ),
    ];
    for build in against {
        runs.push(run(
            format!("{}:one", build.label),
            build,
            &["--batch-size", "1"],
            Wire::Inbox,
        ));
    }
    runs
}

/// The in-process scenarios' queue, declared as the runtime declares one.
fn loop_queue(name: &str, prefetch: u16) -> QueueSettings {
    let mut queue = QueueSettings::new(format!("bench.{name}.{}", uuid::Uuid::now_v7()));
    queue.prefetch = prefetch;
    queue
}

/// Every queue kept for `queue` on `wire`, and on MassTransit's the
/// exchanges of the same names (the type's exchange stays, as a MassTransit
/// producer's would).
async fn delete_topology(channel: &Channel, wire: Wire, queue: &str, tiers: usize) -> Result<()> {
    for name in super::topology(wire, queue, tiers) {
        channel
            .queue_delete(name.as_str().into(), Default::default())
            .await?;
    }
    if wire == Wire::Masstransit {
        for name in [
            wire.error_queue(queue),
            wire.skipped_queue(queue),
            queue.to_owned(),
        ] {
            channel
                .exchange_delete(name.as_str().into(), Default::default())
                .await?;
        }
    }
    Ok(())
}

/// A checkpoint before the run, so that no timed one starts inside it
/// (see `settle_database`).
async fn checkpoint(pool: &Pool) -> Result<()> {
    if let Err(e) = pool.get().await?.batch_execute("CHECKPOINT").await {
        eprintln!("service: no checkpoint before the run ({e}); its figures may include one");
    }
    Ok(())
}

/// What `--service` is asked for.
pub(super) struct Options {
    pub(super) count: usize,
    pub(super) dup_ratio: f64,
    pub(super) repeat: usize,
    pub(super) against: Vec<String>,
}

/// `--service`: every round, the loop, the limit and each service run in
/// turn; then each one's medians, its ratios and the goals.
pub(super) async fn compare(options: &Options) -> Result<()> {
    let head = build_head()?;
    let against = options
        .against
        .iter()
        .map(|revision| build_revision(revision))
        .collect::<Result<Vec<_>>>()?;
    let runs = runs(&head, &against);

    let mut settings = crate::common::settings()?.into_inner();
    settings.database.set_dbname(super::DATABASE)?;
    let prefetch = QueueSettings::new("defaults").prefetch;
    // One connection per message the loop has in flight, and a spare.
    settings.database.pool_size = usize::from(LOOP_PREFETCH) + 1;
    crate::common::recreate_database(&settings, super::DATABASE).await?;
    let pool = rabbit_inbox::tools::create_pool(&settings)?;
    crate::common::create_tables(&pool).await?;
    rabbit_inbox::internal::run_migrations(&mut *pool.get().await?).await?;
    let connection = rabbit_inbox::tools::connect(&settings, "inbox throughput").await?;
    let workload = Workload::new(options.count, options.dup_ratio);
    let count = options.count;

    // (name, the limit or the loop, prefetch, wire)
    let in_process_runs = [
        ("raw", true, prefetch, Wire::Inbox),
        ("handwritten", false, LOOP_PREFETCH, Wire::Inbox),
        ("raw_64", true, 64, Wire::Inbox),
        ("raw_masstransit", true, prefetch, Wire::Masstransit),
    ];
    let mut names: Vec<String> = in_process_runs
        .iter()
        .map(|(name, ..)| (*name).to_owned())
        .collect();
    names.extend(runs.iter().map(|run| run.name.clone()));
    let mut results: Vec<Vec<Measured>> = vec![Vec::new(); names.len()];
    eprintln!(
        "service: count={count} unique={} prefetch={prefetch} repeat={}: one line per run on stderr, \
         medians, ratios and goals on stdout",
        workload.unique, options.repeat
    );
    for round in 0..options.repeat {
        for (i, name) in names.iter().enumerate() {
            let measured = match in_process_runs.get(i) {
                Some(&(_, limit, prefetch, wire)) => {
                    in_process(limit, prefetch, wire, &settings, &connection, &pool, &workload).await?
                }
                None => {
                    drain(
                        &runs[i - in_process_runs.len()],
                        &settings,
                        &connection,
                        &workload,
                    )
                    .await?
                }
            };
            eprintln!("round={round} {}", line(name, count, workload.unique, &measured));
            results[i].push(measured);
        }
    }
    for (name, measured) in names.iter().zip(&results) {
        println!("{}", line(name, count, workload.unique, &super::median(measured)));
    }
    let at = |name: &str| {
        names
            .iter()
            .position(|n| n == name)
            .map(|i| results[i].as_slice())
    };
    let mut ratios = vec![
        ("raw", "handwritten"),
        ("service_default", "handwritten"),
        ("service_one", "handwritten"),
        ("service_default", "raw"),
        ("service_masstransit", "service_default"),
        ("raw_masstransit", "raw"),
        ("service_masstransit", "raw_masstransit"),
        ("service_16_8", "handwritten"),
        ("service_default", "service_16_8"),
        ("service_64_16", "handwritten"),
        ("service_64_16", "raw_64"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_owned(), b.to_owned()))
    .collect::<Vec<_>>();
    for build in &against {
        ratios.push(("service_one".into(), format!("{}:one", build.label)));
    }
    for (mine, theirs) in &ratios {
        if let (Some(m), Some(t)) = (at(mine), at(theirs)) {
            println!("{}", ratio_line(mine, theirs, m, t));
        }
    }
    let rate = |mine: &str, theirs: &str| Some(rate_median(at(mine)?, at(theirs)?));
    let cpu = |mine: &str, theirs: &str| -> Option<f64> {
        let ratios: Option<Vec<f64>> = at(mine)?
            .iter()
            .zip(at(theirs)?)
            .map(|(m, t)| Some(m.cpu?.service / t.cpu?.service))
            .collect();
        ratios.map(super::middle)
    };
    let goals = [
        (
            "one_message_rate",
            rate("service_one", "handwritten"),
            "at_least",
            1.0,
        ),
        (
            "one_message_service_cpu",
            cpu("service_one", "handwritten"),
            "at_most",
            1.0,
        ),
        (
            "default_rate",
            rate("service_default", "handwritten"),
            "at_least",
            2.0,
        ),
        (
            "default_of_limit",
            rate("service_default", "raw"),
            "at_least",
            0.70,
        ),
        (
            "masstransit_rate",
            rate("service_masstransit", "service_default"),
            "at_least",
            0.95,
        ),
    ];
    for (name, measured, bound, limit) in goals {
        match measured {
            Some(m) => {
                let met = match bound {
                    "at_least" => m >= limit,
                    _ => m <= limit,
                };
                println!("goal name={name} measured={m:.3} {bound}={limit:.2} met={met}");
            }
            None => println!("goal name={name} measured=unknown"),
        }
    }
    if let Err(e) = connection.close(200, "done".into()).await {
        eprintln!("throughput: closing the connection: {e}");
    }
    Ok(())
}

/// `raw` (`limit`) or `handwritten` in this process, as `run` runs them,
/// with this process's CPU as the service's. On MassTransit's `wire` (the
/// limit only), the queue is classic, as the service's is on that wire,
/// and takes what a MassTransit producer publishes to the type's
/// exchange: the broker's limit for MassTransit's messages.
async fn in_process(
    limit: bool,
    prefetch: u16,
    wire: Wire,
    settings: &Settings,
    connection: &Connection,
    pool: &Pool,
    workload: &Workload,
) -> Result<Measured> {
    pool.get()
        .await?
        .batch_execute("TRUNCATE attendee_checkins, session_attendance, inbox_messages")
        .await?;
    let mut queue = loop_queue(if limit { "raw" } else { "handwritten" }, prefetch);
    // The kind of queue the service consumes on this wire: classic on
    // MassTransit's, as a MassTransit endpoint declares it.
    queue.kind = Some(QueueKind::default_on(wire));
    let channel = connection.create_channel().await?;
    rabbit_inbox::tools::declare_topology(&channel, &queue, &settings.failure).await?;
    match wire {
        Wire::Inbox => super::prefill(connection, &queue.name, workload).await?,
        Wire::Masstransit => {
            use rabbit_inbox::IntegrationEvent;
            let exchange = crate::common::masstransit::AttendeeCheckedIn::TYPE;
            rabbit_inbox::tools::bind_to_fanout(&channel, &queue.name, exchange).await?;
            super::prefill_masstransit(connection, workload).await?;
        }
    }
    checkpoint(pool).await?;
    let count = workload.messages.len();
    let before = CpuSplit::sample();
    let measured = match limit {
        true => super::raw(connection, &queue, count).await?,
        false => super::handwritten(connection, pool, &queue, count, None).await?,
    };
    let cpu = match (before, CpuSplit::sample()) {
        (Some(before), Some(after)) => Some(after.since(&before, count)),
        _ => None,
    };
    let effects_ok = limit || super::effects_ok(pool, workload.unique).await?;
    delete_topology(&channel, Wire::Inbox, &queue.name, settings.failure.delays.len()).await?;
    Ok(Measured {
        cpu,
        effects_ok,
        ..measured
    })
}

/// A run's line: its time, rate, effects and CPU per message by process.
fn line(name: &str, count: usize, unique: usize, m: &Measured) -> String {
    let cpu = super::cpu_fields(m.cpu);
    format!(
        "scenario={name} messages={count} unique={unique} seconds={:.3} msgs_per_s={:.0} effects_ok={}{cpu}",
        m.seconds,
        count as f64 / m.seconds,
        m.effects_ok
    )
}

/// The median over the rounds of `mine`'s rate over `theirs`'s.
fn rate_median(mine: &[Measured], theirs: &[Measured]) -> f64 {
    super::middle(
        mine.iter()
            .zip(theirs)
            .map(|(m, t)| t.seconds / m.seconds)
            .collect(),
    )
}

fn ratio_line(mine: &str, theirs: &str, m: &[Measured], t: &[Measured]) -> String {
    let rounds: Vec<String> = m
        .iter()
        .zip(t)
        .map(|(m, t)| format!("{:.2}", t.seconds / m.seconds))
        .collect();
    format!(
        "ratio scenario={mine} against={theirs} median={:.2} rounds={}",
        rate_median(m, t),
        rounds.join(",")
    )
}

/// Database `name` made anew as a copy of `template`: PostgreSQL copies its
/// files (`STRATEGY = FILE_COPY` from version 15 on, whose default writes
/// every page to the WAL instead), outside the measured window.
async fn copy_database(settings: &Settings, template: &str, name: &str) -> Result<()> {
    let mut admin = settings.clone();
    admin.database.set_dbname("postgres")?;
    let pool = rabbit_inbox::tools::create_pool(&admin)?;
    let client = pool.get().await?;
    // Each a statement of its own: neither runs in a transaction.
    let said = |e: rabbit_inbox::tokio_postgres::Error| match e.as_db_error() {
        Some(db) => Error::from(format!("copying {template}: {}", db.message())),
        None => Error::from(format!("copying {template}: {e}")),
    };
    client
        .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
        .await
        .map_err(said)?;
    // Every session on the template ended first (the check that it is
    // made leaves one closing).
    client
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            &[&template],
        )
        .await
        .map_err(said)?;
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .map_err(said)?
        .get(0);
    let strategy = if version >= 150_000 {
        " STRATEGY = FILE_COPY"
    } else {
        ""
    };
    client
        .batch_execute(&format!(
            "CREATE DATABASE \"{name}\" TEMPLATE \"{template}\"{strategy}"
        ))
        .await
        .map_err(said)?;
    Ok(())
}

/// A template database holding the inbox's and the example service's
/// tables and `rows` processed inbox rows of another queue, `processed_at`
/// 30 days ago (due at the default 7 days of retention, not at 60), their
/// ids made as `ids` says (four producers' worth of NewIds, as a
/// MassTransit service's inbox holds). Made once and kept: filling millions
/// of rows takes minutes. The rows go in before the indexes, which are
/// then built as the migration declares them: a sorted build, minutes
/// where inserting into them would take hours at a hundred million.
async fn inbox_template(settings: &Settings, rows: u64, ids: Ids) -> Result<String> {
    let name = match ids {
        Ids::NewId => format!("inbox_bench_inbox_{rows}_newid"),
        _ => format!("inbox_bench_inbox_{rows}"),
    };
    let mut at = settings.clone();
    at.database.set_dbname(&name)?;
    let made = match rabbit_inbox::tools::create_pool(&at)?.get().await {
        Ok(client) => client
            .query_opt(
                "SELECT rows FROM bench_template WHERE rows = $1",
                &[&(rows as i64)],
            )
            .await
            .ok()
            .flatten()
            .is_some(),
        Err(_) => false,
    };
    if made {
        return Ok(name);
    }
    eprintln!("service: filling {name} with {rows} inbox rows (once; kept for later runs)");
    crate::common::recreate_database(&at, &name).await?;
    // (the id, what it is selected from)
    let (message_id, from) = match ids {
        // NewId.NextGuid()'s layout (see `NewIds`): worker bytes 4-5, the
        // sequence (0: one id per tick), worker bytes 2-3 and 0-1, then the
        // tick's bytes 6-7, 0-3 and 4-5; ticks a millisecond apart, give
        // or take a jitter, as `processed_at`; four producers.
        Ids::NewId => (
            "(substr(w, 1, 4) || '0000' || substr(w, 5, 8)
              || substr(h, 13, 4) || substr(h, 1, 8) || substr(h, 9, 4))::uuid",
            "(SELECT at,
                     (ARRAY['0b1752757374', '3fa1c2d45e6f', '9e0481b27cd3', 'c65d0fe2a419'])[1 + i % 4] AS w,
                     lpad(to_hex(621355968000000000 + (extract(epoch FROM at) * 10000000)::bigint
                                 + (hashint8(i)::bigint & 8191)), 16, '0') AS h
              FROM series) AS s",
        ),
        _ => ("gen_random_uuid()", "series"),
    };
    {
        let pool = rabbit_inbox::tools::create_pool(&at)?;
        crate::common::create_tables(&pool).await?;
        rabbit_inbox::internal::run_migrations(&mut *pool.get().await?).await?;
        let client = pool.get().await?;
        // Minutes, not the sessions' bound; sorts in memory.
        client
            .batch_execute("SET statement_timeout = 0; SET maintenance_work_mem = '1GB'")
            .await?;
        client
            .batch_execute(
                "ALTER TABLE inbox_messages DROP CONSTRAINT inbox_messages_pkey;
                 DROP INDEX inbox_messages_processed_at",
            )
            .await?;
        client
            .execute(
                &format!(
                    "INSERT INTO inbox_messages (consumer, message_id, event_type, processed_at)
                     WITH series AS (
                         SELECT i, now() - interval '30 days' + i * interval '1 millisecond' AS at
                         FROM generate_series(1, $1::bigint) i
                     )
                     SELECT 'bench.earlier', {message_id}, 'AttendeeCheckedIn', at FROM {from}"
                ),
                &[&(rows as i64)],
            )
            .await?;
        // As 0001_inbox_messages.sql declares them.
        client
            .batch_execute("ALTER TABLE inbox_messages ADD PRIMARY KEY (consumer, message_id)")
            .await?;
        client
            .batch_execute("CREATE INDEX inbox_messages_processed_at ON inbox_messages (processed_at)")
            .await?;
        // A statement of its own: VACUUM runs in no transaction.
        client.batch_execute("VACUUM ANALYZE inbox_messages").await?;
        client
            .batch_execute(&format!(
                "CREATE TABLE bench_template (rows bigint); INSERT INTO bench_template VALUES ({rows})"
            ))
            .await?;
    }
    Ok(name)
}

/// The inboxes `--retention` runs on.
pub(super) struct Templates {
    rows: u64,
    /// Holding random ids.
    random: String,
    /// Holding ids as MassTransit makes them.
    new_ids: String,
}

/// The inboxes of `rows` rows `--retention` runs on, made if they are not
/// there yet (before anything is measured: it takes minutes).
pub(super) async fn templates(rows: u64) -> Result<Templates> {
    let settings = crate::common::settings()?.into_inner();
    Ok(Templates {
        rows,
        random: inbox_template(&settings, rows, Ids::Random).await?,
        new_ids: inbox_template(&settings, rows, Ids::NewId).await?,
    })
}

/// `--retention`: the example service at its defaults draining the
/// workload from an empty inbox and from one holding `rows` rows nothing
/// sweeps (`service_full`), with random message ids in both, and again
/// with ids as MassTransit makes them (`service_empty_newid`,
/// `service_full_newid`); and from a copy of the random inbox whose `rows`
/// rows are all due, swept as it consumes (`service_sweeping`, paced as by
/// default; `service_sweeping_unpaced`, `retention.busy_share = 1`), in
/// turns.
pub(super) async fn retention(options: &Options, templates: Templates) -> Result<()> {
    let head = build_head()?;
    let settings = crate::common::settings()?.into_inner();
    let Templates {
        rows,
        random,
        new_ids,
    } = templates;
    let connection = rabbit_inbox::tools::connect(&settings, "inbox throughput").await?;
    let workloads =
        [Ids::Random, Ids::NewId].map(|ids| (ids, Workload::with_ids(options.count, options.dup_ratio, ids)));
    let count = options.count;
    let base = runs(&head, &[]).swap_remove(0);
    let with = |name: &str, env: &[(&str, &str)], database: Database, ids: Ids| Run {
        name: name.to_owned(),
        env: env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        database,
        ids,
        ..base.clone()
    };
    // Nothing is due at 60 days of retention: the rows are 30 days old.
    let keep = [("INBOX__RETENTION__DAYS", "60")];
    let runs = [
        with("service_empty", &[], Database::Empty, Ids::Random),
        with(
            "service_full",
            &keep,
            Database::Template(random.clone()),
            Ids::Random,
        ),
        with("service_empty_newid", &[], Database::Empty, Ids::NewId),
        with(
            "service_full_newid",
            &keep,
            Database::Template(new_ids),
            Ids::NewId,
        ),
        with(
            "service_sweeping",
            &[],
            Database::CopyOf(random.clone()),
            Ids::Random,
        ),
        with(
            "service_sweeping_unpaced",
            &[("INBOX__RETENTION__BUSY_SHARE", "1")],
            Database::CopyOf(random),
            Ids::Random,
        ),
    ];
    let unique = workloads[0].1.unique;
    let mut results: Vec<Vec<Measured>> = vec![Vec::new(); runs.len()];
    eprintln!(
        "service: retention over {rows} inbox rows, count={count} unique={unique} repeat={}",
        options.repeat
    );
    for round in 0..options.repeat {
        for (i, run) in runs.iter().enumerate() {
            let workload = workloads
                .iter()
                .find_map(|(ids, workload)| (*ids == run.ids).then_some(workload))
                .ok_or("no workload for the run's ids")?;
            let measured = drain(run, &settings, &connection, workload).await?;
            eprintln!(
                "round={round} {}",
                line(&run.name, count, workload.unique, &measured)
            );
            results[i].push(measured);
        }
    }
    for (run, measured) in runs.iter().zip(&results) {
        println!("{}", line(&run.name, count, unique, &super::median(measured)));
    }
    let at = |name: &str| {
        runs.iter()
            .position(|run| run.name == name)
            .map(|i| results[i].as_slice())
            .unwrap_or_default()
    };
    let compared = [
        ("full_inbox_rate", "service_full", "service_empty"),
        (
            "full_inbox_rate_newid",
            "service_full_newid",
            "service_empty_newid",
        ),
        ("sweeping_rate", "service_sweeping", "service_empty"),
        (
            "sweeping_rate_unpaced",
            "service_sweeping_unpaced",
            "service_empty",
        ),
    ];
    for (_, mine, theirs) in compared {
        println!("{}", ratio_line(mine, theirs, at(mine), at(theirs)));
    }
    // The unpaced sweep is there to show what pacing wins, not a target.
    for (goal, mine, theirs) in &compared[..3] {
        let measured = rate_median(at(mine), at(theirs));
        println!(
            "goal name={goal} rows={rows} measured={measured:.3} at_least=0.90 met={}",
            measured >= 0.9
        );
    }
    // The copy a sweep ran on: as large as the template.
    let mut admin = settings.clone();
    admin.database.set_dbname("postgres")?;
    if let Ok(client) = rabbit_inbox::tools::create_pool(&admin)?.get().await {
        let _ = client
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS \"{SERVICE_DATABASE}\" WITH (FORCE)"
            ))
            .await;
    }
    if let Err(e) = connection.close(200, "done".into()).await {
        eprintln!("throughput: closing the connection: {e}");
    }
    Ok(())
}
