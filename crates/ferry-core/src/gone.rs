//! The owner's first check of a request, shared by the TCP and same-host
//! owners: do its credentials open the slot and generation it names?
//!
//! **Order.** The credentials are checked before anything about the slot
//! is revealed: a request whose token was not issued for that slot and
//! generation is refused with `AccessDenied`, whether the slot holds that
//! region, another generation, or nothing. So a stranger probing slot ids
//! and generations with guessed tokens learns nothing about which exist.
//! Only a request whose credentials the region *did* accept hears that it
//! is gone (`UnknownRegion`) or replaced (`StaleGeneration`): for that,
//! the owner remembers the tokens of the regions that left most recently
//! ([`Departed`], [`DEPARTED`] of them). The holder of a handle to a
//! region that left longer ago hears `AccessDenied` too.
//!
//! The work is the same either way: a slot and generation the owner
//! knows no token for is checked against a random decoy, so a probe costs
//! the owner (and takes) what a wrong token on a live region does.

use std::collections::{HashMap, VecDeque};

use crate::{Generation, RegionId, Scope, Scopes, random_u128};

/// How many departed regions an owner remembers, per transport: their
/// holders are told the region is gone. About 40 bytes each.
pub const DEPARTED: usize = 8192;

/// Why an owner refuses a request at its first check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotRefusal {
    /// The credentials were not issued for that slot and generation
    /// (or for one that left too long ago to be remembered).
    AccessDenied,
    /// The region they were issued for is gone; the slot is empty.
    UnknownRegion,
    /// The region they were issued for is gone; the slot holds a newer
    /// one, of generation `current`.
    StaleGeneration {
        /// The slot's generation now.
        current: Generation,
    },
}

/// The tokens of the regions that left an owner most recently, so that it
/// can tell their holders (and only them) that they are gone.
pub struct Departed {
    tokens: HashMap<(RegionId, Generation), u128>,
    order: VecDeque<(RegionId, Generation)>,
    /// What credentials for a slot and generation with no remembered
    /// token are checked against: random, so nothing presented matches.
    decoy: u128,
}

impl Default for Departed {
    fn default() -> Self {
        Departed {
            tokens: HashMap::new(),
            order: VecDeque::new(),
            decoy: random_u128(),
        }
    }
}

impl Departed {
    /// Remembers that `region` of `generation`, whose token was `token`,
    /// left; the oldest is forgotten past [`DEPARTED`].
    pub fn remember(&mut self, region: RegionId, generation: Generation, token: u128) {
        if self.tokens.insert((region, generation), token).is_none() {
            self.order.push_back((region, generation));
        }
        while self.order.len() > DEPARTED {
            if let Some(oldest) = self.order.pop_front() {
                self.tokens.remove(&oldest);
            }
        }
    }

    /// Whether `presented` with `scopes` is a credential of `region` at
    /// `generation`, remembered as departed.
    fn issued(
        &self,
        region: RegionId,
        generation: Generation,
        presented: u128,
        scopes: &Scopes,
    ) -> bool {
        let token = self.tokens.get(&(region, generation));
        // The decoy's answer is discarded, but computed: the same work.
        let issued = scopes.issued_by(token.copied().unwrap_or(self.decoy), presented);
        issued && token.is_some()
    }

    /// The owner's first check of a request for slot `region` at
    /// `generation`, presenting token `presented` with chain `scopes`;
    /// `live` is what the slot holds now (its generation, token, and its
    /// range and access as a [`Scope`]), if anything. `Ok` with the scope
    /// the credentials open (see [`Scopes::open`]); otherwise the refusal,
    /// in the order the module describes.
    pub fn check(
        &self,
        live: Option<(Generation, u128, Scope)>,
        region: RegionId,
        generation: Generation,
        presented: u128,
        scopes: &Scopes,
    ) -> Result<Scope, SlotRefusal> {
        if let Some((current, token, range)) = live
            && current == generation
        {
            return scopes
                .open(range, token, presented)
                .ok_or(SlotRefusal::AccessDenied);
        }
        if !self.issued(region, generation, presented, scopes) {
            return Err(SlotRefusal::AccessDenied);
        }
        Err(match live {
            Some((current, ..)) => SlotRefusal::StaleGeneration { current },
            None => SlotRefusal::UnknownRegion,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Access;

    const REGION: Scope = Scope {
        addr: 0x1000,
        len: 100,
        access: Access::ReadWrite,
    };

    #[test]
    fn only_holders_hear_that_a_region_is_gone() {
        let mut departed = Departed::default();
        let (slot, old, new) = (RegionId(3), Generation(1), Generation(2));
        let (old_token, new_token) = (11, 12);
        let none = Scopes::default();
        let live = Some((new, new_token, REGION));
        // The live region: its token opens it, a wrong one does not.
        assert_eq!(departed.check(live, slot, new, 12, &none), Ok(REGION));
        let denied = Err(SlotRefusal::AccessDenied);
        assert_eq!(departed.check(live, slot, new, 13, &none), denied);
        // The old generation, not remembered: nobody hears it existed.
        assert_eq!(departed.check(live, slot, old, old_token, &none), denied);
        departed.remember(slot, old, old_token);
        let stale = Err(SlotRefusal::StaleGeneration { current: new });
        assert_eq!(departed.check(live, slot, old, old_token, &none), stale);
        assert_eq!(departed.check(None, slot, old, old_token, &none), {
            Err(SlotRefusal::UnknownRegion)
        });
        // A stranger probing it, or a generation that never was.
        assert_eq!(departed.check(live, slot, old, 99, &none), denied);
        assert_eq!(departed.check(live, slot, Generation(3), 12, &none), denied);
        assert_eq!(departed.check(None, RegionId(4), new, 12, &none), denied);
        // A narrowed credential of the departed region is heard too.
        let scope = Scope { len: 10, ..REGION };
        let chain = Scopes::new(&[scope]).unwrap();
        let narrowed = chain.token(old_token);
        assert_eq!(departed.check(live, slot, old, narrowed, &chain), stale);
        assert_eq!(
            departed.check(live, slot, old, narrowed ^ 1, &chain),
            denied
        );
    }

    #[test]
    fn the_oldest_departed_are_forgotten() {
        let mut departed = Departed::default();
        for k in 0..DEPARTED as u32 + 10 {
            departed.remember(RegionId(k), Generation(1), u128::from(k));
        }
        assert_eq!(departed.tokens.len(), DEPARTED);
        let none = Scopes::default();
        let gone = |k: u32| departed.check(None, RegionId(k), Generation(1), k.into(), &none);
        assert_eq!(gone(9), Err(SlotRefusal::AccessDenied));
        assert_eq!(gone(10), Err(SlotRefusal::UnknownRegion));
    }
}
