//! A chunk sent just as the owner closes that idle data connection (issue
//! 37, item 7): the owner never read it, so the initiator sends it again
//! on a new connection instead of failing the op with `ConnectionLost`.
//!
//! The race is made exact by a proxy in front of the owner: on the first
//! data connection it forwards everything until the connection has been
//! idle a moment (a request answered, then quiet), then closes both ends
//! instead of forwarding the next request, as an owner whose idle timeout
//! fired just then would. Later connections it forwards untouched.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry::control::Channel;
use ferry::control::hello::HELLO_LEN;
use ferry::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::pattern;

const T: Duration = Duration::from_secs(20);
/// How long the trapped connection must be quiet before it is cut.
const QUIET: Duration = Duration::from_millis(150);

/// Copies `from` to `to` until either ends.
async fn pump(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf) {
    let mut buf = vec![0; 64 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf).await {
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
}

/// Serves one client connection: forwards it to `owner`, trapping it if
/// `trap` (see the module docs). Counts the connections it trapped.
async fn proxy(client: TcpStream, owner: SocketAddr, trap: bool, trapped: Arc<AtomicUsize>) {
    let Ok(upstream) = TcpStream::connect(owner).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut owner_read, mut owner_write) = upstream.into_split();
    if !trap {
        tokio::join!(
            pump(client_read, owner_write),
            pump(owner_read, client_write)
        );
        return;
    }
    // Both directions in this task, so that "quiet" sees both.
    let (mut up, mut down) = (vec![0; 64 << 10], vec![0; 64 << 10]);
    let mut answered = false;
    loop {
        let quiet = tokio::time::sleep(QUIET);
        tokio::select! {
            n = client_read.read(&mut up) => {
                let Ok(n @ 1..) = n else { return };
                if answered {
                    // Idle, then a request: close, unread.
                    trapped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                if owner_write.write_all(&up[..n]).await.is_err() {
                    return;
                }
            }
            n = owner_read.read(&mut down) => {
                let Ok(n @ 1..) = n else { return };
                if client_write.write_all(&down[..n]).await.is_err() {
                    return;
                }
            }
            _ = quiet => answered = true,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_sent_as_the_owner_closes_an_idle_connection_goes_again() {
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_addr = front.local_addr().unwrap();
    // The owner listens on a port of its own and advertises the proxy's.
    let owner_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let owner = Node::builder()
        .ibverbs(false)
        .memory(false)
        .listen(owner_addr)
        .advertise(proxy_addr)
        .spawn()
        .await
        .unwrap();
    let trapped = Arc::new(AtomicUsize::new(0));
    let data_connections = Arc::new(AtomicUsize::new(0));
    {
        let (trapped, data_connections) = (trapped.clone(), data_connections.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = front.accept().await {
                // The hello's channel decides: peeked, so it is forwarded.
                let mut hello = [0; HELLO_LEN];
                let mut data = false;
                for _ in 0..1000 {
                    match client.peek(&mut hello).await {
                        Ok(HELLO_LEN..) => {
                            data = Channel(hello[6]) == Channel::TCP_DATA;
                            break;
                        }
                        Ok(1..) => tokio::time::sleep(Duration::from_millis(1)).await,
                        _ => break,
                    }
                }
                let trap = data && data_connections.fetch_add(1, Ordering::Relaxed) == 0;
                tokio::spawn(proxy(client, owner_addr, trap, trapped.clone()));
            }
        });
    }
    let client = Node::builder()
        .ibverbs(false)
        .memory(false)
        .tcp_connections(1)
        .spawn()
        .await
        .unwrap();
    let len = 256 << 10;
    let target = owner.alloc(len, Access::ReadWrite).await.unwrap();
    let src = client.alloc(len, Access::ReadWrite).await.unwrap();
    for seed in [1, 2] {
        src.write_at(0, &pattern(len as usize, seed)).unwrap();
        let write = RdmaOp::write(src.whole(), target.remote());
        // The second write goes out on a connection the "owner" closes
        // unread: it must still succeed, on a new connection.
        tokio::time::sleep(QUIET * 3).await;
        client
            .submit(vec![write], T)
            .await
            .unwrap_or_else(|e| panic!("write {seed}: {e}"));
        assert!(
            target.to_vec() == pattern(len as usize, seed),
            "write {seed}"
        );
    }
    assert_eq!(trapped.load(Ordering::Relaxed), 1, "the race was made once");
    assert!(data_connections.load(Ordering::Relaxed) >= 2);
}
