//! Layouts and plans over ibverbs: the KV hand-off of
//! `tests/shared/plans.rs` between nodes whose bytes only RDMA carries.

#[path = "../shared/plans.rs"]
mod shared;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an RDMA device: run by tests/rxe/run.sh"]
async fn a_kv_cache_moves_from_tp4_to_tp2_over_rdma() {
    shared::a_kv_cache_moves_from_tp4_to_tp2_byte_for_byte(crate::rdma_only, true).await;
}
