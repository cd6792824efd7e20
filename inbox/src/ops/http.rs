//! The operator plane over HTTP: an actix-web scope the service mounts on
//! its own server, with the JSON API under `v1/` and the page at its root.
//!
//! ```no_run
//! # async fn run(runtime: &rabbit_inbox::Runtime) -> std::io::Result<()> {
//! use actix_web::{App, HttpServer};
//! use rabbit_inbox::ops::{access::Access, http};
//!
//! let access = Access::from_settings(runtime.settings()).map_err(std::io::Error::other)?;
//! let operations = runtime.operations();
//! HttpServer::new(move || App::new().service(http::scope("/ops", operations.clone(), access.clone())))
//!     .bind("127.0.0.1:8080")?
//!     .run()
//!     .await
//! # }
//! ```
//!
//! Every API request carries `Authorization: Bearer <token>`: none, or one
//! not known, is answered 401; a role that may not act, 403. Errors are
//! JSON: `{"error": "..."}`. The contract (names, status codes) is in
//! docs/operations.md, "The operations API".

use std::collections::HashMap;

use actix_web::http::StatusCode;
use actix_web::http::header;
use actix_web::{HttpRequest, HttpResponse, ResponseError, web};
use serde::Deserialize;
use uuid::Uuid;

use super::access::Access;
use super::model::{Filter, Selection};
use super::{Operations, Operator, OpsError, Role};

/// What every handler of the scope shares.
pub(crate) struct Plane {
    pub(crate) operations: Operations,
    pub(crate) access: Access,
    /// Where the scope is mounted (`/ops`): the page's links and its
    /// cookie's path.
    pub(crate) mount: String,
}

/// The operator plane's scope, mounted at `mount` (`/ops`): the API under
/// `mount/v1/`, the page at `mount/`.
pub fn scope(mount: &str, operations: Operations, access: Access) -> actix_web::Scope {
    let mount = mount.trim_end_matches('/').to_owned();
    let plane = web::Data::new(Plane {
        operations,
        access,
        mount: mount.clone(),
    });
    let json = web::JsonConfig::default()
        .limit(1 << 20)
        .error_handler(|e, _| ApiError::Ops(OpsError::Invalid(format!("the request's JSON: {e}"))).into());
    web::scope(&mount)
        .app_data(plane)
        .app_data(json)
        .service(
            web::scope("/v1")
                .route("/failures", web::get().to(failures))
                .route("/failures/{id}", web::get().to(failure))
                .route("/groups", web::get().to(groups))
                .route("/redrive", web::post().to(redrive))
                .route("/discard", web::post().to(discard))
                .route("/restore", web::post().to(restore))
                .route("/jobs", web::get().to(jobs))
                .route("/jobs/{id}", web::get().to(job))
                .route("/jobs/{id}/{action}", web::post().to(control_job))
                .route("/queues", web::get().to(queues))
                .route("/queues/{queue}/{action}", web::post().to(pause_queue))
                .route("/audit", web::get().to(audit))
                .default_service(web::to(|| async {
                    ApiError::Ops(OpsError::NotFound("no such endpoint".into())).error_response()
                })),
        )
        .configure(super::page::routes)
}

/// An [`OpsError`], or a refused token, as the API answers it.
#[derive(Debug)]
pub(crate) enum ApiError {
    /// No token, or one not known (401).
    Unauthorized,
    Ops(OpsError),
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::Unauthorized => f.write_str("a valid `Authorization: Bearer <token>` is required"),
            ApiError::Ops(e) => e.fmt(f),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Ops(e) => status_of(e),
        }
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status_code());
        match self {
            ApiError::Unauthorized => {
                response.insert_header((header::WWW_AUTHENTICATE, "Bearer realm=\"inbox operations\""));
            }
            ApiError::Ops(OpsError::Database(e)) => {
                tracing::warn!(error = %e, "operator plane: the database failed a request");
            }
            ApiError::Ops(_) => {}
        }
        response.json(serde_json::json!({ "error": self.to_string() }))
    }
}

pub(crate) fn status_of(error: &OpsError) -> StatusCode {
    match error {
        OpsError::Invalid(_) => StatusCode::BAD_REQUEST,
        OpsError::Forbidden(_) => StatusCode::FORBIDDEN,
        OpsError::NotFound(_) => StatusCode::NOT_FOUND,
        OpsError::Conflict(_) => StatusCode::CONFLICT,
        OpsError::Database(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

impl From<OpsError> for ApiError {
    fn from(error: OpsError) -> Self {
        ApiError::Ops(error)
    }
}

type Answer = Result<HttpResponse, ApiError>;

/// Who the request's bearer token is, if its role is at least `role`.
fn caller(request: &HttpRequest, plane: &Plane, role: Role, what: &str) -> Result<Operator, ApiError> {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok());
    let who = plane.access.bearer(authorization).ok_or(ApiError::Unauthorized)?;
    who.may(role, what)?;
    Ok(who)
}

/// A query string as a filter (its unknown keys refused: a mistyped key
/// must not widen a selection), with `after` and `limit` apart.
pub(crate) fn list_query(query: &str) -> Result<(Filter, Option<String>, i64), OpsError> {
    let mut pairs: HashMap<String, String> = web::Query::<HashMap<String, String>>::from_query(query)
        .map_err(|e| OpsError::Invalid(format!("the query string: {e}")))?
        .into_inner();
    let after = pairs.remove("after").filter(|a| !a.is_empty());
    let limit = match pairs.remove("limit") {
        None => 50,
        Some(text) => text
            .parse()
            .map_err(|_| OpsError::Invalid(format!("limit `{text}` is not a number")))?,
    };
    let filter = filter_of(pairs)?;
    Ok((filter, after, limit))
}

pub(crate) fn filter_of(pairs: HashMap<String, String>) -> Result<Filter, OpsError> {
    let object: serde_json::Map<String, serde_json::Value> = pairs
        .into_iter()
        .map(|(k, v)| (k, serde_json::Value::String(v)))
        .collect();
    serde_json::from_value(serde_json::Value::Object(object))
        .map_err(|e| OpsError::Invalid(format!("the filter: {e}")))
}

async fn failures(request: HttpRequest, plane: web::Data<Plane>) -> Answer {
    caller(&request, &plane, Role::Reader, "see failures")?;
    let (filter, after, limit) = list_query(request.query_string())?;
    let page = plane
        .operations
        .failures(&filter, after.as_deref(), limit)
        .await?;
    Ok(HttpResponse::Ok().json(page))
}

async fn failure(request: HttpRequest, plane: web::Data<Plane>, id: web::Path<String>) -> Answer {
    caller(&request, &plane, Role::Reader, "see failures")?;
    let id = uuid_of(&id)?;
    Ok(HttpResponse::Ok().json(plane.operations.failure(id).await?))
}

fn uuid_of(text: &str) -> Result<Uuid, OpsError> {
    Uuid::try_parse(text).map_err(|_| OpsError::NotFound(format!("`{text}` is not an id")))
}

async fn groups(request: HttpRequest, plane: web::Data<Plane>) -> Answer {
    caller(&request, &plane, Role::Reader, "see failures")?;
    let (filter, _, _) = list_query(request.query_string())?;
    let groups = plane.operations.groups(&filter).await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({ "items": groups })))
}

/// The body of a redrive, discard or restore.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ActionBody {
    ids: Option<Vec<Uuid>>,
    filter: Option<Filter>,
    reason: Option<String>,
    rate_per_second: Option<i32>,
    #[serde(default)]
    dry_run: bool,
}

impl ActionBody {
    fn selection(&self) -> Result<Selection, OpsError> {
        match (&self.ids, &self.filter) {
            (Some(ids), None) => Ok(Selection::Ids(ids.clone())),
            (None, Some(filter)) => Ok(Selection::Filter(filter.clone())),
            _ => Err(OpsError::Invalid("give either `ids` or `filter`".into())),
        }
    }
}

fn job_answer(job: super::Job) -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({ "job": job }))
}

async fn redrive(request: HttpRequest, plane: web::Data<Plane>, body: web::Json<ActionBody>) -> Answer {
    let who = caller(&request, &plane, Role::Operator, "redrive")?;
    let selection = body.selection()?;
    let job = plane
        .operations
        .redrive(
            &who,
            &selection,
            body.rate_per_second,
            body.reason.as_deref(),
            body.dry_run,
        )
        .await?;
    Ok(job_answer(job))
}

async fn discard(request: HttpRequest, plane: web::Data<Plane>, body: web::Json<ActionBody>) -> Answer {
    let who = caller(&request, &plane, Role::Operator, "discard")?;
    let job = plane
        .operations
        .discard(&who, &body.selection()?, body.reason.as_deref())
        .await?;
    Ok(job_answer(job))
}

async fn restore(request: HttpRequest, plane: web::Data<Plane>, body: web::Json<ActionBody>) -> Answer {
    let who = caller(&request, &plane, Role::Operator, "restore")?;
    let job = plane
        .operations
        .restore(&who, &body.selection()?, body.reason.as_deref())
        .await?;
    Ok(job_answer(job))
}

async fn jobs(request: HttpRequest, plane: web::Data<Plane>) -> Answer {
    caller(&request, &plane, Role::Reader, "see jobs")?;
    let jobs = plane.operations.jobs(50).await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({ "items": jobs })))
}

async fn job(request: HttpRequest, plane: web::Data<Plane>, id: web::Path<String>) -> Answer {
    caller(&request, &plane, Role::Reader, "see jobs")?;
    Ok(job_answer(plane.operations.job(uuid_of(&id)?).await?))
}

async fn control_job(
    request: HttpRequest,
    plane: web::Data<Plane>,
    path: web::Path<(String, String)>,
) -> Answer {
    let (id, action) = path.into_inner();
    let who = caller(&request, &plane, Role::Operator, "control a job")?;
    let id = uuid_of(&id)?;
    let job = match action.as_str() {
        "pause" => plane.operations.pause_job(&who, id).await?,
        "resume" => plane.operations.resume_job(&who, id).await?,
        "cancel" => plane.operations.cancel_job(&who, id).await?,
        other => {
            return Err(
                OpsError::NotFound(format!("no job action `{other}`: pause, resume or cancel")).into(),
            );
        }
    };
    Ok(job_answer(job))
}

async fn queues(request: HttpRequest, plane: web::Data<Plane>) -> Answer {
    caller(&request, &plane, Role::Reader, "see queues")?;
    let paused = plane.operations.paused_queues().await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({ "paused": paused })))
}

/// The body of a queue's pause or resume (optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct QueueBody {
    reason: Option<String>,
}

async fn pause_queue(
    request: HttpRequest,
    plane: web::Data<Plane>,
    path: web::Path<(String, String)>,
    body: Option<web::Json<QueueBody>>,
) -> Answer {
    let (queue, action) = path.into_inner();
    let who = caller(&request, &plane, Role::Operator, "pause or resume a queue")?;
    let pause = match action.as_str() {
        "pause" => true,
        "resume" => false,
        other => {
            return Err(OpsError::NotFound(format!("no queue action `{other}`: pause or resume")).into());
        }
    };
    let reason = body.and_then(|b| b.into_inner().reason);
    let changed = plane
        .operations
        .pause_queue(&who, &queue, pause, reason.as_deref())
        .await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({ "queue": queue, "paused": pause, "changed": changed })))
}

async fn audit(request: HttpRequest, plane: web::Data<Plane>) -> Answer {
    caller(&request, &plane, Role::Reader, "see the audit")?;
    let mut pairs: HashMap<String, String> =
        web::Query::<HashMap<String, String>>::from_query(request.query_string())
            .map_err(|e| OpsError::Invalid(format!("the query string: {e}")))?
            .into_inner();
    let after = pairs.remove("after");
    let limit = pairs.remove("limit").and_then(|l| l.parse().ok()).unwrap_or(50);
    if let Some(key) = pairs.keys().next() {
        return Err(OpsError::Invalid(format!("unknown query key `{key}`: after, limit")).into());
    }
    Ok(HttpResponse::Ok().json(plane.operations.audit(after.as_deref(), limit).await?))
}
