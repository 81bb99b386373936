"""MoE expert sharding, measured side by side in one run (this machine, loopback, greedy).

1. **One MoE layer, experts remote ÷ local.** A layer with Qwen3-30B-A3B's expert shape
   (d_model 2048, expert ffn 768, 8 experts per token) but 16 experts instead of 128 so it
   fits here: each expert is 18.9 MB of float32, so a token's 8 experts read 151 MB and a
   real saving from spreading them over processes is plausible (the work is memory-bound at
   T = 1 and compute-bound at T = 64; a round trip on loopback is ~0.15 ms). The routed
   feed-forward (`engine.moe.moe_ffn`: routing, the experts, the weighted sum) is timed for
   T = 1, 16, 64 rows, computed:
   - locally (the baseline, 1 torch thread; also 2 threads for reference),
   - remotely: every expert on two real worker processes (8 experts each, 1 thread each;
     each link admitted by the handshake with the worker's secret),
   - split: 8 experts here, 8 on one worker, in parallel.
2. **Throughput under saturation** through the real control plane: a daphne gateway on a
   temporary SQLite database (loopback workers allowed: MOE_ALLOW_PRIVATE_WORKERS), the
   expert market with `boost` 1, a coordinator bound to the model (`MoeRunner` +
   `CoordinatorAgent`, default probe and report intervals) with 4 requests in flight, and
   0, 1, 2 or 4 `python -m mahout moe volunteer` processes on trusted hosts. Per round: the time from
   the load starting to the first remote dispatch, then generated tokens/s once every
   volunteer serves, and the share of routed experts computed remotely in that window. Each
   round with volunteers runs twice: under seed 004's Layer-1 rule as first written
   (`DispatchPolicy(latency_aware=False)`: every proven worker engaged under load) and under
   the latency-aware rule (the default: a worker engaged only while its round trip beats
   computing the call here; `mahout.moe.policy`). The model: 2 layers, d_model 1024, expert
   ffn 768, 16 experts (8 per slice, so 4 slices), 4 per token. `--only-saturation` runs
   only this section.
3. **Packed decode steps** (`--only-packing` runs only this): the same control plane and
   model, 1, 2 and 4 requests in flight, with 0 and 2 volunteers; tokens/s with decode steps
   packed across requests, against one request's step per pass in the same run.

4. **Volunteers behind NAT** (`--netsim`, root on Linux; runs only this): section 2 with the
   gateway on the simulated internet's public side (bench/netsim.py) and each volunteer in its
   own home namespace behind its own NAT on a home link, reached only through the expert
   relay: 0 volunteers, 2 strangers on probation (a default deployment's volunteers, their
   batches checked at `MOE_PROBATION_CHECK_SHARE`), 2 trusted hosts; each under both rules.

5. **What sealing costs expert links** (`--seal-only`, issue 32): section 1's remote layer
   (every expert on two workers) over links sealed as agents run them (AES-GCM after the
   handshake) and over the same links in the clear (the workers run from `bench/unsealed.py`),
   T = 1, 16, 64 rows; sealed ÷ clear layer throughput.

Rounds alternate between the sides so machine noise hits both; medians are reported.
Nothing is asserted: the figures go into BENCHMARKS.md.

    .venv/bin/python bench/moe.py [--rounds 20] [--window 10] [--only-saturation | --only-packing]
    sudo .venv/bin/python bench/moe.py --netsim [--rtt-ms 20-80] [--loss 0.5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import netsim  # noqa: E402 - bench/ is on the path as the script's own folder
import torch  # noqa: E402
from unsealed import unsealed  # noqa: E402 - bench/unsealed.py, beside this script

from engine.moe import LocalExperts, moe_ffn  # noqa: E402
from engine.moe_loader import load_moe, make_tiny_moe  # noqa: E402
from mahout.link import Link, new_secret  # noqa: E402
from mahout.moe.coordinator import Coordinator, WorkerSpec  # noqa: E402
from mahout.moe.policy import DispatchPolicy, LoadMonitor, LoadState  # noqa: E402

RULES = {"seed 004": False, "latency-aware": True}  # label: DispatchPolicy.latency_aware
from mahout.moe.worker import SECRET_ENV  # noqa: E402

SECRET = new_secret()  # the layer bench's workers' (the market hands each worker its own)

LAYER_SHAPE = {
    "n_layers": 1,
    "d_model": 2048,
    "n_heads": 16,
    "n_kv_heads": 4,
    "head_dim": 128,
    "n_experts": 16,
    "n_experts_used": 8,
    "expert_ffn_dim": 768,
}
MODEL_SHAPE = {
    "n_layers": 2,
    "d_model": 1024,
    "n_heads": 8,
    "n_kv_heads": 2,
    "head_dim": 128,
    "n_experts": 16,
    "n_experts_used": 4,
    "expert_ffn_dim": 768,
    "context_length": 512,
}
ROWS = (1, 16, 64)
PROMPTS = ["The elephant", "A herd crossed the river", "Load rises at noon", "Experts, remote and local"]


def start_worker(
    model: Path, layer: int, first: int, count: int, *, module: tuple[str, ...] = ("mahout.moe.worker",)
) -> tuple[subprocess.Popen, tuple[str, int]]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            *module,
            "--model",
            str(model),
            "--layer",
            str(layer),
            "--first",
            str(first),
            "--count",
            str(count),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, SECRET_ENV: SECRET},
    )
    assert process.stdout is not None
    host, port = process.stdout.readline().strip().rsplit(" ", 1)[1].split(":")
    return process, (host, int(port))


def under_load(local: LocalExperts, check_share: float = DispatchPolicy.check_share) -> Coordinator:
    """A coordinator that engages every worker attached (seed 004's rule: this section times the
    remote path itself, which the latency-aware rule would skip wherever it loses)."""
    monitor = LoadMonitor(lambda: 0, DispatchPolicy(latency_aware=False, check_share=check_share))
    monitor.state = LoadState(busy=4, under_load=True, last_load_at=time.monotonic() + 3600)
    return Coordinator(local, monitor=monitor)


def time_layer(compute, layer, config, x: torch.Tensor, threads: int = 1) -> float:  # type: ignore[no-untyped-def]
    torch.set_num_threads(threads)
    started = time.perf_counter()
    with torch.inference_mode():
        moe_ffn(x, layer, config, compute)
    elapsed = time.perf_counter() - started
    torch.set_num_threads(1)
    return elapsed


def one_layer(tmp: Path):  # type: ignore[no-untyped-def]
    """Section 1's layer: its file, config, weights and the experts computed here."""
    path = make_tiny_moe(tmp / "layer.gguf", seed=11, **LAYER_SHAPE)
    config, weights = load_moe(path)
    layer = weights.layers[0]
    assert layer.experts is not None
    return path, config, layer, LocalExperts({0: layer.experts})


def bench_layer(tmp: Path, rounds: int) -> None:
    path, config, layer, local = one_layer(tmp)
    workers = [start_worker(path, 0, 0, 8), start_worker(path, 0, 8, 8)]
    remote, split = under_load(local), under_load(local)
    remote.attach(WorkerSpec("a", 0, 0, 8, workers[0][1], secret=SECRET))
    remote.attach(WorkerSpec("b", 0, 8, 8, workers[1][1], secret=SECRET))
    split.attach(WorkerSpec("b", 0, 8, 8, workers[1][1], secret=SECRET))
    sides = {
        "local": (local, 1),
        "local 2 threads": (local, 2),
        "remote (2 workers)": (remote, 1),
        "split (here + 1 worker)": (split, 1),
    }
    print(
        f"\n1. One MoE layer: D={config.d_model}, F={config.expert_ffn_dim}, E={config.n_experts}, "
        f"K={config.n_experts_used}; median ms of {rounds} interleaved rounds (after 5 warm-up calls)"
    )
    print(f"{'T':>4} " + " ".join(f"{name:>24}" for name in sides) + f" {'remote/local':>13} {'split/local':>12}")
    try:
        for t in ROWS:
            x = torch.randn(t, config.d_model, generator=torch.Generator().manual_seed(t))  # (T, D)
            for compute, threads in sides.values():
                for _ in range(5):
                    time_layer(compute, layer, config, x, threads)
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(rounds):
                for name, (compute, threads) in sides.items():
                    times[name].append(time_layer(compute, layer, config, x, threads))
            ms = {name: statistics.median(values) * 1000 for name, values in times.items()}
            print(
                f"{t:>4} "
                + " ".join(f"{ms[name]:>24.2f}" for name in sides)
                + (
                    f" {ms['remote (2 workers)'] / ms['local']:>13.2f} "
                    f"{ms['split (here + 1 worker)'] / ms['local']:>12.2f}"
                )
            )
        print(f"     dispatch stats: remote {remote.stats}, split {split.stats}")
    finally:
        remote.close()
        split.close()
        for process, _ in workers:
            process.kill()
            process.wait()


def bench_seal(tmp: Path, rounds: int) -> None:
    """5.: section 1's remote layer over sealed links and over links in the clear, alternated."""
    path, config, layer, local = one_layer(tmp)
    clear_module = ("bench.unsealed", "mahout.moe.worker")
    sealed_workers = [start_worker(path, 0, 0, 8), start_worker(path, 0, 8, 8)]
    clear_workers = [start_worker(path, 0, 0, 8, module=clear_module), start_worker(path, 0, 8, 8, module=clear_module)]
    clear_ports = {address[1] for _, address in clear_workers}
    admitted = {"sealed": 0, "clear": 0}  # the coordinator's ends of the links, as they were opened

    def clear_worker(link: Link) -> bool:
        clear = link.sock.getpeername()[1] in clear_ports
        admitted["clear" if clear else "sealed"] += 1
        return clear

    with unsealed(clear_worker):  # the coordinator's links to the clear workers
        # No batch recomputed here (check share 0): a check's local compute would land in one side's round.
        sides = {"sealed": under_load(local, check_share=0.0), "clear": under_load(local, check_share=0.0)}
        for (name, coordinator), workers in zip(sides.items(), (sealed_workers, clear_workers), strict=True):
            coordinator.attach(WorkerSpec(f"{name}-a", 0, 0, 8, workers[0][1], secret=SECRET))
            coordinator.attach(WorkerSpec(f"{name}-b", 0, 8, 8, workers[1][1], secret=SECRET))
        print(
            f"\n5. Sealing on expert links: section 1's layer with every expert on 2 workers, links sealed "
            "(as agents run) and in the clear (workers from "
            f"bench/unsealed.py); median ms of {rounds} alternated rounds"
        )
        print(f"{'T':>4} {'frame KB':>9} {'sealed ms':>10} {'clear ms':>9} {'sealed / clear throughput':>26}")
        try:
            for t in ROWS:
                x = torch.randn(t, config.d_model, generator=torch.Generator().manual_seed(t))  # (T, D)
                for compute in sides.values():
                    for _ in range(5):
                        time_layer(compute, layer, config, x)
                times: dict[str, list[float]] = {name: [] for name in sides}
                for i in range(rounds):
                    for name in sides if i % 2 == 0 else reversed(sides):
                        times[name].append(time_layer(sides[name], layer, config, x))
                ms = {name: statistics.median(values) * 1000 for name, values in times.items()}
                frame_kb = t * config.n_experts_used // 2 * config.d_model * 4 / 1024  # rows a worker gets, float32
                print(
                    f"{t:>4} {frame_kb:>9.0f} {ms['sealed']:>10.2f} "
                    f"{ms['clear']:>9.2f} {ms['clear'] / ms['sealed']:>26.3f}"
                )
            print(
                f"     links opened: {admitted}; dispatch stats (no fallbacks: every batch went remote as "
                f"timed): " + "; ".join(f"{name} {coordinator.stats}" for name, coordinator in sides.items())
            )
        finally:
            for coordinator in sides.values():
                coordinator.close()
            for process, _ in sealed_workers + clear_workers:
                process.kill()
                process.wait()


# --- 2. saturation through the control plane ---------------------------------------------


def setup_gateway(tmp: Path, address: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    os.environ.update(
        {
            "ALLOWED_HOSTS": f"127.0.0.1,localhost,{address}",
            "SQLITE_PATH": str(tmp / "bench.sqlite3"),
            "ELEPHANT_VAR_DIR": str(tmp / "var"),
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "MOE_COORDINATOR_STALE_SECONDS": "5",
            "MOE_WORKER_STALE_SECONDS": "5",
            "MOE_COOLDOWN_SECONDS": "5",
            "MOE_ALLOW_PRIVATE_WORKERS": "1",
            # each round times the rule it names with its volunteers serving: a coordinator that
            # only probes them must keep them (a deployment releases them: README, control plane)
            "MOE_UNUSED_GRACE_SECONDS": "3600",
        }
    )
    os.environ.pop("DATABASE_URL", None)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from testkit.stack import free_port, wait_until

    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", address, "-p", str(port), "config.asgi:application"],
        cwd=ROOT,
        env=dict(os.environ),
        stdout=(tmp / "gateway.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://{address}:{port}"
    import httpx

    def up() -> bool:
        try:
            return httpx.get(f"{url}/v1/models", timeout=1).status_code in (200, 401)
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=60, what="the gateway")
    return gateway, url


class Load:
    """`n` requests in flight on the runner, each generating again as soon as it ends."""

    def __init__(self, runner, n: int, tokens: int = 32) -> None:  # type: ignore[no-untyped-def]
        self.runner, self.tokens = runner, tokens
        self.stamps: list[float] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(PROMPTS[i % len(PROMPTS)],), daemon=True) for i in range(n)
        ]

    def _run(self, prompt: str) -> None:
        ids = self.runner.tokenizer.encode(prompt)
        while not self.stop.is_set():
            for _ in self.runner.generate_stream(ids, self.tokens):
                self.stamps.append(time.monotonic())

    def start(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def tps(self, since: float, until: float) -> float:
        return sum(1 for t in list(self.stamps) if since <= t < until) / (until - since)

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def saturation_round(
    path: Path,
    url: str,
    volunteers: int,
    window: float,
    tmp: Path,
    *,
    concurrency: int = 4,
    pack: bool = True,
    homes: bool = False,
    probation: bool = False,
    latency_aware: bool = True,
) -> tuple[float, float | None, float]:
    """(tokens/s once every volunteer serves, seconds from the load starting to the first remote batch,
    share of routed experts computed remotely in the window). `homes`: volunteer i runs in netsim's
    home i + 1 (behind NAT); `probation`: strangers, not trusted hosts; `latency_aware`: the dispatch rule."""
    from django.utils import timezone

    from hosts.models import Host
    from mahout.moe.control import CoordinatorAgent, MeshClient
    from mahout.moe.runner import MoeRunner
    from mesh.experts.models import ExpertModel
    from mesh.experts.services import moe_model_publish
    from testkit.personas import make_host
    from testkit.stack import wait_until

    def volunteer_token(name: str) -> str:  # a trusted host's workers are checked at 5%, a stranger's on probation
        host = make_host(qualified=False, name=name)
        if not probation:
            Host.objects.filter(pk=host.host.pk).update(trusted_at=timezone.now())
        return host.token

    def at_home(i: int) -> list[str]:
        return ["ip", "netns", "exec", netsim.home_ns(i + 1)] if homes else []

    name = f"bench-moe-{volunteers}-{time.time_ns()}"
    coordinator = make_host(qualified=False, name=f"coordinator-{name}")
    moe_model_publish(name=name, gguf_path=path, slice_size=8, base_target=0, boost=1, coordinator=coordinator.host)
    runner = MoeRunner(path, n_slots=4, pack=pack, policy=DispatchPolicy(latency_aware=latency_aware)).start()
    client = MeshClient(url, coordinator.token)
    agent = CoordinatorAgent(runner, client, name).start()
    processes = [
        subprocess.Popen(
            [
                *at_home(i),
                sys.executable,
                "-m",
                "mahout",
                "moe",
                "volunteer",
                "--server",
                url,
                "--token",
                volunteer_token(f"v{i}-{name}"),
                "--max-slices",
                "1",
                "--no-idle-detect",
                "--home",
                str(tmp / f"home-{i}"),
            ],
            cwd=ROOT,
            stdout=(tmp / f"volunteer-{name}-{i}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(volunteers)
    ]
    load = None
    try:
        wait_until(lambda: agent.reports >= 1, timeout=30, what="a first coordinator report")
        load = Load(runner, concurrency).start()
        began = time.monotonic()
        first_remote = None
        if volunteers and concurrency >= runner.policy.saturation_threshold:  # below it the coordinator recruits nobody

            def serving() -> bool:
                proven = [w for w in list(runner.coordinator.workers.values()) if w.last_serve_ms > 0]
                return len(proven) >= volunteers

            wait_until(serving, timeout=120, what=f"{volunteers} volunteers serving", interval=0.05)
            assert runner.coordinator.stats.first_remote_at is not None
            first_remote = runner.coordinator.stats.first_remote_at - began
        time.sleep(2.0)  # settle
        stats = runner.coordinator.stats
        start, remote, local = time.monotonic(), stats.remote_experts, stats.local_experts
        time.sleep(window)
        tps = load.tps(start, time.monotonic())
        remote, local = stats.remote_experts - remote, stats.local_experts - local
        return tps, first_remote, remote / max(remote + local, 1)
    finally:
        if load is not None:
            load.end()
        agent.stop()
        runner.close()
        client.close()
        for process in processes:
            process.kill()
            process.wait()
        ExpertModel.objects.filter(name=name).delete()  # its slices must not be scarce for the next round


def bench_saturation(tmp: Path, window: float) -> None:
    path = make_tiny_moe(tmp / "model.gguf", seed=12, **MODEL_SHAPE)
    gateway, url = setup_gateway(tmp)
    print(
        "\n2. Throughput under saturation (4 requests in flight, 32 tokens each, greedy), "
        f"{window:.0f} s window once every volunteer serves; model {MODEL_SHAPE}"
    )
    print_header("volunteers")
    try:
        baseline = None
        for label, volunteers in (("0", 0), ("1", 1), ("2", 2), ("4", 4), ("0 (again, noise)", 0)):
            for rule, latency_aware in RULES.items() if volunteers else [("-", True)]:
                tps, first, remote = saturation_round(path, url, volunteers, window, tmp, latency_aware=latency_aware)
                baseline = baseline or tps
                print_row(label, rule, tps, baseline, first, remote)
    finally:
        gateway.terminate()
        gateway.wait(timeout=10)


def print_header(first: str) -> None:
    print(
        f"{first:>22} {'rule':>14} {'tokens/s':>9} {'vs 0':>6} "
        f"{'load -> first remote dispatch':>30} {'remote experts':>15}"
    )


def print_row(label: str, rule: str, tps: float, baseline: float, first: float | None, remote: float) -> None:
    first_text = "-" if first is None else f"{first:.2f} s"
    print(f"{label:>22} {rule:>14} {tps:>9.1f} {tps / baseline:>6.2f} {first_text:>30} {remote:>15.0%}", flush=True)


def bench_netsim(tmp: Path, window: float, rtt: str, loss: float) -> None:
    """Section 2 with every volunteer behind its own NAT, reached only through the relay."""
    low, _, high = rtt.partition("-")
    homes = netsim.up(2, (float(low), float(high or low)), 5.0, loss, seed=7)
    path = make_tiny_moe(tmp / "model.gguf", seed=12, **MODEL_SHAPE)
    gateway = None
    try:
        gateway, url = setup_gateway(tmp, netsim.GATEWAY_IP)
        print(
            f"\n4. Volunteers behind NAT (homes' RTT {sorted(h['rtt_ms'] for h in homes)} ms, {loss}% loss, link "
            f"{homes[0]['link']}): 4 requests in flight, {window:.0f} s window once every volunteer serves"
        )
        print_header("volunteers")
        baseline = None
        for label, count, probation in (
            ("none", 0, False),
            ("2 on probation", 2, True),
            ("2 trusted", 2, False),
            ("none (again, noise)", 0, False),
        ):
            for rule, latency_aware in RULES.items() if count else [("-", True)]:
                tps, first, remote = saturation_round(
                    path, url, count, window, tmp, homes=True, probation=probation, latency_aware=latency_aware
                )
                baseline = baseline or tps
                print_row(label, rule, tps, baseline, first, remote)
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=10)
        netsim.down()


def bench_packing(tmp: Path, window: float) -> None:
    """Decode steps packed across requests (`MoeRunner(pack=True)`) against one request's
    step per pass (`pack=False`, the baseline), at 1, 2 and 4 requests in flight, with no
    volunteer and with 2 (recruited only under load: 2 or more requests in flight)."""
    path = make_tiny_moe(tmp / "model-packing.gguf", seed=12, **MODEL_SHAPE)
    gateway, url = setup_gateway(tmp)
    print(
        f"\n3. Packed decode steps: tokens/s, {window:.0f} s window, 32 tokens per request, greedy; model {MODEL_SHAPE}"
    )
    print(f"{'volunteers':>10} {'in flight':>9} {'one row/pass':>13} {'packed':>8} {'packed ÷ one':>13}")
    try:
        for volunteers in (0, 2):
            for concurrency in (1, 2, 4):
                one, _, _ = saturation_round(path, url, volunteers, window, tmp, concurrency=concurrency, pack=False)
                packed, _, _ = saturation_round(path, url, volunteers, window, tmp, concurrency=concurrency, pack=True)
                print(
                    f"{volunteers:>10} {concurrency:>9} {one:>13.1f} {packed:>8.1f} {packed / one:>13.2f}", flush=True
                )
    finally:
        gateway.terminate()
        gateway.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--only-packing", action="store_true", help="run only section 3 (packed decode steps)")
    parser.add_argument(
        "--only-saturation", action="store_true", help="run only section 2 (throughput, both dispatch rules)"
    )
    parser.add_argument("--netsim", action="store_true", help="run only section 4: volunteers behind NAT (Linux, root)")
    parser.add_argument("--seal-only", action="store_true", help="run only section 5: what sealing costs expert links")
    parser.add_argument(
        "--rtt-ms", default="20-80", help="with --netsim: each home's round trip, drawn from this range"
    )
    parser.add_argument("--loss", type=float, default=0.5, help="with --netsim: percent lost, each direction")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {Path('/proc/loadavg').read_text().strip()}")
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as scratch:
        tmp = Path(scratch)
        if args.seal_only:
            bench_seal(tmp, args.rounds)
        elif args.netsim:
            bench_netsim(tmp, args.window, args.rtt_ms, args.loss)
        elif args.only_saturation:
            bench_saturation(tmp, args.window)
        else:
            if not args.only_packing:
                bench_layer(tmp, args.rounds)
                bench_saturation(tmp, args.window)
            bench_packing(tmp, args.window)
    print(f"\nload average at end: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
