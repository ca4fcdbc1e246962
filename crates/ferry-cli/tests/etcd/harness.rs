//! A real etcd (Debian's `etcd-server`) on free loopback ports with a
//! temporary data directory, and `ferry serve` processes publishing in it.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::RemoteBuffer;

/// The `ferry` binary under test.
pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Polls `done` every 20 ms until it holds or `within` passes; returns
/// how long it took.
pub fn wait_until(within: Duration, what: &str, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    start.elapsed()
}

/// One etcd server; killed and its data removed on drop.
pub struct EtcdServer {
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
    data: PathBuf,
}

impl EtcdServer {
    /// Starts etcd on two free loopback ports and waits until it answers.
    /// A "free" port may be taken by another process's connection before
    /// etcd binds it: then etcd exits, and this tries fresh ports.
    pub fn start() -> Self {
        Self::start_with(free_port)
    }

    /// Starts etcd with clients on `client_port` (and a free peer port).
    pub fn start_on(client_port: u16) -> Self {
        Self::start_with(|| client_port)
    }

    fn start_with(mut client_port: impl FnMut() -> u16) -> Self {
        let mut failures = Vec::new();
        for _ in 0..3 {
            let mut server = EtcdServer {
                child: None,
                client_port: client_port(),
                peer_port: free_port(),
                data: PathBuf::new(),
            };
            match server.launch() {
                Ok(()) => return server,
                Err(e) => failures.push(e),
            }
        }
        panic!("etcd did not start in 3 tries: {failures:#?}");
    }

    /// The client URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.data);
        let _ = std::fs::remove_file(self.data.with_extension("log"));
    }

    /// Starts it again on the same ports with an empty data directory:
    /// whatever was published is gone, as after losing the cluster.
    pub fn restart(&mut self) {
        if let Err(e) = self.launch() {
            panic!("etcd restarts: {e}");
        }
    }

    /// (Re)starts etcd on this server's ports with an empty data directory
    /// and waits until it answers; an etcd that exits first (its port was
    /// taken) is an error carrying the end of its log.
    fn launch(&mut self) -> Result<(), String> {
        self.kill();
        let etcd = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("etcd is not installed: scripts/install-deps.sh installs Debian's etcd-server");
        self.data = std::env::temp_dir().join(format!(
            "ferry-etcd-test-{}-{}",
            std::process::id(),
            self.client_port
        ));
        let _ = std::fs::remove_dir_all(&self.data);
        let log_path = self.data.with_extension("log");
        let log = std::fs::File::create(&log_path).expect("etcd log file");
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(etcd)
            .args(["--name", "ferry-test", "--data-dir"])
            .arg(&self.data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("ferry-test={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        let child = self.child.insert(child);
        let addr: SocketAddr = ([127, 0, 0, 1], self.client_port).into();
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(addr).is_err() {
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() >= deadline {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(3).collect();
                return Err(format!(
                    "etcd on {client} / {peer}: {}; its log ends {tail:?}",
                    exited.map_or("not listening within 20 s".into(), |s| format!(
                        "exited ({s})"
                    ))
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Listening is not serving: wait for an answer.
        wait_until(Duration::from_secs(20), "etcd answers", || {
            ferry_ls(&self.url()).is_some()
        });
        Ok(())
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `ferry ls --etcd URL --json`, parsed; `None` when it fails.
pub fn ferry_ls(url: &str) -> Option<Vec<serde_json::Value>> {
    let out = Command::new(FERRY)
        .args(["ls", "--etcd", url, "--json"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// The names `ferry ls` shows (empty when it fails).
pub fn listed(url: &str) -> Vec<String> {
    ferry_ls(url)
        .unwrap_or_default()
        .iter()
        .filter_map(|n| n["name"].as_str().map(String::from))
        .collect()
}

/// A `ferry serve` process; `kill -9` on drop.
pub struct Serve {
    child: Child,
    /// The handle of its region, as it printed it.
    pub handle: RemoteBuffer,
}

impl Serve {
    /// `ferry serve --name NAME --publish kv --size 4M --no-ibverbs` plus
    /// `extra`; waits for its handle.
    pub fn start(name: &str, extra: &[&str]) -> Self {
        let mut child = Command::new(FERRY)
            .args(["serve", "--name", name, "--publish", "kv", "--size", "4M"])
            .arg("--no-ibverbs")
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("ferry serve starts");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("ferry serve printed its handle");
        let handle = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("ferry serve printed {line:?}, not a handle: {e}"));
        Serve { child, handle }
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits up to 10 s for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -TERM {pid}");
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "serve ignored SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill();
    }
}
