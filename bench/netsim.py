"""A simulated internet of home routers on one machine (Linux, root): the gateway on a public
bridge, each host in its own network namespace behind its own NAT, over a home link with
latency, jitter and loss.

    sudo .venv/bin/python bench/netsim.py up --homes 10 [--rtt-ms 20-80] [--jitter-ms 5] [--loss 0.5]
    sudo .venv/bin/python bench/netsim.py down

For home i (1..N):

    [ns eh-home-i]  10.77.i.2  ──veth──  10.77.i.1  [ns eh-router-i]  10.76.0.(i+10) ──veth──
        bridge eh-wan (10.76.0.1, this machine)

- The router masquerades the home's traffic to the bridge and forwards only connections the
  home opened (conntrack ESTABLISHED,RELATED); nothing from the bridge reaches a home: a host
  there can dial out, as behind a real home router, and cannot be dialled.
- The home link's latency, jitter and loss: `tc netem` where the kernel has it; where it does
  not (this project's VMs: "Specified qdisc kind is unknown"), every TCP connection a home
  opens is redirected to a relay in its router (`relay`, iptables REDIRECT + SO_ORIGINAL_DST)
  that dials the destination itself (the NAT), waits one round trip before the first byte,
  delivers each piece of data half a round trip (± jitter) later in each direction, in order,
  and charges a lost segment (each 1,448 bytes lost with --loss %) the stall TCP pays to
  retransmit it: max(200 ms, 2 × RTT). Other protocols are forwarded unshaped. All our
  traffic (HTTP, the hosts' WebSocket) is TCP.
- The gateway listens on 10.76.0.1 (this machine's end of the bridge); customers call it from
  here, hosts from their homes (`ip netns exec eh-home-i …`). `bench/chaos.py --netsim N` does.

Every address is private and on this machine only; `down` removes every namespace, link and
rule `up` made (they are all named `eh-…`). Printed: one line per home with its RTT.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

WAN = "eh-wan"
GATEWAY_IP = "10.76.0.1"
RELAY_PORT = 7070
RELAYS = Path("/run/eh-netsim-relays")  # the relays' pids, for `down`
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
SEGMENT = 1448
MIN_RTO = 0.2  # Linux's floor on a retransmission timeout


def has_netem() -> bool:
    probe = subprocess.run("tc qdisc add dev lo root netem delay 1ms", shell=True, capture_output=True)
    if probe.returncode == 0:
        subprocess.run("tc qdisc del dev lo root", shell=True, capture_output=True)
    return probe.returncode == 0


def home_ns(i: int) -> str:
    return f"eh-home-{i}"


def router_ns(i: int) -> str:
    return f"eh-router-{i}"


def sh(*commands: str, check: bool = True) -> None:
    for command in commands:
        done = subprocess.run(command, shell=True, capture_output=True, text=True)
        if check and done.returncode != 0:
            raise SystemExit(f"netsim: `{command}` failed: {done.stderr.strip()}")


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith("eh-")]


def down() -> None:
    if RELAYS.exists():
        for pid in RELAYS.read_text().split():
            try:
                os.kill(int(pid), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
        RELAYS.unlink()
    for ns in namespaces():
        sh(f"ip netns del {ns}", check=False)
    sh(f"ip link del {WAN}", check=False)
    sh(f"iptables -D FORWARD -i {WAN} -o {WAN} -j ACCEPT", check=False)


def up(homes: int, rtt: tuple[float, float], jitter: float, loss: float, seed: int) -> list[dict]:
    down()
    rng, netem = random.Random(seed), has_netem()
    relays: list[int] = []
    sh(
        f"ip link add {WAN} type bridge",
        f"ip addr add {GATEWAY_IP}/24 dev {WAN}",
        f"ip link set {WAN} up",
        "sysctl -qw net.ipv4.ip_forward=1",
        f"iptables -I FORWARD -i {WAN} -o {WAN} -j ACCEPT",
    )
    made = []
    for i in range(1, homes + 1):
        home, router = home_ns(i), router_ns(i)
        wan_ip, lan = f"10.76.0.{i + 10}", f"10.77.{i}"
        one_way = rng.uniform(*rtt) / 2
        sh(
            f"ip netns add {home}",
            f"ip netns add {router}",
            # the router's uplink to the bridge
            f"ip link add eh-u{i} type veth peer name eh-w{i}",
            f"ip link set eh-u{i} netns {router}",
            f"ip link set eh-w{i} master {WAN}",
            f"ip link set eh-w{i} up",
            f"ip -n {router} addr add {wan_ip}/24 dev eh-u{i}",
            f"ip -n {router} link set eh-u{i} up",
            f"ip -n {router} link set lo up",
            # the home's LAN
            f"ip link add eh-l{i} type veth peer name eh-h{i}",
            f"ip link set eh-l{i} netns {router}",
            f"ip link set eh-h{i} netns {home}",
            f"ip -n {router} addr add {lan}.1/24 dev eh-l{i}",
            f"ip -n {router} link set eh-l{i} up",
            f"ip -n {home} addr add {lan}.2/24 dev eh-h{i}",
            f"ip -n {home} link set eh-h{i} up",
            f"ip -n {home} link set lo up",
            f"ip -n {home} route add default via {lan}.1",
            # NAT: out is masqueraded, in only what the home opened
            f"ip netns exec {router} sysctl -qw net.ipv4.ip_forward=1",
            f"ip netns exec {router} iptables -t nat -A POSTROUTING -o eh-u{i} -j MASQUERADE",
            f"ip netns exec {router} iptables -P FORWARD DROP",
            f"ip netns exec {router} iptables -A FORWARD -i eh-l{i} -o eh-u{i} -j ACCEPT",
            (
                f"ip netns exec {router} iptables -A FORWARD -i eh-u{i} -o "
                f"eh-l{i} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"
            ),
        )
        if netem:  # the home link: half the round trip each way, jitter and loss on both
            sh(
                (
                    f"ip netns exec {router} tc qdisc add dev eh-u{i} root "
                    f"netem delay {one_way:.1f}ms {jitter:g}ms loss {loss:g}%"
                ),
                (
                    f"ip netns exec {router} tc qdisc add dev eh-l{i} root "
                    f"netem delay {one_way:.1f}ms {jitter:g}ms loss {loss:g}%"
                ),
            )
        else:
            sh(
                f"ip netns exec {router} iptables -t nat -A PREROUTING "
                f"-i eh-l{i} -p tcp -j REDIRECT --to-ports {RELAY_PORT}"
            )
            relays.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        router,
                        sys.executable,
                        __file__,
                        "relay",
                        "--one-way-ms",
                        f"{one_way:.1f}",
                        "--jitter-ms",
                        str(jitter),
                        "--loss",
                        str(loss),
                        "--seed",
                        str(seed + i),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                ).pid
            )
        made.append(
            {
                "home": home,
                "router": router,
                "wan_ip": wan_ip,
                "rtt_ms": round(2 * one_way, 1),
                "link": "netem" if netem else "relay",
            }
        )
    if relays:
        RELAYS.write_text(" ".join(map(str, relays)))
    return made


class Link:
    """One direction of a relayed connection: each piece read is written half a round trip
    (± jitter) later, never before the piece read before it, plus a retransmission stall for
    each segment lost."""

    def __init__(self, one_way: float, jitter: float, loss: float, rng: random.Random) -> None:
        self.one_way, self.jitter, self.loss, self.rng = one_way, jitter, loss, rng
        self.rto = max(MIN_RTO, 4 * one_way)

    async def carry(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await queue.get()
                await asyncio.sleep(max(0.0, at - loop.time()))
                if data is None:
                    break
                sink.write(data)
                await sink.drain()
            sink.close()

        delivery = asyncio.create_task(deliver())
        last = loop.time()
        try:
            while data := await source.read(65536):
                at = loop.time() + max(0.0, self.one_way + self.rng.uniform(-self.jitter, self.jitter))
                segments = -(-len(data) // SEGMENT)
                at += self.rto * sum(self.rng.random() < self.loss for _ in range(segments))
                last = max(last, at)
                queue.put_nowait((last, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((max(last, loop.time() + self.one_way), None))
        try:
            await delivery
        except (ConnectionError, OSError):
            pass


async def relay(port: int, one_way: float, jitter: float, loss: float, seed: int) -> None:
    rng = random.Random(seed)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw = writer.get_extra_info("socket").getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        dport, dip = struct.unpack("!2xH4s8x", raw)
        await asyncio.sleep(2 * one_way)  # the handshake's round trip
        try:
            up_reader, up_writer = await asyncio.open_connection(socket.inet_ntoa(dip), dport)
        except OSError:
            writer.close()
            return
        link = (Link(one_way, jitter, loss, rng), Link(one_way, jitter, loss, rng))
        await asyncio.gather(link[0].carry(reader, up_writer), link[1].carry(up_reader, writer))

    server = await asyncio.start_server(connection, "0.0.0.0", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up")
    start.add_argument("--homes", type=int, default=10)
    start.add_argument("--rtt-ms", default="20-80", help="round trip per home, drawn from this range")
    start.add_argument("--jitter-ms", type=float, default=5.0)
    start.add_argument("--loss", type=float, default=0.5, help="percent, each direction")
    start.add_argument("--seed", type=int, default=7)
    sub.add_parser("down")
    link = sub.add_parser("relay", help="(run by `up` in each router) the home link's relay")
    link.add_argument("--one-way-ms", type=float, required=True)
    link.add_argument("--jitter-ms", type=float, default=0.0)
    link.add_argument("--loss", type=float, default=0.0)
    link.add_argument("--seed", type=int, default=0)
    link.add_argument("--port", type=int, default=RELAY_PORT)
    args = parser.parse_args()
    if args.command == "relay":
        asyncio.run(relay(args.port, args.one_way_ms / 1000, args.jitter_ms / 1000, args.loss / 100, args.seed))
        return
    if args.command == "down":
        down()
        print("netsim: down")
        return
    low, _, high = args.rtt_ms.partition("-")
    try:
        rtt = (float(low), float(high or low))
    except ValueError:
        sys.exit(f"netsim: --rtt-ms wants LOW-HIGH in milliseconds, not {args.rtt_ms!r}")
    for home in up(args.homes, rtt, args.jitter_ms, args.loss, args.seed):
        print(f"{home['home']}: behind {home['router']} ({home['wan_ip']}), RTT {home['rtt_ms']} ms ({home['link']})")
    print(f"netsim: gateway address {GATEWAY_IP}")


if __name__ == "__main__":
    main()
