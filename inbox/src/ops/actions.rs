//! The write side: each action one transaction with its audit row.
//!
//! A redrive claims its failures (`open` to `redriving`, marked with its
//! job) in the transaction that creates the job: a failure another action
//! holds is not `open`, so two redrives of one message never both take it.
//! The job then stages them through the outbox a slice at a time
//! ([`super::runner`]). A discard or a restore changes its failures in the
//! transaction that creates its job, done at once.

use tokio_postgres::GenericClient;
use uuid::Uuid;

use super::model::{Job, Selection};
use super::query::{self, Clause};
use super::{Operator, OpsError, OpsResult, Role};

/// The longest reason kept.
const MAX_REASON: usize = 1000;
/// The fastest rate a redrive takes.
pub(crate) const MAX_RATE: i32 = 10_000;

/// Writes the audit row of an action, in its transaction.
pub(crate) async fn audit(
    client: &impl GenericClient,
    who: &Operator,
    action: &str,
    target: serde_json::Value,
    reason: Option<&str>,
    affected: u64,
    job_id: Option<Uuid>,
) -> OpsResult<()> {
    client
        .execute(
            "INSERT INTO inbox_ops_audit (actor, role, action, target, reason, affected, job_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[
                &who.name,
                &who.role.as_str(),
                &action,
                &target,
                &reason,
                &i32::try_from(affected).unwrap_or(i32::MAX),
                &job_id,
            ],
        )
        .await?;
    Ok(())
}

fn reason_of(reason: Option<&str>, required: bool) -> OpsResult<Option<String>> {
    let reason = reason.map(str::trim).filter(|r| !r.is_empty());
    match reason {
        None if required => Err(OpsError::Invalid("a reason is required".into())),
        Some(r) if r.chars().count() > MAX_REASON => Err(OpsError::Invalid(format!(
            "the reason is longer than {MAX_REASON} characters"
        ))),
        r => Ok(r.map(|r| r.replace('\0', "\u{fffd}"))),
    }
}

fn selection_json(selection: &Selection) -> serde_json::Value {
    serde_json::to_value(selection).unwrap_or(serde_json::Value::Null)
}

/// What a redrive is asked.
#[derive(Debug, Clone)]
pub(crate) struct Redrive<'a> {
    pub(crate) selection: &'a Selection,
    pub(crate) rate_per_second: Option<i32>,
    pub(crate) reason: Option<&'a str>,
    pub(crate) dry_run: bool,
}

/// Starts a redrive of the open failures `selection` names that have a
/// message id (one without cannot be told apart from a new message, and is
/// malformed anyway), or, as a dry run, counts them.
pub(crate) async fn redrive(
    client: &mut tokio_postgres::Client,
    who: &Operator,
    ask: Redrive<'_>,
) -> OpsResult<Job> {
    who.may(Role::Operator, "redrive")?;
    if let Some(rate) = ask.rate_per_second
        && !(1..=MAX_RATE).contains(&rate)
    {
        return Err(OpsError::Invalid(format!(
            "rate_per_second {rate}: expected 1 to {MAX_RATE}, or none for as fast as the outbox goes"
        )));
    }
    let reason = reason_of(ask.reason, false)?;
    let mut clause = Clause::selecting(ask.selection)?;
    clause.and_sql("status = 'open' AND message_id IS NOT NULL");
    let tx = client.transaction().await?;
    if ask.dry_run {
        let count: i64 = tx
            .query_one(
                &format!("SELECT count(*) FROM inbox_failures WHERE {}", clause.sql()),
                &clause.params(),
            )
            .await?
            .try_get(0)?;
        let now = std::time::SystemTime::now();
        return Ok(Job {
            id: Uuid::nil(),
            action: "redrive".into(),
            status: "dry_run".into(),
            total: i32::try_from(count).unwrap_or(i32::MAX),
            done: 0,
            failed_again: 0,
            rate_per_second: ask.rate_per_second,
            actor: who.name.clone(),
            reason,
            paused_reason: None,
            created_at: now,
            updated_at: now,
        });
    }
    let job_id = Uuid::now_v7();
    let n = clause.next();
    let mut params = clause.params();
    params.push(&job_id);
    let claimed = tx
        .execute(
            &format!(
                "UPDATE inbox_failures SET status = 'redriving', job_id = ${n}, updated_at = now() WHERE {}",
                clause.sql()
            ),
            &params,
        )
        .await?;
    create_job(
        &tx,
        job_id,
        who,
        "redrive",
        ask.selection,
        reason.as_deref(),
        ask.rate_per_second,
        claimed,
        0,
    )
    .await?;
    audit(
        &tx,
        who,
        "redrive",
        selection_json(ask.selection),
        reason.as_deref(),
        claimed,
        Some(job_id),
    )
    .await?;
    let job = query::job_by_id(&tx, job_id).await;
    tx.commit().await?;
    crate::actors::metrics::operator_action("redrive", "done");
    job
}

#[allow(clippy::too_many_arguments)]
async fn create_job(
    client: &impl GenericClient,
    id: Uuid,
    who: &Operator,
    action: &str,
    selection: &Selection,
    reason: Option<&str>,
    rate_per_second: Option<i32>,
    total: u64,
    done: u64,
) -> OpsResult<()> {
    let total = i32::try_from(total).unwrap_or(i32::MAX);
    let done = i32::try_from(done).unwrap_or(i32::MAX);
    let status = if done >= total { "done" } else { "running" };
    client
        .execute(
            "INSERT INTO inbox_ops_jobs (id, action, status, actor, reason, selection, rate_per_second, total, done)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            &[
                &id,
                &action,
                &status,
                &who.name,
                &reason,
                &selection_json(selection),
                &rate_per_second,
                &total,
                &done,
            ],
        )
        .await?;
    Ok(())
}

/// Discards the open failures `selection` names: they stay, out of the
/// open list, until restored. A reason is required.
pub(crate) async fn discard(
    client: &mut tokio_postgres::Client,
    who: &Operator,
    selection: &Selection,
    reason: Option<&str>,
) -> OpsResult<Job> {
    who.may(Role::Operator, "discard")?;
    let reason = reason_of(reason, true)?;
    change(
        client,
        who,
        "discard",
        selection,
        reason.as_deref(),
        "open",
        "discarded",
    )
    .await
}

/// Opens again the discarded failures `selection` names.
pub(crate) async fn restore(
    client: &mut tokio_postgres::Client,
    who: &Operator,
    selection: &Selection,
    reason: Option<&str>,
) -> OpsResult<Job> {
    who.may(Role::Operator, "restore")?;
    let reason = reason_of(reason, false)?;
    change(
        client,
        who,
        "restore",
        selection,
        reason.as_deref(),
        "discarded",
        "open",
    )
    .await
}

/// A discard or a restore: the failures in status `from` move to `to`,
/// with the job, done, and its audit row.
async fn change(
    client: &mut tokio_postgres::Client,
    who: &Operator,
    action: &str,
    selection: &Selection,
    reason: Option<&str>,
    from: &str,
    to: &str,
) -> OpsResult<Job> {
    let mut clause = Clause::selecting(selection)?;
    clause.and_sql(&format!("status = '{from}'"));
    let tx = client.transaction().await?;
    let job_id = Uuid::now_v7();
    let (n, m) = (clause.next(), clause.next() + 1);
    let mut params = clause.params();
    params.push(&job_id);
    let discard_reason = if to == "discarded" { reason } else { None };
    params.push(&discard_reason);
    let changed = tx
        .execute(
            &format!(
                "UPDATE inbox_failures SET status = '{to}', job_id = ${n}, discard_reason = ${m}, updated_at = now()
                 WHERE {}",
                clause.sql()
            ),
            &params,
        )
        .await?;
    create_job(
        &tx, job_id, who, action, selection, reason, None, changed, changed,
    )
    .await?;
    audit(
        &tx,
        who,
        action,
        selection_json(selection),
        reason,
        changed,
        Some(job_id),
    )
    .await?;
    let job = query::job_by_id(&tx, job_id).await;
    tx.commit().await?;
    crate::actors::metrics::operator_action(action, "done");
    job
}

/// What is done to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JobAction {
    Pause,
    Resume,
    Cancel,
}

impl JobAction {
    fn audit_name(self) -> &'static str {
        match self {
            JobAction::Pause => "pause_job",
            JobAction::Resume => "resume_job",
            JobAction::Cancel => "cancel_job",
        }
    }
}

/// Pauses, resumes or cancels a redrive. Pausing and resuming is an
/// operator's; cancelling another's job an admin's. A cancelled job's
/// failures not yet redriven are open again.
pub(crate) async fn control_job(
    client: &mut tokio_postgres::Client,
    who: &Operator,
    id: Uuid,
    action: JobAction,
) -> OpsResult<Job> {
    who.may(Role::Operator, action.audit_name())?;
    let tx = client.transaction().await?;
    let row = tx
        .query_opt(
            "SELECT status, actor FROM inbox_ops_jobs WHERE id = $1 FOR UPDATE",
            &[&id],
        )
        .await?
        .ok_or_else(|| OpsError::NotFound(format!("no job {id}")))?;
    let (status, owner): (String, String) = (row.try_get(0)?, row.try_get(1)?);
    if action == JobAction::Cancel && owner != who.name {
        who.may(Role::Admin, "cancel another's job")?;
    }
    let (allowed, to): (&[&str], &str) = match action {
        JobAction::Pause => (&["running"], "paused"),
        JobAction::Resume => (&["paused"], "running"),
        JobAction::Cancel => (&["running", "paused"], "cancelled"),
    };
    if !allowed.contains(&status.as_str()) {
        crate::actors::metrics::operator_action(action.audit_name(), "refused");
        return Err(OpsError::Conflict(format!(
            "job {id} is {status}: it cannot be {}",
            match action {
                JobAction::Pause => "paused",
                JobAction::Resume => "resumed",
                JobAction::Cancel => "cancelled",
            }
        )));
    }
    tx.execute(
        "UPDATE inbox_ops_jobs SET status = $2, paused_reason = NULL, updated_at = now(),
                resumed_at = CASE WHEN $3 THEN now() ELSE resumed_at END
         WHERE id = $1",
        &[&id, &to, &(action == JobAction::Resume)],
    )
    .await?;
    let mut affected = 0;
    if action == JobAction::Cancel {
        affected = tx
            .execute(
                "UPDATE inbox_failures SET status = 'open', updated_at = now()
                 WHERE job_id = $1 AND status = 'redriving'",
                &[&id],
            )
            .await?;
    }
    audit(
        &tx,
        who,
        action.audit_name(),
        serde_json::json!({ "job": id }),
        None,
        affected,
        Some(id),
    )
    .await?;
    let job = query::job_by_id(&tx, id).await;
    tx.commit().await?;
    crate::actors::metrics::operator_action(action.audit_name(), "done");
    job
}

/// Pauses (`pause`) or resumes consuming `queue` on every instance.
/// Answers whether it changed anything (pausing a paused queue does not).
pub(crate) async fn pause_queue(
    client: &mut tokio_postgres::Client,
    who: &Operator,
    queue: &str,
    pause: bool,
    reason: Option<&str>,
) -> OpsResult<bool> {
    let action = if pause { "pause_queue" } else { "resume_queue" };
    who.may(Role::Operator, action)?;
    let reason = reason_of(reason, false)?;
    let tx = client.transaction().await?;
    let changed = match pause {
        true => {
            tx.execute(
                "INSERT INTO inbox_ops_paused_queues (queue, paused_by, reason) VALUES ($1, $2, $3)
                 ON CONFLICT (queue) DO NOTHING",
                &[&queue, &who.name, &reason],
            )
            .await?
        }
        false => {
            tx.execute("DELETE FROM inbox_ops_paused_queues WHERE queue = $1", &[&queue])
                .await?
        }
    };
    audit(
        &tx,
        who,
        action,
        serde_json::json!({ "queue": queue }),
        reason.as_deref(),
        0,
        None,
    )
    .await?;
    tx.commit().await?;
    crate::actors::metrics::operator_action(action, "done");
    Ok(changed > 0)
}
