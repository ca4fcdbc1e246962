//! Cost estimates for transfer requests ([`crate::Node::estimate`]): how
//! long a request to a peer will take, learned from the requests to that
//! peer over that transport that completed.
//!
//! A request's time is modelled as `fixed + per_op × ops + per_byte ×
//! bytes`, fitted per (peer, transport) by least squares with forgetting,
//! so that recent requests count most and a changed path is followed
//! within a hundred requests or so, while what the requests never vary
//! keeps the configured figures. Each sample is weighted by its own
//! duration: the fit minimises *relative* error, which is what makes
//! one model good for a 64 KiB request and a 16 MiB one alike (a plain fit
//! would serve the large ones and miss the small ones by multiples). The
//! per-op term is what NIXL's estimate gets wrong for small blocks (it sums
//! whole microseconds per descriptor, and 4 KiB blocks estimate 0 µs).
//! Before any request completed (the first to a peer over a transport is
//! not counted: it pays one-time costs), the configured defaults answer,
//! and the estimate says so.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Mutex;
use std::time::Duration;

use ferry_core::{NodeAddr, RdmaTransportLevel};

/// How an estimate was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EstimateMethod {
    /// From `samples` completed requests to this peer over this transport.
    Measured {
        /// Requests the model learned from.
        samples: u64,
    },
    /// From the configured defaults: nothing was measured to this peer
    /// over this transport yet.
    Configured,
}

/// What a request is expected to take ([`crate::Node::estimate`]).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Estimate {
    /// The expected duration, from post to done.
    pub duration: Duration,
    /// How far off recent estimates were (their mean relative error, times
    /// this duration): expect the request within `duration ± margin`.
    pub margin: Duration,
    /// Measured, or the defaults.
    pub method: EstimateMethod,
    /// The transport the estimate is for (the request's first region's).
    pub transport: RdmaTransportLevel,
}

/// Features: 1, ops, MiB. Time in microseconds.
const N: usize = 3;
/// How much each new sample discounts the ones before: about the last 20
/// count, so that a path that changed is followed within a few dozen
/// requests.
const FORGET: f64 = 0.95;
/// How far (as a factor of the estimate) one sample may pull the model
/// once it has a footing.
const OUTLIER: f64 = 2.0;
/// The smallest margin reported, as a fraction: timing noise.
const MIN_MARGIN: f64 = 0.05;

/// One (peer, transport)'s model, kept as the information (the inverse
/// covariance) of a weighted least-squares fit, not its covariance.
///
/// Why: forgetting divides what the fit knows by `FORGET` at every sample,
/// in every direction, also those the requests never vary. A steady stream
/// of identical requests (the same KV block, over and over) varies none
/// but one, and the covariance of plain recursive least squares grew by
/// 1/0.95 per request in the others: past 10^308 after about 14,000
/// requests, and every estimate was NaN from then on. Here the forgotten
/// share of the information is replaced by the same share of the prior's
/// (stabilised forgetting), so what the requests do not vary stays at the
/// configured figures, and what they vary follows the recent samples.
#[derive(Clone, Debug)]
struct Model {
    /// The fit: fixed µs, µs per op, µs per MiB.
    theta: [f64; N],
    /// The information about `theta`: sum of the weighted samples' x·xᵀ,
    /// plus the prior's.
    info: [[f64; N]; N],
    /// Sum of the weighted samples' x·y, plus the prior's `info · theta`.
    evidence: [f64; N],
    /// The configured figures, and what they count for.
    prior: ([f64; N], [f64; N]),
    samples: u64,
    /// Moving mean of |estimate − measured| / measured, before each update.
    error: f64,
}

impl Model {
    fn configured(level: RdmaTransportLevel) -> Self {
        // fixed µs, µs per op, µs per MiB: conservative figures for a
        // loopback or LAN peer; the first measurements replace them.
        let theta = match level {
            RdmaTransportLevel::Tcp => [100.0, 1.0, 1e6 / 2500.0],
            RdmaTransportLevel::Nic => [20.0, 0.5, 1e6 / 10_000.0],
            RdmaTransportLevel::Memory => [20.0, 0.2, 1e6 / 8000.0],
        };
        // Weak priors (the inverse of variances of 10^6, 10^2 and 10^6):
        // the first samples move the model most.
        let weight = [1e-6, 1e-2, 1e-6];
        let mut info = [[0.0; N]; N];
        for i in 0..N {
            info[i][i] = weight[i];
        }
        Model {
            theta,
            info,
            evidence: std::array::from_fn(|i| weight[i] * theta[i]),
            prior: (theta, weight),
            samples: 0,
            error: 0.25,
        }
    }

    fn predict(&self, x: &[f64; N]) -> f64 {
        (0..N).map(|i| self.theta[i] * x[i]).sum::<f64>()
    }

    /// One weighted least-squares step on (`x`, `y` µs), with forgetting.
    fn update(&mut self, x: [f64; N], y: f64) {
        let before = self.predict(&x);
        let relative = ((before - y) / y).abs().min(10.0);
        self.error = if self.samples == 0 {
            relative
        } else {
            0.9 * self.error + 0.1 * relative
        };
        // Relative error: the sample scaled by what the model expected of
        // it (not by its own value, which would weigh the faster samples of
        // a path that slowed down more than the recent ones).
        let scale = before.max(1.0).max(y / 4.0).min(y * 4.0);
        let (x, mut y): ([f64; N], f64) = (std::array::from_fn(|i| x[i] / scale), y / scale);
        // Once the model has a footing, one outlier (a request that met a
        // page fault storm, a retransmit) moves it by at most a factor of
        // `OUTLIER` in one step: a path that really changed gets there in
        // a few requests, a one-off hardly counts.
        if self.samples >= 2 {
            y = y.clamp(1.0 / OUTLIER, OUTLIER);
        }
        let (prior, weight) = self.prior;
        for i in 0..N {
            for j in 0..N {
                let prior_info = if i == j { weight[i] } else { 0.0 };
                self.info[i][j] =
                    FORGET * self.info[i][j] + (1.0 - FORGET) * prior_info + x[i] * x[j];
            }
            self.evidence[i] =
                FORGET * self.evidence[i] + (1.0 - FORGET) * weight[i] * prior[i] + x[i] * y;
        }
        // The information is the prior's (positive definite) plus sums of
        // x·xᵀ: always positive definite, so the solve succeeds; kept
        // against a bug, the last fit stays if it does not.
        if let Some(theta) = solve(&self.info, &self.evidence) {
            self.theta = theta;
        }
        self.samples += 1;
    }
}

/// `a⁻¹ · b` for a symmetric positive definite `a` (Cholesky), or `None`
/// when `a` is not (or the result is not finite).
fn solve(a: &[[f64; N]; N], b: &[f64; N]) -> Option<[f64; N]> {
    let mut l = [[0.0; N]; N];
    for i in 0..N {
        for j in 0..=i {
            let sum = a[i][j] - (0..j).map(|k| l[i][k] * l[j][k]).sum::<f64>();
            if i == j {
                if sum.is_nan() || sum <= 0.0 {
                    return None;
                }
                l[i][i] = sum.sqrt();
            } else {
                l[i][j] = sum / l[j][j];
            }
        }
    }
    let mut z = [0.0; N];
    for i in 0..N {
        z[i] = (b[i] - (0..i).map(|k| l[i][k] * z[k]).sum::<f64>()) / l[i][i];
    }
    let mut x = [0.0; N];
    for i in (0..N).rev() {
        x[i] = (z[i] - (i + 1..N).map(|k| l[k][i] * x[k]).sum::<f64>()) / l[i][i];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

fn features(ops: usize, bytes: u64) -> [f64; N] {
    [1.0, ops as f64, bytes as f64 / (1u64 << 20) as f64]
}

/// Every peer's models. One lock: an update is a few dozen flops, once
/// per completed request.
#[derive(Default)]
pub(crate) struct Estimator(Mutex<HashMap<(NodeAddr, RdmaTransportLevel), Model>>);

impl Estimator {
    /// Learns from a request of `ops` ops and `bytes` bytes to `peer` over
    /// `level` that took `took`.
    pub fn record(
        &self,
        peer: NodeAddr,
        level: RdmaTransportLevel,
        ops: usize,
        bytes: u64,
        took: Duration,
    ) {
        let y = (took.as_secs_f64() * 1e6).max(1.0);
        let mut models = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match models.entry((peer, level)) {
            // The first request to a peer over a transport pays what later
            // ones do not (the first mapping, the connections' first use,
            // first touches of pages): it is not a sample of the path.
            Entry::Vacant(first) => {
                first.insert(Model::configured(level));
            }
            Entry::Occupied(mut model) => model.get_mut().update(features(ops, bytes), y),
        }
    }

    /// What a request of `ops` ops and `bytes` bytes to `peer` over `level`
    /// is expected to take.
    pub fn estimate(
        &self,
        peer: NodeAddr,
        level: RdmaTransportLevel,
        ops: usize,
        bytes: u64,
    ) -> Estimate {
        let models = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let model = models
            .get(&(peer, level))
            .cloned()
            .unwrap_or_else(|| Model::configured(level));
        drop(models);
        let micros = model.predict(&features(ops, bytes)).max(1.0);
        let duration = Duration::from_secs_f64(micros / 1e6);
        let method = match model.samples {
            0 => EstimateMethod::Configured,
            samples => EstimateMethod::Measured { samples },
        };
        Estimate {
            duration,
            margin: duration.mul_f64(model.error.max(MIN_MARGIN)),
            method,
            transport: level,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::NodeId;

    fn peer() -> NodeAddr {
        NodeAddr {
            id: NodeId(7),
            endpoint: "127.0.0.1:9".parse().unwrap(),
        }
    }

    /// A path of 50 µs per request, 2 µs per op and 1 GB/s is learned to
    /// within a few percent, for small and large requests alike.
    #[test]
    fn a_linear_path_is_learned_in_relative_terms() {
        let truth = |ops: usize, bytes: u64| 50.0 + 2.0 * ops as f64 + bytes as f64 / 1000.0;
        let estimator = Estimator::default();
        let before = estimator.estimate(peer(), RdmaTransportLevel::Tcp, 16, 64 << 10);
        assert_eq!(before.method, EstimateMethod::Configured);
        let sizes = [
            (16, 64u64 << 10),
            (256, 1 << 20),
            (1024, 4 << 20),
            (4096, 16 << 20),
        ];
        for round in 0..30 {
            let (ops, bytes) = sizes[round % sizes.len()];
            let took = Duration::from_secs_f64(truth(ops, bytes) / 1e6);
            estimator.record(peer(), RdmaTransportLevel::Tcp, ops, bytes, took);
        }
        for (ops, bytes) in sizes {
            let estimate = estimator.estimate(peer(), RdmaTransportLevel::Tcp, ops, bytes);
            let truth = truth(ops, bytes) / 1e6;
            let off = (estimate.duration.as_secs_f64() - truth).abs() / truth;
            assert!(
                off < 0.05,
                "{ops} ops of {bytes} B: {estimate:?} against {truth} s"
            );
            assert_eq!(estimate.method, EstimateMethod::Measured { samples: 29 });
        }
        // Other peers and transports keep their own models.
        let other = estimator.estimate(peer(), RdmaTransportLevel::Memory, 16, 64 << 10);
        assert_eq!(other.method, EstimateMethod::Configured);
    }

    /// The first request (one-time costs) is not learned from, and a
    /// later one-off outlier hardly moves a settled model.
    #[test]
    fn the_first_request_and_outliers_hardly_count() {
        let estimator = Estimator::default();
        let (ops, bytes) = (256, 1u64 << 20);
        let record = |micros| {
            let took = Duration::from_micros(micros);
            estimator.record(peer(), RdmaTransportLevel::Memory, ops, bytes, took)
        };
        record(5000);
        let first = estimator.estimate(peer(), RdmaTransportLevel::Memory, ops, bytes);
        assert_eq!(first.method, EstimateMethod::Configured);
        for _ in 0..10 {
            record(500);
        }
        record(20_000);
        record(500);
        let estimate = estimator.estimate(peer(), RdmaTransportLevel::Memory, ops, bytes);
        let off = (estimate.duration.as_secs_f64() - 500e-6).abs() / 500e-6;
        assert!(off < 0.15, "{estimate:?}");
    }

    /// A million identical requests (one path, one size: a connector
    /// moving the same KV block) keep the model finite and right for that
    /// size, and sizes never seen keep estimates of the configured order;
    /// a changed path is still followed after them. The covariance form
    /// this replaced estimated NaN (answered as 1 µs) after about 14,000.
    #[test]
    fn a_steady_stream_of_one_size_keeps_the_model_finite() {
        let estimator = Estimator::default();
        let level = RdmaTransportLevel::Memory;
        let record = |micros: f64| {
            let took = Duration::from_secs_f64(micros / 1e6);
            estimator.record(peer(), level, 1, 8, took)
        };
        for k in 0..1_000_000u32 {
            record(5.0 + f64::from(k % 7) * 0.1);
        }
        let same = estimator.estimate(peer(), level, 1, 8).duration;
        let off = (same.as_secs_f64() - 5.3e-6).abs() / 5.3e-6;
        assert!(off < 0.1, "{same:?} for the size it learned from");
        // 1,024 ops of 64 KiB: the configured per-op and per-MiB figures
        // (0.2 µs, 125 µs) over the learned fixed cost, within 2x.
        let configured = 5.3 + 0.2 * 1024.0 + 125.0 * 64.0;
        let other = estimator.estimate(peer(), level, 1024, 64 << 20).duration;
        let ratio = other.as_secs_f64() / (configured / 1e6);
        assert!((0.5..2.0).contains(&ratio), "{other:?} for an unseen size");
        for _ in 0..100 {
            record(20.0);
        }
        let changed = estimator.estimate(peer(), level, 1, 8).duration;
        let off = (changed.as_secs_f64() - 20e-6).abs() / 20e-6;
        assert!(off < 0.1, "{changed:?} after the path slowed to 20 µs");
    }

    /// A path that slows down is followed: the old samples fade.
    #[test]
    fn a_changed_path_is_followed() {
        let estimator = Estimator::default();
        let (ops, bytes) = (256, 1u64 << 20);
        for _ in 0..50 {
            estimator.record(
                peer(),
                RdmaTransportLevel::Tcp,
                ops,
                bytes,
                Duration::from_micros(500),
            );
        }
        for _ in 0..100 {
            estimator.record(
                peer(),
                RdmaTransportLevel::Tcp,
                ops,
                bytes,
                Duration::from_micros(2000),
            );
        }
        let estimate = estimator.estimate(peer(), RdmaTransportLevel::Tcp, ops, bytes);
        let off = (estimate.duration.as_secs_f64() - 2e-3).abs() / 2e-3;
        assert!(off < 0.1, "{estimate:?}");
    }
}
