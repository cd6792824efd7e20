//! Where the database and the brokers are: the PostgreSQL connection
//! settings, endpoints for logs and errors, and passwords kept out of both.

use std::time::Duration;

use super::tls::PgTls;
use super::{DatabaseSettings, Settings};
use crate::error::{Error, Result};

impl Settings {
    /// Where the brokers are, for logs and errors: each one's
    /// `host:port/vhost`, comma-separated; never a password.
    pub fn broker_endpoint(&self) -> String {
        let endpoints: Vec<String> = self
            .message_bus
            .amqp_urls
            .iter()
            .map(|url| broker_endpoint(url))
            .collect();
        endpoints.join(",")
    }

    /// Where the database is, for logs and errors: `host:port/dbname` (every
    /// host, for a list), never the password.
    pub fn database_endpoint(&self) -> String {
        let Ok(config) = self.pg_config() else {
            return redact(&self.database.url);
        };
        let ports = config.get_ports();
        let hosts: Vec<String> = config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, host)| {
                let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                match host {
                    tokio_postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                    #[cfg(unix)]
                    tokio_postgres::config::Host::Unix(path) => format!("{}:{port}", path.display()),
                }
            })
            .collect();
        format!("{}/{}", hosts.join(","), config.get_dbname().unwrap_or(""))
    }

    /// The PostgreSQL connection settings: `database.url` with
    /// `database.connect_timeout` and, for every session,
    /// `database.lock_timeout` applied.
    ///
    /// libpq's TLS parameters are read apart (tokio-postgres knows none
    /// but `sslmode`): the configuration requires TLS for `require` and the
    /// `verify-*` modes, and the runtime's connector verifies what they say
    /// (docs/operations.md, "TLS and secrets").
    /// `database.password` or `database.password_file` replace the URL's
    /// password.
    pub fn pg_config(&self) -> Result<tokio_postgres::Config> {
        let db = &self.database;
        let (url, tls) = PgTls::split(&db.url)?;
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|e| Error::setting("database.url", format!("not a PostgreSQL URL: {e}")))?;
        config.ssl_mode(tls.wire_mode());
        if let Some(password) = db.secret_password()? {
            config.password(password);
        }
        config.connect_timeout(db.connect_timeout);
        // A peer that vanished without closing: keepalives find an idle
        // connection dead within about 30 s, and unacknowledged writes fail
        // after 30 s, instead of the system's two hours or more.
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(15))
            .tcp_user_timeout(Duration::from_secs(30));
        #[cfg(unix)]
        config
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3);
        // Session settings rather than SET LOCAL in every transaction: no
        // statement more per message.
        let lock = db.lock_timeout.as_millis().max(1);
        let transaction = db.transaction_timeout.as_millis().max(1);
        let session = format!(
            "-c lock_timeout={lock} -c statement_timeout={transaction} \
             -c idle_in_transaction_session_timeout={transaction}"
        );
        let options = match config.get_options() {
            Some(given) if !given.is_empty() => format!("{given} {session}"),
            _ => session,
        };
        config.options(&options);
        Ok(config)
    }
}

impl Settings {
    /// The TLS connector for every PostgreSQL connection (the pool, the
    /// outbox's `LISTEN`, migrations): rustls, verifying what `sslmode`
    /// says, with the CA of `sslrootcert` (or the system's) and the client
    /// certificate of `sslcert` and `sslkey`. Reads those files now: an
    /// error names the parameter and the path.
    pub(crate) fn pg_tls(&self) -> Result<tokio_postgres_rustls::MakeRustlsConnect> {
        let (_, tls) = PgTls::split(&self.database.url)?;
        let config = crate::tls::client_config(&tls.verify(), tls.identity()?.as_ref())?;
        Ok(tokio_postgres_rustls::MakeRustlsConnect::new(
            std::sync::Arc::unwrap_or_clone(config),
        ))
    }
}

impl DatabaseSettings {
    /// The database `url` names, if it names one (PostgreSQL's default is
    /// the user's name) and reads as a PostgreSQL URL.
    pub fn dbname(&self) -> Option<String> {
        let (url, _) = PgTls::split(&self.url).ok()?;
        let config: tokio_postgres::Config = url.parse().ok()?;
        config.get_dbname().map(str::to_owned)
    }

    /// Names database `name` in `url`, keeping the server, the user and the
    /// options: in a URL, its path becomes `/name` (percent-encoded); in a
    /// `key=value` string, a `dbname` is added, which wins over any before
    /// it. Fails, naming `database.url`, when `url` is neither.
    pub fn set_dbname(&mut self, name: &str) -> Result<()> {
        let not_a_url =
            |e: tokio_postgres::Error| Error::setting("database.url", format!("not a PostgreSQL URL: {e}"));
        let parse =
            |url: &str| -> Result<tokio_postgres::Config> { PgTls::split(url)?.0.parse().map_err(not_a_url) };
        parse(&self.url)?;
        let renamed = match self.url.split_once("://") {
            Some((scheme, rest)) => {
                // The authority ends at the path, the query or the fragment;
                // the path, at the query or the fragment.
                let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
                let (authority, tail) = rest.split_at(authority_end);
                let query = tail.strip_prefix('/').unwrap_or(tail);
                let query = &query[query.find(['?', '#']).unwrap_or(query.len())..];
                format!("{scheme}://{authority}/{}{query}", percent_encode(name))
            }
            None => {
                let quoted = name.replace('\\', "\\\\").replace('\'', "\\'");
                format!("{} dbname='{quoted}'", self.url.trim_end())
            }
        };
        let config = parse(&renamed)?;
        if config.get_dbname() != Some(name) {
            return Err(Error::setting(
                "database.url",
                format!("cannot name database `{name}` in it"),
            ));
        }
        self.url = renamed;
        Ok(())
    }
}

/// Every byte but the unreserved ones of RFC 3986 (letters, digits,
/// `-._~`): what a URL's path segment or query value encodes.
const NOT_UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `text` with every byte but the unreserved ones of RFC 3986 as `%XX`, as
/// a URL's path segment or query value.
pub(crate) fn percent_encode(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, NOT_UNRESERVED).to_string()
}

/// Where the broker `url` names is, for logs and errors: `host:port`, then
/// `/vhost` unless it is the default `/`; never the password.
pub(crate) fn broker_endpoint(url: &str) -> String {
    match url.parse::<lapin::uri::AMQPUri>() {
        Ok(uri) if uri.vhost == "/" => format!("{}:{}", uri.authority.host, uri.authority.port),
        Ok(uri) => format!("{}:{}/{}", uri.authority.host, uri.authority.port, uri.vhost),
        Err(_) => redact(url),
    }
}

/// `url` with its password, if any, replaced by `***`: in the
/// `scheme://user:password@host` form, and in PostgreSQL's `key=value`
/// form (`password=...`). For logs, errors and `Debug`.
pub(crate) fn redact(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        if let Some((userinfo, host)) = authority.rsplit_once('@')
            && let Some((user, _password)) = userinfo.split_once(':')
        {
            return format!("{scheme}://{user}:***@{host}{}", redact_options(tail));
        }
        return format!("{scheme}://{authority}{}", redact_options(tail));
    }
    redact_options(url)
}

/// `password=...` (a `key=value` connection string, spaces around `=`
/// allowed, or a URL's query) with the value replaced by `***`, quoted or
/// not.
fn redact_options(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("password") {
        let after = &rest[at + "password".len()..];
        let Some(value) = after.trim_start().strip_prefix('=') else {
            out.push_str(&rest[..rest.len() - after.len()]);
            rest = after;
            continue;
        };
        let value = value.trim_start();
        out.push_str(&rest[..rest.len() - value.len()]);
        out.push_str("***");
        let end = match value.strip_prefix('\'') {
            // A quoted value ends at the first quote that no `\` escapes.
            Some(quoted) => {
                let mut escaped = false;
                let close = quoted.char_indices().find(|&(_, c)| {
                    let closes = c == '\'' && !escaped;
                    escaped = c == '\\' && !escaped;
                    closes
                });
                close.map_or(value.len(), |(i, _)| i + 2)
            }
            None => value.find([' ', '&']).unwrap_or(value.len()),
        };
        rest = &value[end..];
    }
    out.push_str(rest);
    out
}
