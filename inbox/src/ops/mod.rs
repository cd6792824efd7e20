//! The operator plane: every failed message in one table
//! (`inbox_failures`, fed by the failures drainer and by the outbox's dead
//! rows), and what an operator does with them, each action one transaction
//! with its audit row: redrive (through the outbox, under the message's own
//! id, so that its effect is applied once whatever happens to the copy),
//! discard and restore, pause and resume a queue.
//!
//! [`Operations`] is the whole of it as a Rust API, which the HTTP scope
//! (`http`, with the `ops` feature: the JSON API and the page) and the
//! `inbox-ops` command line both call. Who acts is an [`Operator`]: a
//! name, written in the audit, and a [`Role`].
//!
//! - `query.rs`: lists, one failure, groups, jobs, the audit;
//! - `actions.rs`: the actions and their audit rows;
//! - `runner.rs`: redrive jobs, a slice at a time, at their rate;
//! - `model.rs`: what the API answers (the JSON contract).

mod actions;
pub mod model;
mod query;
mod runner;

#[cfg(feature = "ops")]
pub mod access;
#[cfg(feature = "ops")]
pub mod http;
#[cfg(feature = "ops")]
mod page;

use std::sync::Arc;

use deadpool_postgres::Pool;
use tokio::sync::Notify;
use uuid::Uuid;

pub use model::{
    AuditEntry, FailureDetail, FailureSummary, Filter, Group, Job, Page, PausedQueue, Selection,
};

use crate::settings::Settings;

/// What an operator may do, each role all that the one before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Sees failures, jobs and the audit.
    Reader,
    /// Also redrives, discards, restores, pauses and resumes queues and
    /// jobs, and cancels its own jobs.
    Operator,
    /// Also cancels anyone's jobs.
    Admin,
}

impl Role {
    /// Its name: `reader`, `operator` or `admin`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "reader" => Ok(Role::Reader),
            "operator" => Ok(Role::Operator),
            "admin" => Ok(Role::Admin),
            other => Err(format!("role `{other}`: expected reader, operator or admin")),
        }
    }
}

/// Who acts: a name (a token's, or the command line's user) and a role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    /// Written in the audit.
    pub name: String,
    /// What it may do.
    pub role: Role,
}

impl Operator {
    /// `name` acting as `role`.
    pub fn new(name: impl Into<String>, role: Role) -> Self {
        Self {
            name: name.into(),
            role,
        }
    }

    /// Refuses `what` unless the role is `role` or above.
    pub(crate) fn may(&self, role: Role, what: &str) -> OpsResult<()> {
        match self.role >= role {
            true => Ok(()),
            false => {
                crate::actors::metrics::operator_action(what, "forbidden");
                Err(OpsError::Forbidden(format!(
                    "{} is a {}: to {what} takes the {} role",
                    self.name,
                    self.role.as_str(),
                    role.as_str()
                )))
            }
        }
    }
}

/// Why an operation was refused or failed. Each maps to an HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The request is not valid (400).
    #[error("{0}")]
    Invalid(String),
    /// The operator's role may not do it (403).
    #[error("{0}")]
    Forbidden(String),
    /// No such failure, job or queue (404).
    #[error("{0}")]
    NotFound(String),
    /// Not in this state (409): a job already done, say.
    #[error("{0}")]
    Conflict(String),
    /// The database failed (503).
    #[error("the database failed: {0}")]
    Database(#[source] crate::Error),
}

impl From<tokio_postgres::Error> for OpsError {
    fn from(error: tokio_postgres::Error) -> Self {
        OpsError::Database(crate::Error::client(error))
    }
}

impl From<deadpool_postgres::PoolError> for OpsError {
    fn from(error: deadpool_postgres::PoolError) -> Self {
        OpsError::Database(crate::Error::client(error))
    }
}

/// What an operation answers.
pub type OpsResult<T> = std::result::Result<T, OpsError>;

/// The operator plane's actions on one service's database: for the HTTP
/// scope ([`Runtime::operations`](crate::Runtime::operations)) and for
/// tools outside a runtime ([`Operations::new`]). Cheap to clone.
#[derive(Clone)]
pub struct Operations {
    pool: Pool,
    /// The queues the service consumes: those that may be paused.
    queues: Arc<[String]>,
    /// Whether the outbox is on: a redrive goes through it.
    outbox: bool,
    /// `failures.pause_redrive_at`.
    pause_at: f64,
    /// Wakes this process's outbox dispatcher, when it has one.
    wake_outbox: Option<Arc<Notify>>,
    /// Wakes this process's operator actor: a job to run, a queue to pause.
    nudge: Arc<Notify>,
}

impl std::fmt::Debug for Operations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operations")
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

impl Operations {
    /// The operations on `pool`'s database, for a service with `settings`
    /// (its queues, its outbox), outside its runtime: a command line, a
    /// script. A redrive started here is run by the service's instances.
    pub fn new(pool: Pool, settings: &Settings) -> Self {
        Self {
            pool,
            queues: settings.queues.iter().map(|q| q.name.clone()).collect(),
            outbox: settings.is_outbox_enabled(),
            pause_at: settings.failures.pause_redrive_at,
            wake_outbox: None,
            nudge: Arc::new(Notify::new()),
        }
    }

    /// [`new`](Self::new), inside a runtime: its outbox woken at once.
    pub(crate) fn in_runtime(pool: Pool, settings: &Settings, wake_outbox: Arc<Notify>) -> Self {
        Self {
            wake_outbox: Some(wake_outbox),
            ..Self::new(pool, settings)
        }
    }

    /// The queues the service consumes.
    pub fn queues(&self) -> &[String] {
        &self.queues
    }

    /// How many of the failures `selection` names are in `status`.
    pub async fn count(&self, selection: &Selection, status: &str) -> OpsResult<i64> {
        query::count(&**self.client().await?, selection, status).await
    }

    pub(crate) fn nudge(&self) -> &Arc<Notify> {
        &self.nudge
    }

    async fn client(&self) -> OpsResult<deadpool_postgres::Object> {
        Ok(self.pool.get().await?)
    }

    /// A page of the failures `filter` matches, latest first; `after` is
    /// the previous page's `next`.
    pub async fn failures(
        &self,
        filter: &Filter,
        after: Option<&str>,
        limit: i64,
    ) -> OpsResult<Page<FailureSummary>> {
        query::failures(&**self.client().await?, filter, after, limit).await
    }

    /// One failure, with its headers and body.
    pub async fn failure(&self, id: Uuid) -> OpsResult<FailureDetail> {
        query::failure(&**self.client().await?, id).await
    }

    /// The failures `filter` matches (the open ones unless it says a
    /// status), counted by cause.
    pub async fn groups(&self, filter: &Filter) -> OpsResult<Vec<Group>> {
        query::groups(&**self.client().await?, filter).await
    }

    /// Redrives the open failures `selection` names to the queues they
    /// failed on (dead outbox rows: to where they were going), at most
    /// `rate_per_second`, as a job any instance runs; or, with `dry_run`,
    /// counts them.
    pub async fn redrive(
        &self,
        who: &Operator,
        selection: &Selection,
        rate_per_second: Option<i32>,
        reason: Option<&str>,
        dry_run: bool,
    ) -> OpsResult<Job> {
        if !self.outbox {
            return Err(OpsError::Conflict(
                "a redrive goes through the outbox, which is off (message_bus.enable_outbox)".into(),
            ));
        }
        let ask = actions::Redrive {
            selection,
            rate_per_second,
            reason,
            dry_run,
        };
        let job = actions::redrive(&mut **self.client().await?, who, ask).await?;
        self.nudge.notify_one();
        Ok(job)
    }

    /// Discards the open failures `selection` names, for `reason`.
    pub async fn discard(
        &self,
        who: &Operator,
        selection: &Selection,
        reason: Option<&str>,
    ) -> OpsResult<Job> {
        actions::discard(&mut **self.client().await?, who, selection, reason).await
    }

    /// Opens again the discarded failures `selection` names.
    pub async fn restore(
        &self,
        who: &Operator,
        selection: &Selection,
        reason: Option<&str>,
    ) -> OpsResult<Job> {
        actions::restore(&mut **self.client().await?, who, selection, reason).await
    }

    /// One job.
    pub async fn job(&self, id: Uuid) -> OpsResult<Job> {
        query::job_by_id(&**self.client().await?, id).await
    }

    /// The latest jobs.
    pub async fn jobs(&self, limit: i64) -> OpsResult<Vec<Job>> {
        query::jobs(&**self.client().await?, limit).await
    }

    /// Pauses a running redrive.
    pub async fn pause_job(&self, who: &Operator, id: Uuid) -> OpsResult<Job> {
        actions::control_job(&mut **self.client().await?, who, id, actions::JobAction::Pause).await
    }

    /// Resumes a paused redrive.
    pub async fn resume_job(&self, who: &Operator, id: Uuid) -> OpsResult<Job> {
        let job =
            actions::control_job(&mut **self.client().await?, who, id, actions::JobAction::Resume).await?;
        self.nudge.notify_one();
        Ok(job)
    }

    /// Cancels a redrive: its failures not yet redriven are open again.
    pub async fn cancel_job(&self, who: &Operator, id: Uuid) -> OpsResult<Job> {
        actions::control_job(&mut **self.client().await?, who, id, actions::JobAction::Cancel).await
    }

    /// Pauses (`true`) or resumes consuming `queue`, one of the service's,
    /// on every instance. Answers whether it changed anything.
    pub async fn pause_queue(
        &self,
        who: &Operator,
        queue: &str,
        pause: bool,
        reason: Option<&str>,
    ) -> OpsResult<bool> {
        if !self.queues.iter().any(|q| q == queue) {
            return Err(OpsError::NotFound(format!(
                "queue `{queue}` is not one this service consumes ({})",
                self.queues.join(", ")
            )));
        }
        let changed = actions::pause_queue(&mut **self.client().await?, who, queue, pause, reason).await?;
        self.nudge.notify_one();
        Ok(changed)
    }

    /// The queues operators paused.
    pub async fn paused_queues(&self) -> OpsResult<Vec<PausedQueue>> {
        query::paused_queues(&**self.client().await?).await
    }

    /// A page of the audit, latest first; `after` is the previous page's
    /// `next`.
    pub async fn audit(&self, after: Option<&str>, limit: i64) -> OpsResult<Page<AuditEntry>> {
        query::audit(&**self.client().await?, after, limit).await
    }

    /// The gauges' sample: open failures by queue and kind (zero where a
    /// queue and kind has only resolved ones), how long ago the oldest open
    /// one failed, and the jobs running.
    pub(crate) async fn sample(&self) -> OpsResult<(Vec<(String, String, i64)>, Option<f64>, i64)> {
        let client = self.client().await?;
        let open = client
            .query(
                "SELECT queue, kind, count(*) FILTER (WHERE status = 'open') FROM inbox_failures GROUP BY queue, kind",
                &[],
            )
            .await?
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
            .collect::<OpsResult<Vec<_>>>()?;
        let row = client
            .query_one(
                "SELECT (SELECT EXTRACT(EPOCH FROM now() - min(last_failed_at))::float8
                         FROM inbox_failures WHERE status = 'open'),
                        (SELECT count(*) FROM inbox_ops_jobs WHERE status = 'running')",
                &[],
            )
            .await?;
        Ok((open, row.try_get(0)?, row.try_get(1)?))
    }

    /// Advances the due redrive jobs by a slice each, until none is due;
    /// answers how many failures it staged. The runtime's operator actor
    /// calls it; a tool may too.
    pub async fn advance_jobs(&self) -> OpsResult<u64> {
        let mut client = self.client().await?;
        let mut staged = 0;
        loop {
            let advanced = runner::advance(&mut client, self.pause_at).await?;
            staged += advanced.staged;
            if advanced.staged > 0
                && let Some(wake) = &self.wake_outbox
            {
                wake.notify_one();
            }
            if advanced.job.is_none() {
                return Ok(staged);
            }
        }
    }
}
