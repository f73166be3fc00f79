"""The serve command against a plain server, on one checkpoint of a language model: aggregate
tokens/s and latency (median, 99th percentile) at each number of concurrent clients.

The plain server is Python's `http.server` answering one request at a time with the same
checkpoint's `net.generate` (greedy). Both get the same greedy requests (prompts of 6 to 44
characters, `--new-tokens` each) from `--clients` threads sending `--per-client` requests one
after the other; the texts are compared, so a faster server that answered differently shows.

    python scripts/serve_against_plain.py logs/train/runs/<run>/checkpoints/last.ckpt
    python scripts/serve_against_plain.py <ckpt> --clients 1 8 32 --per-client 4 --device cuda
"""

from __future__ import annotations

import argparse
import http.server
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import torch

from {{ cookiecutter.package_name }}.checkpointing.trained import (
    rebuild,
)


def plain_server(net: Any, device: torch.device) -> http.server.HTTPServer:
    """One request at a time: the next waits in the socket's queue."""

    class Plain(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            tokens = list(body["prompt"].encode())
            idx = torch.tensor([tokens], device=device)
            with torch.inference_mode():
                out = net.generate(idx, body["max_new_tokens"], temperature=0)
            text = bytes(out[0, len(tokens) :].tolist()).decode("utf-8", "replace")
            data = json.dumps({"completion": text}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    http.server.HTTPServer.request_queue_size = 256
    server = http.server.HTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def drain(stream: Any) -> None:
    for _ in stream:
        pass


def our_server(checkpoint: str, device: str, rows: int) -> tuple[subprocess.Popen[str], str]:
    module = "{{ cookiecutter.package_name }}.recipes.serve"
    command = [
        sys.executable, "-m", module, f"ckpt_path={checkpoint}", "port=0", f"device={device}",
        f"max_batch_size={rows}", "hydra.run.dir=logs/serve_against_plain",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    seen = []
    for line in process.stdout:
        seen.append(line)
        if "Serving at " in line:
            url = line.split("Serving at ", 1)[1].split()[0]
            threading.Thread(target=drain, args=(process.stdout,), daemon=True).start()
            return process, url
    sys.exit("the server did not start:\n" + "".join(seen[-20:]))


def prompt(index: int) -> str:
    return f"def f{index}(" + "x" * (index % 37)


def load(url: str, clients: int, per_client: int, new_tokens: int) -> dict[str, Any]:
    latencies: list[float] = []
    texts: dict[int, str] = {}

    def client(number: int) -> None:
        with httpx.Client(timeout=3600) as session:
            for request in range(per_client):
                index = number * per_client + request
                began = time.perf_counter()
                answer = session.post(url, json={
                    "prompt": prompt(index), "max_new_tokens": new_tokens, "temperature": 0,
                })  # fmt: skip
                latencies.append(time.perf_counter() - began)
                texts[index] = answer.json()["completion"]

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(number,)) for number in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    latencies.sort()
    return {
        "tokens_per_sec": clients * per_client * new_tokens / wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "texts": texts,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--per-client", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", help="the figures as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    net: Any = rebuild(args.checkpoint, False, {}, {}).model.net
    net = net.to(device).eval()
    plain = plain_server(net, device)
    plain_url = f"http://127.0.0.1:{plain.server_address[1]}/generate"
    process, url = our_server(args.checkpoint, args.device, max(args.clients))
    ours_url = f"{url}/generate"

    def run(where: str, clients: int) -> dict[str, Any]:
        return load(where, clients, args.per_client, args.new_tokens)

    try:
        run(ours_url, 2)  # warm-up
        run(plain_url, 1)
        rows = []
        print("| clients | serve tokens/s | plain tokens/s | serve/plain | serve latency p50, p99 (s) "
              "| plain latency p50, p99 (s) | same texts |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for clients in args.clients:
            ours, theirs = run(ours_url, clients), run(plain_url, clients)
            same = ours.pop("texts") == theirs.pop("texts")
            ratio = ours["tokens_per_sec"] / theirs["tokens_per_sec"]
            rows.append({"clients": clients, "serve": ours, "plain": theirs, "ratio": ratio,
                         "same_texts": same})  # fmt: skip
            print(
                f"| {clients} | {ours['tokens_per_sec']:,.0f} | {theirs['tokens_per_sec']:,.0f} "
                f"| {ratio:.2f} | {ours['latency_p50_s']:.2f}, {ours['latency_p99_s']:.2f} "
                f"| {theirs['latency_p50_s']:.2f}, {theirs['latency_p99_s']:.2f} | {same} |",
                flush=True,
            )
        if args.output:
            with open(args.output, "w") as file:
                json.dump(rows, file, indent=2)
    finally:
        process.terminate()
        process.wait(60)
        plain.shutdown()


if __name__ == "__main__":
    main()
