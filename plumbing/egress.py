"""An internal Docker network whose only way out is an egress container (the local stand-in for VPC endpoints).

    task ──(internal network)──> egress container ──(default bridge)──> allowed endpoint
                                  one TCP relay per allowed endpoint

* The network is `internal`: Docker gives it no route out. Docker still gives the host an address on its
  bridge, through which a container could reach any host port; one iptables rule (INPUT from that bridge:
  DROP) closes that, so a task can talk only to peers on the network, i.e. the egress forwarders. With
  `host_address=False` the bridge gets no address on the host at all (Docker's inhibit_ipv4), which closes the
  same door without iptables (what an eval worker in a container, with no say over the host's firewall, can do).
* Endpoints on the host's loopback (moto, Valkey, a local gateway) are not reachable from any container, so
  a host relay (a thread here) listens on the default bridge's gateway address with the same port and
  forwards to loopback. Same port, so a resumed dispatcher recreates the very same relays.
* The egress container's routes are kept in a label; an unchanged egress is reused across dispatchers, so
  running tasks (whose job documents name the egress address) keep working.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import ipaddress
import json
import shutil
import subprocess
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import docker
import docker.errors

from plumbing import relay

LABEL = "evalplane.egress"
EGRESS_IMAGE = "evalplane/debian:bookworm"  # any image with python3: the egress runs a standard-library relay
EGRESS_IMAGE_ENV = "EVALPLANE_EGRESS_IMAGE"  # another such image (on AWS the eval worker's own)
INHIBIT_IPV4 = "com.docker.network.bridge.inhibit_ipv4"


class EgressError(RuntimeError):
    """The network could not be made tight; refuse to run tasks on it."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        """`http://127.0.0.1:4566`, `redis://h:6379/0` or `h:443` -> Endpoint."""
        if "://" not in url:
            url = "tcp://" + url
        u = urlsplit(url)
        default = {"http": 80, "https": 443, "redis": 6379, "rediss": 6379}.get(u.scheme)
        port = u.port or default
        if not u.hostname or not port:
            raise ValueError(f"an allowed endpoint needs a host and a port: {url!r}")
        return cls(u.hostname, port)

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def bridge_gateway(client: docker.DockerClient) -> str:
    cfg = client.networks.get("bridge").attrs["IPAM"]["Config"]
    return cfg[0].get("Gateway") or str(next(ipaddress.ip_network(cfg[0]["Subnet"]).hosts()))


class Egress:
    """The internal network `name`, its egress container and firewall rule, and the host relays."""

    def __init__(self, client: docker.DockerClient, name: str, allowed: list[str], image: str,
                 host_address: bool = True):
        self.client = client
        self.host_address = host_address
        self.name = name
        self.image = image
        self.endpoints = sorted({Endpoint.parse(u) for u in allowed}, key=lambda e: (e.host, e.port))
        self.bridge = "ep-" + hashlib.sha1(name.encode()).hexdigest()[:11]  # Linux caps interface names at 15
        self.egress_name = f"{name}-egress"
        self.listen: dict[Endpoint, int] = {}
        used: set[int] = set()
        for e in self.endpoints:  # the endpoint's own port where it is free: readable, and stable
            port = e.port if e.port not in used else max(used | {20000}) + 1
            used.add(port)
            self.listen[e] = port
        self.ip: str | None = None
        self._relays: list[relay.Relay] = []

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> Egress:
        gateway = bridge_gateway(self.client)
        targets = {e: self._host_side(e, gateway) for e in self.endpoints}
        net = self._network()
        if self.host_address:
            self._firewall("-C", check=False) or self._firewall("-I")
        routes = [f"0.0.0.0:{self.listen[e]}={t.host}:{t.port}" for e, t in targets.items()]
        if routes:
            self.ip = self._egress_container(net, routes)
        else:  # nowhere to go: no peer on the network at all
            self._remove_egress_container()
        return self

    def down(self) -> None:
        """Remove the egress container, the firewall rule and the network (the tasks on it must be gone)."""
        self.stop_relays()
        self._remove_egress_container()
        while self.host_address and self._firewall("-C", check=False):
            self._firewall("-D")
        try:
            self.client.networks.get(self.name).remove()
        except docker.errors.NotFound:
            pass

    def _remove_egress_container(self) -> None:
        try:
            self.client.containers.get(self.egress_name).remove(force=True)
        except docker.errors.NotFound:
            pass

    def stop_relays(self) -> None:
        for r in self._relays:
            r.close()
        self._relays.clear()

    # ------------------------------------------------------------------ addresses
    def url(self, url: str) -> str:
        """An allowed endpoint's URL as a task on the network must write it (the egress address)."""
        e = Endpoint.parse(url)
        if e not in self.listen:
            raise KeyError(f"{url!r} is not an allowed endpoint of {self.name}")
        if "://" not in url:
            return f"{self.ip}:{self.listen[e]}"
        u = urlsplit(url)
        netloc = (u.netloc.rpartition("@")[0] + "@" if "@" in u.netloc else "") + f"{self.ip}:{self.listen[e]}"
        return urlunsplit(u._replace(netloc=netloc))

    def allows(self, url: str) -> bool:
        try:
            return Endpoint.parse(url) in self.listen
        except ValueError:
            return False

    # ------------------------------------------------------------------ parts
    def _host_side(self, e: Endpoint, gateway: str) -> Endpoint:
        """Where the egress container reaches `e`: directly, or through a host relay for loopback endpoints."""
        if not e.loopback:
            return e
        try:
            self._relays.append(relay.Relay([(gateway, e.port, "127.0.0.1", e.port)]))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            # bound already: the service listens on all addresses, or an earlier relay of ours still runs
        return Endpoint(gateway, e.port)

    def _network(self):
        options = {"com.docker.network.bridge.name": self.bridge}
        if not self.host_address:
            options[INHIBIT_IPV4] = "true"
        try:
            net = self.client.networks.get(self.name)
        except docker.errors.NotFound:
            net = self.client.networks.create(
                self.name, driver="bridge", internal=True, labels={LABEL: "network"}, options=options)
        if not net.attrs.get("Internal"):
            raise EgressError(f"network {self.name} exists but is not internal")
        if not self.host_address and net.attrs.get("Options", {}).get(INHIBIT_IPV4) != "true":
            raise EgressError(f"network {self.name} exists but gives the host an address on it")
        return net

    def _firewall(self, op: str, check: bool = True) -> bool:
        """INPUT from the network's bridge: DROP (no host port is reachable through the bridge's own address)."""
        iptables = shutil.which("iptables") or "/usr/sbin/iptables"
        argv = [iptables, "-w", op, "INPUT", "-i", self.bridge, "-j", "DROP"]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, check=False)
        except OSError as err:
            raise EgressError(f"iptables is needed to close the host off from {self.name}: {err}") from err
        if check and p.returncode != 0:
            raise EgressError(f"{' '.join(argv)} failed (root is needed): {p.stderr.strip()}")
        return p.returncode == 0

    def _egress_container(self, net, routes: list[str]) -> str:
        label = json.dumps(routes)
        try:
            c = self.client.containers.get(self.egress_name)
            if c.labels.get(LABEL) != label or c.status != "running":
                c.remove(force=True)
                raise docker.errors.NotFound("stale egress")
        except docker.errors.NotFound:
            c = self.client.containers.create(
                self.image, entrypoint=["python3", "-c", inspect.getsource(relay), *routes],
                name=self.egress_name, network="bridge", labels={LABEL: label}, detach=True,
                restart_policy={"Name": "unless-stopped"}, user="65534:65534" if _unprivileged(routes) else None,
            )
            net.connect(c)
            c.start()
        c.reload()
        ip = c.attrs["NetworkSettings"]["Networks"][self.name]["IPAddress"]
        if not ip:
            raise EgressError(f"the egress container has no address on {self.name}")
        return ip


def _unprivileged(routes: list[str]) -> bool:
    """Run the relay as nobody unless it has to listen on a port below 1024."""
    return all(int(r.split("=")[0].rsplit(":", 1)[1]) >= 1024 for r in routes)
