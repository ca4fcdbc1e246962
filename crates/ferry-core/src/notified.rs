//! What a data path did with a notification attached to a batch.

use crate::OpError;

/// How a notification attached to a batch went on a data path's own
/// channel for it: a SEND on the owner's queue pair (`ferry-ibverbs`), the
/// ring the owner reads on the same host (`ferry-memory`). Each such
/// channel delivers only into buffers the owner set aside, so it can run
/// out of room; what it could not take goes another way, and the caller
/// needs to know which of the three happened to do that without losing
/// the notification or delivering it twice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataPathNotification {
    /// Taken by a buffer the owner set aside for it, after every op of the
    /// batch on that owner: the owner's node hands it to its inbox from
    /// there.
    Accepted,
    /// Not sent: the path had no room for it (the owner's inbox is full,
    /// or the owner set nothing aside), or it is larger than the path
    /// carries. Nothing reached the owner: notify it another way.
    NotSent,
    /// Sent, then the path failed (the owner or its connection went): it
    /// may or may not have arrived, so it must not be sent again.
    Failed(OpError),
}
