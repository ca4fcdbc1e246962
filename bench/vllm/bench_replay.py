"""Time one request's READs outside vLLM, same geometry, same NIXL backend:
(a) vLLM's descriptors as recorded in a run_pd.py run (analysis.json),
(b) ferry.nixl_plan with K and V as two tensors, (c) ferry.nixl_plan with
K/V as an axis (one tensor). Two processes: this one is the decode rank
(one agent), a child holds the prefill ranks (one agent each), both with
pools shaped as vLLM's CPU_ATTN caches [layers][blocks][heads][block][2*dim].

  bench_replay.py runs/p2d1-UCX --backend UCX --iters 300
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
import numpy as np


def pools(kv):
    names = sorted(kv["layers"])
    l0 = kv["layers"][names[0]]
    return len(names), l0["shape"]


def prefill_main(a):
    from nixl._api import nixl_agent, nixl_agent_config
    spec = json.load(open(os.path.join(a.dir, "spec.json")))
    agents, arrs = [], []
    for r, (L, shape) in sorted((int(k), v) for k, v in spec["prefill"].items()):
        cfg = nixl_agent_config(backends=[a.backend])
        ag = nixl_agent(f"prefill{r}", cfg)
        arr = np.random.default_rng(r).integers(0, 1 << 16, (L, *shape), dtype=np.uint16)
        ag.register_memory([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")
        np.save(os.path.join(a.dir, f"p{r}.npy"), arr)
        open(os.path.join(a.dir, f"p{r}.md"), "wb").write(ag.get_agent_metadata())
        json.dump({"addr": arr.ctypes.data}, open(os.path.join(a.dir, f"p{r}.json"), "w"))
        agents.append(ag)
        arrs.append(arr)
    open(os.path.join(a.dir, "ready"), "w").close()
    while not os.path.exists(os.path.join(a.dir, "stop")):
        for ag in agents:
            ag.get_new_notifs()
        time.sleep(0.001)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="?")
    ap.add_argument("--backend", default="UCX")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--role")
    ap.add_argument("--dir")
    a = ap.parse_args()
    if a.role == "prefill":
        return prefill_main(a)
    import ferry
    from nixl._api import nixl_agent, nixl_agent_config
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from analyze import load, View
    args = json.load(open(os.path.join(a.run, "args.json")))
    ev = load(a.run)
    kvs = [e for e in ev if e["ev"] == "kv_caches"]
    pre = {e["tp_rank"]: e for e in kvs if e["role"] == "prefill"}
    dec = sorted((e for e in kvs if e["role"] == "decode"), key=lambda e: e["tp_rank"])[0]
    res = json.load(open(os.path.join(a.run, "analysis.json")))
    rec = next(r for r in res if r["decode_rank"] == dec["tp_rank"])
    d = tempfile.mkdtemp(prefix="ferry-vllm-bench-")
    json.dump({"prefill": {r: pools(kv) for r, kv in pre.items()}}, open(os.path.join(d, "spec.json"), "w"))
    child = subprocess.Popen([sys.executable, __file__, "--role", "prefill", "--dir", d,
                              "--backend", a.backend], start_new_session=True)
    try:
        while not os.path.exists(os.path.join(d, "ready")):
            if child.poll() is not None:
                raise SystemExit("prefill process died")
            time.sleep(0.05)
        # as vLLM 0.33 creates its agent (base_worker.py): UCX alone gets num_threads=4
        cfg = (nixl_agent_config(num_threads=4, capture_telemetry=True) if a.backend == "UCX"
               else nixl_agent_config(backends=[a.backend], capture_telemetry=True))
        ag = nixl_agent("decode", cfg)
        L, shape = pools(dec)
        mine = np.zeros((L, *shape), dtype=np.uint16)
        ag.register_memory([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM")
        rbase, parr = {}, {}
        for r in pre:
            ag.add_remote_agent(open(os.path.join(d, f"p{r}.md"), "rb").read())
            rbase[r] = json.load(open(os.path.join(d, f"p{r}.json")))["addr"]
            parr[r] = np.load(os.path.join(d, f"p{r}.npy"))
        layer_bytes = {r: parr[r][0].nbytes for r in pre}
        lbytes = mine[0].nbytes

        def lnum(name):
            return int(name)

        # (a) vLLM's descriptors of the recorded request, addresses moved to these pools
        va = {}
        for x in rec["vllm_descs_rel"]:
            r = x["remote_rank"]
            la = mine.ctypes.data + lnum(x["local_layer"]) * lbytes + x["local_off"]
            ra = rbase[r] + lnum(x["remote_layer"]) * layer_bytes[r] + x["remote_off"]
            va.setdefault(r, []).append(((la, x["len"], 0), (ra, x["len"], 0)))
        variants = {"vllm": {r: (np.array([p[0] for p in v], np.uint64), np.array([p[1] for p in v], np.uint64))
                             for r, v in va.items()}}

        # (b), (c) ferry's plan over the same pools and block tables
        def layout(arr, rank, tp, kv_axis):
            L_, nb, h, bs, c = arr.shape
            dd = c // 2
            e = 2
            span = ferry.MemorySpan(arr.ctypes.data, arr.nbytes)
            s = [st // e for st in arr.strides]
            if kv_axis:
                views = [View(arr.ctypes.data + l * s[0] * e, (nb, h, 2, bs, dd), (s[1], s[2], bs * dd, dd, 1), e) for l in range(L_)]
                ts = [ferry.TensorLayout.from_array("kv", views, [span] * L_, axes=("layer", "block", "head", "kv", "token", "dim"),
                                                    paged=("token", "block"), table="kv", global_sizes={"token": 4096},
                                                    parts={"head": (rank, tp)})]
            else:
                ts = []
                for i, nm in enumerate(("k", "v")):
                    views = [View(arr.ctypes.data + l * s[0] * e + i * bs * dd * e, (nb, h, bs, dd), (s[1], s[2], dd, 1), e) for l in range(L_)]
                    ts.append(ferry.TensorLayout.from_array(nm, views, [span] * L_, axes=("layer", "block", "head", "token", "dim"),
                                                            paged=("token", "block"), table="kv", global_sizes={"token": 4096},
                                                            parts={"head": (rank, tp)}))
            return ferry.RankLayout(rank, ts)

        lb, rb = np.asarray(rec["local_blocks"]), np.asarray(rec["remote_blocks"])
        ntok = min(len(rb) * args["pbs"], len(lb) * args["dbs"])
        for name, kvx in (("ferry_kv_separate", False), ("ferry_kv_axis", True)):
            plan = ferry.nixl_plan(layout(mine, dec["tp_rank"], args["dtp"], kvx),
                                   [layout(parr[r], r, args["ptp"], kvx) for r in sorted(pre)])
            # remote addresses: the child's pools (same shapes, other addresses)
            fl = plan.local_descs()
            v = {}
            for r, (li, ri) in plan.indices(ntok, lb, rb).items():
                rows = plan.remote_descs(r)
                rows = rows.copy()
                rows[:, 0] = rows[:, 0] - np.uint64(parr[r].ctypes.data) + np.uint64(rbase[r])
                v[r] = (fl[li], rows[ri])
            variants[name] = v

        out = {"run": a.run, "backend": a.backend, "tokens": ntok, "iters": a.iters}
        preps = {name: {r: (ag.prep_xfer_dlist("NIXL_INIT_AGENT", l_, "DRAM"),
                            ag.prep_xfer_dlist(f"prefill{r}", r_, "DRAM"), len(l_)) for r, (l_, r_) in v.items()}
                 for name, v in variants.items()}

        def one(p):
            t0 = time.perf_counter()
            hs = []
            for r, (lp, rp, n) in p.items():
                idx = np.arange(n, dtype=np.int32)
                h = ag.make_prepped_xfer("READ", lp, idx, rp, idx)
                ag.transfer(h)
                hs.append(h)
            for h in hs:
                s_ = ag.check_xfer_state(h)
                while s_ == "PROC":
                    s_ = ag.check_xfer_state(h)
                assert s_ == "DONE", s_
                ag.release_xfer_handle(h)
            return time.perf_counter() - t0

        snaps = {}
        for name, p in preps.items():       # bytes: each variant alone into a zeroed pool
            mine[:] = 0
            one(p)
            snaps[name] = mine.copy()
        times = {name: [] for name in preps}
        for it in range(a.iters + 20):      # timing: the variants interleaved
            for name, p in preps.items():
                dt = one(p)
                if it >= 20:
                    times[name].append(dt)
        for name, v in variants.items():
            t = sorted(times[name])
            out[name] = {"descs": sum(p_[2] for p_ in preps[name].values()),
                         "bytes": sum(int(l_[:, 1].sum()) for l_, _ in v.values()),
                         "median_us": round(statistics.median(t) * 1e6, 1),
                         "p10_us": round(t[len(t) // 10] * 1e6, 1),
                         "p90_us": round(t[len(t) * 9 // 10] * 1e6, 1)}
            if name != "vllm":
                out[name]["same_local_bytes_as_vllm"] = bool((snaps[name] == snaps["vllm"]).all())
        print(json.dumps(out))
    finally:
        open(os.path.join(d, "stop"), "w").close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, 9)
        import shutil
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
