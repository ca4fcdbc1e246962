//! VM a, as this suite drives it: commands through its agent on the
//! management wire, peer processes started there, and the faults of the
//! wire between the VMs.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use crate::common::PeerProcess;

/// The longest one agent command may take.
const AGENT_DEADLINE: Duration = Duration::from_secs(60);
/// The wire's interface in both VMs (`FERRY_RXE_WIRE`).
const WIRE: &str = "wire";

fn agent_addr() -> String {
    std::env::var("FERRY_RXE_AGENT")
        .unwrap_or_else(|_| panic!("FERRY_RXE_AGENT unset: {}", crate::NEEDS_TWO_VMS))
}

/// Runs the sh command line `cmd` in VM a; its exit status and output.
pub fn on_peer_status(cmd: &str) -> (i32, String) {
    let mut stream = TcpStream::connect(agent_addr()).expect("connect to VM a's agent");
    stream.set_read_timeout(Some(AGENT_DEADLINE)).unwrap();
    stream.write_all(format!("{cmd}\n").as_bytes()).unwrap();
    let mut out = String::new();
    stream
        .read_to_string(&mut out)
        .unwrap_or_else(|e| panic!("VM a's agent did not finish `{cmd}`: {e}"));
    let (output, status) = out
        .rsplit_once("AGENT-EXIT=")
        .unwrap_or_else(|| panic!("VM a's agent gave no status for `{cmd}`: {out}"));
    (status.trim().parse().unwrap(), output.to_string())
}

/// Runs `cmd` in VM a, which must succeed; its output.
pub fn on_peer(cmd: &str) -> String {
    let (status, output) = on_peer_status(cmd);
    assert_eq!(status, 0, "`{cmd}` failed in VM a: {output}");
    output
}

/// Runs `cmd` here, which must succeed.
pub fn here(cmd: &str) {
    let out = std::process::Command::new("sh")
        .args(["-c", cmd])
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `cmd` in both VMs.
pub fn both(cmd: &str) {
    here(cmd);
    on_peer(cmd);
}

/// A peer process in VM a: this binary as `ferry_peer`, its node on the
/// wire's address, its commands over the management wire. Its process id
/// is in `/tmp/peer-<port>.pid` there.
pub struct RemotePeer {
    pub process: PeerProcess,
    port: u16,
}

impl RemotePeer {
    pub async fn start() -> RemotePeer {
        Self::start_with(&[]).await
    }

    /// A peer whose process gets these environment variables too.
    pub async fn start_with(env: &[(&str, String)]) -> RemotePeer {
        static NEXT_PORT: AtomicU16 = AtomicU16::new(7001);
        let port = NEXT_PORT.fetch_add(1, Ordering::Relaxed);
        let exe = std::env::current_exe().unwrap();
        let exe = exe.file_name().unwrap().to_string_lossy();
        let peer_ip = std::env::var("FERRY_RXE_PEER_IP").expect("FERRY_RXE_PEER_IP");
        // nc runs the script with the connection as stdin and stdout. The
        // agent takes one line: printf expands the script's `\n`s.
        let script = [
            "#!/bin/sh".to_string(),
            format!("echo $$ > /tmp/peer-{port}.pid"),
            format!("exec 2>> /tmp/peer-{port}.log"),
            format!(
                "export FERRY_TEST_PEER=1 FERRY_TEST_LISTEN={peer_ip}:0 FERRY_DISABLE_MEMORY=1{}",
                env.iter()
                    .map(|(var, value)| format!(" {var}={value}"))
                    .collect::<String>()
            ),
            format!("exec {exe} --exact ferry_peer --nocapture --test-threads=1"),
        ]
        .join("\\n");
        on_peer(&format!(
            "printf '{script}\\n' > /tmp/peer-{port}.sh && chmod +x /tmp/peer-{port}.sh && \
             (setsid nc -l -p {port} -e /tmp/peer-{port}.sh < /dev/null > /dev/null 2>&1 &)"
        ));
        let agent = agent_addr();
        let host = agent.rsplit_once(':').unwrap().0;
        let started = Instant::now();
        let stream = loop {
            match tokio::net::TcpStream::connect((host, port)).await {
                Ok(stream) => break stream,
                Err(e) if started.elapsed() < AGENT_DEADLINE => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("peer on VM a port {port} never listened: {e}"),
            }
        };
        RemotePeer {
            process: PeerProcess::over_stream(stream),
            port,
        }
    }

    /// `kill -9` of the peer's process in VM a.
    pub fn kill_9(&self) {
        on_peer(&format!("kill -9 $(cat /tmp/peer-{}.pid)", self.port));
    }

    /// The peer's stderr so far (its log), for failure messages.
    #[allow(dead_code)]
    pub fn log(&self) -> String {
        on_peer(&format!(
            "cat /tmp/peer-{}.log 2>/dev/null; true",
            self.port
        ))
    }
}

/// The wire's faults, undone when this guard drops (a failing test
/// included), so the next test starts on a clean wire.
pub struct Wire(());

impl Wire {
    /// A clean wire: no loss, both interfaces up.
    pub fn clean() -> Wire {
        clear();
        Wire(())
    }

    /// Drops `percent` % of the packets each way (netem in both VMs).
    pub fn loss(&self, percent: f64) {
        both(&format!(
            "/usr/bin/tc qdisc replace dev {WIRE} root netem loss {percent}%"
        ));
    }

    /// Drops every packet each way: a cut wire whose links stay up, as
    /// when a switch between two hosts fails.
    pub fn cut(&self) {
        self.loss(100.0);
    }

    /// Drops every TCP packet each way and nothing else: the nodes'
    /// control sessions go silent while RoCE v2 (UDP) still flows, as
    /// behind a firewall rule that blocks the control port.
    pub fn block_tcp(&self) {
        both(&format!(
            "/usr/bin/tc qdisc replace dev {WIRE} root handle 1: prio && \
             /usr/bin/tc filter add dev {WIRE} parent 1: protocol ip prio 1 \
             u32 match ip protocol 6 0xff action drop"
        ));
    }

    /// Heals the wire.
    pub fn heal(&self) {
        clear();
    }

    /// Takes VM a's end of the wire down for `outage`, then up again
    /// (blocks meanwhile): the owner's port goes down, as when its cable
    /// is pulled and put back.
    pub fn flap(&self, outage: Duration) {
        on_peer(&format!(
            "/usr/bin/ip link set {WIRE} down && sleep {} && /usr/bin/ip link set {WIRE} up",
            outage.as_secs_f64()
        ));
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        clear();
    }
}

/// No netem, no filter, and both ends up, whatever was set before.
fn clear() {
    let cmd = format!(
        "/usr/bin/tc qdisc del dev {WIRE} root 2>/dev/null; /usr/bin/ip link set {WIRE} up"
    );
    both(&cmd);
}
