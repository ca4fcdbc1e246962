//! Sixteen nodes, each its own process, all to all for a few seconds: each
//! one, round after round, writes into every other's memory with a
//! notification and reads it back, reads every other's read-only region,
//! sends it a message and calls it. Every byte is compared, every call
//! answered, and every notification and message arrives exactly once.
//! Half the members run the memory transport: pairs of those move bytes
//! through shared memory, every other pair over TCP.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferry::prelude::*;
use ferry::{DeliveryKind, Inbox, NodeAddr};
use serde_json::{Value, json};
use tokio::io::{BufReader, Lines};
use tokio::sync::{mpsc, oneshot};

use crate::child::{Child, say};
use crate::{DEADLINE, open_fds, pattern, read_and_check, rss_kib, serial, soak};

/// Processes.
const MEMBERS: usize = 16;
/// How long they run in the suite.
const RUN: Duration = Duration::from_secs(3);
/// Bytes each member writes into each other's region per round.
const SLOT: u64 = 16 << 10;
/// Bytes of each member's read-only region.
const READ_ONLY: u64 = 64 << 10;

#[test]
fn sixteen_processes_all_to_all_every_byte_and_delivery_checked() {
    serial(run());
}

async fn run() {
    let run = soak().unwrap_or(RUN);
    let mut children = Vec::new();
    for index in 0..MEMBERS {
        children.push(Child::spawn("member", index % 2 == 0, index).await);
    }
    let mut members = Vec::new();
    for child in &mut children {
        members.push(child.answer().await);
    }
    let go = json!({ "run_ms": run.as_millis() as u64, "members": members });
    for child in &mut children {
        child.tell(&format!("go {go}")).await;
    }
    // sent[i][j]: rounds member i completed to member j.
    let mut sent: Vec<Vec<u64>> = Vec::new();
    for (i, child) in children.iter_mut().enumerate() {
        let done = child.answer().await;
        let errors = done["errors"].as_array().unwrap();
        assert!(errors.is_empty(), "member {i} failed: {errors:?}");
        sent.push(serde_json::from_value(done["sent"].clone()).unwrap());
    }
    let mut total = 0;
    for (j, child) in children.iter_mut().enumerate() {
        let report = child.ask("report").await;
        let received: BTreeMap<String, Vec<u64>> =
            serde_json::from_value(report["received"].clone()).unwrap();
        for (i, sent) in sent.iter().enumerate().filter(|(i, _)| *i != j) {
            assert!(sent[j] > 0, "member {i} completed no round to {j}");
            let expected: Vec<u64> = (0..sent[j]).collect();
            for kind in ["n", "m"] {
                let got = received
                    .get(&format!("{kind} {i}"))
                    .cloned()
                    .unwrap_or_default();
                assert_eq!(
                    got, expected,
                    "{kind} from member {i} to {j}: each of its rounds exactly once"
                );
            }
            total += sent[j];
        }
    }
    for (i, mut child) in children.into_iter().enumerate() {
        child.tell("exit").await;
        assert!(child.exited().await, "member {i} exited with an error");
    }
    println!("all-to-all: {MEMBERS} processes, {total} rounds of every kind in {run:?}");
}

/// A member: announces its node, runs the rounds on `go`, reports what it
/// received on `report`, and leaves on `exit`.
pub async fn member(node: &Node, commands: &mut Lines<BufReader<tokio::io::Stdin>>) {
    let me: usize = std::env::var("FERRY_CHURN_INDEX").unwrap().parse().unwrap();
    let area = node
        .alloc(SLOT * MEMBERS as u64, Access::ReadWrite)
        .await
        .unwrap();
    let fixed = node.alloc(READ_ONLY, Access::ReadOnly).await.unwrap();
    fixed
        .write_at(0, &pattern(READ_ONLY as usize, 1000 + me as u64))
        .unwrap();
    let tally = tally(node.inbox().unwrap());
    say(
        json!({ "index": me, "addr": node.addr(), "area": area.remote(), "fixed": fixed.remote() }),
    );

    let line = commands.next_line().await.unwrap().expect("go");
    let go: Value = serde_json::from_str(line.strip_prefix("go ").unwrap()).unwrap();
    let run = Duration::from_millis(go["run_ms"].as_u64().unwrap());
    let members = go["members"].as_array().unwrap();
    let (sent, errors) = rounds(node, me, members, run).await;
    say(json!({ "sent": sent, "errors": errors }));

    while let Some(line) = commands.next_line().await.unwrap() {
        match line.as_str() {
            "report" => {
                let (asked, received) = oneshot::channel();
                tally.send(asked).await.unwrap();
                say(json!({ "received": received.await.unwrap() }));
            }
            "exit" => break,
            other => panic!("unknown command {other}"),
        }
    }
    node.shutdown().await;
}

/// Rounds until `run` has passed; rounds completed per member, and what
/// failed.
async fn rounds(
    node: &Node,
    me: usize,
    members: &[Value],
    run: Duration,
) -> (Vec<u64>, Vec<String>) {
    let field = |j: usize, name: &str| -> RemoteBuffer {
        serde_json::from_value(members[j][name].clone()).unwrap()
    };
    let addrs: Vec<NodeAddr> = (0..MEMBERS)
        .map(|j| serde_json::from_value(members[j]["addr"].clone()).unwrap())
        .collect();
    let src = node.alloc(SLOT, Access::ReadWrite).await.unwrap();
    let mut sent = vec![0u64; MEMBERS];
    let mut errors = Vec::new();
    let started = Instant::now();
    let mut next_report = Duration::from_secs(10);
    let mut round = 0u64;
    while started.elapsed() < run && errors.is_empty() {
        for k in 1..MEMBERS {
            let j = (me + k) % MEMBERS;
            let slot = field(j, "area")
                .slice(me as u64 * SLOT..(me as u64 + 1) * SLOT)
                .unwrap();
            let bytes = pattern(SLOT as usize, (me * MEMBERS + j) as u64 * 1_000_003 + round);
            src.write_at(0, &bytes).unwrap();
            let notified = node
                .submit_with_notification(
                    vec![RdmaOp::write(src.whole(), slot.clone())],
                    DEADLINE,
                    format!("n {me} {round}"),
                )
                .await;
            if let Err(e) = notified {
                errors.push(format!("notified write to {j}: {e}"));
                break;
            }
            read_and_check(node, &slot, &bytes).await;
            let fixed = pattern(READ_ONLY as usize, 1000 + j as u64);
            read_and_check(node, &field(j, "fixed"), &fixed).await;
            if let Err(e) = node
                .send_message(addrs[j], format!("m {me} {round}"), DEADLINE)
                .await
            {
                errors.push(format!("message to {j}: {e}"));
                break;
            }
            let body = format!("c {me} {round}");
            match node.call(addrs[j], "echo", body.clone(), DEADLINE).await {
                Ok(answer) if answer[..].iter().rev().eq(body.as_bytes()) => {}
                Ok(answer) => errors.push(format!("call to {j} answered {answer:?}")),
                Err(e) => errors.push(format!("call to {j}: {e}")),
            }
            if !errors.is_empty() {
                break;
            }
            sent[j] += 1;
        }
        round += 1;
        // The soak's log: two members (memory on, memory off) speak.
        if me < 2 && started.elapsed() >= next_report {
            eprintln!(
                "soak all-to-all member={me} t={:>4}s rounds={round} rss={}KiB fds={} tables={:?}",
                started.elapsed().as_secs(),
                rss_kib(),
                open_fds(),
                node.peer_tables()
            );
            next_report += Duration::from_secs(10);
        }
    }
    (sent, errors)
}

/// What the inbox received, by `"<kind> <sender>"`: the rounds, in arrival
/// order per sender (a round seen twice shows twice).
type Received = BTreeMap<String, Vec<u64>>;

/// Drains `inbox` into a tally, sent back (after draining what is already
/// there) to whoever asks on the returned channel.
fn tally(mut inbox: Inbox) -> mpsc::Sender<oneshot::Sender<Received>> {
    let (ask, mut asked) = mpsc::channel::<oneshot::Sender<Received>>(1);
    tokio::spawn(async move {
        let mut received = Received::new();
        let record = |received: &mut Received, body: Bytes, kind: DeliveryKind| {
            let text = String::from_utf8_lossy(&body).into_owned();
            let mut words = text.split(' ');
            let (tag, from, round) = (words.next(), words.next(), words.next());
            let expected_tag = if kind == DeliveryKind::Notification {
                "n"
            } else {
                "m"
            };
            let round = round.and_then(|r| r.parse().ok()).unwrap_or(u64::MAX);
            let key = match (tag, from) {
                (Some(tag), Some(from)) if tag == expected_tag => format!("{tag} {from}"),
                _ => format!("malformed {text}"),
            };
            received.entry(key).or_default().push(round);
        };
        loop {
            tokio::select! {
                biased;
                delivery = inbox.recv() => match delivery {
                    Some(d) => record(&mut received, d.body, d.kind),
                    None => return,
                },
                reply = asked.recv() => {
                    let Some(reply) = reply else { return };
                    while let Some(d) = inbox.try_recv() {
                        record(&mut received, d.body, d.kind);
                    }
                    let _ = reply.send(received.clone());
                }
            }
        }
    });
    ask
}
