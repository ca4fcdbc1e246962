"""vLLM general plugin: records every NIXL call vLLM's NixlConnector makes.

Active only when NIXL_PROBE_DIR is set. Loaded by vLLM in every process
(engine core, each worker) through the `vllm.general_plugins` entry point.
Writes NIXL_PROBE_DIR/<role>-<pid>.jsonl (role = NIXL_PROBE_ROLE) and, for
byte checks, raw dumps: the prefill side dumps its registered regions when a
notification arrives (before vLLM frees the blocks); the decode side dumps
each request's local descriptor bytes once its READ is DONE.
After DONE it can also replay the same prepared READ (no notification)
NIXL_PROBE_REPLAY times, to time it apart from vLLM's step loop.
"""
import ctypes, json, os, threading, time

_done = False
_lock = threading.Lock()


def register():
    global _done
    d = os.environ.get("NIXL_PROBE_DIR")
    if not d or _done:
        return
    _done = True
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    os.makedirs(d, exist_ok=True)
    import numpy as np
    import nixl._api as napi

    role = os.environ.get("NIXL_PROBE_ROLE", "x")
    replay = int(os.environ.get("NIXL_PROBE_REPLAY", "0"))
    path = os.path.join(d, f"{role}-{os.getpid()}.jsonl")
    out = open(path, "a", buffering=1)
    A = napi.nixl_agent
    dl_ids, x_ids, x_info = {}, {}, {}
    dl_rows = {}          # dlist id -> expanded (addr, len, dev) np array
    regions = []          # (addr, len) registered DRAM ranges
    keep = []
    seq = [0]

    def log(ev, **kw):
        kw["ev"] = ev
        kw["t"] = time.perf_counter()
        kw["pid"] = os.getpid()
        with _lock:
            out.write(json.dumps(kw) + "\n")

    def nid():
        seq[0] += 1
        return seq[0]

    def expand(rows):
        rows = np.asarray(rows, dtype=np.uint64)
        if rows.shape[1] == 3:
            return rows
        parts = []
        for addr, ln, dev, stride, count in rows.tolist():
            a = addr + stride * np.arange(count, dtype=np.uint64)
            parts.append(np.stack([a, np.full(count, ln, np.uint64),
                                   np.full(count, dev, np.uint64)], axis=1))
        return np.concatenate(parts) if parts else np.zeros((0, 3), np.uint64)

    orig_init = A.__init__
    def __init__(self, name, *a, **k):
        orig_init(self, name, *a, **k)
        log("agent", name=name, backends=list(getattr(self, "backends", {}).keys()))
    A.__init__ = __init__

    reg_lists = {}
    orig_get_reg = A.get_reg_descs
    def get_reg_descs(self, descs, mem_type=None):
        r = orig_get_reg(self, descs, mem_type)
        if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
            reg_lists[id(r)] = ([(int(x[0]), int(x[1]), int(x[2])) for x in descs], r)
        return r
    A.get_reg_descs = get_reg_descs

    orig_reg = A.register_memory
    def register_memory(self, reg_list, mem_type=None, backends=[]):
        r = orig_reg(self, reg_list, mem_type, backends)
        descs = reg_lists.get(id(reg_list), (None,))[0]
        if descs is None and isinstance(reg_list, list):
            descs = [(int(x[0]), int(x[1]), int(x[2])) for x in reg_list]
        for a_, l_, _ in descs or []:
            regions.append((a_, l_))
        log("register_memory", name=self.name, mem_type=mem_type, backends=backends, descs=descs)
        return r
    A.register_memory = register_memory

    orig_prep = A.prep_xfer_dlist
    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=[]):
        t0 = time.perf_counter()
        h = orig_prep(self, agent_name, xfer_list, mem_type, backends)
        t1 = time.perf_counter()
        i = nid()
        dl_ids[id(h)] = i
        keep.append(h)  # keep alive so id() stays unique
        if isinstance(xfer_list, np.ndarray):
            raw = xfer_list.astype(np.uint64).tolist()
        else:
            raw = [list(map(int, x[:3])) for x in xfer_list]
        ex = expand(raw) if raw else np.zeros((0, 3), np.uint64)
        dl_rows[i] = ex
        log("prep_xfer_dlist", id=i, name=self.name, agent=str(agent_name), mem_type=mem_type,
            raw=raw, n_expanded=int(len(ex)), dt=t1 - t0)
        return h
    A.prep_xfer_dlist = prep_xfer_dlist

    orig_make = A.make_prepped_xfer
    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side,
                          remote_indices, notif_msg=b"", backends=[], skip_desc_merge=False):
        if getattr(self, "_probe_replaying", False):
            return orig_make(self, operation, local_xfer_side, local_indices, remote_xfer_side,
                             remote_indices, notif_msg, backends, skip_desc_merge)
        t0 = time.perf_counter()
        h = orig_make(self, operation, local_xfer_side, local_indices, remote_xfer_side,
                      remote_indices, notif_msg, backends, skip_desc_merge)
        t1 = time.perf_counter()
        i = nid()
        x_ids[id(h)] = i
        li = np.asarray(local_indices).astype(np.int64)
        ri = np.asarray(remote_indices).astype(np.int64)
        x_info[i] = dict(op=operation, l=local_xfer_side, li=li, r=remote_xfer_side, ri=ri,
                         lid=dl_ids.get(id(local_xfer_side)), rid=dl_ids.get(id(remote_xfer_side)),
                         h=h, t0=t0)
        log("make_prepped_xfer", id=i, name=self.name, op=operation,
            local_dlist=dl_ids.get(id(local_xfer_side)), remote_dlist=dl_ids.get(id(remote_xfer_side)),
            local_idx=li.tolist(), remote_idx=ri.tolist(),
            notif=notif_msg.decode() if isinstance(notif_msg, bytes) else str(notif_msg), dt=t1 - t0)
        return h
    A.make_prepped_xfer = make_prepped_xfer

    orig_transfer = A.transfer
    def transfer(self, handle, notif_msg=b""):
        t0 = time.perf_counter()
        s = orig_transfer(self, handle, notif_msg)
        i = x_ids.get(id(handle))
        if i is not None:
            x_info[i]["tpost"] = t0
            log("transfer", id=i, state=s, dt=time.perf_counter() - t0)
        return s
    A.transfer = transfer

    def _replay(self, info):
        self._probe_replaying = True
        try:
            times = []
            for _ in range(replay):
                t0 = time.perf_counter()
                h = orig_make(self, info["op"], info["l"], info["li"], info["r"], info["ri"])
                s = orig_transfer(self, h)
                while s == "PROC":
                    s = orig_check(self, h)
                t1 = time.perf_counter()
                self.release_xfer_handle(h)
                times.append(t1 - t0)
                if s != "DONE":
                    times.append(s)
                    break
            return times
        finally:
            self._probe_replaying = False

    orig_check = A.check_xfer_state
    def check_xfer_state(self, handle):
        s = orig_check(self, handle)
        if getattr(self, "_probe_replaying", False):
            return s
        i = x_ids.get(id(handle))
        if i is not None and s != "PROC" and "tdone" not in x_info[i]:
            info = x_info[i]
            info["tdone"] = time.perf_counter()
            # Dump the local bytes of every descriptor this request filled.
            lrows = dl_rows[info["lid"]][info["li"]]
            fn = os.path.join(d, f"{role}-{os.getpid()}-xfer{i}.bin")
            with open(fn, "wb") as f:
                for a_, l_, _ in lrows.tolist():
                    f.write(ctypes.string_at(a_, l_))
            times = _replay(self, info) if (replay and s == "DONE") else []
            log("xfer_done", id=i, state=s, wall_from_make=info["tdone"] - info["t0"],
                wall_from_post=info["tdone"] - info.get("tpost", info["t0"]), dump=fn,
                replay_s=times)
        return s
    A.check_xfer_state = check_xfer_state

    orig_notifs = A.get_new_notifs
    def get_new_notifs(self, backends=[]):
        n = orig_notifs(self, backends)
        if n and not getattr(self, "_probe_replaying", False):
            fns = []
            for k, (a_, l_) in enumerate(regions):
                fn = os.path.join(d, f"{role}-{os.getpid()}-region{k}-n{nid()}.bin")
                with open(fn, "wb") as f:
                    f.write(ctypes.string_at(a_, l_))
                fns.append(dict(addr=a_, len=l_, file=fn))
            log("notifs", name=self.name,
                notifs={k: [m.decode(errors="replace") for m in v] for k, v in n.items()},
                region_dumps=fns)
        return n
    A.get_new_notifs = get_new_notifs

    orig_add = A.add_remote_agent
    def add_remote_agent(self, metadata):
        r = orig_add(self, metadata)
        log("add_remote_agent", name=self.name, remote=r.decode() if isinstance(r, bytes) else str(r))
        return r
    A.add_remote_agent = add_remote_agent

    # vLLM side: what the connector registers (per-layer KV tensors).
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
        orig_rkv = bw.NixlBaseConnectorWorker.register_kv_caches
        def register_kv_caches(self, kv_caches):
            r = orig_rkv(self, kv_caches)
            layers = {n: dict(ptr=t.data_ptr(), storage=t.untyped_storage().data_ptr(),
                              storage_nbytes=t.untyped_storage().nbytes(),
                              shape=list(t.shape), stride=list(t.stride()),
                              dtype=str(t.dtype), elem=t.element_size())
                      for n, t in kv_caches.items()}
            log("kv_caches", engine_id=self.engine_id, tp_rank=self.tp_rank,
                block_size=self.block_size, num_blocks=self.num_blocks,
                layers=layers, base_addrs=list(self.kv_caches_base_addr[self.engine_id][self.tp_rank]),
                block_len_per_layer=list(self.block_len_per_layer),
                block_stride_per_layer=list(self.block_stride_per_layer),
                region_num_blocks=list(self.region_num_blocks),
                kv_cache_layout=str(self.kv_cache_layout), backends=list(self.nixl_backends),
                agent=self.nixl_wrapper.name)
            return r
        bw.NixlBaseConnectorWorker.register_kv_caches = register_kv_caches
    except Exception as e:  # engine-core process may not import it
        log("patch_error", err=repr(e))
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker as pw
        orig_rb = pw.NixlPullConnectorWorker._read_blocks_for_req
        def _read_blocks_for_req(self, req_id, meta):
            def ids(b):
                return [list(map(int, g)) for g in b] if b is not None else None
            log("read_blocks_for_req", req_id=req_id, tp_rank=self.tp_rank,
                local_block_ids=ids(meta.local_block_ids),
                local_physical_block_ids=ids(getattr(meta, "local_physical_block_ids", None)),
                remote_block_ids=ids(meta.remote.block_ids) if meta.remote else None,
                remote_engine=meta.remote.engine_id if meta.remote else None,
                remote_request_id=meta.remote.request_id if meta.remote else None,
                remote_num_tokens=getattr(meta.remote, "num_tokens", None) if meta.remote else None,
                t0=time.perf_counter())
            return orig_rb(self, req_id, meta)
        pw.NixlPullConnectorWorker._read_blocks_for_req = _read_blocks_for_req
    except Exception as e:
        log("patch_error", err=repr(e))
    log("probe_loaded", role=role)
