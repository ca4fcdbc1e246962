//! Child processes: this test binary re-executed with [`ROLE_ENV`], driven
//! by one JSON command per stdin line and answering one `CHURN <json>` line
//! per command on stdout.

use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use ferry::NodeAddr;
use ferry::prelude::*;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{ChildStdin, ChildStdout, Command};

use crate::{DEADLINE, PREFIX, ROLE_ENV, pattern, write_and_check};

/// Longest wait for a child's answer (the all-to-all's run included).
const ANSWER_DEADLINE: Duration = Duration::from_secs(900);

/// A child process, killed if dropped.
pub struct Child {
    process: tokio::process::Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Child {
    /// Starts a child playing `role`, with the memory transport on or off,
    /// numbered `index`.
    pub async fn spawn(role: &str, memory: bool, index: usize) -> Child {
        let exe = std::env::current_exe().expect("test binary path");
        let mut process = Command::new(exe)
            .args(["--exact", "churn_child", "--nocapture", "--test-threads=1"])
            .env(ROLE_ENV, role)
            .env("FERRY_CHURN_INDEX", index.to_string())
            .env(ferry::DISABLE_MEMORY_ENV, if memory { "0" } else { "1" })
            .env(ferry::DISABLE_IBVERBS_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn a child process");
        let stdin = process.stdin.take().unwrap();
        let lines = BufReader::new(process.stdout.take().unwrap()).lines();
        Child {
            process,
            stdin,
            lines,
        }
    }

    /// Sends `line` without waiting for an answer.
    pub async fn tell(&mut self, line: &str) {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .expect("child stdin");
    }

    /// The child's next answer.
    pub async fn answer(&mut self) -> Value {
        let read = async {
            while let Some(line) = self.lines.next_line().await.expect("child stdout") {
                if let Some(at) = line.find(PREFIX) {
                    return serde_json::from_str(&line[at + PREFIX.len()..]).expect("answer");
                }
            }
            panic!("child exited without answering");
        };
        tokio::time::timeout(ANSWER_DEADLINE, read)
            .await
            .expect("child answered in time")
    }

    /// Sends `line`; the answer.
    pub async fn ask(&mut self, line: &str) -> Value {
        self.tell(line).await;
        self.answer().await
    }

    /// SIGKILL, and waits for the process to be gone.
    pub async fn kill(mut self) {
        self.process.kill().await.expect("kill a child");
    }

    /// Waits (up to `DEADLINE`) for the child to exit on its own; whether
    /// it exited successfully.
    pub async fn exited(mut self) -> bool {
        drop(self.stdin);
        let status = tokio::time::timeout(DEADLINE, self.process.wait())
            .await
            .expect("child exits")
            .expect("child status");
        status.success()
    }
}

/// Answers the parent.
pub fn say(answer: Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{PREFIX}{answer}").unwrap();
    out.flush().unwrap();
}

/// A child's life: `role` decides what it does.
pub fn main(role: &str) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let node = Node::builder().spawn().await.expect("child node");
        node.serve_rpc("echo", |request| async move {
            Ok(Bytes::from(
                request.body.iter().rev().copied().collect::<Vec<u8>>(),
            ))
        })
        .unwrap();
        let mut commands = BufReader::new(tokio::io::stdin()).lines();
        match role {
            "victim" => victim(&node, &mut commands).await,
            "member" => crate::all_to_all::member(&node, &mut commands).await,
            other => panic!("no such role: {other}"),
        }
    });
}

/// Bytes of a victim's region: large enough that a read of it is still
/// on its way when the victim is killed.
const VICTIM_REGION: u64 = 8 << 20;

/// Writes into the hub's slot (read back), sends it a message, calls it,
/// and then waits to be killed, with a large region to be read.
async fn victim(node: &Node, commands: &mut Lines<BufReader<tokio::io::Stdin>>) {
    let line = commands.next_line().await.unwrap().expect("a command");
    let setup: Value = serde_json::from_str(line.strip_prefix("victim ").unwrap()).unwrap();
    let hub: NodeAddr = serde_json::from_value(setup["hub"].clone()).unwrap();
    let slot: RemoteBuffer = serde_json::from_value(setup["slot"].clone()).unwrap();
    let seed = u64::from(std::process::id());
    write_and_check(node, &slot, &pattern(slot.len() as usize, seed)).await;
    node.send_message(hub, "victim", DEADLINE).await.unwrap();
    node.call(hub, "echo", "victim", DEADLINE).await.unwrap();
    let region = node.alloc(VICTIM_REGION, Access::ReadOnly).await.unwrap();
    region
        .write_at(0, &pattern(VICTIM_REGION as usize, seed))
        .unwrap();
    say(json!({ "region": region.remote(), "seed": seed }));
    // Killed while waiting here.
    let _ = commands.next_line().await;
}
