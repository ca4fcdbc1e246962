//! Messages and RPC between two nodes over their control session (loopback
//! TCP).

mod messages;
mod notifications;
mod publish;
mod relay;
mod rpc;
mod secret;

use std::time::Duration;

use ferry::Node;

/// Every wait in these tests ends by then, pass or fail.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// A receiving (or serving) node and a sending (or calling) one.
pub async fn two_nodes() -> (Node, Node) {
    let server = Node::builder().spawn().await.unwrap();
    let client = Node::builder().spawn().await.unwrap();
    (server, client)
}
