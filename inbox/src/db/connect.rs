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
