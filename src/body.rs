//! [`IntoBody`]: what a message, notification or RPC argument may be given
//! as. `Into<Bytes>` alone refuses byte-string literals (`b"done"` is a
//! `&[u8; 4]`, which `Bytes` has no `From` for), and a blanket impl over
//! `Into<Bytes>` next to one for arrays is refused by coherence (the
//! `bytes` crate could add the array impl later), so the types are listed
//! here one by one.

use bytes::{Bytes, BytesMut};

/// A message body, notification or RPC argument: anything that becomes
/// [`Bytes`]. Owned buffers ([`Bytes`], [`BytesMut`], `Vec<u8>`, `String`,
/// `Box<[u8]>`) are moved in without a copy; borrowed ones (`&[u8]`,
/// `&[u8; N]`, `&str`, including `b"done"` and `"done"`) are copied, since
/// the send outlives the borrow. A copy of a literal costs far less than
/// the round trip that carries it.
pub trait IntoBody {
    /// The bytes to send.
    fn into_body(self) -> Bytes;
}

impl IntoBody for Bytes {
    fn into_body(self) -> Bytes {
        self
    }
}

impl IntoBody for BytesMut {
    fn into_body(self) -> Bytes {
        self.freeze()
    }
}

impl IntoBody for Vec<u8> {
    fn into_body(self) -> Bytes {
        Bytes::from(self)
    }
}

impl IntoBody for Box<[u8]> {
    fn into_body(self) -> Bytes {
        Bytes::from(self)
    }
}

impl IntoBody for String {
    fn into_body(self) -> Bytes {
        Bytes::from(self)
    }
}

impl IntoBody for &[u8] {
    fn into_body(self) -> Bytes {
        Bytes::copy_from_slice(self)
    }
}

impl<const N: usize> IntoBody for &[u8; N] {
    fn into_body(self) -> Bytes {
        Bytes::copy_from_slice(self)
    }
}

impl IntoBody for &str {
    fn into_body(self) -> Bytes {
        Bytes::copy_from_slice(self.as_bytes())
    }
}

impl IntoBody for &String {
    fn into_body(self) -> Bytes {
        Bytes::copy_from_slice(self.as_bytes())
    }
}

impl IntoBody for &Vec<u8> {
    fn into_body(self) -> Bytes {
        Bytes::copy_from_slice(self)
    }
}

impl IntoBody for &Bytes {
    /// A reference count, not a copy.
    fn into_body(self) -> Bytes {
        self.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every form a caller reaches for converts, to the same bytes; the
    /// owned ones without a copy (the same allocation comes out).
    #[test]
    fn literals_and_buffers_become_the_same_bytes() {
        let expected = Bytes::from_static(b"done");
        assert_eq!(b"done".into_body(), expected);
        assert_eq!((&b"done"[..]).into_body(), expected);
        assert_eq!("done".into_body(), expected);
        assert_eq!(String::from("done").into_body(), expected);
        assert_eq!((&String::from("done")).into_body(), expected);
        assert_eq!(b"done".to_vec().into_body(), expected);
        assert_eq!((&b"done".to_vec()).into_body(), expected);
        assert_eq!(Box::<[u8]>::from(&b"done"[..]).into_body(), expected);
        assert_eq!(BytesMut::from(&b"done"[..]).into_body(), expected);
        assert_eq!((&expected).into_body(), expected);

        let vec = vec![7u8; 64];
        let at = vec.as_ptr();
        assert_eq!(vec.into_body().as_ptr(), at, "a Vec is moved, not copied");
        let bytes = Bytes::from(vec![7u8; 64]);
        let at = bytes.as_ptr();
        assert_eq!(
            bytes.into_body().as_ptr(),
            at,
            "Bytes are moved, not copied"
        );
    }
}
