//! Asking the node's actor from code that returns ferry's own errors: each
//! message's kameo `SendError` converts with `?`, and byte-string literals
//! are message bodies.

use std::time::Duration;

use kameo::error::SendError;

use crate::prelude::*;
use crate::{
    Call, MessageError, NotifyError, RegisterError, RpcError, SendMessage, SubmitWithNotification,
};

const T: Duration = Duration::from_secs(10);

async fn node() -> Node {
    Node::builder()
        .listen("127.0.0.1:0".parse().unwrap())
        .ibverbs(false)
        .memory(false)
        .spawn()
        .await
        .unwrap()
}

async fn alloc(node: &Node) -> Result<Region, RegisterError> {
    Ok(node
        .actor()
        .ask(Alloc {
            len: 4096,
            access: Access::ReadWrite,
        })
        .await?)
}

async fn send(node: &Node, peer: &Node) -> Result<(), MessageError> {
    node.send_message(peer.addr(), b"direct", T).await?;
    node.actor()
        .ask(SendMessage::new(peer.addr(), b"asked", T))
        .await?;
    Ok(())
}

async fn call(node: &Node, peer: &Node) -> Result<Bytes, RpcError> {
    let direct = node.call(peer.addr(), "echo", "direct", T).await?;
    assert_eq!(direct, Bytes::from_static(b"direct"));
    Ok(node
        .actor()
        .ask(Call::new(peer.addr(), "echo", b"asked", T))
        .await?)
}

async fn notify(node: &Node, ops: Vec<RdmaOp>) -> Result<(), NotifyError> {
    Ok(node
        .actor()
        .ask(SubmitWithNotification::new(ops, T, b"written".to_vec()))
        .await?)
}

#[tokio::test]
async fn every_message_answers_with_question_mark_and_literal_bodies() {
    let (a, b) = (node().await, node().await);
    let mut inbox = b.inbox().unwrap();
    b.serve_rpc("echo", |request| async move { Ok(request.body) })
        .unwrap();

    let local = alloc(&a).await.unwrap();
    assert_eq!(local.len(), 4096);
    local.write_at(0, b"payload!").unwrap();
    let target = alloc(&b).await.unwrap();

    send(&a, &b).await.unwrap();
    for expected in [&b"direct"[..], b"asked"] {
        let delivery = inbox.recv().await.unwrap();
        assert_eq!(delivery.body, expected);
        assert_eq!(delivery.from, a.addr());
    }

    assert_eq!(call(&a, &b).await.unwrap(), Bytes::from_static(b"asked"));

    let op = RdmaOp::write(
        local.slice(0..8usize).unwrap(),
        target.remote().slice(0..8).unwrap(),
    );
    notify(&a, vec![op]).await.unwrap();
    assert_eq!(inbox.recv().await.unwrap().body, &b"written"[..]);
    let mut landed = [0u8; 8];
    target.read_at(0, &mut landed).unwrap();
    assert_eq!(&landed, b"payload!");
}

/// An actor that did not answer becomes each error's "not running"
/// variant; a handler's error comes through as it is.
#[test]
fn send_errors_convert_to_each_messages_error() {
    assert_eq!(
        RegisterError::from(SendError::<Alloc, RegisterError>::ActorStopped),
        RegisterError::BackendStopped
    );
    assert_eq!(
        RegisterError::from(SendError::<Alloc, _>::HandlerError(
            RegisterError::ZeroLength
        )),
        RegisterError::ZeroLength
    );
    assert_eq!(
        MessageError::from(SendError::<SendMessage, MessageError>::ActorStopped),
        MessageError::NodeStopped
    );
    assert_eq!(
        RpcError::from(SendError::<Call, RpcError>::Timeout(None)),
        RpcError::NodeStopped
    );
    assert_eq!(
        NotifyError::from(SendError::<SubmitWithNotification, NotifyError>::ActorStopped),
        NotifyError::Submit(SubmitError::BackendStopped)
    );
}
