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
            session_evictable_after: long,
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

/// At the bound with nothing idle (a control session is only once it has
/// received nothing for `session_evictable_after`, 10 s here), a new
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

/// Waits (within `T`) until `endpoint` holds `count` accepted connections.
async fn wait_accepted(endpoint: &Endpoint, count: usize) {
    let started = std::time::Instant::now();
    while endpoint.accepted_connections() != count {
        assert!(
            started.elapsed() < T,
            "{} accepted connections, not {count}",
            endpoint.accepted_connections()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A session from `a` to `b`, asked for again until `within` has passed
/// (each refusal is immediate): `Ok` with the attempts it took.
async fn session_within(
    a: &Endpoint,
    b: &Endpoint,
    within: Duration,
) -> Result<(ferry_control::Session, usize), ControlError> {
    let started = std::time::Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        match a.session(b.local(), T).await {
            Ok(session) => return Ok((session, attempts)),
            Err(e) if started.elapsed() >= within => return Err(e),
            // The good peer's retry, not a wait for the endpoint's state.
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Issue 55: control sessions from 127.0.0.2 that said their hello and
/// `Open` and then nothing fill the endpoint's total: a good peer opens
/// a session anyway once they have idled a while, the least recently
/// used of them making room. Before, a session was never idle, and the
/// good peer was told `Busy` for as long as the flood stayed.
#[tokio::test]
async fn idle_control_sessions_make_room_for_a_good_peer() {
    let mut config = limited(8, 8);
    config.limits.session_evictable_after = Duration::from_millis(500);
    let b = endpoint_with(config).await;
    let mut flood = Vec::new();
    for _ in 0..8 {
        let raw = connect_from("127.0.0.2", b.local().endpoint).await.unwrap();
        flood.push(raw_session_on(raw, b.local().id, SESSION_VERSIONS.1).await);
    }
    // The oldest has a request in flight: it is in use, however quiet.
    let mut framed = Framed::new(flood.remove(0), ControlCodec::default());
    let slow = Frame::Request {
        id: 1,
        service: SLOW,
        deadline: Duration::from_secs(60),
        body: Bytes::new(),
    };
    framed.send(slow).await.unwrap();
    let mut busy = framed.into_inner();
    wait_accepted(&b, 8).await;
    let a = endpoint().await;
    let opened = session_within(&a, &b, Duration::from_secs(8)).await;
    let held = b.accepted_connections();
    let closed = count_hung_up(&mut flood).await;
    eprintln!(
        "8 idle sessions held; the good peer: {opened:?}; then {held} held, {closed} of the \
         flood closed"
    );
    let (session, _) = opened.expect("the good peer opened a session");
    assert!(session.request(ECHO, Bytes::new(), T).await.is_ok());
    assert_eq!(held, 8, "the good peer's session took an idle one's place");
    assert_eq!(closed, 1, "one idle session made room");
    assert!(
        !hung_up(&mut busy).await,
        "not the one with a request in flight"
    );
}

/// Pre-hello connections make room before idle sessions, even newer ones:
/// they have proved nothing. (Sessions evictable after 1.5 s: each kind
/// makes room only once idle for its own while, and a session's is the
/// longer one by default too.)
#[tokio::test]
async fn unproven_connections_make_room_before_idle_sessions() {
    let mut config = limited(8, 8);
    config.limits.session_evictable_after = EVICTABLE_AFTER + Duration::from_millis(500);
    let b = endpoint_with(config).await;
    let mut sessions = Vec::new();
    for _ in 0..4 {
        let raw = connect_from("127.0.0.2", b.local().endpoint).await.unwrap();
        sessions.push(raw_session_on(raw, b.local().id, SESSION_VERSIONS.1).await);
    }
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(connect_from("127.0.0.3", b.local().endpoint).await.unwrap());
    }
    wait_accepted(&b, 8).await;
    let a = endpoint().await;
    let (session, attempts) = session_within(&a, &b, Duration::from_secs(8))
        .await
        .expect("the good peer opened a session");
    assert!(session.request(ECHO, Bytes::new(), T).await.is_ok());
    let (closed_sessions, closed_silent) = (
        count_hung_up(&mut sessions).await,
        count_hung_up(&mut silent).await,
    );
    eprintln!(
        "after {attempts} attempts: {closed_sessions} idle sessions and {closed_silent} \
         pre-hello connections closed"
    );
    assert_eq!((closed_sessions, closed_silent), (0, 1));
}
