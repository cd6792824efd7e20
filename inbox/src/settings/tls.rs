//! TLS and secrets in the settings: libpq's `ssl*` parameters in
//! `database.url`, the TLS query parameters of RabbitMQ's URI spec in
//! `message_bus.amqp_urls` and the `message_bus.tls_*` settings, and
//! passwords given apart from the URLs (a value, or a mounted file).

use std::path::PathBuf;

use super::{DatabaseSettings, MessageBusSettings, Settings};
use crate::error::{Error, Result};
use crate::tls::{Identity, Roots, Verify};

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum SslMode {
    /// Clear text only.
    Disable,
    /// TLS if the server offers it, unverified; clear text otherwise.
    /// libpq's default, and so this library's (docs/operations.md, "TLS
    /// and secrets").
    #[default]
    Prefer,
    /// TLS, unverified (verified as `verify-ca` when `sslrootcert` is
    /// given, as libpq does).
    Require,
    /// TLS, the chain verified.
    VerifyCa,
    /// TLS, the chain and the host name verified.
    VerifyFull,
}

/// libpq's TLS parameters, which tokio-postgres does not read (it knows
/// `sslmode` only as `disable`, `prefer` or `require`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PgTls {
    pub(crate) mode: SslMode,
    /// Whether the URL said `sslmode` (else `mode` is the default).
    pub(crate) mode_given: bool,
    pub(crate) root_cert: Option<String>,
    pub(crate) cert: Option<String>,
    pub(crate) key: Option<String>,
}

/// The parameters of libpq's that this module takes out of `database.url`.
const PG_TLS_KEYS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

impl PgTls {
    /// `url` without libpq's TLS parameters, and those parameters: from a
    /// URL's query (`?sslmode=verify-full&sslrootcert=/ca.pem`) or a
    /// `key=value` connection string.
    pub(crate) fn split(url: &str) -> Result<(String, PgTls)> {
        let mut tls = PgTls::default();
        let mut take = |key: &str, value: String| -> Result<()> {
            match key {
                "sslmode" => {
                    tls.mode = parse_sslmode(&value)?;
                    tls.mode_given = true;
                }
                "sslrootcert" => tls.root_cert = Some(value),
                "sslcert" => tls.cert = Some(value),
                "sslkey" => tls.key = Some(value),
                _ => {}
            }
            Ok(())
        };
        let rest = if url.contains("://") {
            let (rest, taken) = take_query_params(url, |key| PG_TLS_KEYS.contains(&key));
            for (key, value) in taken {
                take(key, value)?;
            }
            rest
        } else {
            let mut kept = Vec::new();
            for (key, value) in conninfo_pairs(url)? {
                if PG_TLS_KEYS.contains(&key.as_str()) {
                    take(&key, value)?;
                } else {
                    let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
                    kept.push(format!("{key}='{quoted}'"));
                }
            }
            kept.join(" ")
        };
        Ok((rest, tls))
    }

    /// Whether the URL gives any TLS parameter: a mode, a CA or a client
    /// certificate all say TLS is meant.
    pub(crate) fn asks_for_tls(&self) -> bool {
        self.mode_given || self.root_cert.is_some() || self.cert.is_some() || self.key.is_some()
    }

    /// tokio-postgres's mode: whether TLS is off, offered or required.
    pub(crate) fn wire_mode(&self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as Wire;
        match self.mode {
            SslMode::Disable => Wire::Disable,
            SslMode::Prefer => Wire::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Wire::Require,
        }
    }

    /// What the connection checks of the server's certificate.
    pub(crate) fn verify(&self) -> Verify {
        let roots = || match self.root_cert.as_deref() {
            None | Some("system") => Roots::System,
            Some(path) => Roots::File {
                path: PathBuf::from(path),
                setting: "database.url (sslrootcert)".into(),
            },
        };
        match self.mode {
            SslMode::Disable | SslMode::Prefer => Verify::Nothing,
            // libpq: "if a root CA file exists, sslmode=require behaves
            // like verify-ca".
            SslMode::Require if self.root_cert.is_some() => Verify::ChainOnly(roots()),
            SslMode::Require => Verify::Nothing,
            SslMode::VerifyCa => Verify::ChainOnly(roots()),
            SslMode::VerifyFull => Verify::Full(roots()),
        }
    }

    /// The client certificate, if `sslcert` and `sslkey` name one.
    pub(crate) fn identity(&self) -> Result<Option<Identity>> {
        match (&self.cert, &self.key) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => Ok(Some(Identity {
                cert: PathBuf::from(cert),
                cert_setting: "database.url (sslcert)".into(),
                key: PathBuf::from(key),
                key_setting: "database.url (sslkey)".into(),
            })),
            (Some(_), None) => Err(Error::setting(
                "database.url",
                "sslcert needs sslkey: the client certificate's key",
            )),
            (None, Some(_)) => Err(Error::setting(
                "database.url",
                "sslkey needs sslcert: the client certificate",
            )),
        }
    }
}

fn parse_sslmode(value: &str) -> Result<SslMode> {
    Ok(match value {
        "disable" => SslMode::Disable,
        "prefer" => SslMode::Prefer,
        "require" => SslMode::Require,
        "verify-ca" => SslMode::VerifyCa,
        "verify-full" => SslMode::VerifyFull,
        other => {
            return Err(Error::setting(
                "database.url",
                format!(
                    "sslmode `{other}` is not one of disable, prefer, require, verify-ca, verify-full \
                     (libpq's `allow` is not supported: use `prefer`)"
                ),
            ));
        }
    })
}

/// The `key=value` pairs of a libpq connection string: values bare or in
/// single quotes, with `\` escaping the next character.
fn conninfo_pairs(text: &str) -> Result<Vec<(String, String)>> {
    let malformed = || {
        Error::setting(
            "database.url",
            "not a PostgreSQL URL or key=value connection string",
        )
    };
    let mut pairs = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(malformed());
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next().ok_or_else(malformed)? {
                    '\'' => break,
                    '\\' => value.push(chars.next().ok_or_else(malformed)?),
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                match c {
                    '\\' => value.push(chars.next().ok_or_else(malformed)?),
                    c => value.push(c),
                }
            }
        }
        pairs.push((key, value));
    }
}

/// `%XX` sequences decoded (a URL's query value); anything malformed is
/// kept as it is.
fn percent_decode(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

/// The TLS parameters of RabbitMQ's URI spec that this library reads, as
/// RabbitMQ's own clients do; the settings' `message_bus.tls_*` apply
/// where a URL gives none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BrokerTls {
    /// `cacertfile`: the CA to trust instead of the system's.
    pub(crate) ca_file: Option<(String, String)>,
    /// `certfile` and `keyfile`: a client certificate.
    pub(crate) cert_file: Option<(String, String)>,
    pub(crate) key_file: Option<(String, String)>,
    /// `server_name_indication`: the name to verify (and send) instead of
    /// the URL's host.
    pub(crate) server_name: Option<String>,
}

/// Whether `name` is one of the TLS parameters of RabbitMQ's URI spec this
/// library reads (`verify` included, to refuse `verify_none`).
fn is_amqp_tls_param(name: &str) -> bool {
    matches!(
        name,
        "cacertfile" | "certfile" | "keyfile" | "server_name_indication" | "verify"
    )
}

impl BrokerTls {
    /// What `url` (the `index`th of `amqp_urls`) and the `tls_*` settings
    /// say. `verify=verify_none` is refused: this library always verifies
    /// an `amqps://` broker.
    pub(crate) fn of(url: &str, index: usize, bus: &MessageBusSettings) -> Result<BrokerTls> {
        let key = |param: &str| format!("message_bus.amqp_urls[{index}] ({param})");
        let mut tls = BrokerTls {
            ca_file: bus
                .tls_ca_file
                .clone()
                .map(|f| (f, "message_bus.tls_ca_file".into())),
            cert_file: bus
                .tls_cert_file
                .clone()
                .map(|f| (f, "message_bus.tls_cert_file".into())),
            key_file: bus
                .tls_key_file
                .clone()
                .map(|f| (f, "message_bus.tls_key_file".into())),
            server_name: bus.tls_server_name.clone(),
        };
        for (name, value) in amqp_tls_params(url) {
            let name = name.as_str();
            match name {
                "cacertfile" => tls.ca_file = Some((value, key(name))),
                "certfile" => tls.cert_file = Some((value, key(name))),
                "keyfile" => tls.key_file = Some((value, key(name))),
                "server_name_indication" => tls.server_name = Some(value),
                "verify" if value != "verify_peer" => {
                    return Err(Error::setting(
                        &key(name),
                        format!("`{value}`: an amqps:// broker is always verified (verify_peer)"),
                    ));
                }
                _ => {}
            }
        }
        Ok(tls)
    }

    /// What the connection checks: the chain up to `cacertfile` (or the
    /// system's CAs) and the broker's name.
    pub(crate) fn verify(&self) -> Verify {
        Verify::Full(match &self.ca_file {
            Some((path, setting)) => Roots::File {
                path: PathBuf::from(path),
                setting: setting.clone(),
            },
            None => Roots::System,
        })
    }

    /// The client certificate, if `certfile` and `keyfile` name one.
    pub(crate) fn identity(&self) -> Result<Option<Identity>> {
        match (&self.cert_file, &self.key_file) {
            (None, None) => Ok(None),
            (Some((cert, cert_setting)), Some((key, key_setting))) => Ok(Some(Identity {
                cert: PathBuf::from(cert),
                cert_setting: cert_setting.clone(),
                key: PathBuf::from(key),
                key_setting: key_setting.clone(),
            })),
            (Some((_, setting)), None) | (None, Some((_, setting))) => Err(Error::setting(
                setting,
                "a client certificate needs both certfile and keyfile (message_bus.tls_cert_file and \
                 message_bus.tls_key_file)",
            )),
        }
    }
}

/// The TLS parameters of RabbitMQ's URI spec in broker `url`, names and
/// values, decoded as lapin decodes the rest of its query (the `url`
/// crate's `query_pairs`). None when `url` is not a URL: lapin says why
/// when it connects.
fn amqp_tls_params(url: &str) -> Vec<(String, String)> {
    let Ok(url) = url::Url::parse(url) else {
        return Vec::new();
    };
    url.query_pairs()
        .filter(|(name, _)| is_amqp_tls_param(name))
        .map(|(name, value)| (name.into_owned(), value.into_owned()))
        .collect()
}

/// Broker `url` without the TLS parameters of RabbitMQ's URI spec (lapin
/// reads none of them); as it is when it has none, or is not a URL.
pub(crate) fn without_amqp_tls_params(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return url.to_owned();
    };
    if !parsed.query_pairs().any(|(name, _)| is_amqp_tls_param(&name)) {
        return url.to_owned();
    }
    let kept: Vec<(String, String)> = parsed
        .query_pairs()
        .filter(|(name, _)| !is_amqp_tls_param(name))
        .map(|(name, value)| (name.into_owned(), value.into_owned()))
        .collect();
    match kept.is_empty() {
        true => parsed.set_query(None),
        false => {
            parsed.query_pairs_mut().clear().extend_pairs(kept);
        }
    }
    parsed.into()
}

/// `url`, a PostgreSQL URL, without the parameters of its query that
/// `taken` names, and those parameters, names and percent-decoded values,
/// in order. By hand rather than with the `url` crate: a PostgreSQL URL
/// may name several hosts (`postgresql://a:5432,b:5433/db`), which is not
/// a URL the `url` crate accepts, and libpq reads a `+` in a value as a
/// `+`, where the `url` crate's `query_pairs` reads a space.
fn take_query_params(url: &str, taken: impl Fn(&str) -> bool) -> (String, Vec<(&str, String)>) {
    let Some((head, query)) = url.split_once('?') else {
        return (url.to_owned(), Vec::new());
    };
    let (mut kept, mut took) = (Vec::new(), Vec::new());
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if taken(name) {
            took.push((name, percent_decode(value)));
        } else {
            kept.push(pair);
        }
    }
    let rest = match kept.is_empty() {
        true => head.to_owned(),
        false => format!("{head}?{}", kept.join("&")),
    };
    (rest, took)
}

/// A secret given apart from the URL: `file`'s contents (a mounted
/// secret; one trailing newline dropped) or `value`. Setting both is an
/// error naming both keys.
pub(crate) fn secret(
    value: Option<&str>,
    value_key: &str,
    file: Option<&str>,
    file_key: &str,
) -> Result<Option<String>> {
    match (value, file) {
        (Some(_), Some(_)) => Err(Error::setting(
            file_key,
            format!("set either {value_key} or {file_key}, not both"),
        )),
        (Some(value), None) => Ok(Some(value.to_owned())),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::setting(file_key, format!("cannot read {path}: {e}")))?;
            let text = text.strip_suffix('\n').unwrap_or(&text);
            let text = text.strip_suffix('\r').unwrap_or(text);
            Ok(Some(text.to_owned()))
        }
        (None, None) => Ok(None),
    }
}

impl DatabaseSettings {
    /// The password given apart from `url`, if any.
    pub(crate) fn secret_password(&self) -> Result<Option<String>> {
        secret(
            self.password.as_deref(),
            "database.password",
            self.password_file.as_deref(),
            "database.password_file",
        )
    }
}

impl MessageBusSettings {
    /// The password given apart from `amqp_urls`, if any.
    pub(crate) fn secret_password(&self) -> Result<Option<String>> {
        secret(
            self.password.as_deref(),
            "message_bus.password",
            self.password_file.as_deref(),
            "message_bus.password_file",
        )
    }
}

impl Settings {
    /// Whether a PostgreSQL connection tries clear text first: no TLS
    /// parameter given (a CA or a client certificate says TLS is meant)
    /// and every host this machine's own (a loopback address, `localhost`,
    /// a Unix socket), where TLS protects nothing and costs the server
    /// about a fifth more CPU a message. See `db::connect`.
    pub(crate) fn pg_clear_text_first(&self) -> bool {
        let Ok((_, tls)) = PgTls::split(&self.database.url) else {
            return false;
        };
        let Ok(config) = self.pg_config() else {
            return false;
        };
        !tls.asks_for_tls()
            && !config.get_hosts().is_empty()
            && config.get_hosts().iter().all(|host| match host {
                tokio_postgres::config::Host::Tcp(name) => is_loopback(name),
                #[cfg(unix)]
                tokio_postgres::config::Host::Unix(_) => true,
            })
    }

    /// What the start should say about the connections' security: a
    /// connection to a host other than this machine that is in clear text
    /// or does not verify the server. Empty when everything is verified.
    pub(crate) fn insecure_connections(&self) -> Vec<String> {
        let mut said = Vec::new();
        if let Ok((_, tls)) = PgTls::split(&self.database.url)
            && tls.verify() == Verify::Nothing
            && let Ok(config) = self.pg_config()
        {
            let remote = config.get_hosts().iter().any(|host| match host {
                tokio_postgres::config::Host::Tcp(name) => !is_loopback(name),
                #[cfg(unix)]
                tokio_postgres::config::Host::Unix(_) => false,
            });
            if remote {
                let mode = match tls.mode {
                    SslMode::Disable => "sslmode=disable: clear text",
                    SslMode::Prefer => "sslmode=prefer: TLS if offered, the server unverified",
                    _ => "sslmode=require: the server unverified",
                };
                said.push(format!(
                    "database {} ({mode}): set sslmode=verify-full in database.url, with sslrootcert \
                     for a private CA",
                    self.database_endpoint()
                ));
            }
        }
        let urls = match self.message_bus.provider {
            super::Provider::Rabbitmq => self.message_bus.amqp_urls.as_slice(),
            super::Provider::InProcess => &[],
        };
        for url in urls {
            if let Ok(uri) = url.parse::<lapin::uri::AMQPUri>()
                && uri.scheme == lapin::uri::AMQPScheme::AMQP
                && !is_loopback(&uri.authority.host)
            {
                said.push(format!(
                    "broker {} (amqp://: clear text): use amqps://",
                    super::broker_endpoint(url)
                ));
            }
        }
        said
    }
}

/// Whether `host` is this machine: a connection to it crosses no network.
fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}
