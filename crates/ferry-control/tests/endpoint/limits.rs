//! The connection limits: per address, in total, the hello's deadline,
//! and what a newcomer is told when nothing can make room.

use super::*;

/// Connects from a chosen loopback address (all of 127/8 is loopback).
async fn connect_from(source: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(format!("{source}:0").parse().unwrap())?;
    socket.connect(to).await
}

/// Whether the server has hung up on `stream` (within a moment), after
/// whatever it said first (a refusal's `Busy` hello reply).
async fn hung_up(stream: &mut TcpStream) -> bool {
    let mut bytes = [0; HELLO_LEN];
    let closed = async {
        loop {
            match stream.read(&mut bytes).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(2), closed)
        .await
        .is_ok()
}

/// How many of `streams` the server hangs up on, all watched at once.
async fn count_hung_up(streams: &mut [TcpStream]) -> usize {
    let checks = streams.iter_mut().map(hung_up);
    futures_util::future::join_all(checks)
        .await
        .into_iter()
        .filter(|&h| h)
        .count()
}

/// An endpoint's config with these bounds on connections, in total and
/// per address, and timeouts long enough that none fires in a test.
fn limited(max_connections: usize, max_per_address: usize) -> EndpointConfig {
    let long = Duration::from_secs(30);
    EndpointConfig {
        limits: ConnectionLimits {
            max_connections,
            max_per_address,
            hello_timeout: long,
            idle_timeout: long,
            frame_timeout: long,
        },
        ..Default::default()
    }
}

#[tokio::test]
async fn a_flood_from_one_address_does_not_lock_out_others() {
    let b = endpoint_with(limited(40, 10)).await;
    let a = endpoint().await;
    // A peer with a session before the flood.
    let before = a.session(b.local(), T).await.unwrap();

    // Silent connections from 127.0.0.2: the first 10 are held, the rest
    // are closed at once while those are fresh (see EVICTABLE_AFTER).
    let mut flood = Vec::new();
    for _ in 0..10 {
        flood.push(connect_from("127.0.0.2", b.local().endpoint).await.unwrap());
    }
    let mut extra = connect_from("127.0.0.2", b.local().endpoint).await.unwrap();
    assert!(hung_up(&mut extra).await, "the 11th connection is refused");
    assert!(!hung_up(&mut flood[0]).await, "held ones stay open");

    // Others are served, old and new.
    assert!(before.request(ECHO, Bytes::new(), T).await.is_ok());
    let c = endpoint().await;
    let fresh = c.session(b.local(), T).await.unwrap();
    assert!(fresh.request(ECHO, Bytes::new(), T).await.is_ok());

    // Once they have idled a while, the oldest makes room for a newcomer.
    tokio::time::sleep(EVICTABLE_AFTER).await;
    let mut newcomer = connect_from("127.0.0.2", b.local().endpoint).await.unwrap();
    assert!(!hung_up(&mut newcomer).await, "the newcomer is held");
    assert!(
        hung_up(&mut flood[0]).await,
        "the oldest idle one made room"
    );
    assert!(!hung_up(&mut flood[1]).await, "only the oldest");

    // Closing the flood makes room again.
    drop(flood);
    let mut later = None;
    for _ in 0..100 {
        let mut s = connect_from("127.0.0.2", b.local().endpoint).await.unwrap();
        if !hung_up(&mut s).await {
            later = Some(s);
            break;
        }
    }
    assert!(
        later.is_some(),
        "127.0.0.2 is admitted again once its connections closed"
    );
}

#[tokio::test]
async fn at_the_total_bound_open_sessions_keep_working() {
    let b = endpoint_with(limited(12, 4)).await;
    let a = endpoint().await;
    let session = a.session(b.local(), T).await.unwrap();
    // Fill the rest of the total from several addresses.
    let mut flood = Vec::new();
    for source in ["127.0.0.2", "127.0.0.3", "127.0.0.4"] {
        for _ in 0..4 {
            flood.push(connect_from(source, b.local().endpoint).await.unwrap());
        }
    }
    assert_eq!(
        count_hung_up(&mut flood).await,
        1,
        "one over the total of 12 (1 session + 11 held)"
    );
    // The established session is served throughout.
    for _ in 0..10 {
        assert!(session.request(ECHO, Bytes::new(), T).await.is_ok());
    }
}

#[tokio::test]
async fn a_client_that_never_says_hello_is_disconnected() {
    let config = EndpointConfig {
        limits: ConnectionLimits {
            hello_timeout: Duration::from_millis(300),
            ..Default::default()
        },
        ..Default::default()
    };
    let b = endpoint_with(config).await;
    let mut silent = TcpStream::connect(b.local().endpoint).await.unwrap();
    let started = std::time::Instant::now();
    assert!(hung_up(&mut silent).await);
    assert!(started.elapsed() >= Duration::from_millis(250));
}

/// At the bound with nothing idle (a control session never is), a new
/// connection is told `Busy` in a hello reply, which a data plane sees as
/// the owner at its connection limit, however often it asks.
#[tokio::test]
async fn at_a_bound_with_nothing_idle_a_new_connection_is_told_busy() {
    let config = EndpointConfig {
        limits: ConnectionLimits {
            max_per_address: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let b = endpoint_with(config).await;
    let a = endpoint().await;
    let session = a.session(b.local(), T).await.unwrap();
    for _ in 0..20 {
        let refused = ferry_control::Dialer::new(NodeId::random(), None)
            .connect(b.local(), Channel::TCP_DATA)
            .await
            .unwrap_err();
        let endpoint = b.local().endpoint;
        assert_eq!(
            refused,
            ControlError::Refused {
                endpoint,
                status: Some(HelloStatus::Busy)
            }
        );
        assert!(matches!(
            ferry_core::OpError::from(refused),
            ferry_core::OpError::PeerBusy { endpoint: e, .. } if e == endpoint
        ));
    }
    // The session that holds the place is served throughout.
    assert!(session.request(ECHO, Bytes::new(), T).await.is_ok());
}
