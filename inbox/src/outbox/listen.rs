//! Waking the dispatcher when another process commits rows
//! (`LISTEN inbox_outbox`).

use std::time::Duration;

use crate::backoff::Backoff;

/// The channel a commit that staged outbox rows notifies (migration 3).
pub(crate) const CHANNEL: &str = "inbox_outbox";

/// Where the `LISTEN` connection goes: the database's connection settings
/// and its TLS, as the pool's.
#[derive(Clone)]
pub(crate) struct ListenTo {
    config: tokio_postgres::Config,
    connector: crate::db::Connector,
}

impl ListenTo {
    /// The database `settings` name, reached as the pool reaches it.
    pub(crate) fn of(settings: &crate::Settings) -> crate::Result<Self> {
        Ok(Self {
            config: settings.pg_config()?,
            connector: crate::db::Connector::of(settings)?,
        })
    }
}

impl std::fmt::Debug for ListenTo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the configuration: it holds the password.
        f.debug_struct("ListenTo").finish_non_exhaustive()
    }
}

/// Listens on [`CHANNEL`] over a connection of its own (not the pool's:
/// it waits for notifications all along) and calls `wake` for each, until
/// `stop` resolves. A lost connection is opened again with a growing pause;
/// the dispatcher's poll covers the gap.
pub(crate) async fn listen(
    to: ListenTo,
    wake: impl Fn() + Send + 'static,
    stop: impl std::future::Future<Output = ()> + Send,
) {
    use futures_util::StreamExt;
    let listening = async {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        loop {
            match to.connector.open(&to.config).await {
                Ok((client, mut connection)) => {
                    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                    // The LISTEN's answer comes through the connection,
                    // which only the stream below drives.
                    let listen = client.batch_execute("LISTEN inbox_outbox");
                    let mut listen = std::pin::pin!(listen);
                    let mut listening = false;
                    loop {
                        tokio::select! {
                            result = &mut listen, if !listening => match result {
                                Ok(()) => {
                                    listening = true;
                                    // Rows committed meanwhile: look now.
                                    wake();
                                }
                                Err(_) => break,
                            },
                            message = messages.next() => match message {
                                Some(Ok(tokio_postgres::AsyncMessage::Notification(_))) => wake(),
                                Some(Ok(_)) => {}
                                Some(Err(_)) | None => break,
                            },
                        }
                    }
                    tracing::debug!("the outbox's LISTEN connection ended; opening another");
                }
                Err(e) => tracing::debug!(error = %e, "cannot open the outbox's LISTEN connection"),
            }
            tokio::time::sleep(backoff.next_pause()).await;
        }
    };
    tokio::select! {
        () = listening => {}
        () = stop => {}
    }
}
