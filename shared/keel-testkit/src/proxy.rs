//! A TCP proxy a test can cut: services reach NATS or Postgres through it, and cutting it
//! is, to them, the server going away — every connection drops and new ones are refused
//! until it is restored — without stopping the shared server other tests use.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Debug)]
pub struct Proxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// True while the proxy is cut.
    cut: watch::Sender<bool>,
    accept: JoinHandle<()>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    /// Forwards a free local port to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(false);
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let held = connections.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *cut_rx.borrow() {
                    drop(client);
                    continue;
                }
                let connection = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(upstream).await {
                        let mut client = client;
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                let mut held = held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                held.retain(|c| !c.is_finished());
                held.push(connection);
            }
        });
        Ok(Self { addr, cut, accept, connections })
    }

    /// Drops every connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.cut.send_replace(true);
        let connections =
            std::mem::take(&mut *self.connections.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        for connection in connections {
            connection.abort();
        }
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}
