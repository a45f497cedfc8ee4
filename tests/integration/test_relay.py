"""Relayed hops end to end (ADR-0045): SmolLM2 in three real node processes, the middle one
reached only through the tracker's relay, with the same greedy tokens as a direct route, and
serving again by itself after its tunnel is cut.

Two setups:

- network namespaces (root only): the middle node runs in a namespace of its own, listening
  on that namespace's loopback alone, so nothing outside can connect to it; the tracker's probe
  of its advertised address fails and the node moves to the relay by itself. The tunnel is cut
  by taking the veth link down, then restored.
- loopback (always): the middle node starts with ``--relay``; the tracker (its relay) is killed
  and started again, and the node re-attaches and re-registers by itself.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from meshnet.endpoints import free_port
from tests.hostnet import free_subnet
from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
SHARDS = {"node-0": (0, 9), "node-1": (10, 19), "node-2": (20, 29)}
FLOAT32 = ("--dtype", "float32", "--wire-dtype", "float32")
MAX_TOKENS = 12
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
#: the acceptance bound: back in service this long after the network (or the relay) returns, s
HEAL_S = 15.0


def shard_args(name: str) -> list[str]:
    start, end = SHARDS[name]
    return ["--model", REAL, "--shard-start", str(start), "--shard-end", str(end), *FLOAT32]


def chat(mesh: Mesh, timeout_s: float = 120) -> dict:
    resp = httpx.post(f"{mesh.url}/v1/chat/completions", timeout=timeout_s, json={
        "model": REAL, "messages": STORY, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()


def middle(data: dict) -> dict:
    return data["meshnet"]["route"][1]


def wait_middle(mesh: Mesh, node_id: str, timeout_s: float) -> dict:
    """Wait until the tracker's route runs layers 10-19 on ``node_id``; returns that hop."""
    def check():
        hops = mesh.get("/v1/route", params={"model": REAL})["hops"]
        hop = next((h for h in hops if h["start_layer"] == 10), None)
        return hop if hop and hop["node_id"] == node_id else None
    return mesh.wait(check, timeout_s, f"layers 10-19 routed to {node_id}")


def wait_released(mesh: Mesh, endpoint: str) -> None:
    """The entry's signed release reached the relayed node through the tunnel: it holds no session."""
    mesh.wait(lambda: httpx.get(f"{endpoint}/v1/health", timeout=5).json()["sessions"] == 0, 15,
              "the relayed node to release its session")


def stream_messages_in(endpoint: str) -> float:
    """Hop stream messages (ADR-0040) a node received, read from its metrics through ``endpoint``."""
    text = httpx.get(f"{endpoint}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("meshnet_stream_messages_total{") and 'direction="in"' in line)


def chat_until_served(mesh: Mesh, timeout_s: float) -> tuple[dict, float]:
    """Send the chat again and again until one answers 200 (each bounded); returns it and the seconds taken."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout_s:
        try:
            resp = httpx.post(f"{mesh.url}/v1/chat/completions", timeout=max(1.0, timeout_s - (time.monotonic() - t0)),
                              json={"model": REAL, "messages": STORY, "max_tokens": MAX_TOKENS, "temperature": 0})
            if resp.status_code == 200:
                return resp.json(), time.monotonic() - t0
            last = resp.text[:300]
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise AssertionError(f"no answer within {timeout_s} s (last: {last})\n" + mesh.tail("node-1", 30)
                         + "\n" + mesh.tail("tracker", 30))


def direct_tokens(mesh: Mesh, host: str = "127.0.0.1") -> list[int]:
    """The answer through a directly reachable middle node (``node-1d``), which then stops: the
    relayed ``node-1`` started next is the only holder of layers 10-19. The nodes listen on
    ``host``: a relayed node pushes its chain steps to the next hop and the entry itself (ADR-0040),
    so they must be reachable from where it runs, as public nodes are."""
    listen = ["--host", host]
    # no spot-checks: a checked session goes hop by hop over HTTP (ADR-0042), and the relayed
    # chats below assert that their hops were a chain of streams
    mesh.start_node("node-0", *shard_args("node-0"), *listen, "--spot-check-rate", "0")
    mesh.start_node("node-2", *shard_args("node-2"), *listen)
    mesh.start_node("node-1d", *shard_args("node-1"), *listen)
    wait_middle(mesh, "node-1d", 240)
    data = chat(mesh)
    assert middle(data)["endpoint"].startswith(f"http://{host}:") and "/v1/relay/" not in middle(data)["endpoint"]
    assert [h["endpoint"].count("/v1/relay/") for h in data["meshnet"]["route"]] == [0, 0, 0]
    mesh.kill("node-1d")
    return data["meshnet"]["completion_token_ids"]


# ---- network namespaces ------------------------------------------------------------------

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


class Namespace:
    """A network namespace joined to this one by a veth pair: ``outer_ip`` here, ``inner_ip`` there.
    Removed in :meth:`remove` (deleting the namespace takes its veth end, and with it the pair)."""

    def __init__(self, tag: str, subnet: int) -> None:
        self.name, self.outer, self.inner = f"mnrelay{tag}", f"mnr{tag}o", f"mnr{tag}i"
        self.outer_ip, self.inner_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"

    def create(self) -> None:
        _ip("netns", "add", self.name)
        _ip("-n", self.name, "link", "set", "lo", "up")
        _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        _ip("link", "set", self.inner, "netns", self.name)
        _ip("addr", "add", f"{self.outer_ip}/30", "dev", self.outer)
        _ip("link", "set", self.outer, "up")
        _ip("-n", self.name, "addr", "add", f"{self.inner_ip}/30", "dev", self.inner)
        _ip("-n", self.name, "link", "set", self.inner, "up")

    def link(self, up: bool) -> None:
        _ip("link", "set", self.outer, "up" if up else "down")

    def remove(self) -> None:
        _ip("link", "del", self.outer, check=False)
        _ip("netns", "del", self.name, check=False)

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


def namespaces_unavailable() -> str:
    """Why this machine cannot run the namespace test ("" when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = Namespace(f"p{os.getpid() % 10000}", 251)
    try:
        probe.create()
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace here: {getattr(exc, 'stderr', '') or exc}".strip()
    finally:
        probe.remove()
    return ""


@pytest.fixture
def netns():
    why = namespaces_unavailable()
    if why:
        pytest.skip(why + " (test_relay_on_loopback covers the relay without them)")
    first = os.getpid() % 50  # a subnet no route here overlaps: a leftover pair would take the replies
    subnet = free_subnet(f"10.213.{200 + (first + i) % 50}.0/30" for i in range(50))
    ns = Namespace(f"{os.getpid() % 10000}", subnet.network_address.packed[2])
    ns.remove()  # leftovers of a killed run with the same pid
    ns.create()
    try:
        yield ns
    finally:
        ns.remove()


def test_unreachable_node_in_a_namespace_serves_through_the_relay_and_heals(real_model_path, netns, tmp_path):
    mesh = Mesh(tmp_path, join_token="join-relay-test", operator_token="op-relay-test")
    mesh.url = f"http://{netns.outer_ip}:{mesh.port}"  # beyond loopback: tokens required (ADR-0035)
    try:
        mesh.start_tracker(REAL, extra=["--host", netns.outer_ip])
        direct = direct_tokens(mesh, netns.outer_ip)
        # listens on the namespace's loopback only: the address it advertises takes no connection
        port = free_port()
        mesh.start_node("node-1", *shard_args("node-1"), "--host", "127.0.0.1", "--port", str(port),
                        "--public-url", f"http://{netns.inner_ip}:{port}", prefix=netns.prefix)
        hop = wait_middle(mesh, "node-1", 240)
        assert hop["endpoint"] == f"{mesh.url}/v1/relay/node-1"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{netns.inner_ip}:{port}/v1/health", timeout=3)

        relayed = chat(mesh)
        assert middle(relayed)["endpoint"] == f"{mesh.url}/v1/relay/node-1"
        tokens = relayed["meshnet"]["completion_token_ids"]
        assert len(tokens) == MAX_TOKENS
        assert tokens == direct
        # the hops were a chain of streams through the tunnel: OPEN, the prefill, every decode step
        assert stream_messages_in(middle(relayed)["endpoint"]) >= MAX_TOKENS + 1
        wait_released(mesh, middle(relayed)["endpoint"])

        netns.link(up=False)  # cut: the tunnel's keepalive goes unanswered, the node dials again and again
        mesh.wait(lambda: "dialling again" in (tmp_path / "node-1.log").read_text(), 30, "node-1 to see its tunnel down")
        netns.link(up=True)
        healed, took_s = chat_until_served(mesh, 60)
        print(f"relayed node served again {took_s:.1f} s after the link came back")
        assert took_s <= HEAL_S, f"took {took_s:.1f} s"
        assert middle(healed)["node_id"] == "node-1"
        assert healed["meshnet"]["completion_token_ids"] == tokens
        log = (tmp_path / "node-1.log").read_text()
        assert len(re.findall(r"tunnel to \S+ attached", log)) >= 2, mesh.tail("node-1", 40)
    finally:
        mesh.stop()


# ---- loopback ----------------------------------------------------------------------------

def test_relay_on_loopback(real_model_path, tmp_path):
    mesh = Mesh(tmp_path)
    db = tmp_path / "tracker.db"
    try:
        mesh.start_tracker(REAL, db=db)
        direct = direct_tokens(mesh)
        mesh.start_node("node-1", *shard_args("node-1"), "--relay")
        hop = wait_middle(mesh, "node-1", 240)
        assert hop["endpoint"] == f"{mesh.url}/v1/relay/node-1"
        relayed = chat(mesh)
        tokens = relayed["meshnet"]["completion_token_ids"]
        assert middle(relayed)["endpoint"] == f"{mesh.url}/v1/relay/node-1"
        assert len(tokens) == MAX_TOKENS
        assert tokens == direct
        assert stream_messages_in(middle(relayed)["endpoint"]) >= MAX_TOKENS + 1  # a chain through the tunnel
        wait_released(mesh, middle(relayed)["endpoint"])

        # the relay (the tracker) dies and comes back: the node dials its tunnel again and
        # re-registers on its own, as do the others
        mesh.kill("tracker", signal.SIGKILL)
        mesh.wait(lambda: "dialling again" in (tmp_path / "node-1.log").read_text(), 30, "node-1 to see its tunnel down")
        mesh.start_tracker(REAL, db=db)
        healed, took_s = chat_until_served(mesh, 60)
        print(f"relayed node served again {took_s:.1f} s after its relay came back")
        assert took_s <= HEAL_S, f"took {took_s:.1f} s"
        assert middle(healed)["endpoint"] == f"{mesh.url}/v1/relay/node-1"
        assert healed["meshnet"]["completion_token_ids"] == tokens
        health = httpx.get(f"{mesh.url}/v1/relay/node-1/v1/health", timeout=10).json()
        assert health["endpoint"] == f"{mesh.url}/v1/relay/node-1"
        assert health["relay"]["url"] == mesh.url and health["relay"]["attached"] is True
        assert health["relay"]["attaches"] == 2
    finally:
        mesh.stop()


def test_a_node_whose_public_url_nobody_can_reach_moves_to_the_relay_by_itself(tmp_path, monkeypatch):
    """Auto relay on loopback (tiny seeded model): the advertised URL takes no connection, the node
    listens all the same, so after the tracker still cannot reach it the node attaches a tunnel,
    registers its relayed endpoint and is routed; the chat answers as through a direct node."""
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path / "cache"))
    tiny, ask = "tiny-llama", [{"role": "user", "content": "hello"}]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker(tiny)
        mesh.start_node("seen", "--model", tiny, "--shard-start", "0", "--shard-end", "3", *FLOAT32)
        mesh.wait_routable(tiny, 60)
        direct = mesh.chat(tiny, ask, max_tokens=6).json()["meshnet"]["completion_token_ids"]
        mesh.kill("seen")
        mesh.start_node("hidden", "--model", tiny, "--shard-start", "0", "--shard-end", "3", "--public-url", dead,
                        *FLOAT32)
        node = mesh.wait(lambda: (n := {x["node_id"]: x for x in mesh.get("/v1/nodes")["nodes"]}.get("hidden"))
                         and n["reachable"] and n, 60, "hidden reachable through the relay")
        assert node["endpoint"] == f"{mesh.url}/v1/relay/hidden"
        mesh.wait(lambda: mesh.get(f"/v1/coverage/{tiny}")["routable"], 30, "routable again")
        resp = mesh.chat(tiny, ask, max_tokens=6)
        assert resp.status_code == 200, resp.text
        assert resp.json()["meshnet"]["route"][0]["endpoint"] == f"{mesh.url}/v1/relay/hidden"
        assert resp.json()["meshnet"]["completion_token_ids"] == direct
        log = (tmp_path / "hidden.log").read_text()
        assert f"the tracker cannot reach this node at {dead} although it listens: serving through a relay" in log
    finally:
        mesh.stop()
