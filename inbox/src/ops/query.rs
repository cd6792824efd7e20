//! The read side: failures listed (keyset pages), one failure, groups by
//! cause, jobs, the audit; and the SQL that selects failures by a
//! [`Selection`], which the actions share.

use std::time::SystemTime;

use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, Row};
use uuid::Uuid;

use super::model::{
    AuditEntry, FailureDetail, FailureSummary, Filter, Group, Job, Page, PausedQueue, Selection,
};
use super::{OpsError, OpsResult};

/// The most failures an action takes by id, and a page holds.
pub(crate) const MAX_IDS: usize = 10_000;
pub(crate) const MAX_PAGE: i64 = 500;

const KINDS: &[&str] = &["error", "skipped", "dead_outbox"];
const STATUSES: &[&str] = &["open", "redriving", "redriven", "discarded"];

/// A `WHERE` clause and its parameters, numbered from 1.
#[derive(Default)]
pub(crate) struct Clause {
    pub(crate) sql: String,
    pub(crate) params: Vec<Box<dyn ToSql + Sync + Send>>,
}

impl Clause {
    fn and(&mut self, condition: impl FnOnce(usize) -> String, value: impl ToSql + Sync + Send + 'static) {
        self.params.push(Box::new(value));
        let condition = condition(self.params.len());
        self.sql.push_str(if self.sql.is_empty() { "" } else { " AND " });
        self.sql.push_str(&condition);
    }

    /// `AND`s a condition without a parameter.
    pub(crate) fn and_sql(&mut self, condition: &str) {
        self.sql.push_str(if self.sql.is_empty() { "" } else { " AND " });
        self.sql.push_str(condition);
    }

    /// The clause, `TRUE` when empty.
    pub(crate) fn sql(&self) -> &str {
        if self.sql.is_empty() { "TRUE" } else { &self.sql }
    }

    /// The next parameter's number.
    pub(crate) fn next(&self) -> usize {
        self.params.len() + 1
    }

    pub(crate) fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.params.iter().map(|p| &**p as &(dyn ToSql + Sync)).collect()
    }

    /// The failures `selection` names, checked.
    pub(crate) fn selecting(selection: &Selection) -> OpsResult<Self> {
        match selection {
            Selection::Ids(ids) if ids.is_empty() => Err(OpsError::Invalid("`ids` is empty".into())),
            Selection::Ids(ids) if ids.len() > MAX_IDS => Err(OpsError::Invalid(format!(
                "{} ids: at most {MAX_IDS} by id; select more with a filter",
                ids.len()
            ))),
            Selection::Ids(ids) => {
                let mut clause = Clause::default();
                clause.and(|n| format!("id = ANY(${n})"), ids.clone());
                Ok(clause)
            }
            Selection::Filter(filter) => Clause::filtering(filter),
        }
    }

    /// The failures `filter` matches, its values checked.
    pub(crate) fn filtering(filter: &Filter) -> OpsResult<Self> {
        let mut clause = Clause::default();
        if let Some(queue) = &filter.queue {
            clause.and(|n| format!("queue = ${n}"), queue.clone());
        }
        if let Some(kind) = &filter.kind {
            one_of("kind", kind, KINDS)?;
            clause.and(|n| format!("kind = ${n}"), kind.clone());
        }
        if let Some(status) = &filter.status {
            one_of("status", status, STATUSES)?;
            clause.and(|n| format!("status = ${n}"), status.clone());
        }
        if let Some(message_type) = &filter.message_type {
            clause.and(|n| format!("message_type = ${n}"), message_type.clone());
        }
        if let Some(fingerprint) = &filter.fingerprint {
            clause.and(|n| format!("fingerprint = ${n}"), fingerprint.clone());
        }
        if let Some(since) = &filter.since {
            clause.and(|n| format!("last_failed_at >= ${n}"), time("since", since)?);
        }
        if let Some(until) = &filter.until {
            clause.and(|n| format!("last_failed_at < ${n}"), time("until", until)?);
        }
        if let Some(text) = &filter.text {
            let pattern = format!("%{}%", like_escaped(text));
            clause.and(
                |n| {
                    format!(
                        "(reason ILIKE ${n} OR message_type ILIKE ${n} OR handler ILIKE ${n} OR message_key ILIKE ${n})"
                    )
                },
                pattern,
            );
        }
        Ok(clause)
    }
}

fn one_of(key: &str, value: &str, allowed: &[&str]) -> OpsResult<()> {
    match allowed.contains(&value) {
        true => Ok(()),
        false => Err(OpsError::Invalid(format!(
            "{key} `{value}`: expected one of {}",
            allowed.join(", ")
        ))),
    }
}

fn time(key: &str, text: &str) -> OpsResult<SystemTime> {
    humantime::parse_rfc3339_weak(text)
        .map_err(|e| OpsError::Invalid(format!("{key} `{text}` is not an RFC 3339 time: {e}")))
}

/// `text` matched literally by `LIKE`.
fn like_escaped(text: &str) -> String {
    text.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_")
}

/// The columns a [`FailureSummary`] is read from.
pub(crate) const SUMMARY: &str = "id, message_id, queue, kind, status, message_type, reason, fingerprint, attempts, \
                                  first_failed_at, last_failed_at";

pub(crate) fn summary(row: &Row) -> OpsResult<FailureSummary> {
    Ok(FailureSummary {
        id: row.try_get("id")?,
        message_id: row.try_get("message_id")?,
        queue: row.try_get("queue")?,
        kind: row.try_get("kind")?,
        status: row.try_get("status")?,
        message_type: row.try_get("message_type")?,
        reason: row.try_get("reason")?,
        fingerprint: row.try_get("fingerprint")?,
        attempts: row.try_get("attempts")?,
        first_failed_at: row.try_get("first_failed_at")?,
        last_failed_at: row.try_get("last_failed_at")?,
    })
}

/// A page of the failures `filter` matches, latest failure first, after
/// the cursor `after`.
pub(crate) async fn failures(
    client: &impl GenericClient,
    filter: &Filter,
    after: Option<&str>,
    limit: i64,
) -> OpsResult<Page<FailureSummary>> {
    let mut clause = Clause::filtering(filter)?;
    if let Some(after) = after {
        let (at, id) = cursor(after)?;
        let (a, b) = (clause.next(), clause.next() + 1);
        clause.and_sql(&format!("(last_failed_at, id) < (${a}, ${b})"));
        clause.params.push(Box::new(at));
        clause.params.push(Box::new(id));
    }
    let limit = limit.clamp(1, MAX_PAGE);
    let sql = format!(
        "SELECT {SUMMARY} FROM inbox_failures WHERE {} ORDER BY last_failed_at DESC, id DESC LIMIT {}",
        clause.sql(),
        limit + 1
    );
    let rows = client.query(&sql, &clause.params()).await?;
    let mut items = rows.iter().map(summary).collect::<OpsResult<Vec<_>>>()?;
    let next = match items.len() as i64 > limit {
        true => {
            items.truncate(limit as usize);
            items.last().map(|last| {
                let micros = micros(last.last_failed_at);
                format!("{micros}_{}", last.id)
            })
        }
        false => None,
    };
    Ok(Page { items, next })
}

fn micros(time: SystemTime) -> i128 {
    match time.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => after.as_micros() as i128,
        Err(before) => -(before.duration().as_micros() as i128),
    }
}

/// The cursor of a page: the last item's time (microseconds since the
/// epoch) and id.
fn cursor(text: &str) -> OpsResult<(SystemTime, Uuid)> {
    let invalid = || OpsError::Invalid(format!("`after` `{text}` is not a cursor this API gave"));
    let (micros, id) = text.split_once('_').ok_or_else(invalid)?;
    let micros: i64 = micros.parse().map_err(|_| invalid())?;
    let id = Uuid::try_parse(id).map_err(|_| invalid())?;
    let offset = std::time::Duration::from_micros(micros.unsigned_abs());
    let at = match micros >= 0 {
        true => SystemTime::UNIX_EPOCH.checked_add(offset),
        false => SystemTime::UNIX_EPOCH.checked_sub(offset),
    }
    .ok_or_else(invalid)?;
    Ok((at, id))
}

/// How many of the failures `selection` names are in `status`.
pub(crate) async fn count(
    client: &impl GenericClient,
    selection: &Selection,
    status: &str,
) -> OpsResult<i64> {
    let mut clause = Clause::selecting(selection)?;
    clause.and(|n| format!("status = ${n}"), status.to_owned());
    let sql = format!("SELECT count(*) FROM inbox_failures WHERE {}", clause.sql());
    Ok(client.query_one(&sql, &clause.params()).await?.try_get(0)?)
}

/// One failure, all of it.
pub(crate) async fn failure(client: &impl GenericClient, id: Uuid) -> OpsResult<FailureDetail> {
    let row = client
        .query_opt(
            &format!(
                "SELECT {SUMMARY}, handler, set_aside_in, times_failed, properties, headers, body, job_id, discard_reason
                 FROM inbox_failures WHERE id = $1"
            ),
            &[&id],
        )
        .await?
        .ok_or_else(|| OpsError::NotFound(format!("no failure {id}")))?;
    let body: Vec<u8> = row.try_get("body")?;
    Ok(FailureDetail {
        summary: summary(&row)?,
        handler: row.try_get("handler")?,
        set_aside_in: row.try_get("set_aside_in")?,
        times_failed: row.try_get("times_failed")?,
        properties: row.try_get("properties")?,
        headers: row.try_get("headers")?,
        body: String::from_utf8_lossy(&body).into_owned(),
        job_id: row.try_get("job_id")?,
        discard_reason: row.try_get("discard_reason")?,
    })
}

/// The failures `filter` matches (by default, the open ones), counted by
/// cause, the largest group first.
pub(crate) async fn groups(client: &impl GenericClient, filter: &Filter) -> OpsResult<Vec<Group>> {
    let mut filter = filter.clone();
    filter.status.get_or_insert_with(|| "open".to_owned());
    let clause = Clause::filtering(&filter)?;
    let sql = format!(
        "SELECT fingerprint, count(*) AS count, array_agg(DISTINCT queue) AS queues,
                max(last_failed_at) AS last_failed_at,
                (array_agg(message_type ORDER BY last_failed_at DESC))[1] AS message_type,
                (array_agg(handler ORDER BY last_failed_at DESC))[1] AS handler,
                (array_agg(reason ORDER BY last_failed_at DESC))[1] AS reason
         FROM inbox_failures WHERE {} GROUP BY fingerprint ORDER BY count(*) DESC, fingerprint LIMIT 200",
        clause.sql()
    );
    let rows = client.query(&sql, &clause.params()).await?;
    rows.iter()
        .map(|row| {
            Ok(Group {
                fingerprint: row.try_get("fingerprint")?,
                message_type: row.try_get("message_type")?,
                handler: row.try_get("handler")?,
                reason: row.try_get("reason")?,
                count: row.try_get("count")?,
                queues: row.try_get("queues")?,
                last_failed_at: row.try_get("last_failed_at")?,
            })
        })
        .collect()
}

/// The columns a [`Job`] is read from; `failed_again` counts the job's
/// redriven failures that came back since.
pub(crate) const JOB: &str =
    "j.id, j.action, j.status, j.total, j.done, j.rate_per_second, j.actor, j.reason, \
     j.paused_reason, j.created_at, j.updated_at,
     (SELECT count(*) FROM inbox_failures f
      WHERE f.job_id = j.id AND f.status = 'open' AND f.last_failed_at > f.redriven_at) AS failed_again";

pub(crate) fn job(row: &Row) -> OpsResult<Job> {
    Ok(Job {
        id: row.try_get("id")?,
        action: row.try_get("action")?,
        status: row.try_get("status")?,
        total: row.try_get("total")?,
        done: row.try_get("done")?,
        failed_again: row.try_get("failed_again")?,
        rate_per_second: row.try_get("rate_per_second")?,
        actor: row.try_get("actor")?,
        reason: row.try_get("reason")?,
        paused_reason: row.try_get("paused_reason")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

/// One job.
pub(crate) async fn job_by_id(client: &impl GenericClient, id: Uuid) -> OpsResult<Job> {
    let row = client
        .query_opt(
            &format!("SELECT {JOB} FROM inbox_ops_jobs j WHERE j.id = $1"),
            &[&id],
        )
        .await?
        .ok_or_else(|| OpsError::NotFound(format!("no job {id}")))?;
    job(&row)
}

/// The latest jobs, newest first.
pub(crate) async fn jobs(client: &impl GenericClient, limit: i64) -> OpsResult<Vec<Job>> {
    let rows = client
        .query(
            &format!("SELECT {JOB} FROM inbox_ops_jobs j ORDER BY j.created_at DESC, j.id DESC LIMIT $1"),
            &[&limit.clamp(1, MAX_PAGE)],
        )
        .await?;
    rows.iter().map(job).collect()
}

/// A page of the audit, latest first, before the entry `before` (its
/// `seq`).
pub(crate) async fn audit(
    client: &impl GenericClient,
    before: Option<&str>,
    limit: i64,
) -> OpsResult<Page<AuditEntry>> {
    let before: i64 = match before {
        None => i64::MAX,
        Some(text) => text
            .parse()
            .map_err(|_| OpsError::Invalid(format!("`after` `{text}` is not a cursor this API gave")))?,
    };
    let limit = limit.clamp(1, MAX_PAGE);
    let rows = client
        .query(
            "SELECT seq, at, actor, role, action, reason, target, affected, job_id
             FROM inbox_ops_audit WHERE seq < $1 ORDER BY seq DESC LIMIT $2",
            &[&before, &(limit + 1)],
        )
        .await?;
    let mut items = rows
        .iter()
        .map(|row| {
            Ok(AuditEntry {
                seq: row.try_get("seq")?,
                at: row.try_get("at")?,
                actor: row.try_get("actor")?,
                role: row.try_get("role")?,
                action: row.try_get("action")?,
                reason: row.try_get("reason")?,
                target: row.try_get("target")?,
                affected: row.try_get("affected")?,
                job_id: row.try_get("job_id")?,
            })
        })
        .collect::<OpsResult<Vec<_>>>()?;
    let next = match items.len() as i64 > limit {
        true => {
            items.truncate(limit as usize);
            items.last().map(|last| last.seq.to_string())
        }
        false => None,
    };
    Ok(Page { items, next })
}

/// The queues operators paused.
pub(crate) async fn paused_queues(client: &impl GenericClient) -> OpsResult<Vec<PausedQueue>> {
    let rows = client
        .query(
            "SELECT queue, paused_by, paused_at, reason FROM inbox_ops_paused_queues ORDER BY queue",
            &[],
        )
        .await?;
    rows.iter()
        .map(|row| {
            Ok(PausedQueue {
                queue: row.try_get("queue")?,
                paused_by: row.try_get("paused_by")?,
                paused_at: row.try_get("paused_at")?,
                reason: row.try_get("reason")?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_comes_back_as_it_was_given() {
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_micros(1_765_000_000_123_456);
        let id = Uuid::now_v7();
        let text = format!("{}_{id}", micros(at));
        assert_eq!(cursor(&text).unwrap(), (at, id));
        assert!(matches!(cursor("nonsense"), Err(OpsError::Invalid(_))));
    }

    #[test]
    fn a_filter_refuses_what_it_does_not_know() {
        let filter = Filter {
            status: Some("closed".into()),
            ..Filter::default()
        };
        assert!(
            matches!(Clause::filtering(&filter), Err(OpsError::Invalid(e)) if e.contains("status `closed`"))
        );
        let filter = Filter {
            since: Some("yesterday".into()),
            ..Filter::default()
        };
        assert!(matches!(Clause::filtering(&filter), Err(OpsError::Invalid(e)) if e.contains("since")));
        assert_eq!(like_escaped("50%_a\\"), "50\\%\\_a\\\\");
    }
}
