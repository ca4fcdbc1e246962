"""Compare what vLLM's NixlConnector moved (recorded by nixl_probe) with
ferry's plan for the same layouts, and check the bytes.

  analyze.py runs/p2d1-UCX [--json out.json]

Per request and decode rank:
  - vLLM's descriptor pairs (local addr, remote rank, remote addr, len),
    from the prepared lists (Nx5 strided rows expanded) and the index
    arrays of make_prepped_xfer; canonicalised by merging runs that
    continue on both sides;
  - bytes: each local descriptor's bytes after DONE (decode dump) against
    the prefill rank's registered region dumped when its notification came;
  - ferry.nixl_plan for the same tensors (K and V views of vLLM's
    [blocks, heads, block_size, 2*head_dim] per-layer caches, HND, one
    NIXL region per rank, heads split by TP) and the same block tables,
    canonicalised the same way: the two mappings must be identical;
  - descriptor counts (vLLM's, after merging; ferry nixl_plan's, after
    merging) and times (vLLM's make->DONE inside its step loop; the same
    prepared READ replayed alone, median).
"""
import glob, json, os, statistics, sys
import numpy as np
import ferry


def load(run):
    ev = []
    for f in sorted(glob.glob(os.path.join(run, "*.jsonl"))):
        role = os.path.basename(f).split("-")[0]
        for line in open(f):
            e = json.loads(line)
            e["role"] = role
            ev.append(e)
    return ev


def expand(raw):
    raw = np.asarray(raw, dtype=np.uint64)
    if raw.size == 0:
        return np.zeros((0, 3), np.uint64)
    if raw.shape[1] == 3:
        return raw
    parts = []
    for addr, ln, dev, stride, count in raw.tolist():
        a = addr + stride * np.arange(count, dtype=np.uint64)
        parts.append(np.stack([a, np.full(count, ln, np.uint64), np.full(count, dev, np.uint64)], 1))
    return np.concatenate(parts)


def canon(pairs):
    """pairs: iterable of (laddr, rrank, raddr, len) -> merged sorted list."""
    pairs = sorted(pairs)
    out = []
    for la, rr, ra, n in pairs:
        if out:
            pla, prr, pra, pn = out[-1]
            if prr == rr and pla + pn == la and pra + pn == ra:
                out[-1] = (pla, prr, pra, pn + n)
                continue
        out.append((la, rr, ra, n))
    return out


def ferry_pairs(plan, local_rows, remote_rows, tokens, lb, rb):
    """A nixl_plan's (laddr, rrank, raddr, len) pairs for one request, as
    its index arrays give them (one per descriptor)."""
    pairs = []
    for r, (li, ri) in plan.indices(tokens, np.asarray(lb), np.asarray(rb)).items():
        for (la, n, _), (ra, n2, _) in zip(local_rows[li].tolist(), remote_rows[r][ri].tolist()):
            assert n == n2
            pairs.append((la, r, ra, n))
    return pairs


class View:
    """A torch-like view (addr, shape, element strides) for ferry.TensorLayout.from_array."""
    def __init__(self, ptr, shape, stride, elem):
        self._p, self.shape, self._s, self._e = ptr, tuple(shape), tuple(stride), elem
    def data_ptr(self): return self._p
    def stride(self): return self._s
    def element_size(self): return self._e


def rank_layout(kv, tp, max_tokens, kv_axis=False):
    """ferry layout of one vLLM rank: per layer [NB, H, BS, 2D] (CPU_ATTN,
    HND, K rows then V rows per head), all layers in one registered span."""
    names = sorted(kv["layers"], key=lambda n: [int(x) if x.isdigit() else x for x in n.replace(".", " ").split()])
    L = [kv["layers"][n] for n in names]
    nb, h, bs, c = L[0]["shape"]
    d = c // 2
    e = L[0]["elem"]
    s0, s1, s2, s3 = L[0]["stride"]
    assert s3 == 1 and s2 == c, "expects [NB, H, BS, 2D] contiguous rows"
    span = ferry.MemorySpan(L[0]["storage"], L[0]["storage_nbytes"])
    tensors = []
    if kv_axis:
        # one tensor: K and V as an axis of 2, between head and token
        views = [View(l["ptr"], (nb, h, 2, bs, d), (s0, s1, bs * d, d, 1), e) for l in L]
        tensors.append(ferry.TensorLayout.from_array(
            "kv", views, [span] * len(views), axes=("layer", "block", "head", "kv", "token", "dim"),
            paged=("token", "block"), table="kv", global_sizes={"token": max_tokens},
            parts={"head": (kv["tp_rank"], tp)}))
        return ferry.RankLayout(kv["tp_rank"], tensors), None
    for i, name in enumerate(("k", "v")):
        # viewed as [NB, H, 2*BS, D]: K = rows 0..BS-1, V = rows BS..2BS-1
        views = [View(l["ptr"] + i * bs * d * e, (nb, h, bs, d), (s0, s1, d, 1), e) for l in L]
        tensors.append(ferry.TensorLayout.from_array(
            name, views, [span] * len(views), axes=("layer", "block", "head", "token", "dim"),
            paged=("token", "block"), table="kv", global_sizes={"token": max_tokens},
            parts={"head": (kv["tp_rank"], tp)}))
    return ferry.RankLayout(kv["tp_rank"], tensors), dict(nb=nb, h=h, bs=bs, d=d, e=e, span=span)


def main():
    run = sys.argv[1]
    args = json.load(open(os.path.join(run, "args.json")))
    ev = load(run)
    kvs = [e for e in ev if e["ev"] == "kv_caches"]
    pre = {e["agent"]: e for e in kvs if e["role"] == "prefill"}
    dec = {e["pid"]: e for e in kvs if e["role"] == "decode"}
    ptp, dtp = args["ptp"], args["dtp"]
    max_tokens = 4096
    peers = {}
    for agent, kv in pre.items():
        peers[kv["tp_rank"]] = rank_layout(kv, ptp, max_tokens)
    rank_of_agent = {a: kv["tp_rank"] for a, kv in pre.items()}
    pid_of_rank = {kv["tp_rank"]: kv["pid"] for kv in pre.values()}
    # prefill region dumps per (rank, notif request id)
    dumps = {}
    for e in ev:
        if e["ev"] == "notifs" and e["role"] == "prefill":
            r = next(kv["tp_rank"] for kv in pre.values() if kv["pid"] == e["pid"])
            for _, msgs in e["notifs"].items():
                for m in msgs:
                    dumps[(r, m.split(":")[0])] = e["region_dumps"]
    results = []
    for pid, kv in sorted(dec.items()):
        mine = [e for e in ev if e.get("pid") == pid]
        dl = {e["id"]: e for e in mine if e["ev"] == "prep_xfer_dlist"}
        rows = {i: expand(e["raw"]) for i, e in dl.items()}
        done = {e["id"]: e for e in mine if e["ev"] == "xfer_done"}
        reads = {e["remote_request_id"]: e for e in mine if e["ev"] == "read_blocks_for_req"}
        by_req = {}
        for e in mine:
            if e["ev"] == "make_prepped_xfer":
                by_req.setdefault(e["notif"].split(":")[0], []).append(e)
        local, linfo = rank_layout(kv, dtp, max_tokens)
        plan = ferry.nixl_plan(local, [peers[r][0] for r in sorted(peers)])
        fl = plan.local_descs()
        fr = {r: plan.remote_descs(r) for r in plan.remote_ranks}
        local2, _ = rank_layout(kv, dtp, max_tokens, kv_axis=True)
        plan2 = ferry.nixl_plan(local2, [rank_layout(pre_kv, ptp, max_tokens, kv_axis=True)[0]
                                         for pre_kv in sorted(pre.values(), key=lambda k: k["tp_rank"])])
        fl2 = plan2.local_descs()
        fr2 = {r: plan2.remote_descs(r) for r in plan2.remote_ranks}
        for req, xs in by_req.items():
            pairs, ndesc, byte_ok, nbytes, walls, replays = [], 0, True, 0, [], []
            for x in xs:
                ragent = dl[x["remote_dlist"]]["agent"]
                ragent = ragent[2:-1] if ragent.startswith("b'") else ragent
                rr = rank_of_agent[ragent]
                lrows = rows[x["local_dlist"]][x["local_idx"]]
                rrows = rows[x["remote_dlist"]][x["remote_idx"]]
                assert (lrows[:, 1] == rrows[:, 1]).all()
                ndesc += len(lrows)
                for (la, n, _), (ra, _, _) in zip(lrows.tolist(), rrows.tolist()):
                    pairs.append((la, rr, ra, n))
                # bytes
                d = done.get(x["id"])
                if d is None:
                    byte_ok = False
                    continue
                walls.append(d["wall_from_make"])
                replays.extend(t for t in d["replay_s"][1:] if isinstance(t, float))
                got = open(d["dump"], "rb").read()
                reg = dumps.get((rr, req))
                if reg is None:
                    byte_ok = None
                    continue
                blobs = [(r_["addr"], open(r_["file"], "rb").read()) for r_ in reg]
                off = 0
                for (ra, n, _) in rrows.tolist():
                    base, blob = next((b, bl) for b, bl in blobs if b <= ra < b + len(bl))
                    if blob[ra - base: ra - base + n] != got[off: off + n]:
                        byte_ok = False
                    off += n
                    nbytes += n
            vllm_c = canon(pairs)
            # ferry: same tables. Tokens: whole blocks, as vLLM reads them.
            rd = reads.get(req)
            if rd is not None:
                lb = rd["local_block_ids"][0]
                rb = rd["remote_block_ids"][0]
                ntok = rd["remote_num_tokens"]
            else:
                lb = rb = None
            pbs, dbs = args["pbs"], args["dbs"]
            whole = len(rb) * pbs
            tokens = whole if len(lb) * dbs >= whole else len(lb) * dbs
            fpairs = ferry_pairs(plan, fl, fr, tokens, lb, rb)
            f2pairs = ferry_pairs(plan2, fl2, fr2, tokens, lb, rb)
            ferry_c, ferry2_c = canon(fpairs), canon(f2pairs)
            fn, fn2 = len(fpairs), len(f2pairs)
            # ferry's own API: exact token count (no tail of the last block)
            res = dict(decode_pid=pid, decode_rank=kv["tp_rank"], request=req,
                       tokens=ntok, local_blocks=lb, remote_blocks=rb,
                       vllm_descs=ndesc, vllm_xfers=len(xs), vllm_merged=len(vllm_c),
                       vllm_bytes=sum(p[3] for p in pairs),
                       ferry_nixl_descs=fn, ferry_merged=len(ferry_c),
                       ferry_bytes=sum(p[3] for p in fpairs),
                       ferry_kvaxis_nixl_descs=fn2, ferry_kvaxis_merged=len(ferry2_c),
                       same_mapping=vllm_c == ferry_c, same_mapping_kvaxis=vllm_c == ferry2_c, bytes_match=byte_ok, bytes_checked=nbytes,
                       vllm_wall_make_to_done_ms=[round(w * 1e3, 3) for w in walls],
                       replay_median_us=round(statistics.median(replays) * 1e6, 1) if replays else None)
            def ivals(ps, key):
                out = []
                for p_ in sorted(key(x) for x in ps):
                    if out and out[-1][0] == p_[0] and out[-1][1] + out[-1][2] == p_[1]:
                        out[-1] = (p_[0], out[-1][1], out[-1][2] + p_[2])
                    else:
                        out.append(p_)
                return out
            res["same_remote_byte_set"] = ivals(pairs, lambda x: (x[1], x[2], x[3])) == ivals(fpairs, lambda x: (x[1], x[2], x[3]))
            res["same_local_byte_set"] = ivals(pairs, lambda x: (0, x[0], x[3])) == ivals(fpairs, lambda x: (0, x[0], x[3]))
            if vllm_c != ferry_c and byte_ok and all((r_, req) in dumps for r_ in peers):
                # Where would each side's bytes sit in the decode block? vLLM's raw
                # placement, then its post-process (kv_postprocess_blksize_on_receive,
                # which treats [B, H, N, C] rows as tokens), against ferry's placement.
                blobs = {}
                for r_ in peers:
                    for d_ in dumps[(r_, req)]:
                        blobs[(r_, d_["addr"])] = open(d_["file"], "rb").read()
                def fetch(rr, ra, n):
                    for (r_, b_), bl in blobs.items():
                        if r_ == rr and b_ <= ra < b_ + len(bl):
                            return bl[ra - b_: ra - b_ + n]
                def assemble(ps):
                    mem = {}
                    for la, rr, ra, n in ps:
                        mem[la] = fetch(rr, ra, n)
                    return mem
                vm, fm = assemble(pairs), assemble(fpairs)
                nb_, h_, n_, c_ = next(iter(kv["layers"].values()))["shape"]
                e_ = next(iter(kv["layers"].values()))["elem"]
                bbytes = h_ * n_ * c_ * e_
                ratio = dbs // pbs
                ok_raw, ok_post, ok_cpu, blocks = True, True, True, 0
                for lname, l in kv["layers"].items():
                    for b in lb:
                        base = l["ptr"] + b * bbytes
                        def block(mem):
                            buf = bytearray(bbytes)
                            for la, bl in mem.items():
                                if base <= la < base + bbytes:
                                    buf[la - base: la - base + len(bl)] = bl
                            return np.frombuffer(bytes(buf), dtype=np.uint16)
                        vb, fb = block(vm), block(fm)
                        post = vb.reshape(ratio, h_, n_ // ratio, c_).transpose(1, 0, 2, 3).reshape(-1)
                        d_ = c_ // 2   # CPU_ATTN: per head K rows then V rows ([H, 2, N, D])
                        cpu_post = vb.reshape(ratio, h_, 2, n_ // ratio, d_).transpose(1, 2, 0, 3, 4).reshape(-1)
                        ok_cpu &= bool((cpu_post == fb).all())
                        ok_raw &= bool((vb == fb).all())
                        ok_post &= bool((post == fb).all())
                        blocks += 1
                res["blocks_compared"] = blocks
                res["vllm_raw_equals_ferry_semantic"] = ok_raw
                res["vllm_after_postprocess_equals_ferry_semantic"] = ok_post
                res["vllm_raw_after_HxKV_aware_permute_equals_ferry"] = ok_cpu
            if vllm_c != ferry_c:
                sv, sf = set(vllm_c), set(ferry_c)
                res["only_vllm"] = sorted(sv - sf)[:5]
                res["only_ferry"] = sorted(sf - sv)[:5]
            # remote offsets relative to each rank's per-layer base, for the record
            bases = {kv_["tp_rank"]: sorted((l["ptr"], n) for n, l in kv_["layers"].items()) for kv_ in pre.values()}
            def rel(rr, ra):
                b = max((p, n) for p, n in bases[rr] if p <= ra)
                return b[1].split(".")[2], ra - b[0]
            lbases = sorted((l["ptr"], n) for n, l in kv["layers"].items())
            def lrel(la):
                b = max((p, n) for p, n in lbases if p <= la)
                return b[1].split(".")[2], la - b[0]
            res["vllm_descs_rel"] = [dict(remote_rank=rr, remote_layer=rel(rr, ra)[0], remote_off=rel(rr, ra)[1],
                                          local_layer=lrel(la)[0], local_off=lrel(la)[1], len=n)
                                     for la, rr, ra, n in sorted(pairs, key=lambda p: (p[1], p[2]))]
            results.append(res)
    for r in results:
        short = {k: v for k, v in r.items() if k != "vllm_descs_rel"}
        print(json.dumps(short))
    if "--json" in sys.argv:
        json.dump(results, open(sys.argv[sys.argv.index("--json") + 1], "w"), indent=1)
    ok = all(r["same_mapping"] and r["bytes_match"] for r in results) and results
    print("ALL SAME MAPPING + BYTES OK" if ok else "MISMATCH", len(results), "request x decode-rank records")


if __name__ == "__main__":
    main()
