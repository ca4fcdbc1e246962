//! A notification names its sending agent in its body (NIXL reports the
//! agent; the receiver may not have loaded the sender), so the name is a
//! claim; the node it came from is not. A notification naming an agent of
//! another node is dropped and counted, never reported as that agent's.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry::{Node, NodeAddr};
use plugin_FERRY::engine::{Engine, Status};

const DEADLINE: Duration = Duration::from_secs(20);

fn tcp_engine(agent: &str) -> Engine {
    let params = HashMap::from([("transports".to_string(), "tcp".to_string())]);
    Engine::new(agent, &params).unwrap()
}

/// The node address in an engine's connection info.
fn addr_of(engine: &Engine) -> NodeAddr {
    let info: serde_json::Value = serde_json::from_str(&engine.conn_info()).unwrap();
    serde_json::from_value(info["addr"].clone()).unwrap()
}

/// A notification as FERRY frames it: the agent's name, then the message.
fn framed(agent: &str, msg: &[u8]) -> Vec<u8> {
    let mut body = (agent.len() as u16).to_le_bytes().to_vec();
    body.extend_from_slice(agent.as_bytes());
    body.extend_from_slice(msg);
    body
}

/// Polls `engine` until `want` notifications came (or the deadline).
fn gather(engine: &Engine, want: usize) -> Vec<(String, Vec<u8>)> {
    let mut got = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    while got.len() < want && Instant::now() < deadline {
        engine.notifs(|agent, msg| got.push((String::from_utf8_lossy(agent).into(), msg.to_vec())));
    }
    got
}

#[test]
fn a_notification_naming_another_nodes_agent_is_dropped_and_counted() {
    let decode = tcp_engine("decode");
    let prefill = tcp_engine("prefill");
    assert_eq!(
        decode.load_conn_info("prefill", prefill.conn_info().as_bytes()),
        Status::Success
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let intruder = runtime
        .block_on(Node::builder().ibverbs(false).memory(false).spawn())
        .unwrap();
    let to = addr_of(&decode);
    let send = |body: Vec<u8>| {
        runtime
            .block_on(intruder.notify(to, body, DEADLINE))
            .unwrap()
    };
    // As the loaded agent "prefill", whose node it is not; as the receiving
    // agent itself; then as a new name, which binds that name to it.
    send(framed("prefill", b"forged"));
    send(framed("decode", b"forged"));
    send(framed("sidecar", b"first"));
    // A real one from prefill, behind them on another connection.
    assert_eq!(
        decode.load_conn_info("prefill", prefill.conn_info().as_bytes()),
        Status::Success
    );
    assert_eq!(
        prefill.load_conn_info("decode", decode.conn_info().as_bytes()),
        Status::Success
    );
    assert_eq!(prefill.gen_notif("decode", b"real"), Status::Success);
    let mut got = gather(&decode, 2);
    got.sort();
    assert_eq!(
        got,
        [
            ("prefill".to_string(), b"real".to_vec()),
            ("sidecar".to_string(), b"first".to_vec())
        ]
    );
    assert_eq!(decode.misnamed(), 2);
    // Another node speaking as "sidecar" now: dropped too.
    let other = runtime
        .block_on(Node::builder().ibverbs(false).memory(false).spawn())
        .unwrap();
    runtime
        .block_on(other.notify(to, framed("sidecar", b"second"), DEADLINE))
        .unwrap();
    let deadline = Instant::now() + DEADLINE;
    while decode.misnamed() < 3 {
        assert!(
            Instant::now() < deadline,
            "the third misnamed one never came"
        );
        decode.notifs(|agent, _| panic!("reported {:?}", String::from_utf8_lossy(agent)));
    }
}
