//! Stable fingerprints of layouts, so that the facade can tell that a
//! peer's published layout changed since a plan was built against it.
//!
//! The hash is FNV-1a (64 bits) over a canonical encoding written here
//! field by field: a format version, then every field in declaration
//! order, integers little-endian, strings and lists length-prefixed, enums
//! and options by a tag byte. It does not depend on serde's formats or on
//! std's hasher (randomly keyed, and unstable across Rust releases), so
//! two processes on two builds agree on it. Not a defence against a peer
//! that wants a collision: only a change detector.

use crate::layout::{Part, RankLayout, TensorLayout};

/// Bumped whenever the encoding below changes.
const FORMAT: u8 = 1;

/// FNV-1a, 64 bits.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        h.byte(FORMAT);
        h
    }
    fn byte(&mut self, b: u8) {
        self.0 ^= u64::from(b);
        self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
    }
    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.byte(b);
        }
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        self.u64(n as u64);
    }
    fn str(&mut self, s: &str) {
        self.len(s.len());
        self.bytes(s.as_bytes());
    }
}

fn tensor_layout(h: &mut Fnv, t: &TensorLayout) {
    h.str(&t.tensor.name);
    h.u32(t.tensor.elem_size);
    h.len(t.tensor.axes.len());
    for axis in &t.tensor.axes {
        h.str(&axis.name);
        h.u64(axis.size);
    }
    h.len(t.parts.len());
    for part in &t.parts {
        match *part {
            Part::Full => h.byte(0),
            Part::Split { parts, index } => {
                h.byte(1);
                h.u64(parts);
                h.u64(index);
            }
            Part::Range { start, len } => {
                h.byte(2);
                h.u64(start);
                h.u64(len);
            }
        }
    }
    h.byte(u8::from(t.replicated));
    h.u32(t.region);
    h.u64(t.offset);
    h.len(t.strides.len());
    for &s in &t.strides {
        h.u64(s);
    }
    match &t.region_map {
        None => h.byte(0),
        Some(map) => {
            h.byte(1);
            h.u32(map.axis);
            h.len(map.places.len());
            for place in &map.places {
                h.u32(place.region);
                h.u64(place.offset);
            }
        }
    }
    match &t.paged {
        None => h.byte(0),
        Some(p) => {
            h.byte(1);
            h.u32(p.axis);
            h.u64(p.block);
            h.u64(p.block_stride);
            h.u64(p.blocks);
            h.str(&p.table);
        }
    }
}

fn rank_layout(h: &mut Fnv, r: &RankLayout) {
    h.u32(r.rank);
    h.len(r.region_lens.len());
    for &len in &r.region_lens {
        h.u64(len);
    }
    h.len(r.tensors.len());
    for t in &r.tensors {
        tensor_layout(h, t);
    }
}

impl TensorLayout {
    /// A stable hash of this layout (see the module docs of
    /// `fingerprint.rs`): equal layouts give equal fingerprints in every
    /// process and build.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        tensor_layout(&mut h, self);
        h.0
    }
}

impl RankLayout {
    /// A stable hash of this rank's layout: regions and tensors, in order.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        rank_layout(&mut h, self);
        h.0
    }
}

/// A stable hash of a whole side, in the order given.
pub fn side_fingerprint(side: &[RankLayout]) -> u64 {
    let mut h = Fnv::new();
    h.len(side.len());
    for r in side {
        rank_layout(&mut h, r);
    }
    h.0
}
