//! Notifications as FERRY sends them: NIXL reports each with the agent that
//! sent it, and the receiver may never have loaded the sender's metadata,
//! so the sender's name travels in the body.

use ferry::Bytes;

/// A notification as it crosses: the sending agent's name first (NIXL
/// reports it with the message; the receiver may not have loaded the
/// sender), as a 2-byte length and its bytes.
pub(crate) fn frame_notif(agent: &str, msg: &[u8]) -> Bytes {
    let name = &agent.as_bytes()[..agent.len().min(u16::MAX as usize)];
    let mut body = Vec::with_capacity(2 + name.len() + msg.len());
    body.extend_from_slice(&(name.len() as u16).to_le_bytes());
    body.extend_from_slice(name);
    body.extend_from_slice(msg);
    body.into()
}

/// The sender and message of a framed notification.
pub(crate) fn unframe_notif(body: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = body.split_first_chunk::<2>()?;
    let len = usize::from(u16::from_le_bytes(*len));
    (rest.len() >= len).then(|| rest.split_at(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_carry_their_sender_and_a_short_body_is_refused() {
        let body = frame_notif("prefill-0", b"req-17 done");
        assert_eq!(
            unframe_notif(&body),
            Some((&b"prefill-0"[..], &b"req-17 done"[..]))
        );
        assert_eq!(
            unframe_notif(&frame_notif("a", b"")),
            Some((&b"a"[..], &b""[..]))
        );
        assert_eq!(unframe_notif(&[5, 0, b'a']), None);
        assert_eq!(unframe_notif(&[1]), None);
    }
}
