//! The operator plane's page: server-rendered HTML, no script, every action
//! a form, each confirmed on a page of its own that says how many messages
//! it takes. It asks for a token once and keeps a session cookie
//! ([`super::access`]); each form carries the session's form token.
//!
//! Routes (under the scope's mount): `/` (groups, filtered list, jobs,
//! queues, audit), `/failures/{id}` (one message), `/jobs/{id}` (a job's
//! progress, refreshed while it runs), and the forms' `POST`s: `/login`,
//! `/logout`, `/confirm`, `/act`, `/jobs/{id}/{action}`,
//! `/queues/{queue}/{action}`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::SystemTime;

use actix_web::http::header;
use actix_web::{HttpRequest, HttpResponse, web};
use uuid::Uuid;

use super::http::{Plane, filter_of, list_query, status_of};
use super::model::{FailureSummary, Filter, Job, Selection};
use super::{Operator, OpsError, Role};

/// The session cookie's name.
pub(crate) const COOKIE: &str = "inbox_ops_session";

pub(crate) fn routes(config: &mut web::ServiceConfig) {
    config
        .route("", web::get().to(index))
        .route("/", web::get().to(index))
        .route("/login", web::post().to(login))
        .route("/logout", web::post().to(logout))
        .route("/failures/{id}", web::get().to(failure))
        .route("/jobs/{id}", web::get().to(job))
        .route("/confirm", web::post().to(confirm))
        .route("/act", web::post().to(act))
        .route("/jobs/{id}/{action}", web::post().to(control_job))
        .route("/queues/{queue}/{action}", web::post().to(pause_queue));
}

/// `text` safe in HTML text and attribute values.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn opt(text: &Option<String>) -> String {
    esc(text.as_deref().unwrap_or(""))
}

fn time(at: SystemTime) -> String {
    humantime::format_rfc3339_seconds(at).to_string()
}

/// A signed-in page request: who, its session cookie's value, and the
/// session's form token.
struct Session {
    who: Operator,
    cookie: String,
    form_token: String,
}

fn session(request: &HttpRequest, plane: &Plane) -> Option<Session> {
    let cookie = request
        .headers()
        .get_all(header::COOKIE)
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.to_owned())?;
    let who = plane.access.session_of(&cookie, SystemTime::now())?;
    let form_token = plane.access.form_token(&cookie)?;
    Some(Session {
        who,
        cookie,
        form_token,
    })
}

/// The page around `body`; `refresh`: reload every second.
fn page(plane: &Plane, who: Option<&Session>, title: &str, body: &str, refresh: bool) -> HttpResponse {
    let mount = esc(&plane.mount);
    let mut html = String::new();
    let _ = write!(
        html,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\">{}<title>{} · inbox operations</title>\
         <style>body{{font:14px system-ui,sans-serif;margin:1.5em;color:#222}}table{{border-collapse:collapse;margin:.5em 0 1.5em}}\
         td,th{{border-bottom:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}}\
         pre{{background:#f6f6f6;padding:.6em;overflow:auto;max-width:100%}}form.inline{{display:inline}}\
         .muted{{color:#777}}.error{{color:#a00}}header{{display:flex;gap:1em;align-items:baseline}}\
         progress{{width:20em}}</style></head><body><header><h1><a href=\"{mount}/\">inbox operations</a></h1>",
        if refresh {
            "<meta http-equiv=\"refresh\" content=\"1\">"
        } else {
            ""
        },
        esc(title),
    );
    if let Some(session) = who {
        let _ = write!(
            html,
            "<span id=\"who\">{} ({})</span><form class=\"inline\" method=\"post\" action=\"{mount}/logout\">\
             <input type=\"hidden\" name=\"form_token\" value=\"{}\"><button>Sign out</button></form>",
            esc(&session.who.name),
            session.who.role.as_str(),
            esc(&session.form_token)
        );
    }
    let _ = write!(html, "</header>{body}</body></html>");
    HttpResponse::Ok()
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .insert_header(("X-Frame-Options", "DENY"))
        .insert_header((
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
        ))
        .content_type("text/html; charset=utf-8")
        .body(html)
}

fn error_page(plane: &Plane, who: Option<&Session>, error: &OpsError) -> HttpResponse {
    let mut response = page(
        plane,
        who,
        "Refused",
        &format!(
            "<p class=\"error\" id=\"error\">{}</p><p><a href=\"{}/\">Back</a></p>",
            esc(&error.to_string()),
            esc(&plane.mount)
        ),
        false,
    );
    *response.status_mut() = status_of(error);
    response
}

fn login_page(plane: &Plane, failed: bool) -> HttpResponse {
    let mut response = page(
        plane,
        None,
        "Sign in",
        &format!(
            "{}<form method=\"post\" action=\"{}/login\" id=\"login\"><label>Token \
             <input type=\"password\" name=\"token\" autocomplete=\"off\" autofocus></label> \
             <button>Sign in</button></form>",
            if failed {
                "<p class=\"error\" id=\"error\">That token is not known.</p>"
            } else {
                ""
            },
            esc(&plane.mount)
        ),
        false,
    );
    if failed {
        *response.status_mut() = actix_web::http::StatusCode::UNAUTHORIZED;
    }
    response
}

fn see_other(location: String) -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, location))
        .finish()
}

async fn login(plane: web::Data<Plane>, form: web::Form<HashMap<String, String>>) -> HttpResponse {
    let token = form.get("token").map(String::as_str).unwrap_or_default().trim();
    let Some(who) = plane.access.token(token) else {
        return login_page(&plane, true);
    };
    let Some(value) = plane.access.session(&who, SystemTime::now()) else {
        return login_page(&plane, true);
    };
    let path = if plane.mount.is_empty() { "/" } else { &plane.mount };
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, format!("{}/", plane.mount)))
        .insert_header((
            header::SET_COOKIE,
            format!(
                "{COOKIE}={value}; Path={path}; HttpOnly; SameSite=Strict; Max-Age={}",
                super::access::SESSION_LIFETIME.as_secs()
            ),
        ))
        .finish()
}

/// A form's session, its token checked: `Err` is the answer.
fn form_session(
    request: &HttpRequest,
    plane: &Plane,
    form: &HashMap<String, String>,
) -> Result<Session, Box<HttpResponse>> {
    let Some(session) = session(request, plane) else {
        return Err(Box::new(login_page(plane, false)));
    };
    let presented = form.get("form_token").map(String::as_str).unwrap_or_default();
    if !plane.access.is_form_token(&session.cookie, presented) {
        return Err(Box::new(error_page(
            plane,
            Some(&session),
            &OpsError::Forbidden("this form did not come from this page: go back and try again".into()),
        )));
    }
    Ok(session)
}

async fn logout(
    request: HttpRequest,
    plane: web::Data<Plane>,
    form: web::Form<HashMap<String, String>>,
) -> HttpResponse {
    if let Err(answer) = form_session(&request, &plane, &form) {
        return *answer;
    }
    let path = if plane.mount.is_empty() { "/" } else { &plane.mount };
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, format!("{}/", plane.mount)))
        .insert_header((
            header::SET_COOKIE,
            format!("{COOKIE}=; Path={path}; HttpOnly; SameSite=Strict; Max-Age=0"),
        ))
        .finish()
}

fn hidden(name: &str, value: &str) -> String {
    format!(
        "<input type=\"hidden\" name=\"{}\" value=\"{}\">",
        esc(name),
        esc(value)
    )
}

/// The filter's fields as hidden inputs (`filter.` before each name).
fn filter_hidden(filter: &Filter) -> String {
    let json = serde_json::to_value(filter).unwrap_or_default();
    let mut out = String::new();
    if let serde_json::Value::Object(map) = json {
        for (key, value) in map {
            if let Some(value) = value.as_str() {
                out.push_str(&hidden(&format!("filter.{key}"), value));
            }
        }
    }
    out
}

async fn index(request: HttpRequest, plane: web::Data<Plane>) -> HttpResponse {
    let Some(session) = session(&request, &plane) else {
        return login_page(&plane, false);
    };
    match render_index(&request, &plane, &session).await {
        Ok(body) => page(&plane, Some(&session), "Failures", &body, false),
        Err(e) => error_page(&plane, Some(&session), &e),
    }
}

async fn render_index(request: &HttpRequest, plane: &Plane, session: &Session) -> Result<String, OpsError> {
    let (filter, after, _) = list_query(request.query_string())?;
    let ops = &plane.operations;
    let operator = session.who.role >= Role::Operator;
    let mount = esc(&plane.mount);
    let token = hidden("form_token", &session.form_token);
    let mut body = String::new();

    // Queues, paused or not.
    let paused = ops.paused_queues().await?;
    body.push_str("<h2>Queues</h2><table id=\"queues\"><tr><th>Queue</th><th>State</th><th></th></tr>");
    for queue in ops.queues() {
        let pause = paused.iter().find(|p| &p.queue == queue);
        let state = match pause {
            Some(p) => format!("paused by {} at {}", esc(&p.paused_by), time(p.paused_at)),
            None => "consuming".into(),
        };
        let action = if pause.is_some() { "resume" } else { "pause" };
        let form = match operator {
            true => format!(
                "<form class=\"inline\" method=\"post\" action=\"{mount}/queues/{}/{action}\">{token}\
                 <button class=\"{action}-queue\">{}</button></form>",
                esc(&url_encoded(queue)),
                if pause.is_some() { "Resume" } else { "Pause" }
            ),
            false => String::new(),
        };
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{state}</td><td>{form}</td></tr>",
            esc(queue)
        );
    }
    body.push_str("</table>");

    // Groups of open failures.
    let groups = ops.groups(&Filter::default()).await?;
    body.push_str(
        "<h2>Open failures by cause</h2><table id=\"groups\"><tr><th>Count</th><th>Type</th><th>Reason</th>\
         <th>Queues</th><th>Last</th><th></th></tr>",
    );
    for group in &groups {
        let show = format!(
            "<a class=\"show-group\" href=\"{mount}/?status=open&amp;fingerprint={}\">show</a>",
            esc(&group.fingerprint)
        );
        let actions = match operator {
            true => format!(
                "<form class=\"inline redrive-group\" method=\"post\" action=\"{mount}/confirm\">{token}\
                 {}{}<label>at <input name=\"rate_per_second\" size=\"5\" placeholder=\"any\">/s</label> \
                 <button>Redrive…</button></form> \
                 <form class=\"inline discard-group\" method=\"post\" action=\"{mount}/confirm\">{token}{}{}\
                 <input name=\"reason\" placeholder=\"reason\" required> <button>Discard…</button></form>",
                hidden("action", "redrive"),
                hidden("filter.fingerprint", &group.fingerprint),
                hidden("action", "discard"),
                hidden("filter.fingerprint", &group.fingerprint),
            ),
            false => String::new(),
        };
        let _ = write!(
            body,
            "<tr class=\"group\"><td class=\"count\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{show} {actions}</td></tr>",
            group.count,
            opt(&group.message_type),
            opt(&group.reason),
            esc(&group.queues.join(", ")),
            time(group.last_failed_at),
        );
    }
    if groups.is_empty() {
        body.push_str("<tr><td colspan=\"6\" class=\"muted\">No open failure.</td></tr>");
    }
    body.push_str("</table>");

    // The filtered list.
    let field = |name: &str, label: &str, value: &Option<String>| {
        format!(
            "<label>{label} <input name=\"{name}\" value=\"{}\" size=\"14\"></label> ",
            opt(value)
        )
    };
    let _ = write!(
        body,
        "<h2>Failures</h2><form method=\"get\" action=\"{mount}/\" id=\"filter\">{}{}{}{}{}{}\
         <button>Filter</button> <a href=\"{mount}/\">clear</a></form>",
        field("queue", "Queue", &filter.queue),
        field("kind", "Kind", &filter.kind),
        field("status", "Status", &filter.status),
        field("type", "Type", &filter.message_type),
        field("fingerprint", "Cause", &filter.fingerprint),
        field("text", "Text", &filter.text),
    );
    let list = ops.failures(&filter, after.as_deref(), 50).await?;
    if operator && !filter.is_empty() {
        let _ = write!(
            body,
            "<p><form class=\"inline\" method=\"post\" action=\"{mount}/confirm\" id=\"redrive-filter\">{token}{}{}\
             <label>Redrive everything this filter matches at <input name=\"rate_per_second\" size=\"5\" \
             placeholder=\"any\">/s</label> <button>Redrive…</button></form></p>",
            hidden("action", "redrive"),
            filter_hidden(&filter),
        );
    }
    body.push_str(
        "<table id=\"failures\"><tr><th>Last failed</th><th>Queue</th><th>Kind</th><th>Status</th><th>Type</th>\
         <th>Reason</th><th>Attempts</th></tr>",
    );
    for failure in &list.items {
        body.push_str(&failure_row(&mount, failure));
    }
    if list.items.is_empty() {
        body.push_str("<tr><td colspan=\"7\" class=\"muted\">None.</td></tr>");
    }
    body.push_str("</table>");
    if let Some(next) = &list.next {
        let mut query: Vec<(String, String)> = serde_json::to_value(&filter)
            .ok()
            .and_then(|v| v.as_object().cloned())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(k, v)| v.as_str().map(|v| (k, v.to_owned())))
            .collect();
        query.push(("after".into(), next.clone()));
        let query: Vec<String> = query
            .iter()
            .map(|(k, v)| format!("{}={}", url_encoded(k), url_encoded(v)))
            .collect();
        let _ = write!(
            body,
            "<p><a id=\"next\" href=\"{mount}/?{}\">Next page</a></p>",
            esc(&query.join("&"))
        );
    }

    // Jobs.
    let jobs = ops.jobs(10).await?;
    body.push_str(
        "<h2>Jobs</h2><table id=\"jobs\"><tr><th>Started</th><th>Action</th><th>By</th><th>Status</th>\
         <th>Progress</th></tr>",
    );
    for job in &jobs {
        let _ = write!(
            body,
            "<tr><td><a href=\"{mount}/jobs/{}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{} / {}</td></tr>",
            job.id,
            time(job.created_at),
            esc(&job.action),
            esc(&job.actor),
            esc(&job.status),
            job.done,
            job.total
        );
    }
    body.push_str("</table>");

    // The audit.
    let audit = ops.audit(None, 20).await?;
    body.push_str(
        "<h2>Audit</h2><table id=\"audit\"><tr><th>At</th><th>Who</th><th>Action</th><th>What</th>\
         <th>Messages</th><th>Why</th></tr>",
    );
    for entry in &audit.items {
        let _ = write!(
            body,
            "<tr class=\"audit-entry\"><td>{}</td><td>{} ({})</td><td class=\"action\">{}</td><td><code>{}</code></td>\
             <td>{}</td><td class=\"reason\">{}</td></tr>",
            time(entry.at),
            esc(&entry.actor),
            esc(&entry.role),
            esc(&entry.action),
            esc(&crate::fault::truncate(&entry.target.to_string(), 200)),
            entry.affected,
            opt(&entry.reason)
        );
    }
    body.push_str("</table>");
    Ok(body)
}

fn url_encoded(text: &str) -> String {
    crate::settings::percent_encode(text)
}

fn failure_row(mount: &str, failure: &FailureSummary) -> String {
    format!(
        "<tr class=\"failure\"><td><a href=\"{mount}/failures/{}\">{}</a></td><td>{}</td><td>{}</td>\
         <td class=\"status\">{}</td><td class=\"type\">{}</td><td>{}</td><td>{}</td></tr>",
        failure.id,
        time(failure.last_failed_at),
        esc(&failure.queue),
        esc(&failure.kind),
        esc(&failure.status),
        opt(&failure.message_type),
        opt(&failure.reason),
        failure.attempts
    )
}

async fn failure(request: HttpRequest, plane: web::Data<Plane>, id: web::Path<String>) -> HttpResponse {
    let Some(session) = session(&request, &plane) else {
        return login_page(&plane, false);
    };
    let detail = match Uuid::try_parse(&id) {
        Ok(id) => plane.operations.failure(id).await,
        Err(_) => Err(OpsError::NotFound(format!("`{id}` is not an id"))),
    };
    let detail = match detail {
        Ok(detail) => detail,
        Err(e) => return error_page(&plane, Some(&session), &e),
    };
    let mount = esc(&plane.mount);
    let token = hidden("form_token", &session.form_token);
    let s = &detail.summary;
    let mut body = format!(
        "<h2>Failure</h2><table id=\"failure\">\
         <tr><th>Message id</th><td id=\"message-id\">{}</td></tr><tr><th>Queue</th><td>{}</td></tr>\
         <tr><th>Kind</th><td>{}</td></tr><tr><th>Status</th><td id=\"status\">{}</td></tr>\
         <tr><th>Type</th><td>{}</td></tr><tr><th>Handler</th><td>{}</td></tr>\
         <tr><th>Reason</th><td>{}</td></tr><tr><th>Attempts</th><td>{}</td></tr>\
         <tr><th>Set aside in</th><td>{}</td></tr><tr><th>Times failed</th><td>{}</td></tr>\
         <tr><th>First failed</th><td>{}</td></tr><tr><th>Last failed</th><td>{}</td></tr>\
         <tr><th>Cause</th><td><a href=\"{mount}/?fingerprint={}\">{}</a></td></tr>{}</table>",
        s.message_id
            .map(|id| id.to_string())
            .unwrap_or_else(|| "none (malformed)".into()),
        esc(&s.queue),
        esc(&s.kind),
        esc(&s.status),
        opt(&s.message_type),
        opt(&detail.handler),
        opt(&s.reason),
        s.attempts,
        esc(&detail.set_aside_in),
        detail.times_failed,
        time(s.first_failed_at),
        time(s.last_failed_at),
        esc(&s.fingerprint),
        esc(&s.fingerprint),
        match &detail.discard_reason {
            Some(why) => format!("<tr><th>Discarded because</th><td>{}</td></tr>", esc(why)),
            None => String::new(),
        }
    );
    if session.who.role >= Role::Operator {
        let id = hidden("ids", &s.id.to_string());
        let action = |name: &str, extra: &str, label: &str| {
            format!(
                "<form class=\"inline\" method=\"post\" action=\"{mount}/confirm\" id=\"{name}\">{token}{}{id}{extra} \
                 <button>{label}</button></form> ",
                hidden("action", name)
            )
        };
        body.push_str("<p id=\"actions\">");
        match s.status.as_str() {
            "open" => {
                body.push_str(&action("redrive", "", "Redrive…"));
                body.push_str(&action(
                    "discard",
                    "<input name=\"reason\" placeholder=\"reason\" required>",
                    "Discard…",
                ));
            }
            "discarded" => body.push_str(&action("restore", "", "Restore…")),
            _ => {}
        }
        body.push_str("</p>");
    }
    let pretty = |value: &serde_json::Value| serde_json::to_string_pretty(value).unwrap_or_default();
    let _ = write!(
        body,
        "<h3>Headers</h3><pre id=\"headers\">{}</pre><h3>Properties</h3><pre>{}</pre>\
         <h3>Body</h3><pre id=\"body\">{}</pre>",
        esc(&pretty(&detail.headers)),
        esc(&pretty(&detail.properties)),
        esc(&detail.body)
    );
    page(&plane, Some(&session), "Failure", &body, false)
}

async fn job(request: HttpRequest, plane: web::Data<Plane>, id: web::Path<String>) -> HttpResponse {
    let Some(session) = session(&request, &plane) else {
        return login_page(&plane, false);
    };
    let job = match Uuid::try_parse(&id) {
        Ok(id) => plane.operations.job(id).await,
        Err(_) => Err(OpsError::NotFound(format!("`{id}` is not an id"))),
    };
    let job = match job {
        Ok(job) => job,
        Err(e) => return error_page(&plane, Some(&session), &e),
    };
    let running = job.status == "running";
    let body = job_body(&plane, &session, &job);
    page(&plane, Some(&session), "Job", &body, running)
}

fn job_body(plane: &Plane, session: &Session, job: &Job) -> String {
    let mount = esc(&plane.mount);
    let percent = match job.total {
        0 => 100,
        total => (i64::from(job.done) * 100 / i64::from(total)).clamp(0, 100),
    };
    let mut body = format!(
        "<h2>{} by {}</h2><p><progress max=\"100\" value=\"{percent}\"></progress> \
         <span id=\"job-progress\">{percent}%</span> ({} of {}) · <span id=\"job-status\">{}</span></p>\
         <table><tr><th>Rate</th><td>{}</td></tr><tr><th>Failed again</th><td id=\"failed-again\">{}</td></tr>\
         <tr><th>Reason</th><td>{}</td></tr>{}</table>",
        esc(&job.action),
        esc(&job.actor),
        job.done,
        job.total,
        esc(&job.status),
        job.rate_per_second
            .map_or("as fast as the outbox goes".into(), |r| format!("{r} a second")),
        job.failed_again,
        opt(&job.reason),
        match &job.paused_reason {
            Some(why) => format!("<tr><th>Paused</th><td>{}</td></tr>", esc(why)),
            None => String::new(),
        }
    );
    if session.who.role >= Role::Operator && job.action == "redrive" {
        let token = hidden("form_token", &session.form_token);
        let button = |action: &str, label: &str| {
            format!(
                "<form class=\"inline\" method=\"post\" action=\"{mount}/jobs/{}/{action}\">{token}\
                 <button id=\"{action}-job\">{label}</button></form> ",
                job.id
            )
        };
        match job.status.as_str() {
            "running" => body.push_str(&(button("pause", "Pause") + &button("cancel", "Cancel"))),
            "paused" => body.push_str(&(button("resume", "Resume") + &button("cancel", "Cancel"))),
            _ => {}
        }
    }
    body
}

/// A form's selection: `ids` (one or more), or its `filter.` fields.
fn form_selection(form: &[(String, String)]) -> Result<Selection, OpsError> {
    let ids: Vec<Uuid> = form
        .iter()
        .filter(|(k, _)| k == "ids")
        .map(|(_, v)| Uuid::try_parse(v).map_err(|_| OpsError::Invalid(format!("`{v}` is not an id"))))
        .collect::<Result<_, _>>()?;
    if !ids.is_empty() {
        return Ok(Selection::Ids(ids));
    }
    let pairs: HashMap<String, String> = form
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("filter.").map(|k| (k.to_owned(), v.clone())))
        .collect();
    Ok(Selection::Filter(filter_of(pairs)?))
}

fn form_value<'a>(form: &'a [(String, String)], key: &str) -> Option<&'a str> {
    form.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.trim().is_empty())
}

fn rate_of(form: &[(String, String)]) -> Result<Option<i32>, OpsError> {
    form_value(form, "rate_per_second")
        .map(|r| {
            r.trim()
                .parse()
                .map_err(|_| OpsError::Invalid(format!("rate `{r}` is not a whole number")))
        })
        .transpose()
}

/// The confirmation of an action: how many messages it takes, and a
/// button that does it.
async fn confirm(
    request: HttpRequest,
    plane: web::Data<Plane>,
    form: web::Form<Vec<(String, String)>>,
) -> HttpResponse {
    let map: HashMap<String, String> = form.iter().cloned().collect();
    let session = match form_session(&request, &plane, &map) {
        Ok(session) => session,
        Err(answer) => return *answer,
    };
    match render_confirm(&plane, &session, &form).await {
        Ok(body) => page(&plane, Some(&session), "Confirm", &body, false),
        Err(e) => error_page(&plane, Some(&session), &e),
    }
}

async fn render_confirm(
    plane: &Plane,
    session: &Session,
    form: &[(String, String)],
) -> Result<String, OpsError> {
    let action = form_value(form, "action").unwrap_or_default();
    let selection = form_selection(form)?;
    let reason = form_value(form, "reason");
    let rate = rate_of(form)?;
    let ops = &plane.operations;
    let count = match action {
        "redrive" => {
            ops.redrive(&session.who, &selection, rate, reason, true)
                .await?
                .total
        }
        "discard" | "restore" => {
            session.who.may(Role::Operator, action)?;
            if action == "discard" && reason.is_none() {
                return Err(OpsError::Invalid("a discard needs a reason".into()));
            }
            let status = if action == "discard" { "open" } else { "discarded" };
            i32::try_from(ops.count(&selection, status).await?).unwrap_or(i32::MAX)
        }
        other => return Err(OpsError::Invalid(format!("no action `{other}`"))),
    };
    let what = match &selection {
        Selection::Ids(ids) if ids.len() == 1 => format!("message {}", ids[0]),
        Selection::Ids(ids) => format!("{} chosen messages", ids.len()),
        Selection::Filter(filter) => format!(
            "every failure matching <code>{}</code>",
            esc(&serde_json::to_string(filter).unwrap_or_default())
        ),
    };
    let fields: String = form
        .iter()
        .filter(|(k, _)| k != "form_token")
        .map(|(k, v)| hidden(k, v))
        .collect();
    Ok(format!(
        "<h2>Confirm</h2><p id=\"confirm-text\">{} <strong id=\"confirm-count\">{count}</strong> {} ({what}){}{}?</p>\
         <form method=\"post\" action=\"{}/act\">{}{fields}<button id=\"confirm\">{}</button></form> \
         <p><a href=\"{}/\">Cancel</a></p>",
        match action {
            "redrive" => "Redrive",
            "discard" => "Discard",
            _ => "Restore",
        },
        if count == 1 { "message" } else { "messages" },
        rate.map_or(String::new(), |r| format!(", {r} a second")),
        reason.map_or(String::new(), |r| format!(", because “{}”", esc(r))),
        esc(&plane.mount),
        hidden("form_token", &session.form_token),
        match action {
            "redrive" => "Redrive",
            "discard" => "Discard",
            _ => "Restore",
        },
        esc(&plane.mount)
    ))
}

/// After an action: its job's page, or why it was refused.
fn to_job_page(plane: &Plane, session: &Session, done: Result<Job, OpsError>) -> HttpResponse {
    match done {
        Ok(job) => see_other(format!("{}/jobs/{}", plane.mount, job.id)),
        Err(e) => error_page(plane, Some(session), &e),
    }
}

async fn act(
    request: HttpRequest,
    plane: web::Data<Plane>,
    form: web::Form<Vec<(String, String)>>,
) -> HttpResponse {
    let map: HashMap<String, String> = form.iter().cloned().collect();
    let session = match form_session(&request, &plane, &map) {
        Ok(session) => session,
        Err(answer) => return *answer,
    };
    let done = async {
        let selection = form_selection(&form)?;
        let reason = form_value(&form, "reason");
        let ops = &plane.operations;
        match form_value(&form, "action").unwrap_or_default() {
            "redrive" => {
                ops.redrive(&session.who, &selection, rate_of(&form)?, reason, false)
                    .await
            }
            "discard" => ops.discard(&session.who, &selection, reason).await,
            "restore" => ops.restore(&session.who, &selection, reason).await,
            other => Err(OpsError::Invalid(format!("no action `{other}`"))),
        }
    }
    .await;
    to_job_page(&plane, &session, done)
}

async fn control_job(
    request: HttpRequest,
    plane: web::Data<Plane>,
    path: web::Path<(String, String)>,
    form: web::Form<HashMap<String, String>>,
) -> HttpResponse {
    let session = match form_session(&request, &plane, &form) {
        Ok(session) => session,
        Err(answer) => return *answer,
    };
    let (id, action) = path.into_inner();
    let done = async {
        let id = Uuid::try_parse(&id).map_err(|_| OpsError::NotFound(format!("`{id}` is not an id")))?;
        let ops = &plane.operations;
        match action.as_str() {
            "pause" => ops.pause_job(&session.who, id).await,
            "resume" => ops.resume_job(&session.who, id).await,
            "cancel" => ops.cancel_job(&session.who, id).await,
            other => Err(OpsError::NotFound(format!("no job action `{other}`"))),
        }
    }
    .await;
    to_job_page(&plane, &session, done)
}

async fn pause_queue(
    request: HttpRequest,
    plane: web::Data<Plane>,
    path: web::Path<(String, String)>,
    form: web::Form<HashMap<String, String>>,
) -> HttpResponse {
    let session = match form_session(&request, &plane, &form) {
        Ok(session) => session,
        Err(answer) => return *answer,
    };
    let (queue, action) = path.into_inner();
    let pause = match action.as_str() {
        "pause" => true,
        "resume" => false,
        other => {
            return error_page(
                &plane,
                Some(&session),
                &OpsError::NotFound(format!("no queue action `{other}`")),
            );
        }
    };
    let reason = form.get("reason").map(String::as_str);
    match plane
        .operations
        .pause_queue(&session.who, &queue, pause, reason)
        .await
    {
        Ok(_) => see_other(format!("{}/", plane.mount)),
        Err(e) => error_page(&plane, Some(&session), &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_message_holds_is_shown_as_text() {
        assert_eq!(
            esc("<script>\"x\" & 'y'</script>"),
            "&lt;script&gt;&quot;x&quot; &amp; &#39;y&#39;&lt;/script&gt;"
        );
        assert_eq!(url_encoded("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
    }

    #[test]
    fn a_forms_selection_is_its_ids_or_its_filter() {
        let id = Uuid::now_v7();
        let form = vec![
            ("ids".to_owned(), id.to_string()),
            ("action".into(), "redrive".into()),
        ];
        assert_eq!(form_selection(&form).unwrap(), Selection::Ids(vec![id]));
        let form = vec![("filter.fingerprint".to_owned(), "abc".to_owned())];
        assert_eq!(
            form_selection(&form).unwrap(),
            Selection::Filter(Filter {
                fingerprint: Some("abc".into()),
                ..Filter::default()
            })
        );
        let typo = vec![("filter.fingerprnt".to_owned(), "abc".to_owned())];
        assert!(
            form_selection(&typo).is_err(),
            "a mistyped key must not select everything"
        );
    }
}
