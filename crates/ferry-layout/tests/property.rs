//! Random layouts on both sides, checked byte for byte against the
//! reference in `common`, pulling into every local rank and pushing from
//! all of them. Seeded: a failure prints its seed; rerun one case with
//! `FERRY_LAYOUT_SEED=<seed> FERRY_LAYOUT_CASES=1`.

mod common;

use common::random::{Case, generate};
use common::{check_pull, check_pull_nixl, check_push};
use fastrand::Rng;
use ferry_layout::RequestError;

fn case(seed: u64, stats: &mut Stats) {
    let mut rng = Rng::with_seed(seed);
    let Case {
        shape,
        pools,
        local,
        remote,
        reqs,
    } = generate(&mut rng);
    let mut descs = 0;
    // The NIXL shape addresses whole sub-blocks of gcd(both blocks).
    let aligned = match (&pools, reqs.first()) {
        (Some((lp, rp)), Some(r)) => {
            let g = gcd(lp.block, rp.block);
            r.range.is_empty() || (r.range.start % g == 0 && r.range.end % g == 0)
        }
        _ => true,
    };
    for l in &local {
        descs += check_pull(l, &remote, &reqs).descs;
        match check_pull_nixl(l, &remote, &reqs) {
            Ok(_) => assert!(aligned, "an unaligned range through the NIXL shape"),
            Err(RequestError::Unaligned { .. }) if !aligned => {}
            Err(e) => panic!("NIXL shape: {e}"),
        }
    }
    descs += check_push(&local, &remote, &reqs, true);
    let all = || local.iter().chain(&remote).flat_map(|r| &r.tensors);
    stats.cases += 1;
    stats.paged += usize::from(shape.paged.is_some());
    stats.interleaved += usize::from(shape.interleave);
    stats.mapped += usize::from(all().any(|t| t.region_map.is_some()));
    stats.replicated += usize::from(all().any(|t| t.replicated));
    stats.descs += descs;
}

/// What the cases exercised: the test fails if the generator stops
/// producing a feature.
#[derive(Debug, Default)]
struct Stats {
    cases: usize,
    paged: usize,
    interleaved: usize,
    mapped: usize,
    replicated: usize,
    descs: usize,
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Prints the seed of a case that panics.
struct Seed(u64);

impl Drop for Seed {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "failing case: FERRY_LAYOUT_SEED={} FERRY_LAYOUT_CASES=1",
                self.0
            );
        }
    }
}

#[test]
fn random_layouts_match_the_reference() {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let first = env("FERRY_LAYOUT_SEED").unwrap_or(0x5eed_0000);
    let cases = env("FERRY_LAYOUT_CASES").unwrap_or(400);
    let mut stats = Stats::default();
    for seed in first..first + cases {
        let guard = Seed(seed);
        case(seed, &mut stats);
        drop(guard);
    }
    eprintln!("{stats:?}");
    if cases >= 100 {
        let least = cases as usize / 10;
        assert!(
            stats.paged > least && stats.interleaved > least,
            "{stats:?}"
        );
        assert!(
            stats.mapped > least && stats.replicated > least,
            "{stats:?}"
        );
    }
}
