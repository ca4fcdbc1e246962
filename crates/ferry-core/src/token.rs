//! Read-only access tokens. A region's TCP and same-host tokens open it for
//! reads and writes; [`RemoteBuffer::read_only`](crate::RemoteBuffer::read_only)
//! replaces them by a token derived from them that opens it for reads only.
//! The derivation is a keyed pseudo-random function (SipHash-2-4, keyed by
//! the token), so a holder of the derived token cannot work its way back to
//! the original one, and the owner, which knows the original, checks either.
//! Without it, a read-only handle edited back to read-write (its tokens
//! intact) could write.

use crate::tokens_equal;

/// The token a read-only handle carries in place of `token`.
pub fn read_only_token(token: u128) -> u128 {
    let (k0, k1) = (token as u64, (token >> 64) as u64);
    let low = siphash24(k0, k1, b"ferry read-only 0");
    let high = siphash24(k0, k1, b"ferry read-only 1");
    u128::from(low) | (u128::from(high) << 64)
}

/// Whether `presented` opens a region whose token is `token`: the token
/// itself for anything, its [`read_only_token`] for reads (`write` false).
/// Each comparison is [`tokens_equal`]'s constant-time one. The derived
/// token is only computed when the token itself did not match: a request
/// with the full token (every transfer through a handle not narrowed)
/// pays no hashing, and a wrong guess always takes the same path.
pub fn token_grants(token: u128, presented: u128, write: bool) -> bool {
    tokens_equal(token, presented) || (!write && tokens_equal(read_only_token(token), presented))
}

/// SipHash-2-4 of `message` under the key `(k0, k1)` (Aumasson and
/// Bernstein's reference: little-endian words, the length in the last
/// byte).
fn siphash24(k0: u64, k1: u64, message: &[u8]) -> u64 {
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let round = |v: &mut [u64; 4]| {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    };
    let compress = |v: &mut [u64; 4], m: u64| {
        v[3] ^= m;
        round(v);
        round(v);
        v[0] ^= m;
    };
    let mut words = message.chunks_exact(8);
    for word in &mut words {
        compress(
            &mut v,
            u64::from_le_bytes(word.try_into().expect("8 bytes")),
        );
    }
    let mut last = [0u8; 8];
    let tail = words.remainder();
    last[..tail.len()].copy_from_slice(tail);
    last[7] = message.len() as u8;
    compress(&mut v, u64::from_le_bytes(last));
    v[2] ^= 0xff;
    for _ in 0..4 {
        round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siphash_matches_the_reference_vectors() {
        // The paper's appendix: key 00..0f, message 00..0e.
        let k0 = u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]);
        let k1 = u64::from_le_bytes([8, 9, 10, 11, 12, 13, 14, 15]);
        let message: Vec<u8> = (0..15).collect();
        assert_eq!(siphash24(k0, k1, &message), 0xa129_ca61_49be_45e5);
        // The reference implementation's vectors.c: the empty message, and
        // messages 00..07 (one whole word and an empty tail).
        assert_eq!(siphash24(k0, k1, &[]), 0x726f_db47_dd0e_0e31);
        let eight: Vec<u8> = (0..8).collect();
        assert_eq!(siphash24(k0, k1, &eight), 0x93f5_f579_9a93_2462);
    }

    #[test]
    fn a_read_only_token_opens_reads_only_and_the_full_token_everything() {
        let token = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210_u128;
        let read = read_only_token(token);
        assert_ne!(read, token);
        assert_eq!(read, read_only_token(token), "deterministic");
        assert!(token_grants(token, token, true));
        assert!(token_grants(token, token, false));
        assert!(token_grants(token, read, false));
        assert!(!token_grants(token, read, true));
        // Deriving again does not give a token that opens anything.
        assert!(!token_grants(token, read_only_token(read), false));
        assert!(!token_grants(token, token ^ 1, false));
    }
}
