//! RPC: answers, concurrency, every typed error, cancellation on the
//! callee, and handlers that are kameo actors.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry::{Call, Node, NodeAddr, RpcError, RpcRequest};
use kameo::Actor;
use kameo::actor::Spawn;
use kameo::message::{Context, Message};

use crate::{DEADLINE, two_nodes};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_gets_the_handlers_answer_and_the_handler_sees_the_caller() {
    let (server, client) = two_nodes().await;
    let seen = Arc::new(Mutex::new(None));
    let saw = seen.clone();
    server
        .serve_rpc("reverse", move |request: RpcRequest| {
            *saw.lock().unwrap() = Some(request.from);
            let mut body = request.body.to_vec();
            body.reverse();
            async move { Ok(Bytes::from(body)) }
        })
        .unwrap();
    let answer = client
        .call(server.addr(), "reverse", &b"ferry"[..], DEADLINE)
        .await
        .unwrap();
    assert_eq!(&answer[..], b"yrref");
    assert_eq!(seen.lock().unwrap().map(|a| a.id), Some(client.addr().id));
    // An empty argument and an empty answer are fine too.
    let empty = client
        .call(server.addr(), "reverse", Bytes::new(), DEADLINE)
        .await;
    assert_eq!(empty, Ok(Bytes::new()));
}

/// Calls that run concurrently on one session are matched to their own
/// answers, whatever order the handlers finish in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_are_answered_in_any_order_each_with_its_own_answer() {
    let (server, client) = two_nodes().await;
    let finished = Arc::new(Mutex::new(Vec::new()));
    let order = finished.clone();
    server
        .serve_rpc("slow-echo", move |request: RpcRequest| {
            let order = order.clone();
            async move {
                let i = request.body[0];
                // Later calls finish first.
                tokio::time::sleep(Duration::from_millis(5 * (64 - u64::from(i)))).await;
                order.lock().unwrap().push(i);
                Ok(request.body)
            }
        })
        .unwrap();
    let calls: Vec<_> = (0..64u8)
        .map(|i| {
            let (client, peer) = (client.clone(), server.addr());
            tokio::spawn(
                async move { (i, client.call(peer, "slow-echo", vec![i], DEADLINE).await) },
            )
        })
        .collect();
    for call in calls {
        let (i, answer) = call.await.unwrap();
        assert_eq!(answer.unwrap()[..], [i]);
    }
    let finished = finished.lock().unwrap().clone();
    assert_eq!(finished.len(), 64);
    assert!(
        finished.windows(2).any(|w| w[0] > w[1]),
        "the handlers finished in call order, so answers were never reordered: {finished:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_typed_and_a_panicking_handler_fails_only_its_call() {
    let (server, client) = two_nodes().await;
    let peer = server.addr();
    let endpoint = peer.endpoint;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    server
        .serve_rpc("count", move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok(Bytes::from_static(b"ok")) }
        })
        .unwrap();
    server
        .serve_rpc("fail", |_| async { Err("no can do".to_string()) })
        .unwrap();
    server
        .serve_rpc("panic", |_| async { panic!("handler bug") })
        .unwrap();
    server
        .serve_rpc("huge", |_| async { Ok(Bytes::from(vec![7; 100_000])) })
        .unwrap();

    assert_eq!(
        client.call(peer, "missing", Bytes::new(), DEADLINE).await,
        Err(RpcError::NoSuchHandler {
            peer: endpoint,
            name: "missing".into()
        })
    );
    assert_eq!(
        client.call(peer, "fail", Bytes::new(), DEADLINE).await,
        Err(RpcError::Failed {
            peer: endpoint,
            name: "fail".into(),
            message: "no can do".into()
        })
    );
    match client.call(peer, "panic", Bytes::new(), DEADLINE).await {
        Err(RpcError::Failed { message, .. }) => {
            assert!(message.contains("handler bug"), "{message}")
        }
        other => panic!("a panicking handler answered {other:?}"),
    }
    // The node, and the session, live on.
    assert_eq!(
        client.call(peer, "count", Bytes::new(), DEADLINE).await,
        Ok(Bytes::from_static(b"ok"))
    );
    assert_eq!(
        client.call(peer, "huge", Bytes::new(), DEADLINE).await,
        Err(RpcError::AnswerTooLarge {
            peer: endpoint,
            name: "huge".into(),
            len: 100_000,
            limit: 64 << 10
        })
    );
    // Over the limit: refused before anything is sent.
    assert_eq!(
        client
            .call(peer, "count", vec![0; (64 << 10) + 1], DEADLINE)
            .await,
        Err(RpcError::TooLarge {
            len: (64 << 10) + 1,
            limit: 64 << 10
        })
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the refused call ran");
    assert!(matches!(
        client.call(peer, "", Bytes::new(), DEADLINE).await,
        Err(RpcError::BadName(_))
    ));
    assert_eq!(
        server.serve_rpc("count", |_| async { Ok(Bytes::new()) }),
        Err(RpcError::NameTaken("count".into()))
    );
    assert!(server.unserve_rpc("count"));
    assert!(matches!(
        client.call(peer, "count", Bytes::new(), DEADLINE).await,
        Err(RpcError::NoSuchHandler { .. })
    ));

    // Nobody listens there any more.
    let gone = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let nobody = NodeAddr {
        id: peer.id,
        endpoint: gone,
    };
    assert!(matches!(
        client.call(nobody, "count", Bytes::new(), DEADLINE).await,
        Err(RpcError::Unreachable { peer, .. }) if peer == gone
    ));
}

/// Resolves when the handler that held it has been dropped: stopped
/// (cancelled) or finished.
struct Stopped(Option<tokio::sync::oneshot::Sender<()>>);

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// A handler that never answers, and reports when it is stopped.
fn serve_forever(
    server: &Node,
) -> tokio::sync::mpsc::UnboundedReceiver<tokio::sync::oneshot::Receiver<()>> {
    let (started, stops) = tokio::sync::mpsc::unbounded_channel();
    server
        .serve_rpc("forever", move |_| {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let _ = started.send(rx);
            let guard = Stopped(Some(tx));
            async move {
                let _guard = guard;
                std::future::pending::<()>().await;
                Ok(Bytes::new())
            }
        })
        .unwrap();
    stops
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_call_is_a_timeout_and_its_handler_is_stopped() {
    let (server, client) = two_nodes().await;
    let mut stops = serve_forever(&server);
    let timeout = Duration::from_millis(300);
    assert_eq!(
        client
            .call(server.addr(), "forever", Bytes::new(), timeout)
            .await,
        Err(RpcError::Timeout {
            peer: server.addr().endpoint,
            name: "forever".into(),
            after: timeout
        })
    );
    let stopped = stops.recv().await.unwrap();
    tokio::time::timeout(DEADLINE, stopped)
        .await
        .expect("the handler still runs after its deadline")
        .unwrap();
}

/// A caller that drops its call (here after 200 ms of a one-hour timeout)
/// stops the handler on the callee long before the call's own deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_call_stops_its_handler_on_the_callee() {
    let (server, client) = two_nodes().await;
    let mut stops = serve_forever(&server);
    let hour = Duration::from_secs(3600);
    let call = client.call(server.addr(), "forever", Bytes::new(), hour);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), call)
            .await
            .is_err()
    );
    let stopped = stops.recv().await.unwrap();
    tokio::time::timeout(DEADLINE, stopped)
        .await
        .expect("the handler still runs after its caller dropped the call")
        .unwrap();
    // The session is fine afterwards.
    server
        .serve_rpc("ping", |_| async { Ok(Bytes::from_static(b"pong")) })
        .unwrap();
    assert_eq!(
        client
            .call(server.addr(), "ping", Bytes::new(), DEADLINE)
            .await,
        Ok(Bytes::from_static(b"pong"))
    );
}

/// A kameo actor as the handler, called through the caller's node actor.
#[derive(Actor, Default)]
struct Counter {
    total: u64,
}

impl Message<RpcRequest> for Counter {
    type Reply = Result<Bytes, String>;

    async fn handle(
        &mut self,
        request: RpcRequest,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let add: [u8; 8] = request.body[..]
            .try_into()
            .map_err(|_| format!("expected 8 bytes, got {}", request.body.len()))?;
        self.total += u64::from_le_bytes(add);
        Ok(Bytes::copy_from_slice(&self.total.to_le_bytes()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_serves_calls_made_through_the_node_actor() {
    let (server, client) = two_nodes().await;
    server
        .serve_rpc_actor("add", Counter::spawn(Counter::default()))
        .unwrap();
    let call = |body: Vec<u8>| Call {
        peer: server.addr(),
        name: "add".into(),
        body: body.into(),
        timeout: DEADLINE,
    };
    for (add, total) in [(5u64, 5u64), (10, 15), (27, 42)] {
        let answer = client
            .actor()
            .ask(call(add.to_le_bytes().to_vec()))
            .await
            .unwrap();
        assert_eq!(u64::from_le_bytes(answer[..].try_into().unwrap()), total);
    }
    let refused = client.actor().ask(call(vec![1, 2, 3])).await;
    assert!(
        matches!(&refused, Err(kameo::error::SendError::HandlerError(RpcError::Failed { message, .. })) if message == "expected 8 bytes, got 3"),
        "{refused:?}"
    );
}
