"""The host side of the expert market, all pulled outward so NATed machines take part.

* `MeshClient`: the `/api/` calls (every one with a timeout; a failed call raises
  `MeshUnavailable` and the loops simply try again on their next tick).
* `CoordinatorAgent`: every `interval_s` reports the coordinator's busy slots (the load
  monitor's latest snapshot: the report never waits on a probe), its workers'
  `last_serve_ms` and passed checks, the workers it blamed (a recomputed batch
  disagreed: the control plane retires them, so no coordinator uses them again), and how
  many experts since the last report it engaged measured workers for and how many it only
  probed them with (a saturated coordinator that only probes gets no boost: more volunteers
  like its own would sit idle), and makes
  the dispatch map the control plane answers with its own (with each worker's check share:
  a volunteer on probation is checked more often). A blame is sent on every report until
  the map drops the worker.
* `Volunteer`: an idle node asks for a slice, downloads only that slice, serves it,
  registers where it can be reached, heartbeats, and stops when told to retire. A host that
  is not trusted is handed one too, on probation (its coordinator recomputes more of its
  batches). Its worker's secret comes with the slice: its server admits only the
  coordinator, which the gateway hands the same secret in the dispatch map. While its owner
  wants the machine (`mahout.owner`) it asks for nothing; when the owner comes back
  mid-slice its server refuses batches at once (the coordinator computes them itself) and
  it leaves within a second: it tells the control plane it is leaving (`MeshClient.leave`),
  so the slice is handed to another volunteer at once, and closes the slice. It says so
  whenever it stops serving a slice it was not told to retire from.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from engine.moe_loader import load_expert_slice
from mahout.link import Heartbeat
from mahout.moe.coordinator import TcpTransport, Transport, WorkerSpec
from mahout.moe.relay import RelayTransport, RelayWorkerLink
from mahout.moe.runner import MoeRunner
from mahout.moe.worker import ExpertServer, worker_caps
from mahout.owner import OwnerGuard, OwnerWatch
from protocol.timing import MOE_COORDINATOR_REPORT_SECONDS, MOE_WORKER_HEARTBEAT_SECONDS

if TYPE_CHECKING:
    import torch

__all__ = ["CoordinatorAgent", "MeshClient", "MeshRefused", "MeshUnavailable", "Volunteer"]


class MeshUnavailable(Exception):
    """The control plane could not be reached or refused the call."""


class MeshRefused(MeshUnavailable):
    """The control plane answered with a 4xx error (its message says why)."""


class MeshClient:
    def __init__(
        self, server: str, token: str, *, timeout: float = 10.0, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.server, self.token = server, token
        self._client = httpx.Client(
            base_url=server.rstrip("/") + "/api",
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )

    def _call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            response = self._client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise MeshUnavailable(f"{method} {path}: {exc}") from exc
        if 400 <= response.status_code < 500:
            raise MeshRefused(f"{method} {path}: HTTP {response.status_code}: {_error_message(response)}")
        if response.status_code >= 500:
            raise MeshUnavailable(f"{method} {path}: HTTP {response.status_code} {response.text[:200]}")
        return response

    def volunteer(self) -> dict | None:
        response = self._call("POST", "/expert-volunteer")
        return None if response.status_code == 204 else response.json()

    def download_slice(self, worker_id: int, dest: Path) -> Path:
        """The worker's slice file, written to `dest` (its folder made: `--workdir` may name a new one)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._client.stream("GET", f"/expert-workers/{worker_id}/slice") as response:
                if response.status_code != 200:
                    raise MeshUnavailable(f"slice {worker_id}: HTTP {response.status_code}")
                with dest.open("wb") as out:
                    for chunk in response.iter_bytes():
                        out.write(chunk)
        except httpx.HTTPError as exc:
            dest.unlink(missing_ok=True)  # no half a file left behind
            raise MeshUnavailable(f"slice {worker_id}: {exc}") from exc
        return dest

    def register(self, worker_id: int, address: str) -> dict:
        return self._call("POST", f"/expert-workers/{worker_id}/register", {"address": address}).json()

    def leave(self, worker_id: int, reason: str = "") -> bool:
        """Say this worker is leaving; False when the control plane had already retired it."""
        return bool(self._call("POST", f"/expert-workers/{worker_id}/leave", {"reason": reason[:150]}).json()["left"])

    def heartbeat(self, worker_id: int) -> bool:
        """True when the control plane says this worker must retire."""
        return bool(self._call("POST", f"/expert-workers/{worker_id}/heartbeat").json()["retire"])

    def coordinator_report(
        self,
        model: str,
        busy: int,
        workers: list[dict],
        blamed: list[dict] | None = None,
        usage: dict[str, int] | None = None,
    ) -> dict:
        """`usage`: experts engaged and only probed since the last report (`engaged_experts`, `probed_experts`)."""
        body = {"model": model, "busy": busy, "workers": workers, "blamed": blamed or [], **(usage or {})}
        return self._call("POST", "/moe/coordinator-report", body).json()

    def recruitment(self) -> list[dict]:
        return self._call("GET", "/moe/recruitment").json()["models"]

    def demand(self) -> dict[str, Any]:
        return self._call("GET", "/expert-demand").json()

    def close(self) -> None:
        self._client.close()


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _spec(entry: dict) -> WorkerSpec:
    """A dispatch-map entry: dialled directly when it has an address, else through the relay."""
    address = None
    if entry.get("address"):
        host, port = entry["address"].rsplit(":", 1)
        address = (host.strip("[]"), int(port))
    share = entry.get("check_share")
    return WorkerSpec(
        str(entry["id"]),
        entry["layer"],
        entry["first"],
        entry["count"],
        address,
        secret=str(entry.get("secret") or ""),
        check_share=None if share is None else float(share),
    )


BLAME_REASON_MAX = 500  # what the control plane keeps of a blame's reason


class CoordinatorAgent:
    def __init__(
        self, runner: MoeRunner, client: MeshClient, model: str, *, interval_s: float = MOE_COORDINATOR_REPORT_SECONDS
    ) -> None:
        self.runner, self.client, self.model, self.interval_s = runner, client, model, interval_s
        runner.coordinator.transport_for = self.transport_for
        self._heartbeat = Heartbeat(self.tick, interval_s, name="moe-coordinator-agent")
        self.reports = 0
        self._reported = (0, 0)  # the coordinator's (engaged, probed) experts at the last report that went through

    def transport_for(self, spec: WorkerSpec) -> Transport:
        """Direct TCP where the worker gave an address, else the gateway's relay."""
        if spec.address is not None:
            return TcpTransport(spec.address, spec.secret)
        return RelayTransport(self.client.server, self.client.token, int(spec.key), spec.secret)

    def tick(self) -> dict | None:
        coordinator = self.runner.coordinator
        known = [w for w in list(coordinator.workers.values()) if w.key.isdigit()]
        workers = [
            {"id": int(w.key), "last_serve_ms": w.last_serve_ms, "checks_passed": w.checks_passed}
            for w in known
            if w.last_serve_ms > 0
        ]
        blamed = [{"id": int(w.key), "reason": w.blamed[:BLAME_REASON_MAX]} for w in known if w.blamed]
        counts = (coordinator.stats.engaged_experts, coordinator.stats.probes)
        usage = {"engaged_experts": counts[0] - self._reported[0], "probed_experts": counts[1] - self._reported[1]}
        try:
            answer = self.client.coordinator_report(self.model, self.runner.monitor.state.busy, workers, blamed, usage)
        except MeshUnavailable:
            return None
        self._reported = counts
        coordinator.sync(map(_spec, answer["dispatch_map"]))
        self.reports += 1
        return answer

    def start(self) -> CoordinatorAgent:
        self._heartbeat.start()
        return self

    def stop(self) -> None:
        self._heartbeat.stop(timeout=self.interval_s + 15)


class Volunteer:
    """One slice at a time: ask, download, serve, register, heartbeat until retired."""

    def __init__(
        self,
        client: MeshClient,
        workdir: Path,
        *,
        host: str = "127.0.0.1",
        advertise: str | None = None,
        relay: bool = True,
        poll_s: float = 1.0,
        heartbeat_s: float = MOE_WORKER_HEARTBEAT_SECONDS,
        out: Callable[[str], None] = print,
        device: torch.device | None = None,
        owner: OwnerGuard | None = None,
    ) -> None:
        self.client, self.workdir, self.host, self.advertise = client, workdir, host, advertise or host
        self.device = device  # a torch device for the experts (None: the CPU)
        self.relay = relay
        self.poll_s, self.heartbeat_s, self.out = poll_s, heartbeat_s, out
        self.owner = owner  # None: a dedicated machine, always free
        self._stop = threading.Event()
        self._leave_now = threading.Event()  # the slice being served: set to leave it at once
        self._paused_said: str | None = None

    def serve_one(self) -> bool:
        """Serve one slice until retired, the owner wants the machine or `stop()`; False when
        nothing was wanted (or the slice could not be registered)."""
        slice_ = self._ask()
        if slice_ is None:
            return False
        worker_id = slice_["worker"]
        try:
            path = self.client.download_slice(worker_id, self.workdir / f"slice-{worker_id}.gguf")
        except MeshUnavailable as exc:  # a slow or broken download: give the slice back, ask again at the next poll
            self.out(f"mahout moe: could not download slice {worker_id} ({exc}); giving it back")
            self._say_leaving(worker_id, f"download failed: {exc}")
            return False
        config, bank = load_expert_slice(path, slice_["layer"], slice_["first"], slice_["count"])
        if self.device is not None and getattr(self.device, "type", "cpu") != "cpu":
            bank.to_device(self.device)
        caps = worker_caps(d_model=config.d_model, count=slice_["count"], context_length=config.context_length)
        leave = self._leave_now = (
            threading.Event()
        )  # set by the owner's return or stop(): leave now, not at a heartbeat
        if self._stop.is_set():
            leave.set()
        watch = (
            OwnerWatch(
                self.owner, lambda reason: leave.set() if reason else None, poll_s=min(1.0, self.heartbeat_s)
            ).start()
            if self.owner is not None
            else None
        )
        away = (lambda: watch.reason) if watch is not None else None
        server = ExpertServer(bank, secret=slice_["secret"], caps=caps, host=self.host, refusal=away).start()
        link = (
            RelayWorkerLink(self.client.server, self.client.token, worker_id, server, out=self.out)
            if self.relay
            else None
        )
        why: str | None = "it could not register"
        try:
            if link is not None:  # connect outward first: the coordinator may dial as soon as we register
                link.start().connected.wait(self.heartbeat_s * 5)
            try:
                self.client.register(worker_id, "" if link else f"{self.advertise}:{server.address[1]}")
            except MeshUnavailable as exc:  # e.g. an address the gateway will not hand a coordinator
                self.out(f"mahout moe: could not register worker {worker_id}: {exc}")
                return False
            where = "through the relay" if link else f"on port {server.address[1]}"
            self.out(
                f"mahout moe: serving {slice_['model']} layer {slice_['layer']} experts "
                f"[{slice_['first']}, {slice_['first'] + slice_['count']}) {where}"
            )
            why = self._serve_until_done(worker_id, server, watch, leave)
        finally:
            if why is not None:
                self._say_leaving(worker_id, why)
            if watch is not None:
                watch.stop()
            if link is not None:
                link.stop()
            server.close()
            path.unlink(missing_ok=True)
        return True

    def _ask(self) -> dict | None:
        """A slice from the control plane, or None (nothing wanted, refused, unreachable)."""
        try:
            return self.client.volunteer()
        except MeshRefused as exc:  # e.g. paused or in maintenance: asked again on the next poll
            self.out(f"mahout moe: the gateway refused: {exc}")
        except MeshUnavailable as exc:
            self.out(f"mahout moe: control plane unavailable: {exc}")
        return None

    def _serve_until_done(
        self, worker_id: int, server: ExpertServer, watch: OwnerWatch | None, leave: threading.Event
    ) -> str | None:
        """Heartbeat until the control plane retires the worker (None) or `leave` is set: then
        the reason to tell the control plane (the owner came back, or this volunteer stops)."""
        while not leave.wait(self.heartbeat_s):
            try:
                if self.client.heartbeat(worker_id):
                    self.out(f"mahout moe: worker {worker_id} retired after {server.served} batches")
                    return None
            except MeshUnavailable as exc:
                self.out(f"mahout moe: heartbeat failed: {exc}")
        if watch is not None and watch.reason:
            self.out(f"mahout moe: paused ({watch.reason}): leaving worker {worker_id} after {server.served} batches")
            return f"the owner wants the machine ({watch.reason})"
        return "the volunteer is stopping"

    def _say_leaving(self, worker_id: int, why: str) -> None:
        """Tell the control plane this worker leaves, so its slice is handed out again now;
        if it cannot be told, the worker ages out after its heartbeat goes stale."""
        try:
            self.client.leave(worker_id, why)
        except MeshUnavailable as exc:
            self.out(f"mahout moe: could not say worker {worker_id} is leaving ({exc}); it ages out instead")

    def run(self, *, max_slices: int | None = None) -> int:
        served = 0
        while not self._stop.is_set() and (max_slices is None or served < max_slices):
            if not self._owner_away() and self.serve_one():
                served += 1
            else:
                self._stop.wait(self.poll_s)
        return served

    def _owner_away(self) -> bool:
        """Ask the owner guard before volunteering; a line when the answer changes."""
        reason = self.owner.reason() if self.owner is not None else None
        if reason != self._paused_said:
            self.out(
                f"mahout moe: paused ({reason}): asking for no slice" if reason else "mahout moe: resumed: volunteering"
            )
            self._paused_said = reason
        return reason is not None

    def stop(self) -> None:
        self._stop.set()
        self._leave_now.set()
