//! Narrowed credentials: how a handle handed to another process covers
//! only its own bytes and access, over TCP and same-host memory.
//!
//! A region's TCP and same-host tokens (random per registration) open the
//! whole region with the region's access. A handle that covers less, a
//! [`Scope`] (a byte range of the region and an access), carries instead a
//! token *derived* from the region's and the scope, with the scope in the
//! clear beside it:
//!
//! ```text
//! token(scope) = HMAC-SHA-256(key = region token, "ferry scope v1" || scope)[..16]
//! ```
//!
//! The owner, which knows the region's token, derives it again and compares
//! in constant time; a holder of the derived token cannot work back to the
//! region's (HMAC is a pseudo-random function keyed by it), so editing the
//! scope in a handle's JSON breaks the token. A narrowed handle narrowed
//! again derives from its own token: a handle carries the chain of scopes
//! it was narrowed through ([`Scopes`], at most [`MAX_SCOPES`]), each inside
//! the one before, and its token is the last link,
//!
//! ```text
//! t0 = region token;   t(k) = token(t(k-1), scope k)
//! ```
//!
//! which only a holder of `t(k-1)` can make; the owner walks the chain
//! from the region's token. Because every holder can derive the next
//! link, the owner also checks that each scope lies inside the one before
//! (and the first inside the region): a holder of scope `k` who derived a
//! wider `k+1` is refused. Access narrows the same way: a scope that
//! allows no writes makes every scope after it read-only.
//!
//! A handle holding the region's own token (the whole region, the
//! region's access) carries no scopes, and the owner checks it with one
//! comparison: no hashing on the common path.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::{Access, tokens_equal};

/// Most scopes one handle's chain may hold: a handle narrowed and handed
/// on this many times can be narrowed no further (serializing it fails).
/// Enough for the hand-offs of a real pipeline, few enough that the
/// owner's check and a TCP request's scope trailer stay small.
pub const MAX_SCOPES: usize = 4;

/// Length of one [`Scope`] on the wire.
pub const SCOPE_LEN: usize = 24;

/// What the derivation mixes in before the scope: a version, so that a
/// later change of the scope's encoding cannot collide with this one.
const LABEL: &[u8] = b"ferry scope v1";

/// A byte range of a region, as addresses in the owner's process, and
/// what a holder may do there: what a narrowed handle's credentials open.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Scope {
    /// The first byte, a virtual address in the owner's process.
    pub addr: u64,
    /// Bytes from `addr`.
    pub len: u64,
    /// Reads only, or reads and writes.
    pub access: Access,
}

impl Scope {
    const EMPTY: Scope = Scope {
        addr: 0,
        len: 0,
        access: Access::ReadOnly,
    };

    /// Whether `len` bytes at `addr` lie inside the scope's range (with no
    /// address arithmetic that can overflow).
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        let offset = addr.wrapping_sub(self.addr);
        addr >= self.addr && offset.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// Whether `inner`'s range lies inside this one's.
    pub fn contains(&self, inner: &Scope) -> bool {
        self.covers(inner.addr, inner.len)
    }

    /// The scope as sent and as hashed: address and length little-endian,
    /// then the access (0 read-only, 1 read-write), then zeros.
    pub fn encode(&self) -> [u8; SCOPE_LEN] {
        let mut b = [0; SCOPE_LEN];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16] = u8::from(self.access.allows_write());
        b
    }

    /// Reads [`Scope::encode`]'s bytes; `None` for any other (an access
    /// byte above 1, a padding byte not zero).
    pub fn decode(b: &[u8; SCOPE_LEN]) -> Option<Scope> {
        let access = match b[16] {
            0 => Access::ReadOnly,
            1 => Access::ReadWrite,
            _ => return None,
        };
        if b[17..].iter().any(|&x| x != 0) {
            return None;
        }
        Some(Scope {
            addr: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            len: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            access,
        })
    }
}

/// The token that opens `scope` to whoever holds `token`'s scope (the
/// whole region, for the region's own token): one link of the chain.
pub fn scope_token(token: u128, scope: &Scope) -> u128 {
    let mut mac =
        Hmac::<Sha256>::new_from_slice(&token.to_le_bytes()).expect("HMAC takes any key length");
    mac.update(LABEL);
    mac.update(&scope.encode());
    let tag = mac.finalize().into_bytes();
    u128::from_le_bytes(tag[..16].try_into().expect("a 32-byte tag"))
}

/// The chain of scopes a handle was narrowed through, outermost first;
/// empty for a handle that holds the region's own token. Serialized as a
/// list of [`Scope`]s. Equal when their scopes are.
#[derive(Clone, Copy, Eq)]
pub struct Scopes {
    len: u8,
    scopes: [Scope; MAX_SCOPES],
}

impl Default for Scopes {
    fn default() -> Self {
        Scopes {
            len: 0,
            scopes: [Scope::EMPTY; MAX_SCOPES],
        }
    }
}

impl Scopes {
    /// The chain `scopes`, outermost first; `None` if it is longer than
    /// [`MAX_SCOPES`].
    pub fn new(scopes: &[Scope]) -> Option<Self> {
        let mut out = Scopes::default();
        out.scopes.get_mut(..scopes.len())?.copy_from_slice(scopes);
        out.len = scopes.len() as u8;
        Some(out)
    }

    /// The scopes, outermost first.
    pub fn as_slice(&self) -> &[Scope] {
        &self.scopes[..usize::from(self.len)]
    }

    /// How many scopes the chain holds.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Whether the chain is empty: the region's own token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The innermost scope: what the credentials open.
    pub fn last(&self) -> Option<&Scope> {
        self.as_slice().last()
    }

    /// The chain with `scope` inside; `None` if it is full.
    pub fn with(&self, scope: Scope) -> Option<Scopes> {
        let mut out = *self;
        *out.scopes.get_mut(self.len())? = scope;
        out.len += 1;
        Some(out)
    }

    /// The token of the chain's innermost scope, from the region's `token`.
    pub fn token(&self, token: u128) -> u128 {
        self.as_slice().iter().fold(token, scope_token)
    }

    /// The chain as sent: each scope's [`Scope::encode`], outermost first.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        for scope in self.as_slice() {
            out.extend_from_slice(&scope.encode());
        }
    }

    /// Reads a chain of `bytes.len() / SCOPE_LEN` scopes; `None` unless
    /// it holds 1 to [`MAX_SCOPES`] whole, well-formed ones.
    pub fn decode(bytes: &[u8]) -> Option<Scopes> {
        if bytes.is_empty() || !bytes.len().is_multiple_of(SCOPE_LEN) {
            return None;
        }
        let mut out = Scopes::default();
        for entry in bytes.chunks_exact(SCOPE_LEN) {
            let scope = Scope::decode(entry.try_into().expect("SCOPE_LEN bytes"))?;
            out = out.with(scope)?;
        }
        Some(out)
    }

    /// What credentials open, as the owner of a region checks them: the
    /// region (its range and access as `region`) and its `token`; a
    /// request presenting `presented` with this chain. `Some` with the
    /// scope opened: the region itself for its own token (one
    /// constant-time comparison), the innermost scope for a chain whose
    /// every scope lies inside the one before (the first inside the
    /// region) and whose last link is `presented`, with the access
    /// narrowed by every scope and the region. `None` otherwise.
    ///
    /// A chain is hashed whole even when a scope lies outside the one
    /// before, so that a refusal takes the same work whichever check
    /// failed.
    pub fn open(&self, region: Scope, token: u128, presented: u128) -> Option<Scope> {
        if self.is_empty() {
            return tokens_equal(token, presented).then_some(region);
        }
        let mut outer = region;
        let mut inside = true;
        for scope in self.as_slice() {
            inside &= outer.contains(scope);
            outer = Scope {
                access: outer.access.min(scope.access),
                ..*scope
            };
        }
        let matches = tokens_equal(self.token(token), presented);
        (matches && inside).then_some(outer)
    }

    /// Whether `presented` with this chain is a credential `token` issued,
    /// whatever its ranges: what the owner checks for a region that is
    /// gone, to tell its holders so and nobody else.
    pub fn issued_by(&self, token: u128, presented: u128) -> bool {
        tokens_equal(self.token(token), presented)
    }
}

impl PartialEq for Scopes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl std::hash::Hash for Scopes {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl std::fmt::Debug for Scopes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl Serialize for Scopes {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Scopes {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let scopes = Vec::<Scope>::deserialize(deserializer)?;
        Scopes::new(&scopes).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "{} scopes: a handle is narrowed at most {MAX_SCOPES} times",
                scopes.len()
            ))
        })
    }
}

#[cfg(test)]
mod tests;
