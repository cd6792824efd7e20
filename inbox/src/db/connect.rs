//! Opening a PostgreSQL connection, the pool's and the outbox listener's
//! alike, as `database.url` says, with one rule of this library's own:
//! where no TLS parameter is given (`sslmode`, `sslrootcert`, `sslcert`,
//! `sslkey`) and every host is this machine's own, clear text first, and
//! what libpq's default (`prefer`) does only when the server refuses it
//! (libpq's `allow`). `prefer` would encrypt a loopback connection to a
//! server that offers TLS, which protects nothing there (whoever can read
//! loopback traffic is root on the machine) and costs the server about a
//! fifth more CPU a message. A URL that gives a TLS parameter gets exactly
//! what it says.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::future::BoxFuture;
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Config, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::Result;
use crate::settings::Settings;

/// A connection and the future that drives it.
pub(crate) type Opened = (
    Client,
    tokio_postgres::Connection<Socket, <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream>,
);

/// Opens the runtime's PostgreSQL connections.
#[derive(Clone)]
pub(crate) struct Connector {
    tls: MakeRustlsConnect,
    /// No TLS parameter given and every host this machine's own.
    clear_text_first: bool,
    /// Set once the server refused clear text and took `prefer`: straight
    /// to `prefer` from then on, without asking again.
    refuses_clear_text: Arc<AtomicBool>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("clear_text_first", &self.clear_text_first)
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// The connector `settings` say (reads the certificate files now).
    pub(crate) fn of(settings: &Settings) -> Result<Self> {
        Ok(Self {
            tls: settings.pg_tls()?,
            clear_text_first: settings.pg_clear_text_first(),
            refuses_clear_text: Arc::default(),
        })
    }

    /// A connection as `config` says, clear text first where the rule
    /// above applies.
    pub(crate) async fn open(&self, config: &Config) -> std::result::Result<Opened, tokio_postgres::Error> {
        if !self.clear_text_first || self.refuses_clear_text.load(Ordering::Relaxed) {
            return config.connect(self.tls.clone()).await;
        }
        let mut clear = config.clone();
        clear.ssl_mode(SslMode::Disable);
        match clear.connect(self.tls.clone()).await {
            // Unreachable, or a timeout: TLS would not reach it either.
            Err(e) if e.as_db_error().is_none() => Err(e),
            // Refused for what it is, not how it came: no slot left
            // (53300, which the pool's gate reads), a server starting or
            // shutting down. Asked again in TLS, it would double the
            // connections at the moment the server has none to spare, and a
            // slot freed in between would switch this machine to TLS for good.
            Err(e) if refused_whatever_the_encryption(&e) => Err(e),
            Ok(opened) => Ok(opened),
            // Refused by the server, in whatever words and language: a
            // `hostssl`-only pg_hba.conf, a pooler that requires TLS. Asked
            // as `prefer` would ask; if that is refused too, its refusal is
            // the one to report, as it would have been without this rule.
            Err(_) => {
                let opened = config.connect(self.tls.clone()).await?;
                tracing::debug!(
                    "the database refuses clear text on this machine's loopback; TLS from now on"
                );
                self.refuses_clear_text.store(true, Ordering::Relaxed);
                Ok(opened)
            }
        }
    }
}

/// Whether the server refused for a reason encryption does not change:
/// insufficient resources (class 53: too many connections, out of memory)
/// or operator intervention (class 57: starting up, shutting down).
fn refused_whatever_the_encryption(error: &tokio_postgres::Error) -> bool {
    error
        .as_db_error()
        .is_some_and(|e| matches!(&e.code().code()[..2], "53" | "57"))
}

impl deadpool_postgres::Connect for Connector {
    fn connect(
        &self,
        config: &Config,
    ) -> BoxFuture<'_, std::result::Result<(Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>>
    {
        let config = config.clone();
        Box::pin(async move {
            let (client, connection) = self.open(&config).await?;
            // As deadpool's own connector drives it.
            let driving = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(target: "deadpool.postgres", "Connection error: {}", e);
                }
            });
            Ok((client, driving))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{Roots, Verify};

    /// A role with no connection left, on this machine's PostgreSQL. The
    /// connector's TLS trusts only the system's CAs, which this server's
    /// certificate is not signed by, and asks for TLS (`require`): an
    /// attempt in TLS fails on the handshake, with no SQLSTATE, so the
    /// error that comes back tells which attempt made it. No slot left
    /// comes back as it is (53300, for the pool's gate), never asked again
    /// in TLS; a refusal of who connects is asked again.
    #[tokio::test]
    async fn no_slot_left_is_not_read_as_a_refusal_of_clear_text() {
        let settings = Settings::default();
        assert!(
            Connector::of(&settings).unwrap().clear_text_first,
            "the default URL is this machine's"
        );
        let tls = crate::tls::client_config(&Verify::Full(Roots::System), None).unwrap();
        let connector = Connector {
            tls: MakeRustlsConnect::new(Arc::unwrap_or_clone(tls)),
            clear_text_first: true,
            refuses_clear_text: Arc::default(),
        };
        let role = format!("inbox_no_slot_{}", std::process::id());
        let (admin, connection) = tokio_postgres::connect(&settings.database.url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        admin
            .batch_execute(&format!("CREATE ROLE {role} LOGIN CONNECTION LIMIT 0"))
            .await
            .unwrap();
        let mut config: Config = settings.database.url.parse().unwrap();
        config.user(&role).ssl_mode(SslMode::Require);
        let refused = connector.open(&config).await.map(|_| ());
        admin.batch_execute(&format!("DROP ROLE {role}")).await.unwrap();
        let refused = refused.unwrap_err();
        assert_eq!(
            refused.code(),
            Some(&tokio_postgres::error::SqlState::TOO_MANY_CONNECTIONS),
            "the clear-text attempt's refusal, not a TLS attempt's: {refused}"
        );
        assert!(!connector.refuses_clear_text.load(Ordering::Relaxed));
        // A refusal of who connects and how (pg_hba.conf, a role) is asked
        // again in TLS: it may be the encryption that was refused. Here
        // that attempt fails on the handshake.
        config.user("inbox_no_such_role");
        let unknown = connector.open(&config).await.map(|_| ()).unwrap_err();
        assert!(
            unknown.as_db_error().is_none(),
            "asked again in TLS, which fails here: {unknown}"
        );
    }
}
