#!/usr/bin/env bash
# Checks deploy/ without a container runtime or a cluster (CI has neither):
#  1. builds each kustomization under deploy/k8s (resources, JSON6902 patches,
#     images) and validates every resulting object against Kubernetes' schemas, strictly;
#  2. runs every ferry command line in deploy/compose.yaml and every ferry
#     container's args in the built manifests through the real binary with
#     --help appended: clap rejects unknown flags and bad values before it
#     prints help, so a stale flag in a manifest fails here.
# Usage: scripts/check-deploy.sh [path/to/ferry]   (default: debug/ferry in
# cargo's target directory, wherever CARGO_TARGET_DIR puts it)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -eq 0 ]; then
    source scripts/target-dir.sh
    set -- "$target_dir/debug/ferry"
fi
ferry=$1
# The Kubernetes version whose schemas the manifests must satisfy, and the
# tools, pinned (kubernetes-validate 1.37.0 ships schemas for 1.25 to 1.37).
k8s_version=1.30.0
pins=(kubernetes-validate==1.37.0 PyYAML==6.0.3)
venv=${FERRY_DEPLOY_VENV:-$HOME/.cache/ferry-deploy-venv}

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# A private venv, so nothing is installed into the system's Python; the stamp
# records the pins it holds and a changed pin rebuilds it.
if [ "$(cat "$venv/.ferry-pins" 2>/dev/null)" != "${pins[*]}" ] ||
    ! "$venv/bin/python" -c 'import yaml, kubernetes_validate' 2>/dev/null; then
    echo "check-deploy: installing ${pins[*]} into $venv" >&2
    rm -rf "$venv"
    # Debian's python3 has no venv module until python3-venv is installed.
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        rm -rf "$venv"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq python3-venv
        python3 -m venv "$venv"
    fi
    PIP_NO_INPUT=1 "$venv/bin/pip" install -q --disable-pip-version-check "${pins[@]}"
    echo "${pins[*]}" >"$venv/.ferry-pins"
fi

exec "$venv/bin/python" -u - "$ferry" "$k8s_version" <<'PY'
import os, shlex, subprocess, sys
import yaml
from kubernetes_validate import utils as kv
from kubernetes_validate.version import __version__ as kv_version

ferry, k8s_version = sys.argv[1], sys.argv[2]
passed, failed = 0, []

def check(ok, what, why=""):
    global passed
    if ok:
        passed += 1
        print(f"  ok    {what}")
    else:
        failed.append(what)
        print(f"  FAIL  {what}" + (f"\n        {why}" if why else ""))

def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]

# --- kustomize, the part of it deploy/k8s uses ------------------------------

KNOWN_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}

def build(directory):
    """The objects `kubectl kustomize DIRECTORY` would print (for the keys above)."""
    path = os.path.join(directory, "kustomization.yaml")
    kust = yaml.safe_load(open(path))
    unknown = set(kust) - KNOWN_KEYS
    if unknown:
        # Fail rather than validate something other than what kubectl applies.
        raise ValueError(f"{path}: check-deploy.sh does not implement {sorted(unknown)}")
    objects = []
    for res in kust.get("resources", []):
        target = os.path.normpath(os.path.join(directory, res))
        if os.path.isdir(target):
            objects += build(target)
        elif os.path.isfile(target):
            objects += load_all(target)
        else:
            raise ValueError(f"{path}: resource {res} does not exist")
    for patch in kust.get("patches", []):
        patch_path = os.path.join(directory, patch["path"])
        if not os.path.isfile(patch_path):
            raise ValueError(f"{path}: patch {patch['path']} does not exist")
        ops = yaml.safe_load(open(patch_path))
        if not isinstance(ops, list):
            raise ValueError(f"{patch_path}: only JSON6902 patches (a list of ops) are implemented")
        targets = [o for o in objects if matches(o, patch.get("target", {}))]
        if not targets:
            raise ValueError(f"{path}: patch {patch['path']} matches no resource")
        for o in targets:
            json6902(o, ops, patch_path)
    for image in kust.get("images", []):  # as `kustomize edit set image` writes them
        for c in containers(objects):
            name, tag = split_image(c["image"])
            if name == image["name"]:
                name = image.get("newName", name)
                tag = "@" + image["digest"] if "digest" in image else \
                      ":" + image["newTag"] if "newTag" in image else tag
                c["image"] = name + tag
    return objects

def containers(objects):
    for o in objects:
        yield from o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])

def split_image(ref):
    """("registry:5000/ferry", ":dev") from "registry:5000/ferry:dev"; the tag part
    keeps its ":" or "@" (a digest) and is "" when there is none."""
    at = ref.find("@")
    if at >= 0:
        return ref[:at], ref[at:]
    colon = ref.rfind(":")
    if colon > ref.rfind("/"):
        return ref[:colon], ref[colon:]
    return ref, ""

def matches(obj, target):
    group, _, version = obj["apiVersion"].rpartition("/")
    return all(want == have for want, have in [
        (target.get("kind"), obj["kind"]), (target.get("name"), obj["metadata"]["name"]),
        (target.get("group"), group), (target.get("version"), version)] if want is not None)

def json6902(doc, ops, where):
    """RFC 6902 add/remove/replace/test; anything else fails."""
    for op in ops:
        try:
            json6902_op(doc, op)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ValueError(f"{where}: {op.get('op')} {op.get('path')}: {e!r}") from None

def json6902_op(doc, op):
    keys = [k.replace("~1", "/").replace("~0", "~") for k in op["path"].split("/")[1:]]
    parent = doc
    for k in keys[:-1]:
        parent = parent[int(k)] if isinstance(parent, list) else parent[k]
    last = keys[-1]
    if isinstance(parent, list) and last != "-":
        last = int(last)
    kind = op["op"]
    if kind == "test":
        if parent[last] != op["value"]:
            raise ValueError(f"is {parent[last]!r}, not {op['value']!r}")
    elif kind == "remove":
        del parent[last]
    elif kind == "replace":
        parent[last]  # must exist
        parent[last] = op["value"]
    elif kind == "add":
        if isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else last, op["value"])
        else:
            parent[last] = op["value"]
    else:
        raise ValueError("op not implemented")

# --- 1. manifests -----------------------------------------------------------

print(f"Kubernetes manifests, built and validated (kubernetes-validate {kv_version},"
      f" strict, Kubernetes {k8s_version}):")
built = {}
kustomizations = sorted(root for root, _, files in os.walk("deploy/k8s")
                        if "kustomization.yaml" in files)
for root in kustomizations:
    try:
        built[root] = build(root)
    except Exception as e:
        check(False, f"{root}: build", str(e))
        continue
    for obj in built[root]:
        name = f"{root}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kv.validate(obj, k8s_version, strict=True)
            check(True, name)
        except kv.ValidationError as e:
            check(False, name, f"{'.'.join(map(str, e.path))}: {e.message}")
        except Exception as e:  # includes an unknown kind or apiVersion
            check(False, name, f"{type(e).__name__}: {getattr(e, 'message', e)}")

# Every YAML file under deploy/k8s must be used by some kustomization: a file
# nothing references is never applied, and so never checked either.
used = set()
for root in kustomizations:
    kust = yaml.safe_load(open(os.path.join(root, "kustomization.yaml")))
    used.add(os.path.join(root, "kustomization.yaml"))
    used.update(os.path.normpath(os.path.join(root, r)) for r in kust.get("resources", []))
    used.update(os.path.normpath(os.path.join(root, p["path"])) for p in kust.get("patches", []))
for root, _, files in os.walk("deploy/k8s"):
    for f in sorted(files):
        p = os.path.normpath(os.path.join(root, f))
        if p.endswith((".yaml", ".yml")) and p not in used:
            check(False, f"{p}: referenced by a kustomization", "no kustomization.yaml lists it")

# --- 2. ferry command lines -------------------------------------------------

def run_help(where, args):
    if not have_ferry:
        return
    cmd = [ferry, *args, "--help"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        # clap's first line says what it rejected.
        ok, why = r.returncode == 0, [l for l in (r.stderr or r.stdout).splitlines() if l.strip()][:1]
    except OSError as e:
        ok, why = False, [str(e)]
    check(ok, f"{where}: ferry {shlex.join(args)}", "\n        ".join(why))

print(f"\nferry command lines, each run as `{ferry} ARGS --help`:")
have_ferry = os.access(ferry, os.X_OK)
check(have_ferry, f"{ferry} is an executable", "build ferry first, or pass its path")
compose = yaml.safe_load(open("deploy/compose.yaml"))  # resolves the `<<` merge keys
ferry_images = {s.get("image") for s in compose["services"].values()
                if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"}
compose_lines = 0
for name, svc in compose["services"].items():
    if svc.get("image") not in ferry_images:
        continue
    compose_lines += 1
    memlock = svc.get("ulimits", {}).get("memlock", {})
    check(memlock in (-1, {"soft": -1, "hard": -1}) and "IPC_LOCK" in svc.get("cap_add", []),
          f"compose {name}: memlock unlimited, IPC_LOCK", f"ulimits.memlock={memlock!r}")
    command = svc.get("command", [])
    run_help(f"compose {name}", shlex.split(command) if isinstance(command, str) else command)

# Values standing in for what the downward API gives a real pod.
SAMPLE_FIELDS = {"metadata.name": "ferry-0", "metadata.namespace": "default",
                 "status.podIP": "10.0.0.10"}
seen = set()
for root, objects in built.items():
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            if split_image(c["image"])[0].rsplit("/", 1)[-1] != "ferry":
                continue
            env = {}
            for e in c.get("env", []):
                field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                env[e["name"]] = e["value"] if "value" in e else SAMPLE_FIELDS.get(field, "sample")
            args = []
            for a in c.get("args", []):
                for var, value in env.items():
                    a = a.replace(f"$({var})", value)
                if "$(" in a:
                    check(False, f"{root}: {obj['kind']}/{obj['metadata']['name']} args",
                          f"{a}: references a variable the container does not define")
                args.append(a)
            key = (obj["kind"], obj["metadata"]["name"], tuple(args))
            if key not in seen:
                seen.add(key)
                run_help(f"{root}: {obj['kind']}/{obj['metadata']['name']}", args)

# Guards the two loops above against finding nothing to check.
check(compose_lines > 0 and len(seen) > 0, "found ferry command lines in compose and k8s",
      f"{compose_lines} in compose.yaml, {len(seen)} in k8s")

print(f"\ncheck-deploy: {passed} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
PY
