//! The admission's bounds, evictions and holds, on a paused clock.

use super::*;

fn limits(total: usize, per_address: usize) -> ConnectionLimits {
    ConnectionLimits {
        max_connections: total,
        max_per_address: per_address,
        hello_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(5),
        frame_timeout: Duration::from_secs(5),
        session_evictable_after: Duration::from_secs(3),
    }
}

/// A permit whose connection said its hello and has work under way.
fn busy(admission: &Arc<Admission>, address: IpAddr) -> Option<ConnectionPermit> {
    let permit = admission.admit(address)?;
    admission.set_idle(permit.id, None).unwrap();
    Some(permit)
}

#[test]
fn bounds_refuse_new_connections_and_free_on_drop() {
    let admission = Admission::new(limits(5, 3), "127.0.0.1:1".parse().unwrap());
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let b: IpAddr = "10.0.0.2".parse().unwrap();
    let from_a: Vec<_> = (0..3).map(|_| busy(&admission, a).unwrap()).collect();
    assert!(admission.admit(a).is_none(), "per-address bound");
    let from_b: Vec<_> = (0..2).map(|_| busy(&admission, b).unwrap()).collect();
    assert!(admission.admit(b).is_none(), "total bound");
    assert_eq!(admission.open(a), (5, 3, 0));
    drop(from_a);
    assert_eq!(admission.open(a), (2, 0, 0));
    assert!(admission.admit(b).is_some(), "room again");
    drop(from_b);
    assert_eq!(admission.open(b), (0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn at_a_bound_the_least_recently_idle_connection_makes_room() {
    let admission = Admission::new(limits(4, 3), "127.0.0.1:1".parse().unwrap());
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let b: IpAddr = "10.0.0.2".parse().unwrap();
    // From a: one busy, then two idle (the first of them idle longest).
    let a_busy = busy(&admission, a).unwrap();
    let a_old = admission.admit(a).unwrap();
    let a_new = admission.admit(a).unwrap();
    // Idle for less than EVICTABLE_AFTER: in use, nothing makes room.
    assert!(admission.admit(a).is_none());
    tokio::time::advance(EVICTABLE_AFTER).await;
    // The per-address bound evicts a's oldest idle one, not its busy one.
    let a_newest = admission.admit(a).unwrap();
    assert!(a_old.evict.is_cancelled());
    assert!(!a_busy.evict.is_cancelled() && !a_new.evict.is_cancelled());
    assert_eq!(admission.open(a), (3, 3, 2));
    // The total bound evicts the oldest idle one of any address.
    let b_first = busy(&admission, b).unwrap();
    assert_eq!(admission.open(b), (4, 1, 2));
    tokio::time::advance(EVICTABLE_AFTER).await;
    let b_second = busy(&admission, b).unwrap();
    assert!(a_new.evict.is_cancelled() && !a_newest.evict.is_cancelled());
    // An evicted permit gives nothing back twice.
    drop((a_old, a_new));
    assert_eq!(admission.open(a), (4, 2, 1));
    // Nothing idle from b and the total full of busy ones: refused.
    admission.set_idle(a_newest.id, None).unwrap();
    assert!(admission.admit(b).is_none());
    drop((a_busy, a_newest, b_first, b_second));
    assert_eq!(admission.open(a), (0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn an_idle_connection_is_closed_by_its_timeout_or_its_eviction() {
    let admission = Admission::new(limits(1, 1), "127.0.0.1:1".parse().unwrap());
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let permit = busy(&admission, a).unwrap();
    let limit = Duration::from_millis(20);
    let never = std::future::pending::<()>();
    assert_eq!(
        permit.idle_within(limit, never).await,
        Err(IdleClose::TimedOut(limit))
    );
    assert_eq!(permit.idle_within(limit, async { 7 }).await, Ok(7));
    let waiting = permit.while_idle(std::future::pending::<()>());
    let evicting = async {
        tokio::time::sleep(EVICTABLE_AFTER / 2).await;
        assert!(admission.admit(a).is_none(), "idle too briefly");
        tokio::time::sleep(EVICTABLE_AFTER / 2).await;
        admission.admit(a).unwrap()
    };
    let (waited, newcomer) = tokio::join!(waiting, evicting);
    assert_eq!(waited, Err(IdleClose::Evicted));
    assert_eq!(
        permit.idle_within(limit, async { 7 }).await,
        Err(IdleClose::Evicted)
    );
    drop(permit);
    assert_eq!(admission.open(a), (1, 1, 1));
    drop(newcomer);
    assert_eq!(admission.open(a), (0, 0, 0));
}

#[test]
fn defaults_leave_room_for_the_process_and_several_peers() {
    let limits = ConnectionLimits::default();
    assert!(limits.max_connections >= 8);
    assert!(limits.max_per_address >= 8);
    // A quarter at most (issue 55: a flooder on one address held a quarter
    // of every place), a sixteenth where that leaves room for 16 nodes.
    assert!(limits.max_per_address <= (limits.max_connections / 4).max(8));
    assert!(
        limits.max_per_address
            >= (NODES_PER_ADDRESS * CONNECTIONS_PER_NODE).min(limits.max_connections / 4)
    );
    if limits.max_connections / 16 >= NODES_PER_ADDRESS * CONNECTIONS_PER_NODE {
        assert_eq!(limits.max_per_address, limits.max_connections / 16);
    }
    if let Some(fds) = crate::socket::fd_limit() {
        assert!(
            (limits.max_connections as u64) < fds,
            "{limits:?} vs {fds} fds"
        );
    }
}

/// A permit of a connection that said its hello and now waits as `waits`
/// says, idle since now.
fn waiting(admission: &Arc<Admission>, address: IpAddr, waits: Waits) -> ConnectionPermit {
    let permit = busy(admission, address).unwrap();
    admission.set_idle(permit.id, Some(waits)).unwrap();
    permit
}

#[tokio::test(start_paused = true)]
async fn unproven_connections_make_room_first_then_idle_data_then_idle_sessions() {
    let admission = Admission::new(limits(4, 4), "127.0.0.1:1".parse().unwrap());
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    // Least recently used first: a session, a data connection, then one
    // that has not said its hello.
    let session = waiting(&admission, a, Waits::Session);
    let data = waiting(&admission, a, Waits::Data);
    let unproven = admission.admit(a).unwrap();
    let _busy = busy(&admission, a).unwrap();
    tokio::time::advance(EVICTABLE_AFTER).await;
    let first = busy(&admission, a).unwrap();
    assert!(
        unproven.evict.is_cancelled(),
        "the unproven one, though newest"
    );
    let second = busy(&admission, a).unwrap();
    assert!(data.evict.is_cancelled(), "then the idle data connection");
    // The session has not been idle for session_evictable_after (3 s).
    assert!(admission.admit(a).is_none());
    assert!(!session.evict.is_cancelled());
    tokio::time::advance(Duration::from_secs(2)).await;
    let _third = busy(&admission, a).unwrap();
    assert!(session.evict.is_cancelled(), "then the idle session");
    drop((first, second));
}

#[tokio::test(start_paused = true)]
async fn a_held_session_is_never_evicted_and_idles_afresh_when_let_go() {
    let admission = Admission::new(limits(1, 1), "127.0.0.1:1".parse().unwrap());
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let session = waiting(&admission, a, Waits::Session);
    let held = session.hold();
    let also = session.hold();
    tokio::time::advance(Duration::from_secs(60)).await;
    assert!(admission.admit(a).is_none(), "held, though idle for long");
    drop(held);
    assert!(admission.admit(a).is_none(), "still held once");
    drop(also);
    // Idle afresh from the last hold's end.
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(admission.admit(a).is_none(), "in use until just now");
    tokio::time::advance(Duration::from_secs(1)).await;
    let newcomer = admission.admit(a).unwrap();
    assert!(session.evict.is_cancelled());
    // A hold on an evicted connection holds nothing, and lets go quietly.
    drop(session.hold());
    drop((session, newcomer));
    assert_eq!(admission.open(a), (0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_session_waiting_between_frames_is_evicted_only_when_idle_long_enough() {
    let admission = Admission::new(limits(1, 1), "127.0.0.1:1".parse().unwrap());
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let session = busy(&admission, a).unwrap();
    let waiting = session.while_session_idle(std::future::pending::<()>());
    let evicting = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(admission.admit(a).is_none(), "idle too briefly");
        tokio::time::sleep(Duration::from_secs(1)).await;
        admission.admit(a).unwrap()
    };
    let (waited, newcomer) = tokio::join!(waiting, evicting);
    // Never timed out, only evicted.
    assert_eq!(waited, Err(IdleClose::Evicted));
    drop((session, newcomer));
}
