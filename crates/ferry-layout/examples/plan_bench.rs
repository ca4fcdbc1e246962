//! What a plan costs: compile time and heap size for a large model, and
//! expansion time per descriptor for 4096-token requests.
//!
//! ```sh
//! cargo run --release -p ferry-layout --example plan_bench
//! ```

use std::hint::black_box;
use std::time::{Duration, Instant};

use ferry_layout::{
    Expansion, KvCache, KvPlacement, LayerPlacement, NixlShape, Plan, PlanOptions, RankLayout,
    TableRequest, TokenOrder, plan,
};

fn cache(layers: u64, blocks: u64, layer_regions: LayerPlacement) -> KvCache {
    KvCache {
        layers,
        heads: 8,
        head_dim: 128,
        elem_size: 2,
        tokens: 16 * blocks,
        block_tokens: 16,
        blocks,
        order: TokenOrder::Hnd,
        kv: KvPlacement::Separate,
        layer_regions,
        table: "kv".into(),
    }
}

fn side(c: &KvCache, tp: u64) -> Vec<RankLayout> {
    (0..tp as u32)
        .map(|r| c.rank(r, tp).expect("rank"))
        .collect()
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Compile time (median of `runs`) and the plan.
fn compile(local: &RankLayout, remote: &[RankLayout], runs: usize) -> (Duration, Plan) {
    let mut times = Vec::with_capacity(runs);
    let mut last = None;
    for _ in 0..runs {
        let start = Instant::now();
        let p = plan(black_box(local), black_box(remote), PlanOptions::default()).expect("plan");
        times.push(start.elapsed());
        last = Some(p);
    }
    (median(times), last.expect("runs > 0"))
}

/// Median ns per descriptor over `rounds` requests, cycling through
/// `tables` (local, remote), into an expansion cleared each time.
fn expand_ns(
    p: &Plan,
    tables: &[(Vec<u64>, Vec<u64>)],
    tokens: u64,
    merge: bool,
    rounds: usize,
) -> (f64, usize) {
    let mut out = if merge {
        Expansion::new()
    } else {
        Expansion::without_merging()
    };
    let mut times = Vec::with_capacity(rounds);
    let mut descs = 0;
    for i in 0..rounds {
        let (l, r) = &tables[i % tables.len()];
        let req = [TableRequest {
            table: "kv",
            range: 0..tokens,
            local: l,
            remote: r,
        }];
        out.clear();
        let start = Instant::now();
        p.expand(black_box(&req), &mut out).expect("expand");
        times.push(start.elapsed());
        descs = out.len();
    }
    (median(times).as_nanos() as f64 / descs as f64, descs)
}

/// What storing alone costs: median ns per pair to push `n` pairs into
/// fresh lists of that capacity (what `Expansion::clear` allocates), with
/// no planning at all. Expansion costs about as much: the walk is cheap
/// next to filling new `Descs` arrays.
fn push_floor(n: usize, rounds: usize) -> f64 {
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        let mut l = ferry_core::Descs::with_capacity(n);
        let mut r = ferry_core::Descs::with_capacity(n);
        for i in 0..n as u64 {
            l.push(black_box(1), i * 16384, 8192);
            r.push(black_box(2), i * 8192, 8192);
        }
        black_box((&l, &r));
        times.push(start.elapsed());
    }
    median(times).as_nanos() as f64 / n as f64
}

fn shuffled(rng: &mut u64, n: u64, take: u64) -> Vec<u64> {
    // xorshift, so the example needs no dependency.
    let mut next = || {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng
    };
    let mut ids: Vec<u64> = (0..n).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    ids.truncate(take as usize);
    ids
}

fn main() {
    println!(
        "# plan compile: 64 layers x 8 KV heads x 128 head_dim, 131072 blocks of 16, prefill TP4 -> decode TP2 (one decode rank)"
    );
    for placement in [LayerPlacement::RegionPerLayer, LayerPlacement::OneRegion] {
        let c = cache(64, 131_072, placement);
        let (prefill, decode) = (side(&c, 4), side(&c, 2));
        let (time, p) = compile(&decode[0], &prefill, 51);
        println!(
            "{placement:?}: compile {:.1} us (median of 51), plan heap {} bytes, {} segments, {} remote regions",
            time.as_secs_f64() * 1e6,
            p.heap_bytes(),
            p.segment_count(),
            p.remote_regions().len()
        );
    }

    let tokens = 4096u64;
    let blocks = 131_072u64;
    let c = cache(64, blocks, LayerPlacement::RegionPerLayer);
    let (prefill, decode) = (side(&c, 4), side(&c, 2));
    let p = plan(&decode[0], &prefill, PlanOptions::default()).expect("plan");
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let used = tokens / 16;
    let random: Vec<(Vec<u64>, Vec<u64>)> = (0..8)
        .map(|_| {
            (
                shuffled(&mut rng, blocks, used),
                shuffled(&mut rng, blocks, used),
            )
        })
        .collect();
    let consecutive = vec![((0..used).collect(), (1000..1000 + used).collect())];
    let vllm = 64 * 2 * used * 2;
    println!(
        "\n# expand: TP4 -> TP2, 64 layers, K and V, HND, {tokens} tokens, one decode rank (median of 200 requests)"
    );
    for (name, tables) in [
        ("random tables", &random),
        ("consecutive tables", &consecutive),
    ] {
        let (ns, n) = expand_ns(&p, tables, tokens, true, 200);
        let (ns_unmerged, n_unmerged) = expand_ns(&p, tables, tokens, false, 200);
        println!(
            "{name}: {n} descriptors merged ({ns:.2} ns each, {:.0} us per request), {n_unmerged} unmerged ({ns_unmerged:.2} ns each); a connector without a planner: {vllm}",
            ns * n as f64 / 1e3
        );
    }
    println!(
        "for comparison, no planning at all: pushing 65536 pairs into fresh ferry_core::Descs costs {:.2} ns each",
        push_floor(65536, 200)
    );
    // The NIXL shape of the same plan: list sizes (not built here: they
    // enumerate the whole pool) and index arrays per request.
    let shape = NixlShape::new(&p);
    let mut indices = Vec::new();
    let mut times = Vec::with_capacity(200);
    for i in 0..200 {
        let (l, r) = &random[i % random.len()];
        let req = [TableRequest {
            table: "kv",
            range: 0..tokens,
            local: l,
            remote: r,
        }];
        let start = Instant::now();
        shape
            .indices(black_box(&req), &mut indices)
            .expect("aligned");
        times.push(start.elapsed());
    }
    let pairs: usize = indices.iter().map(|g| g.local.len()).sum();
    println!(
        "NIXL shape: local list {} rows, remote lists {:?} rows; indices {:.2} ns per pair ({pairs} pairs, arrays reused)",
        shape.local_len(),
        shape.remote_lens(),
        median(times).as_nanos() as f64 / pairs as f64
    );
    // Where merging pays: both sides hold the same heads (TP2 -> TP2).
    let same = side(&c, 2);
    let p = plan(&same[0], &same, PlanOptions::default()).expect("plan");
    println!("\n# expand: TP2 -> TP2 (same heads), otherwise as above");
    for (name, tables) in [
        ("random tables", &random),
        ("consecutive tables", &consecutive),
    ] {
        let (ns, n) = expand_ns(&p, tables, tokens, true, 200);
        let (ns_unmerged, n_unmerged) = expand_ns(&p, tables, tokens, false, 200);
        println!(
            "{name}: {n} descriptors merged ({ns:.2} ns each, {:.0} us per request), {n_unmerged} unmerged ({ns_unmerged:.2} ns each); a connector without a planner: {}",
            ns * n as f64 / 1e3,
            64 * 2 * used
        );
    }
}
