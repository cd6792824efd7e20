//! A loopback TCP proxy the tests can break: cut (connections close), or
//! blackholed (nothing gets through, yet every socket stays open, as with a
//! network that drops packets), for one test while the real server goes on
//! serving the others.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Network {
    /// Forwards it.
    Up,
    /// Closes every connection and refuses new ones.
    Cut,
    /// Holds it: reads nothing more, forwards nothing, closes nothing.
    Blackhole,
}

pub(crate) struct Proxy {
    pub(crate) port: u16,
    /// What new connections, and the ones open since the last
    /// [`restore_for_new_connections`](Self::restore_for_new_connections), see.
    network: Arc<Mutex<watch::Sender<Network>>>,
    /// Kept so that the connections left in a blackhole stay there.
    stranded: Mutex<Vec<watch::Sender<Network>>>,
    links: Arc<Mutex<Vec<AbortHandle>>>,
    accepting: AbortHandle,
}

impl Proxy {
    /// Forwards 127.0.0.1:<port> to `target`.
    pub(crate) async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let network = Arc::new(Mutex::new(watch::channel(Network::Up).0));
        let links: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let (accept_network, accept_links) = (Arc::clone(&network), Arc::clone(&links));
        let accepting = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let network = accept_network.lock().unwrap().subscribe();
                if *network.borrow() == Network::Cut {
                    continue; // dropped: the client sees the connection close
                }
                let link = tokio::spawn(async move {
                    let mut network = network;
                    // A connection opened in a blackhole is accepted, and
                    // then nothing more happens.
                    if !passing(&mut network).await {
                        return;
                    }
                    if let Ok(server) = TcpStream::connect(target).await {
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        tokio::join!(
                            pump(client_read, server_write, network.clone()),
                            pump(server_read, client_write, network),
                        );
                    }
                });
                accept_links.lock().unwrap().push(link.abort_handle());
            }
        })
        .abort_handle();
        Self {
            port,
            network,
            stranded: Mutex::default(),
            links,
            accepting,
        }
    }

    fn set(&self, network: Network) {
        self.network.lock().unwrap().send_replace(network);
    }

    /// Breaks every connection through it and refuses new ones.
    pub(crate) fn cut(&self) {
        self.set(Network::Cut);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    /// Connections through it that are open now.
    pub(crate) fn open_connections(&self) -> usize {
        self.links
            .lock()
            .unwrap()
            .iter()
            .filter(|link| !link.is_finished())
            .count()
    }

    /// Stops all traffic without closing anything: packets vanish.
    pub(crate) fn blackhole(&self) {
        self.set(Network::Blackhole);
    }

    /// Lets traffic through again; what a blackhole held goes on.
    pub(crate) fn restore(&self) {
        self.set(Network::Up);
    }

    /// Lets new connections through, while the ones open now stay in a
    /// blackhole for good: a firewall that lost their state. Only a bound
    /// on every wait gets past this.
    pub(crate) fn restore_for_new_connections(&self) {
        let mut network = self.network.lock().unwrap();
        network.send_replace(Network::Blackhole);
        let old = std::mem::replace(&mut *network, watch::channel(Network::Up).0);
        self.stranded.lock().unwrap().push(old);
    }
}

/// Waits until traffic may pass; `false` once the proxy is gone.
async fn passing(network: &mut watch::Receiver<Network>) -> bool {
    network.wait_for(|n| *n == Network::Up).await.is_ok()
}

/// Copies one direction, holding whatever it read (an end of stream too)
/// while the network is a blackhole.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut network: watch::Receiver<Network>) {
    let mut buffer = vec![0; 16 * 1024];
    loop {
        if !passing(&mut network).await {
            return;
        }
        let read = from.read(&mut buffer).await;
        if !passing(&mut network).await {
            return;
        }
        match read {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to.write_all(&buffer[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accepting.abort();
    }
}

/// Points `settings` at PostgreSQL through a proxy the test can break, with
/// a one-second connect timeout.
pub(crate) async fn database_through_proxy(settings: &mut rabbit_inbox::Settings) -> Proxy {
    let real = settings.pg_config().unwrap();
    let port = real.get_ports().first().copied().unwrap_or(5432);
    let proxy = Proxy::start(([127, 0, 0, 1], port).into()).await;
    let user = real.get_user().unwrap_or("postgres");
    let database = real.get_dbname().unwrap_or("postgres");
    settings.database.url = format!("postgres://{user}@127.0.0.1:{}/{database}", proxy.port);
    settings.database.connect_timeout = std::time::Duration::from_secs(1);
    proxy
}

/// Points `settings` at RabbitMQ through a proxy the test can break, with
/// two-second heartbeats (what notices a silent broker) and a two-second
/// connect timeout.
pub(crate) async fn broker_through_proxy(settings: &mut rabbit_inbox::Settings) -> Proxy {
    let proxy = Proxy::start(([127, 0, 0, 1], 5672).into()).await;
    settings.message_bus.amqp_urls = vec![format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f?heartbeat=2",
        proxy.port
    )];
    settings.message_bus.connect_timeout = std::time::Duration::from_secs(2);
    proxy
}
