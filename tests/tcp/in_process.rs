//! Two nodes in one process: the quickest end-to-end check of the data path.

use std::time::Duration;

use ferry::prelude::*;

use crate::common::pattern;

const T: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_read_back_between_two_nodes() {
    let a = Node::builder().spawn().await.unwrap();
    let b = Node::builder().spawn().await.unwrap();
    let len: usize = 3 << 20 | 123;
    let src = a.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let back = a.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let target = b.alloc(len as u64 + 10, Access::ReadWrite).await.unwrap();
    let data = pattern(len, 7);
    src.write_at(0, &data).unwrap();
    let remote = target.remote().slice(5..5 + len as u64).unwrap();

    a.submit(vec![RdmaOp::write(src.whole(), remote.clone())], T)
        .await
        .unwrap();
    let mut expect = vec![0u8; len + 10];
    expect[5..5 + len].copy_from_slice(&data);
    assert_eq!(target.to_vec(), expect);

    a.submit(vec![RdmaOp::read(back.whole(), remote)], T)
        .await
        .unwrap();
    assert_eq!(back.to_vec(), data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_last_node_handle_closes_its_listener() {
    let node = Node::builder().spawn().await.unwrap();
    let endpoint = node.addr().endpoint;
    assert!(tokio::net::TcpStream::connect(endpoint).await.is_ok());
    drop(node);
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(endpoint).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{endpoint} still accepts connections after the node was dropped");
}
