//! `--service`: the example service as users run it, its own process,
//! drained from outside, beside the hand-written loop and the broker's
//! limit, interleaved round by round.
//!
//! Each round runs, in turn, on the same pre-published workload:
//!
//! - `raw` and `handwritten` in this process, as the in-process scenarios
//!   run them, at the service's default prefetch (16);
//! - the example service (`examples/checkin_service.rs`, built in release)
//!   at its defaults (`service_default`), with `--batch-size 1`
//!   (`service_one`), with `--wire masstransit` (`service_masstransit`)
//!   and with `--prefetch 32 --batch-size 16` (`service_wide`);
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
//! `--retention ROWS` runs the service instead on an inbox holding ROWS
//! rows (a template database made once and kept), with nothing due and
//! with every row due (the sweep running as it consumes), against an empty
//! inbox: see [`retention`].

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rabbit_inbox::tools::lapin::options::QueueDeclareOptions;
use rabbit_inbox::tools::lapin::types::FieldTable;
use rabbit_inbox::tools::lapin::{Channel, Connection};
use rabbit_inbox::{QueueSettings, Settings, Wire};

use super::{CpuSplit, Error, Measured, Pool, Result, Workload};

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
    /// The database it starts from: a copy of this template (an inbox
    /// already holding rows), else an empty one.
    pub(super) template: Option<String>,
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

/// The example service of this checkout, built in release.
pub(super) fn build_head() -> Result<Build> {
    let root = workspace();
    eprintln!("service: building the example service (release)");
    succeed(
        Command::new("cargo")
            .args(["build", "--release", "--example", "checkin_service"])
            .current_dir(&root),
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
        Command::new("cargo")
            .args(["build", "--release", "--example", "checkin_service"])
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
    settings.database.set_dbname(SERVICE_DATABASE)?;
    match &run.template {
        None => crate::common::recreate_database(&settings, SERVICE_DATABASE).await?,
        Some(template) => copy_database(&settings, template, SERVICE_DATABASE).await?,
    }
    let queue = format!("bench.service.{}", uuid::Uuid::now_v7());
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
        template: None,
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
        run(
            "service_wide".into(),
            head,
            &["--prefetch", "32", "--batch-size", "16"],
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
pub(super) fn loop_queue(name: &str) -> QueueSettings {
    let mut queue = QueueSettings::new(format!("bench.{name}.{}", uuid::Uuid::now_v7()));
    queue.prefetch = QueueSettings::new("defaults").prefetch;
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
pub(super) async fn compare(options: Options) -> Result<()> {
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
    settings.database.pool_size = usize::from(prefetch) + 1;
    crate::common::recreate_database(&settings, super::DATABASE).await?;
    let pool = rabbit_inbox::tools::create_pool(&settings)?;
    crate::common::create_tables(&pool).await?;
    rabbit_inbox::internal::run_migrations(&mut *pool.get().await?).await?;
    let connection = rabbit_inbox::tools::connect(&settings, "inbox throughput").await?;
    let workload = Workload::new(options.count, options.dup_ratio);
    let count = options.count;

    let mut names = vec!["raw".to_owned(), "handwritten".to_owned()];
    names.extend(runs.iter().map(|run| run.name.clone()));
    let mut results: Vec<Vec<Measured>> = vec![Vec::new(); names.len()];
    eprintln!(
        "service: count={count} unique={} prefetch={prefetch} repeat={}: one line per run on stderr, \
         medians, ratios and goals on stdout",
        workload.unique, options.repeat
    );
    for round in 0..options.repeat {
        for (i, name) in names.iter().enumerate() {
            let measured = match i {
                0 | 1 => in_process(i == 0, &settings, &connection, &pool, &workload).await?,
                _ => drain(&runs[i - 2], &settings, &connection, &workload).await?,
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
        ("service_wide", "handwritten"),
        ("service_wide", "raw"),
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
/// with this process's CPU as the service's.
async fn in_process(
    limit: bool,
    settings: &Settings,
    connection: &Connection,
    pool: &Pool,
    workload: &Workload,
) -> Result<Measured> {
    pool.get()
        .await?
        .batch_execute("TRUNCATE attendee_checkins, session_attendance, inbox_messages")
        .await?;
    let queue = loop_queue(if limit { "raw" } else { "handwritten" });
    let channel = connection.create_channel().await?;
    rabbit_inbox::tools::declare_topology(&channel, &queue, &settings.failure).await?;
    super::prefill(connection, &queue.name, workload).await?;
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

/// Database `name` made anew as a copy of `template` (PostgreSQL copies
/// its files: seconds for millions of rows, outside the measured window).
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
    client
        .batch_execute(&format!("CREATE DATABASE \"{name}\" TEMPLATE \"{template}\""))
        .await
        .map_err(said)?;
    Ok(())
}

/// A template database holding the inbox's and the example service's
/// tables and `rows` processed inbox rows of another queue, `processed_at`
/// 30 days ago (due at the default 7 days of retention, not at 60), their
/// ids random UUIDs. Made once and kept: filling millions of rows takes
/// minutes.
async fn inbox_template(settings: &Settings, rows: u64) -> Result<String> {
    let name = format!("inbox_bench_inbox_{rows}");
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
    {
        let pool = rabbit_inbox::tools::create_pool(&at)?;
        crate::common::create_tables(&pool).await?;
        rabbit_inbox::internal::run_migrations(&mut *pool.get().await?).await?;
        let client = pool.get().await?;
        // Minutes, not the sessions' bound.
        client.batch_execute("SET statement_timeout = 0").await?;
        client
            .execute(
                "INSERT INTO inbox_messages (consumer, message_id, event_type, processed_at)
                 SELECT 'bench.earlier', gen_random_uuid(), 'AttendeeCheckedIn',
                        now() - interval '30 days' + i * interval '1 millisecond'
                 FROM generate_series(1, $1::bigint) i",
                &[&(rows as i64)],
            )
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

/// `--retention`: the example service at its defaults draining the
/// workload from an empty inbox, from one holding `rows` rows nothing
/// sweeps (`service_full`), and from one whose `rows` rows are all due,
/// swept as it consumes (`service_sweeping`, paced as by default; and
/// `service_sweeping_unpaced`, `retention.busy_share = 1`), in turns.
pub(super) async fn retention(options: Options, rows: u64) -> Result<()> {
    let head = build_head()?;
    let settings = crate::common::settings()?.into_inner();
    let template = inbox_template(&settings, rows).await?;
    let connection = rabbit_inbox::tools::connect(&settings, "inbox throughput").await?;
    let workload = Workload::new(options.count, options.dup_ratio);
    let count = options.count;
    let base = runs(&head, &[]).swap_remove(0);
    let with = |name: &str, env: &[(&str, &str)], template: Option<&str>| Run {
        name: name.to_owned(),
        env: env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        template: template.map(str::to_owned),
        ..base.clone()
    };
    let runs = [
        with("service_empty", &[], None),
        with(
            "service_full",
            &[("INBOX__RETENTION__DAYS", "60")],
            Some(&template),
        ),
        with("service_sweeping", &[], Some(&template)),
        with(
            "service_sweeping_unpaced",
            &[("INBOX__RETENTION__BUSY_SHARE", "1")],
            Some(&template),
        ),
    ];
    let mut results: Vec<Vec<Measured>> = vec![Vec::new(); runs.len()];
    eprintln!(
        "service: retention over {rows} inbox rows, count={count} unique={} repeat={}",
        workload.unique, options.repeat
    );
    for round in 0..options.repeat {
        for (i, run) in runs.iter().enumerate() {
            let measured = drain(run, &settings, &connection, &workload).await?;
            eprintln!(
                "round={round} {}",
                line(&run.name, count, workload.unique, &measured)
            );
            results[i].push(measured);
        }
    }
    for (run, measured) in runs.iter().zip(&results) {
        println!(
            "{}",
            line(&run.name, count, workload.unique, &super::median(measured))
        );
    }
    for i in 1..runs.len() {
        println!(
            "{}",
            ratio_line(&runs[i].name, &runs[0].name, &results[i], &results[0])
        );
    }
    let goals = [
        ("full_inbox_rate", rate_median(&results[1], &results[0])),
        ("sweeping_rate", rate_median(&results[2], &results[0])),
    ];
    for (name, measured) in goals {
        println!(
            "goal name={name} rows={rows} measured={measured:.3} at_least=0.90 met={}",
            measured >= 0.9
        );
    }
    if let Err(e) = connection.close(200, "done".into()).await {
        eprintln!("throughput: closing the connection: {e}");
    }
    Ok(())
}
