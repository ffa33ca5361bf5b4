"""The serving checks of scripts/gpu_check.sh, on a small random-weights model directory.

    python benchmarks/gpu_serve_check.py serve --device cuda --workdir /tmp/kvrelay-gpu-check
    python benchmarks/gpu_serve_check.py up --device cuda --workdir /tmp/kvrelay-gpu-check

serve: `kvrelay serve DIR --device D` answers a completion and a chat completion through the
       OpenAI client (httpx where the client is not installed); the greedy completion is kept in
       WORKDIR/single_answer.json.
up:    `kvrelay up DIR --device D` (1P1D behind the proxy) answers the same greedy completion with
       the same text as the single instance (run first if its answer is not there yet).

Both also time the first token of 4096-token prompts (`--prompt-tokens`; streamed, one warm-up,
then the median of three different prompts, no prefix shared): `up` prints P/D's median against
the single instance's (issue 33's target: <= 1.2x) on a line of its own; the verdict is the
answer's.

The model directory (config.json, model.safetensors, tokenizer.json with a chat template) is
written once into WORKDIR by tests/tiny.py's writer: a 4-layer Llama of the tiny word vocabulary
("t17" is token 17) with weights wide enough (std 0.1) that greedy text varies. On a GPU both run
it in bfloat16 (the checkpoint is float32, whose exact-FMA attention is the slow one) with a
1 GiB KV cache per instance (at the default utilization a model this small would get millions of
blocks, about a microsecond each to build). Prints one "PASS"/"FAIL" line last; exit status 0
on PASS.

`kvrelay up` runs in a session of its own (so its instances stop together); its process group id
goes to WORKDIR/up.pgid while it runs, so whoever stops this check can stop the cluster too
(scripts/gpu_check.sh does, also when the check hit its time limit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.entrypoints.serve_process import ServeProcess, free_port  # noqa: E402
from tests.tiny import write_tiny_model_dir  # noqa: E402

MODEL_OVERRIDES: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=8192, initializer_range=0.1)
# 40 words of the tiny vocabulary: three blocks of 16 with a partial last one.
PROMPT = " ".join(f"t{(11 * i + 5) % 250 + 2}" for i in range(40))
MAX_TOKENS = 16
ANSWER_FILE = "single_answer.json"
PGID_FILE = "up.pgid"
KV_CACHE_MEMORY = "1GiB"
LONG_PROMPT_TOKENS = 4096  # one word each in the tiny vocabulary (issue 33's TTFT case)


def long_prompt(k: int, tokens: int) -> str:
    """The k-th long prompt; two of them share no first token, so no prefix either."""
    return " ".join(f"t{(7 * i + 31 * k) % 250 + 2}" for i in range(tokens))


def first_token_ms(url: str, model: str, prompt: str) -> float:
    """Milliseconds from sending a streamed completion to its first text chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300, trust_env=False) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                return (time.perf_counter() - started) * 1000
    raise RuntimeError("the stream ended without a token")


def ttft_ms(url: str, model: str, tokens: int) -> list[float]:
    """One warm-up, then three measured prompts (the same three on every instance)."""
    first_token_ms(url, model, long_prompt(0, tokens))
    return [first_token_ms(url, model, long_prompt(k, tokens)) for k in (1, 2, 3)]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def model_dir(workdir: Path) -> Path:
    path = workdir / "tiny-random"
    if not (path / "model.safetensors").exists():
        write_tiny_model_dir(path, seed=0, **MODEL_OVERRIDES)
    return path


def model_id(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"])


def complete(url: str, model: str) -> tuple[str, str]:
    """(greedy completion text, the client that asked): the OpenAI client where installed."""
    try:
        import openai
    except ImportError:
        body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
        response.raise_for_status()
        return str(response.json()["choices"][0]["text"]), "httpx (openai is not installed)"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    return str(out.choices[0].text), f"openai {openai.__version__}"


def chat(url: str, model: str) -> str:
    messages = [{"role": "user", "content": "t5 t6 t7"}]
    try:
        import openai
    except ImportError:
        body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0.0}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120, trust_env=False)
        response.raise_for_status()
        return str(response.json()["choices"][0]["message"]["content"])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                         temperature=0.0)
    return str(out.choices[0].message.content)


def engine_flags(device: str) -> list[str]:
    """The flags both checks start their instances with."""
    dtype = [] if device == "cpu" else ["--dtype", "bfloat16"]
    return ["--device", device, "--kv-cache-memory", KV_CACHE_MEMORY, *dtype]


def check_serve(workdir: Path, device: str, timeout_s: float,
                tokens: int = LONG_PROMPT_TOKENS) -> tuple[bool, str]:
    """One `kvrelay serve --device DEVICE`: a completion and a chat answer; keeps the completion."""
    server = ServeProcess(model_dir(workdir), workdir / "serve.log", *engine_flags(device),
                          "--log-level", "info")
    try:
        server.wait_healthy(timeout_s)
        model = model_id(server.url)
        text, client = complete(server.url, model)
        reply = chat(server.url, model)
        ttfts = ttft_ms(server.url, model, tokens)
    except Exception as e:  # noqa: BLE001 - reported with the server's log
        server.stop()
        return False, f"{type(e).__name__}: {e}\n--- serve log (tail) ---\n{tail(server.log())}"
    code = server.stop()
    (workdir / ANSWER_FILE).write_text(json.dumps({"prompt": PROMPT, "text": text, "device": device,
                                                   "ttft_ms": ttfts, "ttft_tokens": tokens}))
    if not text.strip() or not reply.strip():
        return False, f"empty answer: completion {text!r}, chat {reply!r}"
    return code == 0, (f"client {client}; completion {text!r}; chat {reply!r}; "
                       f"TTFT of a {tokens}-token prompt: "
                       f"{', '.join(f'{t:.1f}' for t in ttfts)} ms; "
                       f"serve exited with {code}\n--- serve log (tail) ---\n{tail(server.log(), 15)}")


def check_up(workdir: Path, device: str, timeout_s: float,
             tokens: int = LONG_PROMPT_TOKENS) -> tuple[bool, str]:
    """1P1D `kvrelay up --device DEVICE`: its greedy completion equals the single instance's."""
    answer_path = workdir / ANSWER_FILE
    if not answer_path.exists():
        ok, detail = check_serve(workdir, device, timeout_s / 2, tokens)
        if not ok:
            return False, f"the single instance's answer is missing and serving it failed: {detail}"
    single_run = json.loads(answer_path.read_text())
    single = single_run["text"]
    log_dir = workdir / "up-logs"
    port = free_port()
    cmd = [sys.executable, "-m", "kvrelay.entrypoints.cli", "up", str(model_dir(workdir)),
           *engine_flags(device), "--port", str(port), "--log-dir", str(log_dir),
           "--startup-timeout", str(int(timeout_s))]
    with open(workdir / "up.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (workdir / PGID_FILE).write_text(str(proc.pid))  # a session leader: its pid is its group id
    try:
        url = wait_ready(proc, workdir / "up.log", timeout_s)
        model = model_id(url)
        text, client = complete(url, model)
        ttfts = ttft_ms(url, model, tokens)
    except Exception as e:  # noqa: BLE001 - reported with the cluster's logs
        stop_group(proc)
        (workdir / PGID_FILE).unlink(missing_ok=True)
        return False, f"{type(e).__name__}: {e}\n{cluster_logs(workdir / 'up.log', log_dir)}"
    stop_group(proc)
    (workdir / PGID_FILE).unlink(missing_ok=True)
    same = text == single
    verdict = "equals" if same else f"DIFFERS from the single instance's {single!r}"
    logs = cluster_logs(workdir / "up.log", log_dir)
    ttft = ttft_line(single_run, ttfts, tokens)
    return same, f"client {client}; P/D answer {text!r} {verdict}\n{ttft}\n{logs}"


def ttft_line(single_run: dict[str, Any], ttfts: list[float], tokens: int) -> str:
    pd = median(ttfts)
    if "ttft_ms" not in single_run or single_run.get("ttft_tokens") != tokens:
        return f"TTFT of a {tokens}-token prompt: P/D {pd:.1f} ms (no single-instance figure at this length)"
    single = median(single_run["ttft_ms"])
    ratio = pd / single
    return (f"TTFT of a {tokens}-token prompt (median of 3): single {single:.1f} ms, "
            f"P/D {pd:.1f} ms: {ratio:.2f}x the single instance (target <= 1.2x): "
            f"{'met' if ratio <= 1.2 else 'NOT met'}")


def wait_ready(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> str:
    """The proxy URL `kvrelay up` prints once every instance is healthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"kvrelay up: ready at (\S+)", log_path.read_text(errors="replace"))
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"kvrelay up exited with {proc.returncode} before it was ready")
        time.sleep(0.5)
    raise TimeoutError(f"kvrelay up was not ready within {timeout_s:.0f} s")


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM to `kvrelay up` (it stops its children), SIGKILL to its whole group after a grace
    period or once it exited (a child it left behind goes too)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def cluster_logs(up_log: Path, log_dir: Path) -> str:
    parts = [f"--- kvrelay up (tail) ---\n{tail(up_log.read_text(errors='replace'), 20)}"]
    for path in sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []:
        parts.append(f"--- {path.name} (tail) ---\n{tail(path.read_text(errors='replace'), 15)}")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("serve", "up"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvrelay-gpu-check"))
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for the servers to come up")
    p.add_argument("--prompt-tokens", type=int, default=LONG_PROMPT_TOKENS,
                   help="the TTFT prompts' length (a CPU dry run: a few hundred)")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    check: Any = check_serve if args.part == "serve" else check_up
    ok, detail = check(args.workdir, args.device, args.timeout, args.prompt_tokens)
    print(detail, flush=True)
    verdict = "PASS" if ok else "FAIL"
    print(f"{args.part} --device {args.device}: {verdict} ({time.monotonic() - start:.0f} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
