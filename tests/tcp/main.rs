//! Integration tests of the TCP transport. Nodes that must live in another OS
//! process run in a re-executed copy of this test binary (see `common`).

mod bad_input;
mod common;
mod idle_race;
mod in_process;
mod limits;
mod malformed;
mod names;
mod notified;
mod outcomes;
mod peer_death;
mod plans;
mod raw_drop;
mod slices;
mod timeout;
mod transfers;
mod two_hosts;
mod weights;
mod xfers;

/// Entry point of the peer process; does nothing in a normal test run.
#[test]
fn ferry_peer() {
    if std::env::var_os(common::PEER_ENV).is_some() {
        common::peer_main();
    }
}
