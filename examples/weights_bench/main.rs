//! What a weight update costs on one host: 2 publisher ranks to S
//! subscribers, each subscriber holding the whole set, against the
//! physical bound measured in the same run.
//!
//! The workload: a set of 8 matrices of 2-byte elements, 4,096 columns
//! (8 KiB rows), `--mib` MiB per version in all (default 1024), split by
//! rows over 2 publisher ranks, each rank a child process of this one
//! (`--publisher RANK`). S subscribers (`--subscribers S`, default 4), each
//! a child process too (`--subscriber`), declare another sharding, the
//! whole set, in one buffer (`--buffers 2` for double buffering), and plan
//! once. Per version (`--versions N`, default 5) both publishers take
//! their memory (`Publisher::write`), write version v (a byte `v` over
//! every 4 KiB page, the first and last 8 bytes of each page a tag of the
//! version, tensor and page) and publish; then every subscriber calls
//! `Subscriber::update` at once. The update time is from the last
//! publish to the last subscriber's update completing (the processes'
//! CLOCK_MONOTONIC, which they share). Each subscriber then checks, on
//! every page, the first and last 8 bytes and the middle byte; one
//! mismatch fails the run.
//!
//! Reported per version: the update time, the slowest subscriber's own
//! `update()` time, GB/s delivered (S x V bytes over the update time), the
//! ratio to the bound, and the CPU time the publishers and the subscribers
//! spent over the update (where the time goes: who copies). The summary
//! takes the median over versions 2..N (the subscribers' buffers are
//! faulted in before version 1, but over same-host memory version 1 also
//! faults in their mappings of the publishers' memory; it is reported
//! apart), and the steady state: each subscriber's RSS (/proc/self/statm:
//! resident, and the shared part of it), its mapping count
//! (/proc/self/maps lines, thread stacks among them) and its node's
//! registered regions (`Node::registered_regions`) after version 1 and
//! after the last; the publishers' registered regions too.
//!
//! The bound, measured in the same run, before the children start and
//! again after them (this VM's rates move between runs; the bound takes
//! the better): each subscriber must receive V bytes, so S x V bytes
//! cross the machine per update. Over same-host memory every byte is one
//! copy: the bound is S x V over the machine's aggregate `memcpy` rate
//! (one thread, and one per core in parallel, both reported; the bound
//! uses the parallel one). Over TCP every byte crosses the loopback: the
//! bound is S x V over the best of what `iperf3 -c 127.0.0.1 -P 2` and two
//! `iperf3 -P 1` processes in parallel carry (iperf3 before 3.16 runs a
//! process's streams on one thread), when `iperf3` is installed; the
//! memcpy bound otherwise, said so. Publishers serve every byte once per
//! subscriber (relays would not help on one host, where the same cores
//! copy every subscriber's bytes; `examples/relay_bench.rs` measures them
//! behind a slow publisher link): `--scaling` runs S = 1, 2 and 4 and
//! prints the update time per S. `--verify` has the subscribers check
//! every update's checksums (`Subscriber::verify_checksums`).
//!
//! ```sh
//! cargo run --release --example weights_bench -- --transport tcp|memory [--mib 1024] [--subscribers 4] [--versions 5] [--buffers 1] [--verify] [--scaling]
//! ```

mod children;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use children::*;

/// A child process of this example, spoken to by lines.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    name: String,
}

impl Peer {
    fn spawn(name: String, args: &[String]) -> Result<Peer, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        Ok(Peer {
            child,
            stdin,
            stdout,
            name,
        })
    }

    fn send(&mut self, line: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().expect("open until dropped");
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("{}: {e}", self.name))
    }

    /// The next line's words after `word`.
    fn expect(&mut self, word: &str) -> Result<Vec<String>, String> {
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .map_err(|e| format!("{}: {e}", self.name))?;
        let mut words = line.split_whitespace().map(String::from);
        match words.next() {
            Some(w) if w == word => Ok(words.collect()),
            _ => Err(format!(
                "{} said {line:?}, not {word} (its error is above)",
                self.name
            )),
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

fn field<T: std::str::FromStr>(words: &[String], i: usize) -> Result<T, String> {
    (words.get(i).and_then(|w| w.parse().ok())).ok_or_else(|| format!("bad field {i}: {words:?}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The machine's memcpy rate in GB/s over `threads` threads in parallel,
/// each copying its own 256 MiB (median of 5).
fn memcpy_rate(threads: usize) -> f64 {
    let len = 256 * MIB as usize;
    let barrier = std::sync::Barrier::new(threads);
    let times: Vec<Vec<(Instant, Instant)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let (src, mut dst) = (vec![1u8; len], vec![2u8; len]);
                    let mut times = Vec::new();
                    for _ in 0..5 {
                        barrier.wait();
                        let start = Instant::now();
                        dst.copy_from_slice(&src);
                        std::hint::black_box(&mut dst);
                        times.push((start, Instant::now()));
                    }
                    times
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("memcpy"))
            .collect()
    });
    let rates = (0..5)
        .map(|rep| {
            let start = times.iter().map(|t| t[rep].0).min().expect("a thread");
            let end = times.iter().map(|t| t[rep].1).max().expect("a thread");
            (threads * len) as f64 / (end - start).as_secs_f64() / 1e9
        })
        .collect();
    median(rates)
}

/// What iperf3 carries over the loopback in GB/s, `processes` client
/// processes (each to its own server) of `-P streams` in parallel; `Err`
/// says why not. iperf3 before 3.16 runs all of a process's streams on
/// one thread: only more processes use more cores.
fn iperf3_rate(processes: usize, streams: u32) -> Result<f64, String> {
    let mut servers = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..processes {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port()
            .to_string();
        let server = Command::new("iperf3")
            .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("iperf3 is not installed ({e})"))?;
        servers.push(server);
        ports.push(port);
    }
    std::thread::sleep(Duration::from_millis(300));
    let clients: Vec<_> = ports
        .iter()
        .map(|port| {
            Command::new("iperf3")
                .args(["-c", "127.0.0.1", "-p", port, "-t", "3", "-J"])
                .args(["-P", &streams.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
        })
        .collect();
    let mut total = Ok(0.0);
    for client in clients {
        let rate = client
            .and_then(|c| c.wait_with_output())
            .map_err(|e| e.to_string())
            .and_then(|out| {
                let json: serde_json::Value =
                    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
                (json["end"]["sum_received"]["bits_per_second"].as_f64())
                    .ok_or_else(|| format!("iperf3 said {}", json["error"]))
            });
        total = match (total, rate) {
            (Ok(sum), Ok(bits)) => Ok(sum + bits / 8.0 / 1e9),
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
    }
    for mut server in servers {
        if total.is_err() {
            let _ = server.kill();
        }
        let _ = server.wait();
    }
    total
}

struct Config {
    memory: bool,
    mib: u64,
    versions: u64,
    buffers: usize,
    /// Subscribers check checksums (`--verify`).
    verify: bool,
}

/// What one configuration measured.
struct Measured {
    subscribers: usize,
    /// Per version: update ms, the slowest subscriber's own `update()`
    /// ms, and the CPU ms the publishers and the subscribers spent over
    /// the update.
    versions: Vec<(f64, f64, f64, f64)>,
    /// The steady-state lines, after version 1 and after the last.
    steady: Vec<String>,
}

impl Measured {
    /// The versions the summary takes: 2..N, when there are 3 or more.
    fn warm(&self) -> &[(f64, f64, f64, f64)] {
        match self.versions.len() {
            n if n >= 3 => &self.versions[1..],
            _ => &self.versions,
        }
    }

    fn median(&self, f: fn(&(f64, f64, f64, f64)) -> f64) -> f64 {
        median(self.warm().iter().map(f).collect())
    }
}

/// Runs `subscribers` subscribers through the versions.
fn run(config: &Config, subscribers: usize) -> Result<Measured, String> {
    let transport = if config.memory { "memory" } else { "tcp" };
    let common = |mut args: Vec<String>| {
        args.extend([
            "--transport".into(),
            transport.into(),
            "--mib".into(),
            config.mib.to_string(),
        ]);
        args
    };
    let mut publishers = Vec::new();
    let mut addresses = Vec::new();
    for rank in 0..RANKS {
        let args = common(vec!["--publisher".into(), rank.to_string()]);
        let mut peer = Peer::spawn(format!("publisher {rank}"), &args)?;
        addresses.push(field::<SocketAddr>(&peer.expect("ENDPOINT")?, 0)?.to_string());
        publishers.push(peer);
    }
    // The subscribers plan against the published layouts, before any
    // version exists.
    let mut subs = Vec::new();
    for i in 0..subscribers {
        let mut args = common(vec!["--subscriber".into()]);
        args.extend([
            "--buffers".into(),
            config.buffers.to_string(),
            "--publishers".into(),
            addresses.join(","),
        ]);
        if config.verify {
            args.push("--verify".into());
        }
        subs.push(Peer::spawn(format!("subscriber {i}"), &args)?);
    }
    for sub in &mut subs {
        sub.expect("READY")?;
    }
    let mut versions = Vec::new();
    let mut steady = Vec::new();
    for v in 1..=config.versions {
        for p in &mut publishers {
            p.send(&format!("PUBLISH {v}"))?;
        }
        let (mut published, mut publisher_cpu) = (0u64, 0u64);
        let mut publisher_regions = Vec::new();
        for p in &mut publishers {
            let words = p.expect("PUBLISHED")?;
            published = published.max(field(&words, 1)?);
            publisher_regions.push(field::<usize>(&words, 4)?);
            publisher_cpu += field::<u64>(&words, 5)?;
        }
        for s in &mut subs {
            s.send(&format!("UPDATE {v}"))?;
        }
        let (mut end, mut slowest, mut wrong, mut subscriber_cpu) = (0u64, 0f64, 0u64, 0u64);
        let mut state = Vec::new();
        for s in &mut subs {
            let words = s.expect("UPDATED")?;
            let (start, done): (u64, u64) = (field(&words, 1)?, field(&words, 2)?);
            end = end.max(done);
            slowest = slowest.max(done.saturating_sub(start) as f64 / 1e6);
            wrong += field::<u64>(&words, 3)?;
            state.push([
                field::<u64>(&words, 4)?,
                field::<u64>(&words, 5)?,
                field::<u64>(&words, 6)?,
                field::<u64>(&words, 7)?,
            ]);
            subscriber_cpu += field::<u64>(&words, 8)?;
        }
        if wrong > 0 {
            return Err(format!(
                "version {v}: {wrong} pages of the subscribers do not hold it"
            ));
        }
        // The publishers' CPU from their publish to now.
        for p in &mut publishers {
            p.send("CPU")?;
        }
        let mut publisher_cpu_now = 0u64;
        for p in &mut publishers {
            publisher_cpu_now += field::<u64>(&p.expect("CPU")?, 0)?;
        }
        let ms = end.saturating_sub(published) as f64 / 1e6;
        versions.push((
            ms,
            slowest,
            publisher_cpu_now.saturating_sub(publisher_cpu) as f64 / 1e6,
            subscriber_cpu as f64 / 1e6,
        ));
        if v == 1 || v == config.versions {
            let max = |i: usize| state.iter().map(|s| s[i]).max().unwrap_or(0);
            steady.push(format!(
                "weights_bench: after version {v}: subscriber RSS up to {} MiB (shared {} MiB), \
                 mappings up to {}, registered regions up to {}; publishers' registered \
                 regions {publisher_regions:?}",
                max(0) / MIB,
                max(1) / MIB,
                max(2),
                max(3),
            ));
        }
    }
    Ok(Measured {
        subscribers,
        versions,
        steady,
    })
}

/// One line per version, the summary line and the steady state, against
/// `bound_gbps`.
fn report(config: &Config, m: &Measured, bound_gbps: f64) {
    let transport = if config.memory { "memory" } else { "tcp" };
    let s = m.subscribers;
    let bytes = s as u64 * config.mib * MIB;
    let bound_ms = bytes as f64 / bound_gbps / 1e6;
    println!(
        "{:>7} {:>3} {:>10} {:>12} {:>8} {:>9} {:>6} {:>11} {:>11}",
        "version",
        "S",
        "update ms",
        "slowest sub",
        "GB/s",
        "bound ms",
        "ratio",
        "pub CPU ms",
        "sub CPU ms"
    );
    for (i, &(ms, slowest, publisher_cpu, subscriber_cpu)) in m.versions.iter().enumerate() {
        println!(
            "{:>7} {s:>3} {ms:>10.1} {slowest:>12.1} {:>8.3} {bound_ms:>9.1} {:>6.2} \
             {publisher_cpu:>11.1} {subscriber_cpu:>11.1}",
            i + 1,
            bytes as f64 / ms / 1e6,
            bound_ms / ms,
        );
    }
    let med = m.median(|v| v.0);
    let warm = m.warm().len() as u64;
    println!(
        "weights_bench: {transport}: S={s}, {} MiB per version, {} buffer(s): update {med:.1} \
         ms (median of versions {}..{}; version 1 {:.1} ms), {:.3} GB/s delivered; bound \
         {bound_ms:.1} ms at {bound_gbps:.3} GB/s: ratio {:.2}; CPU per update: publishers \
         {:.0} ms, subscribers {:.0} ms; every page of every version checked",
        config.mib,
        config.buffers,
        config.versions - warm + 1,
        config.versions,
        m.versions[0].0,
        bytes as f64 / med / 1e6,
        bound_ms / med,
        m.median(|v| v.2),
        m.median(|v| v.3),
    );
    for line in &m.steady {
        println!("{line}");
    }
}

fn driver(config: &Config, counts: &[usize]) -> Result<(), String> {
    let transport = if config.memory { "memory" } else { "tcp" };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let memcpy = |when: &str| {
        let (one, two) = (memcpy_rate(1), memcpy_rate(2));
        println!(
            "weights_bench: memcpy of 256 MiB {when}: one thread {one:.3} GB/s, two threads in \
             parallel {two:.3} GB/s together ({cores} cores)"
        );
        two
    };
    let loopback = |when: &str| {
        let rates = [(1, 2), (2, 1)].map(|(processes, streams)| {
            let rate = iperf3_rate(processes, streams);
            match &rate {
                Ok(r) => println!(
                    "weights_bench: iperf3 over the loopback {when}, {processes} process(es) of \
                     -P {streams}: {r:.3} GB/s"
                ),
                Err(e) => println!("weights_bench: no loopback rate ({e})"),
            }
            rate.ok()
        });
        rates.into_iter().flatten().reduce(f64::max)
    };
    // Measured before and after the children: this VM's rates move
    // between runs; the bound is the best of the two.
    let two = memcpy("before");
    let tcp = (!config.memory).then(|| loopback("before")).flatten();
    let mut measured = Vec::new();
    for &s in counts {
        measured.push(run(config, s)?);
    }
    let two = two.max(memcpy("after"));
    let after = (!config.memory).then(|| loopback("after")).flatten();
    let tcp = tcp.into_iter().chain(after).reduce(f64::max);
    let bound = match tcp {
        Some(rate) => {
            println!("weights_bench: tcp: bound: the loopback's best rate, {rate:.3} GB/s");
            rate
        }
        None => {
            let why = if config.memory {
                ""
            } else {
                " (no loopback rate)"
            };
            println!(
                "weights_bench: {transport}: bound: the best two-thread memcpy rate{why}, \
                 {two:.3} GB/s"
            );
            two
        }
    };
    for m in &measured {
        report(config, m, bound);
    }
    if measured.len() > 1 {
        let per: Vec<String> = measured
            .iter()
            .map(|m| format!("S={} {:.1} ms", m.subscribers, m.median(|v| v.0)))
            .collect();
        let (first, last) = (&measured[0], measured.last().expect("some"));
        println!(
            "weights_bench: {transport}: scaling, median update per S: {}; S={} / S={}: {:.2}x",
            per.join(", "),
            last.subscribers,
            first.subscribers,
            last.median(|v| v.0) / first.median(|v| v.0),
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let number = |flag, default: u64| value(flag).and_then(|v| v.parse().ok()).unwrap_or(default);
    let memory = match value("--transport").as_deref() {
        None | Some("tcp") => false,
        Some("memory") => true,
        Some(other) => {
            eprintln!("weights_bench: --transport tcp|memory, not {other}");
            return ExitCode::from(2);
        }
    };
    let config = Config {
        memory,
        mib: number("--mib", 1024).max(1),
        versions: number("--versions", 5).max(1),
        buffers: number("--buffers", 1).clamp(1, 2) as usize,
        verify: has("--verify"),
    };
    let child = |future: std::pin::Pin<Box<dyn Future<Output = Result<(), String>>>>| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
            .and_then(|rt| rt.block_on(future))
    };
    let result = if let Some(rank) = value("--publisher") {
        match rank.parse() {
            Ok(rank) => child(Box::pin(publisher(rank, memory, config.mib))),
            Err(_) => Err(format!("--publisher RANK, not {rank}")),
        }
    } else if has("--subscriber") {
        let publishers: Result<Vec<SocketAddr>, _> = (value("--publishers").unwrap_or_default())
            .split(',')
            .map(str::parse)
            .collect();
        match publishers {
            Ok(p) => {
                let shape = (config.buffers, config.verify);
                child(Box::pin(subscriber(memory, config.mib, shape, p)))
            }
            Err(e) => Err(format!("--publishers: {e}")),
        }
    } else if has("--scaling") {
        driver(&config, &[1, 2, 4])
    } else {
        driver(&config, &[number("--subscribers", 4).max(1) as usize])
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weights_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
