//! Replays the fuzz corpus without cargo-fuzz: every seed in
//! `fuzz/corpus/<target>/` and every input the fuzzer once crashed on in
//! `fuzz/regressions/<target>/` goes through the same check the fuzz target
//! runs, so a fixed bug stays fixed under a plain `cargo test`.

use std::path::{Path, PathBuf};

#[path = "../fuzz/src/checks.rs"]
mod checks;
#[path = "../fuzz/src/seeds.rs"]
mod seeds;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The files directly under `dir/<target>/` for every target directory in
/// `dir` (none if `dir` does not exist), checking that each directory names
/// a target: a misspelt one would silently never be replayed.
fn inputs(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries {
        let path = entry.unwrap().path();
        if !path.is_dir() {
            continue;
        }
        let target = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            checks::TARGETS.iter().any(|(name, _)| *name == target),
            "{} names no fuzz target",
            path.display()
        );
        for file in std::fs::read_dir(&path).unwrap() {
            let file = file.unwrap().path();
            if file.is_file() {
                out.push((target.clone(), file));
            }
        }
    }
    out.sort();
    out
}

fn check_of(target: &str) -> checks::Check {
    checks::TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .map(|(_, check)| *check)
        .unwrap()
}

#[test]
fn every_seed_and_regression_input_passes_its_check() {
    let corpus = inputs(&fuzz_dir().join("corpus"));
    let regressions = inputs(&fuzz_dir().join("regressions"));
    for (target, _) in checks::TARGETS {
        assert!(
            corpus.iter().any(|(t, _)| t == target),
            "fuzz target {target} has no seed in fuzz/corpus/{target}/"
        );
    }
    let mut failed = Vec::new();
    for (target, file) in corpus.iter().chain(&regressions) {
        let bytes = std::fs::read(file).unwrap();
        let check = check_of(target);
        if std::panic::catch_unwind(|| check(&bytes)).is_err() {
            failed.push(file.display().to_string());
        }
    }
    assert!(failed.is_empty(), "inputs failing their check: {failed:?}");
    println!(
        "replayed {} seeds and {} regression inputs",
        corpus.len(),
        regressions.len()
    );
}

/// The committed seeds are what today's encoders make, and each is valid:
/// its decoder accepts it. A format change shows up here; regenerate with
/// `cargo test --test fuzz_corpus -- --ignored write_seed_corpus`.
#[test]
fn committed_seeds_are_what_the_encoders_make() {
    for seed in seeds::seeds() {
        let path = fuzz_dir().join("corpus").join(seed.target).join(seed.name);
        let committed = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; regenerate the seeds", path.display()));
        assert!(
            committed == seed.bytes,
            "{} differs from what the encoders make; regenerate the seeds",
            path.display()
        );
        assert!(
            check_of(seed.target)(&seed.bytes) > 0,
            "{}: its decoder refuses it",
            path.display()
        );
    }
}

/// Writes the seed corpus (`fuzz/corpus/<target>/<name>`) from the encoders.
#[test]
#[ignore = "writes fuzz/corpus; run by hand after a wire format change"]
fn write_seed_corpus() {
    for seed in seeds::seeds() {
        let dir = fuzz_dir().join("corpus").join(seed.target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(seed.name), &seed.bytes).unwrap();
    }
}
