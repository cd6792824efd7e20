//! A loopback TCP proxy the tests can cut and restore: a database outage for
//! one test, while the real server goes on serving the others.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

pub struct Proxy {
    pub port: u16,
    open: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<AbortHandle>>>,
    accepting: AbortHandle,
}

impl Proxy {
    /// Forwards 127.0.0.1:<port> to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = Arc::new(AtomicBool::new(true));
        let links: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let (accept_open, accept_links) = (Arc::clone(&open), Arc::clone(&links));
        let accepting = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !accept_open.load(Ordering::SeqCst) {
                    continue; // dropped: the client sees the connection close
                }
                let link = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                accept_links.lock().unwrap().push(link.abort_handle());
            }
        })
        .abort_handle();
        Self {
            port,
            open,
            links,
            accepting,
        }
    }

    /// Breaks every connection through it and refuses new ones.
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accepting.abort();
    }
}
