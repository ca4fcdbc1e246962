"""One line per run (analysis.json) and per bench (bench_results.jsonl)."""
import glob, json, os, statistics

WORK = os.environ.get("FERRY_VLLM_CHECK", os.path.expanduser("~/.cache/ferry-peers/vllm-check"))
for f in sorted(glob.glob(os.path.join(WORK, "runs", "*", "analysis.json"))):
    run = os.path.basename(os.path.dirname(f))
    rs = json.load(open(f))
    if not rs:
        continue
    reps = [r["replay_median_us"] for r in rs if r.get("replay_median_us")]
    walls = [w for r in rs for w in r["vllm_wall_make_to_done_ms"]]
    print(f"{run:22s} recs={len(rs)} tokens={rs[0]['tokens']} per-decode-rank: vllm_descs={rs[0]['vllm_descs']} "
          f"(xfers {rs[0]['vllm_xfers']}, merged {rs[0]['vllm_merged']}) bytes={rs[0]['vllm_bytes']} | "
          f"ferry k/v: {rs[0]['ferry_nixl_descs']}->{rs[0]['ferry_merged']} kv-axis: {rs[0]['ferry_kvaxis_nixl_descs']} | "
          f"same_mapping={all(r['same_mapping'] for r in rs)} "
          f"same_byte_sets={all(r.get('same_remote_byte_set') and r.get('same_local_byte_set') for r in rs)} "
          f"bytes_ok={[r['bytes_match'] for r in rs]} | "
          f"replay med {statistics.median(reps):.1f}us | in-vLLM make->DONE {min(walls):.2f}-{max(walls):.1f}ms"
          + (f" | post-process==ferry {all(r.get('vllm_after_postprocess_equals_ferry_semantic') for r in rs)}"
             f", CPU-aware permute==ferry {all(r.get('vllm_raw_after_HxKV_aware_permute_equals_ferry') for r in rs)}"
             if 'vllm_after_postprocess_equals_ferry_semantic' in rs[0] else ""))
print()
for l in open(os.path.join(WORK, "bench_results.jsonl")):
    b = json.loads(l)
    print(f"bench {os.path.basename(b['run']):22s} {b['backend']:5s} " + "  ".join(
        f"{k}: {b[k]['descs']} descs {b[k]['median_us']}us" + ("" if k == "vllm" else f" same={b[k]['same_local_bytes_as_vllm']}")
        for k in ("vllm", "ferry_kv_separate", "ferry_kv_axis")))
