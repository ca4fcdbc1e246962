"""Two real vLLM 0.33 CPU engines (prefill, decode), each in its own
processes, NixlConnector with kv_buffer_device="cpu", over UCX or FERRY.
The engines' waits for each other's files end with this process's
deadline, which stops both engines' process groups.

  run_pd.py --ptp 2 --dtp 1 --pbs 32 --dbs 32 --backend UCX --out runs/p2d1-UCX

The nixl_probe plugin (installed in the venv) records every NIXL call of
every worker under --out; analyze.py compares with ferry's plan.
"""
import argparse, json, os, subprocess, sys, time

#: Where setup.sh wrote the model (and run_all.sh the runs).
WORK = os.environ.get("FERRY_VLLM_CHECK", os.path.expanduser("~/.cache/ferry-peers/vllm-check"))
MODEL = os.path.join(WORK, "tiny-llama")


def engine(role, a):
    from vllm import LLM, SamplingParams
    tp = a.ptp if role == "prefill" else a.dtp
    bs = a.pbs if role == "prefill" else a.dbs
    ktc = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
           "kv_buffer_device": "cpu",
           "kv_connector_extra_config": {"backends": [a.backend]}}
    t = time.time()
    llm = LLM(model=MODEL, skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=512, max_num_seqs=2, block_size=bs, enforce_eager=True,
              tensor_parallel_size=tp, enable_prefix_caching=False,
              num_gpu_blocks_override=a.blocks, kv_transfer_config=ktc)
    print(f"[{role}] engine up in {time.time() - t:.1f}s", flush=True)
    out = a.out
    if role == "prefill":
        for i in range(a.requests + 1):          # the last one only flushes notifications
            prompt = [3 + (i * 7919 + j * 104729) % 500 for j in range(a.prompt_len)]
            sp = SamplingParams(max_tokens=1, detokenize=False, temperature=0.0,
                                extra_args={"kv_transfer_params": {"do_remote_decode": True}})
            t0 = time.perf_counter()
            o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
            dt = time.perf_counter() - t0
            if i == a.requests:
                break
            json.dump({"prompt": prompt, "kv_transfer_params": o.kv_transfer_params,
                       "first_token": o.outputs[0].token_ids, "prefill_s": dt},
                      open(os.path.join(out, f"params-{i}.json.tmp"), "w"))
            os.rename(os.path.join(out, f"params-{i}.json.tmp"), os.path.join(out, f"params-{i}.json"))
            while not os.path.exists(os.path.join(out, f"done-{i}")):
                time.sleep(0.05)
        time.sleep(1.0)
    else:
        for i in range(a.requests):
            p = os.path.join(out, f"params-{i}.json")
            while not os.path.exists(p):
                time.sleep(0.05)
            r = json.load(open(p))
            kvp = dict(r["kv_transfer_params"])
            sp = SamplingParams(max_tokens=a.decode_tokens, detokenize=False, temperature=0.0,
                                extra_args={"kv_transfer_params": kvp})
            t0 = time.perf_counter()
            o = llm.generate([{"prompt_token_ids": r["prompt"]}], sp, use_tqdm=False)[0]
            dt = time.perf_counter() - t0
            # reference: the same engine recomputing the prompt itself
            o2 = llm.generate([{"prompt_token_ids": r["prompt"]}],
                              SamplingParams(max_tokens=a.decode_tokens, detokenize=False, temperature=0.0),
                              use_tqdm=False)[0]
            res = {"i": i, "decode_s": dt, "tokens_pd": list(o.outputs[0].token_ids),
                   "tokens_local": list(o2.outputs[0].token_ids),
                   "prefill_first_token": r["first_token"],
                   "kv_transfer_params": r["kv_transfer_params"]}
            print(f"[decode] req {i}: {res['tokens_pd']} local {res['tokens_local']} "
                  f"{dt * 1e3:.1f} ms", flush=True)
            json.dump(res, open(os.path.join(out, f"done-{i}.json"), "w"))
            open(os.path.join(out, f"done-{i}"), "w").close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role")
    ap.add_argument("--ptp", type=int, default=2)
    ap.add_argument("--dtp", type=int, default=1)
    ap.add_argument("--pbs", type=int, default=32)
    ap.add_argument("--dbs", type=int, default=32)
    ap.add_argument("--backend", default="UCX")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--decode-tokens", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--replay", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    a.out = os.path.abspath(a.out)
    if a.role:
        return engine(a.role, a)
    os.makedirs(a.out, exist_ok=True)
    for f in os.listdir(a.out):
        os.remove(os.path.join(a.out, f))
    json.dump(vars(a), open(os.path.join(a.out, "args.json"), "w"))
    base = dict(os.environ, VLLM_TARGET_DEVICE="cpu", NIXL_PROBE_DIR=a.out,
                NIXL_PROBE_REPLAY=str(a.replay), VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="1", OMP_WAIT_POLICY="PASSIVE",
                VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", FERRY_NIXL_LISTEN="127.0.0.1:0")
    procs = []
    for role, tp, port in (("prefill", a.ptp, 5600), ("decode", a.dtp, 5700)):
        env = dict(base, NIXL_PROBE_ROLE=role, VLLM_NIXL_SIDE_CHANNEL_PORT=str(port))
        # two cores: a TP-2 engine takes one each; two TP-1 engines one each
        if tp == 2:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        elif a.ptp == 1 and a.dtp == 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if role == "prefill" else "1"
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"
        log = open(os.path.join(a.out, f"{role}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "--role", role] + sys.argv[1:],
                                      env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    deadline = time.time() + a.requests * 120 + 300
    try:
        while time.time() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)          # one side failed: give the other a moment, then stop it
                break
            time.sleep(0.5)
    finally:
        for p in procs:                # each engine and its workers, by process group
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
    rc = [p.returncode for p in procs]
    print("exit codes", rc)
    sys.exit(max(rc))


if __name__ == "__main__":
    main()
