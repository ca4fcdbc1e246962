//! A `metrics` recorder that keeps every counter in memory, so a test can
//! read what a node reported (ops per transport) without an exporter.
//!
//! A process has one recorder, installed before the nodes whose counters a
//! test reads are spawned (a node registers its counters at spawn). Counters
//! are global to the process: read differences, in tests that run alone.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

#[derive(Default)]
struct Counters(Mutex<BTreeMap<String, Arc<AtomicU64>>>);

struct Cell(Arc<AtomicU64>);

impl metrics::CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}

/// `name{label="value",...}` with labels sorted, as the key of a counter.
fn id(key: &Key) -> String {
    let mut labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}=\"{}\"", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl Recorder for &'static Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut map = self.0.lock().unwrap();
        let cell = map.entry(id(key)).or_default().clone();
        Counter::from_arc(Arc::new(Cell(cell)))
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

static COUNTERS: OnceLock<&'static Counters> = OnceLock::new();

/// Installs the recorder (once per process).
pub fn install() {
    COUNTERS.get_or_init(|| {
        let counters: &'static Counters = Box::leak(Box::default());
        metrics::set_global_recorder(counters).expect("no other recorder in this test binary");
        counters
    });
}

/// The counter `name{labels}` (labels as `key="value"`, sorted), 0 if unseen.
pub fn get(id: &str) -> u64 {
    let counters = COUNTERS.get().expect("counters::install() first");
    let map = counters.0.lock().unwrap();
    map.get(id).map_or(0, |c| c.load(Ordering::Relaxed))
}

/// Ops completed over `transport` (`tcp` or `ibverbs`), reads and writes.
pub fn ops(transport: &str) -> u64 {
    ["read", "write"]
        .iter()
        .map(|op| {
            get(&format!(
                "ferry_ops_total{{op=\"{op}\",transport=\"{transport}\"}}"
            ))
        })
        .sum()
}
