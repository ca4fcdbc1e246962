//! The target process and the line protocol between the two processes: the
//! target's end (`serve`: a node holding one region, answering commands on
//! stdin) and the initiator's end (`Target`: spawning it and asking). Both
//! ends of the protocol live here, apart from the measuring in `main.rs`, so
//! that each command's sender and its handler can be read side by side.

use std::process::Stdio;
use std::time::Duration;

use ferry::prelude::*;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use super::{Args, alloc, fill, mismatch, peak_rss, reset_peak_rss};

/// Deadline for the target's answer to any command (fill/check of a large
/// region included).
const COMMAND_DEADLINE: Duration = Duration::from_secs(60);

pub(super) async fn serve(args: Args) -> Result<(), String> {
    let node = Node::builder().spawn().await.map_err(|e| e.to_string())?;
    let region = alloc(&node, args.size).await?;
    fill(&region, 0);
    let mut out = std::io::stdout();
    say(&mut out, &serde_json::to_string(&region.remote()).unwrap());
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = stdin.next_line().await.map_err(|e| e.to_string())? {
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["fill", seed] => {
                fill(&region, seed.parse().map_err(|_| "bad seed")?);
                "OK".to_string()
            }
            ["check", seed] => match mismatch(&region, seed.parse().map_err(|_| "bad seed")?) {
                None => "OK".to_string(),
                Some(at) => format!("MISMATCH {at}"),
            },
            ["reset"] => format!("OK {}", reset_peak_rss()),
            ["stats"] => format!("STATS {}", peak_rss()),
            other => format!("ERR unknown command {other:?}"),
        };
        say(&mut out, &reply);
    }
    // stdin closed: the initiator is done. Report the whole run's peak.
    say(&mut out, &format!("STATS {}", peak_rss()));
    node.shutdown().await;
    Ok(())
}

fn say(out: &mut std::io::Stdout, line: &str) {
    use std::io::Write;
    // If the initiator is gone there is nobody left to tell.
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// The initiator's end of the target process. The child is killed if this is
/// dropped before `finish`.
pub(super) struct Target {
    pub(super) child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Target {
    pub(super) async fn spawn(size: u64) -> Result<(Target, RemoteBuffer), String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["--serve", "--size", &size.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the target process: {e}"))?;
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut target = Target {
            child,
            stdin,
            lines,
        };
        let json = target.next_line("its handle").await?;
        let handle = serde_json::from_str(&json).map_err(|e| format!("bad handle {json}: {e}"))?;
        Ok((target, handle))
    }

    async fn next_line(&mut self, what: &str) -> Result<String, String> {
        match tokio::time::timeout(COMMAND_DEADLINE, self.lines.next_line()).await {
            Ok(Ok(Some(line))) => Ok(line),
            Ok(Ok(None)) => Err(format!("target exited before sending {what}")),
            Ok(Err(e)) => Err(format!("reading {what} from the target: {e}")),
            Err(_) => Err(format!("no {what} within {COMMAND_DEADLINE:?}")),
        }
    }

    pub(super) async fn ask(&mut self, command: &str) -> Result<String, String> {
        let line = format!("{command}\n");
        let sent = self.stdin.write_all(line.as_bytes()).await;
        sent.map_err(|e| format!("target gone before `{command}`: {e}"))?;
        let reply = self
            .next_line(&format!("the answer to `{command}`"))
            .await?;
        match reply.strip_prefix("ERR ") {
            Some(e) => Err(format!("target refused `{command}`: {e}")),
            None => Ok(reply),
        }
    }

    pub(super) async fn peak_rss(&mut self) -> Result<u64, String> {
        let reply = self.ask("stats").await?;
        parse_stats(&reply)
    }

    /// Closes stdin and collects the target's final report and exit status.
    pub(super) async fn finish(mut self) -> Result<u64, String> {
        drop(self.stdin);
        let last = self.lines.next_line();
        let last = match tokio::time::timeout(COMMAND_DEADLINE, last).await {
            Ok(Ok(Some(line))) => parse_stats(&line)?,
            _ => return Err("target sent no final report".into()),
        };
        match tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await {
            Ok(Ok(status)) if status.success() => Ok(last),
            Ok(Ok(status)) => Err(format!("target exited with {status}")),
            _ => Err("target did not exit".into()),
        }
    }
}

fn parse_stats(line: &str) -> Result<u64, String> {
    line.strip_prefix("STATS ")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("unexpected target answer {line:?}"))
}
