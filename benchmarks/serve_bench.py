"""What the HTTP front costs a spoken turn: N concurrent turns through ``minicpmo-rt serve``'s server
(``serving.http.Server`` + ``TurnService``, streamed answers, N client threads released together) against the
same pipeline called directly (``TurnPipeline.run`` of the N requests), side by side in one process.

The pipeline is ``turn_bench``'s default form (``talker-kernels``) of one turn profile on full-size random
weights, every answer exactly ``--tokens`` text tokens and ``--codes`` codes, so both paths do the same work.
Measured per run: each request's time to its first audio (direct: its first PcmChunk; HTTP: the first audio
delta its client reads, from the moment it sent the request) and the wall time until the last answer is
complete. The server adds the batch window (``TurnService.batch_wait_s``, 20 ms by default: requests released
together share one batch), the JSON/base64 encoding of each chunk and the socket; each row says how many
pipeline runs the answers took and how many requests joined a running one (requests released together that
reach the server after the batch window join it, or start the next run once it has ended).

``--stagger-ms S`` sends request i S*i ms after the first, as users arrive, and compares, side by side, the
server without mid-batch admission (``http-batched``, its default: a late request waits for the next batch), with
it (``http``: a request that arrives while a batch runs joins it, ``TurnPipeline.run``'s ``admit``), and with it
and the Talker's lead (``http-lead``: ``TurnPipeline.talker_lead_s`` = ``--lead-s``, the Thinker goes first while
every speaking request is that far ahead of real time); ``--paths`` picks others (``-side``: the Talker on a CUDA
stream of its own, ``TurnPipeline.talker_side_stream``).

Each client also plays its answer back as it arrives, in real time from its first audio: ``stall`` is how long
that playback would wait for audio that has not arrived (summed over the answer; the table gives the largest
request's and how many requests stalled at all).

    python benchmarks/serve_bench.py OUT                                     # GPU: N = 1, 8, 16
    python benchmarks/serve_bench.py OUT --requests 8,16 --stagger-ms 250    # GPU: arrivals 250 ms apart
    python benchmarks/serve_bench.py OUT --requests 8,16 --stagger-ms 250 --tokens 48 --codes 375   # 15-s answers
    python benchmarks/serve_bench.py OUT --tiny --requests 1,2 --tokens 4 --codes 30 --repeat 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import torch

from minicpmo_rt.checkpoint.tokenizer import load_tokenizer, vendored_tokenizer_dir
from minicpmo_rt.profiles import load_profile
from minicpmo_rt.serving.http import Server
from minicpmo_rt.serving.turns import TurnService

from code2wav_pipeline_bench import bench_models, device_label, parse_batches
from duplex_bench import build, sync
from turn_bench import QUESTIONS, pipeline, run

FORM = "talker-kernels"


def http_run(server: Server, n: int, tokens: int, codes: int, dev: torch.device, stagger_ms: float = 0.0) -> dict:
    """N clients post streamed spoken requests, client i ``stagger_ms`` * i after the common release; each one's
    time to its first audio delta from its own send, and the time to the last ``[DONE]`` from the release."""
    gate = threading.Barrier(n + 1)
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    heard: dict[int, list[tuple[float, int]]] = {i: [] for i in range(n)}    # (arrival s, samples) per delta
    errors: list[str] = []
    t0 = [0.0]

    def client(i: int) -> None:
        body = json.dumps({"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                           "modalities": ["text", "audio"], "stream": True, "seed": i, "max_tokens": tokens,
                           "max_codes": codes}).encode()
        req = urllib.request.Request(server.url + "/v1/chat/completions", body)
        gate.wait()
        if stagger_ms:
            time.sleep(stagger_ms * i / 1e3)
        sent = time.perf_counter() if stagger_ms else t0[0]
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                for line in resp:
                    if line.startswith(b"data: {") and b'"audio":' in line:
                        now = time.perf_counter()
                        audio = json.loads(line[6:])["choices"][0]["delta"].get("audio", {})
                        if audio.get("data"):
                            first.setdefault(i, (now - sent) * 1e3)
                            heard[i].append((now, len(base64.b64decode(audio["data"])) // 2))    # PCM16
                    if line.startswith(b"data: [DONE]"):
                        done[i] = (time.perf_counter() - t0[0]) * 1e3
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(f"client {i}: {exc!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    sync(dev)
    t0[0] = time.perf_counter()
    gate.wait()
    for t in threads:
        t.join()
    if errors or len(first) != n or len(done) != n:
        raise RuntimeError(f"N={n}: {len(first)} first audio, {len(done)} done of {n}; {errors[:3]}")
    ttfa = sorted(first.values())
    stalls = [stall_s(heard[i]) * 1e3 for i in range(n)]
    return {"n": n, "wall_ms": max(done.values()), "ttfa_ms_first": ttfa[0], "ttfa_ms_median": statistics.median(ttfa),
            "ttfa_ms_last": ttfa[-1], "stall_ms_max": max(stalls), "stalled": sum(x > 0 for x in stalls)}


def stall_s(deltas: list[tuple[float, int]], rate: int = 24_000) -> float:
    """Seconds a real-time playback of the deltas (arrival time, samples), started at the first one's arrival,
    waits for audio that has not arrived yet."""
    stall, end = 0.0, None
    for t, samples in deltas:
        if end is not None and t > end:
            stall += t - end
        end = max(end if end is not None else t, t) + samples / rate
    return stall


def write_table(res: dict, path: Path) -> None:
    base = paths(res["stagger_ms"], res.get("paths", STAGGERED))[0]
    title = ("Serving overhead: streamed HTTP answers against direct pipeline calls" if not res["stagger_ms"] else
             f"Mid-batch admission: requests {res['stagger_ms']:.0f} ms apart, joining the running batch or not")
    lines = [f"# {title} on {res['gpu']}", "",
             f"torch {res['torch']}, profile {res['profile']}, {res['dtype']} Thinker/Talker; {res['tokens']} text "
             f"tokens and {res['codes']} codes per answer; the run of median wall time out of {res['repeat']}. "
             "TTFA: time to first audio, from each request's own send. Runs: pipeline runs the answers took "
             "(requests that joined a running one in brackets).", "",
             f"| N | path | wall ms | TTFA first / median / last ms | stall max ms (stalled) | runs | wall x {base} | "
             f"median TTFA x {base} |",
             "|---:|---|---:|---|---|---|---:|---:|"]
    for n in sorted({r["n"] for r in res["rows"]}):
        rows = {r["path"]: r for r in res["rows"] if r["n"] == n}
        d = rows[base]
        for name in paths(res["stagger_ms"], res.get("paths", STAGGERED)):
            r = rows.get(name)
            if r is None:
                continue
            ttfa = f"{r['ttfa_ms_first']:.0f} / {r['ttfa_ms_median']:.0f} / {r['ttfa_ms_last']:.0f}"
            runs = "-" if "runs" not in r else f"{r['runs']} ({r['joined']})"
            stall = "-" if "stall_ms_max" not in r else f"{r['stall_ms_max']:.0f} ({r['stalled']})"
            lines.append(f"| {n} | {name} | {r['wall_ms']:.0f} | {ttfa} | {stall} | {runs} | "
                         f"{r['wall_ms'] / d['wall_ms']:.3f} | {r['ttfa_ms_median'] / d['ttfa_ms_median']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


# staggered paths: name -> (TurnService.join_running, whether TurnPipeline.talker_lead_s is --lead-s, and
# TurnPipeline.talker_side_stream)
SERVER_PATHS = {"http-batched": (False, False, False), "http": (True, False, False), "http-lead": (True, True, False),
                "http-side": (True, False, True), "http-lead-side": (True, True, True)}
STAGGERED = "http-batched,http,http-lead"


def paths(stagger_ms: float, chosen: str = STAGGERED) -> tuple[str, ...]:
    """The compared paths, the reference first: at once, the direct call and the server; staggered, ``chosen``
    (names of SERVER_PATHS; by default the server without joining, with it, and with it and the Talker's lead)."""
    return ("direct", "http") if not stagger_ms else tuple(chosen.split(","))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (a check of the script)")
    ap.add_argument("--requests", default="1,8,16", help="N concurrent turns per run")
    ap.add_argument("--profile", default="minicpmo_4_5_turn_mrv2_h200")
    ap.add_argument("--tokens", type=int, default=24, help="text tokens per answer")
    ap.add_argument("--codes", type=int, default=100, help="codes per answer (25 per second of audio)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the row is the run of median wall time")
    ap.add_argument("--stagger-ms", type=float, default=0.0, help="send request i this many ms * i after the first "
                    "(0: all at once, against the direct call; >0: the server with and without mid-batch joining)")
    ap.add_argument("--lead-s", type=float, default=1.0, help="the http-lead path's TurnPipeline.talker_lead_s")
    ap.add_argument("--paths", default=STAGGERED, help="with --stagger-ms, the compared server paths, the reference "
                    f"first: {', '.join(SERVER_PATHS)} (-side: the Talker on its own CUDA stream)")
    args = ap.parse_args()
    ns = parse_batches(ap, args.requests)
    if load_profile(args.profile).mode != "turn":
        ap.error(f"--profile: {args.profile!r} is not a turn-mode profile")
    if args.tokens < 1 or args.codes < 1 or args.repeat < 1:
        ap.error("--tokens, --codes and --repeat must be positive")
    if args.stagger_ms < 0:
        ap.error(f"--stagger-ms must be >= 0, got {args.stagger_ms}")
    if args.lead_s < 0:
        ap.error(f"--lead-s must be >= 0, got {args.lead_s}")
    unknown = [p for p in args.paths.split(",") if p not in SERVER_PATHS]
    if unknown or len(set(args.paths.split(","))) < len(args.paths.split(",")):
        ap.error(f"--paths {args.paths!r}: name each of {', '.join(SERVER_PATHS)} at most once")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    thinker, tts = build(args.tiny, dev, dtype)
    flow, gen, feats, _ = bench_models(args.tiny, dev)
    parts = (thinker, load_tokenizer(vendored_tokenizer_dir()), tts, flow, gen, feats)
    pipe = pipeline(args.profile, FORM, parts, dev, args.codes, {})
    if max(ns) > pipe.talker.capacity:
        ap.error(f"--requests: {max(ns)} exceeds the profile's Talker capacity {pipe.talker.capacity} (one batch)")
    for n in ns:    # captures and compiles at every N the runs use
        run(pipe, n, feats, min(2, args.tokens), args.codes, dev, f"warm{n}")
    service = TurnService(pipe, {"bench": feats})
    server = Server(("127.0.0.1", 0), "bench", turns=service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    batches: list[list[int]] = []         # per pipeline run: [requests it started with, requests that joined]
    direct_run = pipe.run

    def counted(requests, *a, admit=None, **kw):
        batch = [len(requests), 0]
        batches.append(batch)

        def joining():
            new = admit()
            batch[1] += len(new)
            return new

        return direct_run(requests, *a, admit=joining if admit is not None else None, **kw)

    res = {"gpu": device_label(dev), "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
           "tiny": args.tiny, "profile": args.profile, "form": FORM, "tokens": args.tokens, "codes": args.codes,
           "repeat": args.repeat, "batch_wait_ms": service.batch_wait_s * 1e3, "stagger_ms": args.stagger_ms,
           "lead_s": args.lead_s, "paths": args.paths, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for n in ns:
            http_run(server, n, min(2, args.tokens), args.codes, dev)      # the server's own first batch of N
            for name in paths(args.stagger_ms, args.paths):     # one after the other: drift hits each alike
                runs = []
                for k in range(args.repeat):
                    if name == "direct":
                        runs.append(run(pipe, n, feats, args.tokens, args.codes, dev, f"direct-{n}-{k}"))
                        continue
                    batches.clear()
                    before = service.join_running, pipe.talker_lead_s, pipe.talker_side_stream
                    join, lead, side = SERVER_PATHS[name] if args.stagger_ms else (True, False, False)
                    pipe.run, service.join_running = counted, join
                    pipe.talker_lead_s, pipe.talker_side_stream = args.lead_s if lead else None, side
                    try:
                        runs.append(http_run(server, n, args.tokens, args.codes, dev, args.stagger_ms))
                    finally:
                        del pipe.run
                        service.join_running, pipe.talker_lead_s, pipe.talker_side_stream = before
                    runs[-1].update(runs=len(batches), joined=sum(b[1] for b in batches))
                runs.sort(key=lambda r: r["wall_ms"])
                row = {k: v for k, v in runs[len(runs) // 2].items() if k in
                       ("n", "wall_ms", "ttfa_ms_first", "ttfa_ms_median", "ttfa_ms_last", "stall_ms_max", "stalled",
                        "runs", "joined")}
                row.update(path=name, wall_ms_runs=[r["wall_ms"] for r in runs])
                res["rows"].append(row)
                print(f"N={n:2d} {name:12s}: {row['wall_ms']:8.0f} ms, TTFA {row['ttfa_ms_first']:.0f}/"
                      f"{row['ttfa_ms_median']:.0f}/{row['ttfa_ms_last']:.0f} ms, stall max "
                      f"{row.get('stall_ms_max', 0):.0f} ms", flush=True)
                (args.out / "serve_bench.json").write_text(json.dumps(res, indent=1))  # a cut-off run keeps its rows
    finally:
        server.shutdown()
        server.server_close()
        service.close(timeout=60)
    write_table(res, args.out / "serve_bench.md")


if __name__ == "__main__":
    main()
