//! Simplifying a plan's loop nests: loops folded into the run or merged
//! where they continue each other on both sides, and segments that are
//! shifted copies of one another folded into one segment with one more
//! loop. Each step keeps exactly the bytes the nests move.

use crate::plan::{Dim, Draft};

/// Folds loops contiguous on both sides into the run, then merges loops
/// that continue each other on both sides; drops loops of one step.
/// Leaves them outermost (largest local stride) first.
pub(crate) fn coalesce(dims: &mut Vec<Dim>, run: &mut u64) {
    dims.retain(|d| d.count > 1);
    while let Some(i) = dims
        .iter()
        .position(|d| d.local == *run && d.remote == *run)
    {
        *run *= dims.remove(i).count;
    }
    dims.sort_by_key(|d| std::cmp::Reverse(d.local));
    'merge: loop {
        for i in 0..dims.len() {
            for j in 0..dims.len() {
                let (a, b) = (dims[i], dims[j]);
                if i != j && b.local == a.count * a.local && b.remote == a.count * a.remote {
                    dims[i].count *= b.count;
                    dims.remove(j);
                    continue 'merge;
                }
            }
        }
        break;
    }
}

/// Folds segments that are copies of one another shifted by the same byte
/// distances on both sides into one segment with one more loop, until
/// none are left. K and V declared as two tensors over one block (vLLM's
/// CPU cache: a head's K rows, then its V rows) are such a pair: as one
/// segment, the K/V loop folds into the run whenever a request moves
/// whole blocks, so a head's K and V go as one descriptor, as they would
/// had K/V been declared an axis of 2. The same holds for layers declared
/// as tensors of their own. Each fused segment moves exactly the bytes of
/// the segments it replaces.
pub(crate) fn fuse_translates(drafts: &mut Vec<Draft>) {
    // Everything but the bases must agree for two drafts to be translates.
    fn shape(d: &Draft) -> impl Ord + '_ {
        (
            d.rank,
            d.local_region,
            d.remote_region,
            d.run,
            &d.outer,
            &d.inner,
            d.paged,
        )
    }
    loop {
        let before = drafts.len();
        drafts.sort_by(|a, b| {
            shape(a)
                .cmp(&shape(b))
                .then(a.local_base.cmp(&b.local_base))
                .then(a.remote_base.cmp(&b.remote_base))
        });
        let mut fused: Vec<Draft> = Vec::with_capacity(drafts.len());
        let mut rest = std::mem::take(drafts).into_iter().peekable();
        while let Some(mut first) = rest.next() {
            let mut step: Option<Dim> = None;
            let mut last = (first.local_base, first.remote_base);
            while let Some(next) = rest.peek() {
                let shift = (
                    next.local_base.checked_sub(last.0),
                    next.remote_base.checked_sub(last.1),
                );
                let (Some(local), Some(remote)) = shift else {
                    break;
                };
                let same = shape(next).cmp(&shape(&first)).is_eq() && local > 0 && remote > 0;
                match &mut step {
                    _ if !same => break,
                    None => {
                        step = Some(Dim {
                            count: 2,
                            local,
                            remote,
                        })
                    }
                    Some(d) if d.local == local && d.remote == remote => d.count += 1,
                    Some(_) => break,
                }
                last = (next.local_base, next.remote_base);
                rest.next();
            }
            if let Some(step) = step {
                let loops = match first.paged {
                    Some(p) if step.local <= p.local_block_stride => &mut first.inner,
                    _ => &mut first.outer,
                };
                loops.push(step);
                coalesce(loops, &mut first.run);
            }
            fused.push(first);
        }
        *drafts = fused;
        if drafts.len() == before {
            return;
        }
    }
}
