//! `bench --loopback`: a `ferry serve` child process on 127.0.0.1 to
//! measure against, stopped when the bench ends.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::RemoteBuffer;

use crate::Failure;
use crate::bench::{BenchArgs, Transport};

/// How long `--loopback` waits for the server it started to print its handle.
const SERVE_START: Duration = Duration::from_secs(30);

/// A `ferry serve` child; closing its stdin (on drop) stops it.
pub(crate) struct Server {
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `ferry serve` on 127.0.0.1 for `bench --loopback`, with the
/// transports `args` asks for, and waits for the handle it prints.
pub(crate) fn start_server(args: &BenchArgs) -> Result<(Server, RemoteBuffer), Failure> {
    let exe = std::env::current_exe()?;
    let mut command = Command::new(exe);
    command.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--size",
        &args.size.to_string(),
        "--stdin",
    ]);
    if matches!(args.transport, Transport::Tcp | Transport::Memory) {
        command.arg("--no-ibverbs");
    }
    command.arg(format!("--threads={}", args.threads));
    if let Some(us) = args.busy_poll_us {
        command.arg(format!("--busy-poll-us={us}"));
    }
    // The server proves the secret the bench does: the file's, or the one
    // this process took out of its environment, given back to the child
    // alone.
    if let Some(path) = &args.secret.cluster_secret_file {
        command.arg("--cluster-secret-file").arg(path);
    } else if let Some(text) = crate::secret::from_env() {
        command.env(ferry::control::auth::SECRET_ENV, text);
    }
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let server = Server { child };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = tx.send(BufReader::new(stdout).read_line(&mut line).map(|_| line));
    });
    let line = rx
        .recv_timeout(SERVE_START)
        .map_err(|_| Failure("the loopback server did not start in time".into()))??;
    let handle = serde_json::from_str(&line)
        .map_err(|e| Failure(format!("loopback server: bad handle: {e}")))?;
    Ok((server, handle))
}
