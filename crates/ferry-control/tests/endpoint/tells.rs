//! Tells: requests that nothing answers (session version 3).

use super::*;
use ferry_control::frame::TELL_VERSION;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// A handler that hands each call's body to the test.
const SINK: Service = Service(103);
/// A handler that never ends, holding its slot.
const HOLD: Service = Service(104);

/// Serves [`SINK`] on `b`: the bodies of its calls, in the order handled.
fn sink(b: &Endpoint) -> UnboundedReceiver<Bytes> {
    let (told, heard) = unbounded_channel();
    b.serve(SINK, move |r| {
        let _ = told.send(r.body);
        async { Ok(Bytes::new()) }
    })
    .unwrap();
    heard
}

/// Serves [`HOLD`] on `b`: one message per handler started.
fn hold(b: &Endpoint) -> UnboundedReceiver<()> {
    let (started, holding) = unbounded_channel();
    b.serve(HOLD, move |_| {
        let _ = started.send(());
        std::future::pending()
    })
    .unwrap();
    holding
}

/// A tell runs the peer's handler; nothing answers it, whatever the
/// handler does, and the session goes on.
#[tokio::test]
async fn a_tell_runs_the_peers_handler_and_nothing_answers_it() {
    let (a, b) = (endpoint().await, endpoint().await);
    let mut heard = sink(&b);
    let session = a.session(b.local(), T).await.unwrap();
    for body in [&b"one"[..], b"two"] {
        session.tell(SINK, body, T).await.unwrap();
    }
    for body in [&b"one"[..], b"two"] {
        let got = tokio::time::timeout(T, heard.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&got[..], body, "told in order, heard in order");
    }
    // A failing handler and a missing one are the peer's to log.
    session.tell(FAIL, &b"x"[..], T).await.unwrap();
    session.tell(Service(999), &b"x"[..], T).await.unwrap();
    let answer = session.request(ECHO, &b"still"[..], T).await.unwrap();
    assert_eq!(&answer[..], b"echo: still");

    // On the wire: the first frame back after a tell and a request is the
    // request's answer, even where the tell's handler failed.
    let mut raw = Framed::new(raw_session(&b).await, ControlCodec::default());
    let tell = |service| Frame::Tell {
        service,
        deadline: T,
        body: Bytes::from_static(b"x"),
    };
    for frame in [tell(SINK), tell(FAIL), tell(Service(999))] {
        raw.send(frame).await.unwrap();
    }
    for id in [1, 2] {
        let echo = Frame::Request {
            id,
            service: ECHO,
            deadline: T,
            body: Bytes::new(),
        };
        raw.send(echo).await.unwrap();
    }
    let mut answered = Vec::new();
    while answered.len() < 2 {
        match tokio::time::timeout(T, raw.next()).await.unwrap() {
            Some(Ok(Frame::Response { id, .. })) if id == 1 || id == 2 => answered.push(id),
            other => panic!("expected the requests' answers, got {other:?}"),
        }
    }
}

/// A tell that finds every handler slot taken waits for one, within its
/// deadline, without holding up the session: requests meanwhile are
/// answered `Busy`, and a tell whose deadline passes first never runs.
#[tokio::test]
async fn a_tell_waits_for_a_handler_slot_within_its_deadline() {
    let config = EndpointConfig {
        max_requests_in_flight: 2,
        ..Default::default()
    };
    let (a, b) = (endpoint().await, endpoint_with(config).await);
    let mut heard = sink(&b);
    let session = a.session(b.local(), T).await.unwrap();
    // Two handlers that never finish take both slots.
    let mut holding = hold(&b);
    let held: Vec<_> = (0..2)
        .map(|_| {
            let session = session.clone();
            tokio::spawn(async move { session.request(HOLD, Bytes::new(), T).await })
        })
        .collect();
    for _ in 0..2 {
        tokio::time::timeout(T, holding.recv())
            .await
            .unwrap()
            .unwrap();
    }
    let expires = Duration::from_millis(200);
    session.tell(SINK, &b"expired"[..], expires).await.unwrap();
    session.tell(SINK, &b"waited"[..], T).await.unwrap();
    // Reading goes on while they wait.
    assert!(matches!(
        session.request(ECHO, Bytes::new(), T).await,
        Err(ControlError::Busy { .. })
    ));
    // Well past the first tell's deadline, a slot frees (the dropped
    // request's handler is cancelled): only the second tell runs.
    tokio::time::sleep(expires * 10).await;
    held[0].abort();
    let got = tokio::time::timeout(T, heard.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got[..], b"waited");
    // With every slot free and a round trip since, still nothing else.
    held[1].abort();
    session.request(ECHO, Bytes::new(), T).await.unwrap();
    assert!(heard.try_recv().is_err(), "the expired tell ran");
}

/// As many tells may wait for a slot as may run; one more is dropped.
#[tokio::test]
async fn tells_beyond_those_that_may_wait_are_dropped() {
    let config = EndpointConfig {
        max_requests_in_flight: 1,
        ..Default::default()
    };
    let (a, b) = (endpoint().await, endpoint_with(config).await);
    let mut heard = sink(&b);
    let mut holding = hold(&b);
    let session = a.session(b.local(), T).await.unwrap();
    let held = {
        let session = session.clone();
        tokio::spawn(async move { session.request(HOLD, Bytes::new(), T).await })
    };
    tokio::time::timeout(T, holding.recv())
        .await
        .unwrap()
        .unwrap();
    session.tell(SINK, &b"waits"[..], T).await.unwrap();
    session.tell(SINK, &b"dropped"[..], T).await.unwrap();
    // Both were read (a request behind them is answered) before the slot
    // frees.
    assert!(matches!(
        session.request(ECHO, Bytes::new(), T).await,
        Err(ControlError::Busy { .. })
    ));
    held.abort();
    let got = tokio::time::timeout(T, heard.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got[..], b"waits");
    session.request(ECHO, Bytes::new(), T).await.unwrap();
    assert!(heard.try_recv().is_err(), "the tell beyond the bound ran");
}

/// To a peer that speaks no tells (session version 2), a tell goes as a
/// request and waits for its answer; to one that does, as a `Tell` frame.
#[tokio::test]
async fn a_tell_goes_as_a_request_to_a_peer_before_tells() {
    let b = endpoint().await;
    let (sessions, mut session_of) = unbounded_channel();
    b.serve(SINK, move |r| {
        let _ = sessions.send(r.session);
        async { Ok(Bytes::new()) }
    })
    .unwrap();
    for version in [TELL_VERSION - 1, TELL_VERSION] {
        let raw = raw_session_up_to(&b, version).await;
        let mut raw = Framed::new(raw, ControlCodec::default());
        // A call of ours hands the test b's end of this session.
        raw.send(Frame::Request {
            id: 1,
            service: SINK,
            deadline: T,
            body: Bytes::new(),
        })
        .await
        .unwrap();
        let theirs = tokio::time::timeout(T, session_of.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(theirs.version(), version);
        assert!(matches!(
            tokio::time::timeout(T, raw.next()).await.unwrap(),
            Some(Ok(Frame::Response { id: 1, .. }))
        ));

        let telling = tokio::spawn(async move { theirs.tell(ECHO, &b"hi"[..], T).await });
        match tokio::time::timeout(T, raw.next()).await.unwrap() {
            Some(Ok(Frame::Request {
                id, service, body, ..
            })) if version < TELL_VERSION => {
                assert_eq!((service, &body[..]), (ECHO, &b"hi"[..]));
                assert!(
                    !telling.is_finished(),
                    "a request's tell waits for the answer"
                );
                raw.send(Frame::Response {
                    id,
                    status: ferry_control::frame::Status::Ok,
                    body: Bytes::new(),
                })
                .await
                .unwrap();
            }
            Some(Ok(Frame::Tell { service, body, .. })) if version >= TELL_VERSION => {
                assert_eq!((service, &body[..]), (ECHO, &b"hi"[..]));
            }
            other => panic!("version {version}: {other:?}"),
        }
        tokio::time::timeout(T, telling)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}
