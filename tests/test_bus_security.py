"""A closed bus: the NATS that `llmbus serve` starts takes only the deployment's own
identities, and each may use only its role's subjects (llmbus/deploy/nats_auth.py). Checked on
real nats-servers; a refusal is seen as NATS's own error, not as a timeout. `llmbus serve
--nats-tls --nats-cluster 3` is checked on tests/test_serve_faults.py's deployment (the
same flags), before its faults."""

from __future__ import annotations

import asyncio
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from deployment import llmbus_serve, login
from llmbus.deploy.nats_auth import authorization_config, new_identity, permission_table
from llmbus.deploy.nats_server import NatsServer, cluster_nodes
from llmbus.deploy.supervisor import stop_all
from shared.bus import BusAuth, Subjects

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
SUBJECTS = Subjects("tiny")
P = SUBJECTS.prefix


async def violations(nc, errors: list[str], subscribe=(), publish=()) -> list[str]:
    """Try each subscription and publish; the permission errors NATS sent back."""
    for subject in subscribe:
        await nc.subscribe(subject)
    for subject in publish:
        await nc.publish(subject, b"x")
    await nc.flush()
    await asyncio.sleep(0.3)  # the server's -ERR arrives after its PONG
    found = [e.lower() for e in errors if "permissions violation" in e.lower()]  # nats-py lowercases some
    errors.clear()
    return found


def test_the_permission_table_in_the_docs_is_the_one_enforced():
    assert permission_table() in (ROOT / "docs/serving/security.md").read_text()


@pytest.fixture(scope="module")
def closed_bus():
    """A nats-server with the users of a deployment: one scheduler, tokenizers, two
    gateways, two workers."""
    identities = {"scheduler": new_identity("scheduler"), "tokenizer": new_identity("tokenizer"),
                  "g1": new_identity("gateway", "g1"), "g2": new_identity("gateway", "g2"),
                  "w1": new_identity("worker", "w1"), "w2": new_identity("worker", "w2")}
    server = NatsServer(authorization=authorization_config(list(identities.values()), SUBJECTS)).start()
    yield server, identities
    server.stop()


def test_anonymous_and_wrong_passwords_are_refused(closed_bus):
    server, ids = closed_bus

    async def run():
        for user, password in [(None, None), ("gateway-g1", "wrong"), ("gateway-g1", ids["g2"].password),
                               ("nobody", ids["g1"].password)]:
            nc, errors = await login(server.url, user, password)
            assert nc is None and any("authorization violation" in e.lower() for e in errors), (user, errors)

    asyncio.run(run())


# role identity -> (allowed subscriptions, allowed publishes, forbidden subscriptions, forbidden publishes)
GRANTS = {
    # (and the other gateways' heartbeats, and their questions for stored responses)
    "g1": ([f"{P}.outputs.g1.a1", f"{P}.scheduler.heartbeat", f"{P}.scheduler.stats", "_INBOX.gateway.g1.x",
            f"{P}.gateways.heartbeat", f"{P}.responses", f"{P}.gateways.metrics"],
           [f"{P}.requests.0", f"{P}.abort.1", f"{P}.tokenize", f"{P}.scheduler.info", f"{P}.gateways.heartbeat",
            f"{P}.responses", f"{P}.gateways.metrics"],
           [f"{P}.outputs.g2.a1", f"{P}.outputs.*.*", f"{P}.outputs.>", ">", "_INBOX.>", "_INBOX.scheduler.x",
            "_INBOX.gateway.g2.x", "_INBOX.gateway.>", f"{P}.workers.w1.step", f"{P}.requests.0", f"{P}.tokenize"],
           [f"{P}.workers.w1.step", f"{P}.outputs.g2.a1", f"{P}.outputs.g1.a1", f"{P}.scheduler.heartbeat",
            f"{P}.workers.announce", "_INBOX.gateway.g2.x", "_INBOX.scheduler.x"]),
    "w1": ([f"{P}.workers.w1.step", f"{P}.scheduler.hello"], [f"{P}.workers.announce", "_INBOX.scheduler.x"],
           [f"{P}.workers.w2.step", f"{P}.workers.*.step", f"{P}.outputs.g1.a1", f"{P}.requests.0", "_INBOX.>",
            "_INBOX.scheduler.x"],
           [f"{P}.workers.w2.step", f"{P}.outputs.g1.a1", f"{P}.requests.0", f"{P}.scheduler.heartbeat",
            f"{P}.gateways.heartbeat", "_INBOX.gateway.g1.x", f"{P}.responses"]),
    # (A responder also publishes into its askers' inboxes: allow_responses is per server.)
    "tokenizer": ([f"{P}.tokenize"], ["_INBOX.gateway.g1.x"],
                  [f"{P}.requests.0", f"{P}.outputs.g1.a1", ">", "_INBOX.gateway.g1.x"],
                  [f"{P}.tokenize", f"{P}.outputs.g1.a1", f"{P}.requests.0", "_INBOX.scheduler.x", f"{P}.responses"]),
    "scheduler": ([f"{P}.requests.0", f"{P}.abort.1", f"{P}.workers.announce", f"{P}.scheduler.info",
                   f"{P}.gateways.heartbeat", "_INBOX.scheduler.x"],
                  [f"{P}.outputs.g1.a1", f"{P}.outputs.g2.b2", f"{P}.workers.w1.step", f"{P}.scheduler.hello",
                   f"{P}.scheduler.heartbeat", f"{P}.scheduler.stats", "_INBOX.gateway.g1.x"],
                  [f"{P}.outputs.g1.a1", f"{P}.workers.w1.step", f"{P}.tokenize", "_INBOX.gateway.g1.x", ">"],
                  [f"{P}.requests.0", f"{P}.tokenize", f"{P}.workers.announce", f"{P}.gateways.heartbeat"]),
}


@pytest.mark.parametrize("who", GRANTS)
def test_each_identity_gets_its_roles_subjects_and_no_others(closed_bus, who):
    server, ids = closed_bus
    identity = ids[who]
    allowed_sub, allowed_pub, forbidden_sub, forbidden_pub = GRANTS[who]

    async def run():
        nc, errors = await login(server.url, identity.user, identity.password)
        assert nc is not None, errors
        assert await violations(nc, errors, allowed_sub, allowed_pub) == []
        for subject in forbidden_sub:
            assert await violations(nc, errors, subscribe=[subject]) == [
                f'nats: permissions violation for subscription to "{subject.lower()}"'], (who, subject)
        for subject in forbidden_pub:
            assert await violations(nc, errors, publish=[subject]) == [
                f'nats: permissions violation for publish to "{subject.lower()}"'], (who, subject)
        await nc.close()

    asyncio.run(run())


def test_requests_are_answered_through_the_requesters_own_inbox(closed_bus):
    """Gateway -> tokenizer and scheduler -> worker round trips work, and a gateway cannot
    drive a worker even by request."""
    server, ids = closed_bus

    async def run():
        def options(identity):
            return BusAuth(user=identity.user, password=identity.password).connect_options()

        tokenizer, _ = await login(server.url, ids["tokenizer"].user, ids["tokenizer"].password)
        worker, _ = await login(server.url, ids["w1"].user, ids["w1"].password)
        gateway, gateway_errors = await login(server.url, **options(ids["g1"]))
        scheduler, _ = await login(server.url, **options(ids["scheduler"]))

        async def echo(msg):
            await msg.respond(b"answer:" + msg.data)

        await tokenizer.subscribe(f"{P}.tokenize", cb=echo)
        await worker.subscribe(f"{P}.workers.w1.step", cb=echo)
        await tokenizer.flush()
        await worker.flush()
        assert (await gateway.request(f"{P}.tokenize", b"hi", timeout=5)).data == b"answer:hi"
        assert (await scheduler.request(f"{P}.workers.w1.step", b"s", timeout=5)).data == b"answer:s"
        with pytest.raises(Exception):
            await gateway.request(f"{P}.workers.w1.step", b"s", timeout=1)
        assert any("permissions violation for publish" in e for e in gateway_errors)
        for nc in (tokenizer, worker, gateway, scheduler):
            await nc.close()

    asyncio.run(run())


def _creds(identity) -> dict:
    return {"user": identity.user, "password": identity.password}


def test_cluster_routes_need_the_route_password():
    identities = [new_identity("scheduler"), new_identity("worker", "w1")]
    nodes = cluster_nodes(2, authorization_config(identities, SUBJECTS), "route-secret")
    rogue = NatsServer(name="rogue", cluster_port=_free(), routes=[nodes[0].cluster_port])  # no password
    try:
        for node in nodes:
            node.start()
        rogue.start()

        async def run():
            scheduler, _ = await login(nodes[0].url, **_creds(identities[0]))
            worker, _ = await login(nodes[1].url, **_creds(identities[1]))
            got = asyncio.get_running_loop().create_future()

            async def on_hello(msg):
                if not got.done():
                    got.set_result(msg.data)

            await worker.subscribe(f"{P}.scheduler.hello", cb=on_hello)
            await worker.flush()
            deadline = time.monotonic() + 10
            while not got.done() and time.monotonic() < deadline:  # until the route carries interest
                await scheduler.publish(f"{P}.scheduler.hello", b"hello")
                await asyncio.sleep(0.2)
            assert got.done() and got.result() == b"hello"  # the authenticated route works
            await scheduler.close()
            await worker.close()

        asyncio.run(run())
        assert _routes(nodes[0]) == {"nats-2"}  # its peer (in a pool of routes); the rogue's was refused
        assert _routes(rogue) == set()
    finally:
        for node in (*nodes, rogue):
            node.stop()


def _free() -> int:
    from llmbus.deploy.nats_server import free_port

    return free_port()


def _routes(node: NatsServer) -> set[str]:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port}/routez", timeout=5) as resp:
        return {route.get("remote_name") for route in json.load(resp)["routes"]}


def test_llmbus_serve_closes_its_bus(tiny_llama, tmp_path):
    """The served path works with auth on, its API over HTTPS (vLLM's --ssl-certfile and
    --ssl-keyfile: a client that trusts the CA is served, plain HTTP is not); an anonymous
    client and a service without credentials are refused (the service says so and exits);
    the config is 0600; no password reaches the logs."""
    import ssl

    import httpx

    from llmbus.deploy.nats_tls import make_tls_files

    tls = make_tls_files(tmp_path / "https", ["127.0.0.1", "localhost"])
    proc, base_url = llmbus_serve(["--model", str(tiny_llama), "--served-model-name", "tiny",
                                   "--max-model-len", "256", "--num-kv-blocks", "64",
                                   "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)],
                                  tmp_path / "serve.log")
    try:
        assert base_url.startswith("https://") and f"at {base_url}/v1" in proc.banner
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=tls.ca)))
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert out.choices[0].text is not None and out.usage.completion_tokens == 4
        with pytest.raises(httpx.HTTPError):
            httpx.get(base_url.replace("https://", "http://") + "/v1/models", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(base_url + "/v1/models", timeout=5)  # (a client that does not trust the CA)
        nats_url = re.search(r"\(NATS (\S+)\)", proc.banner).group(1)

        async def anonymous():
            return await login(nats_url)

        nc, errors = asyncio.run(anonymous())
        assert nc is None and any("authorization violation" in e.lower() for e in errors), errors

        # A service started by hand without credentials is refused, says so, and exits.
        rogue = subprocess.run([sys.executable, "-m", "llmbus", "worker", "--nats-url", nats_url,
                                "--model", str(tiny_llama), "--served-model-name", "tiny"],
                               capture_output=True, text=True, timeout=120,
                               env={k: v for k, v in os.environ.items() if not k.startswith("LLMBUS_")})
        assert rogue.returncode == 2, rogue.stderr[-2000:]
        assert "could not log in to NATS" in rogue.stderr and "Authorization Violation" in rogue.stderr
        assert "Traceback" not in rogue.stderr

        import psutil

        nats_proc = next(c for c in psutil.Process(proc.pid).children() if "nats-server" in c.name())
        conf = Path(nats_proc.cmdline()[nats_proc.cmdline().index("-c") + 1])
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
        assert stat.S_IMODE(conf.parent.stat().st_mode) == 0o700
        passwords = re.findall(r'"password": "([^"]+)"', conf.read_text())
        assert len(passwords) == 4  # scheduler, tokenizer, the gateway, the worker
        assert "\nhttp:" not in conf.read_text()  # no monitoring port either: nothing listens without a login
    finally:
        stop_all([proc])
    log = (tmp_path / "serve.log").read_text()
    assert not [p for p in passwords if p in log]


def test_the_tls_files_are_a_ca_and_a_certificate_it_signed(tmp_path):
    import ssl as ssl_module

    from llmbus.deploy.nats_tls import make_tls_files

    files = make_tls_files(tmp_path / "tls", ["127.0.0.1", "localhost"])
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == ["ca.pem", "server.key", "server.pem"]  # no CA key
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    # The server side loads them, and a client trusting the CA verifies the certificate for both names.
    server = ssl_module.create_default_context(ssl_module.Purpose.CLIENT_AUTH)
    server.load_cert_chain(files.cert, files.key)
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]


def _compose(name: str) -> dict:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: [])
    return yaml.load((ROOT / name).read_text(), Loader=Loader)


def test_compose_secure_overlay_takes_the_files_nats_config_writes(tmp_path):
    result = subprocess.run([sys.executable, "-m", "llmbus", "nats-config", "--out", str(tmp_path / "bus"),
                             "--tls", "--workers", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    base, secure = _compose("compose.yaml"), _compose("compose.secure.yaml")
    assert set(secure["services"]) <= set(base["services"])
    for name, service in secure["services"].items():
        for env_file in service.get("env_file", []):
            assert (tmp_path / env_file).is_file(), (name, env_file)
        for secret in service.get("secrets", []):
            assert secret in secure["secrets"], (name, secret)
    for secret in secure["secrets"].values():
        assert (tmp_path / secret["file"]).is_file(), secret
    conf = (tmp_path / "bus/nats.conf").read_text()
    for node in ("nats-1", "nats-2", "nats-3"):
        command = secure["services"][node]["command"]
        assert command[:2] == ["-c", "/run/secrets/nats-conf"] and command[-1] == node
    assert set(re.findall(r'"(/run/secrets/[^"]+)"', conf)) == {f"/run/secrets/{s}" for s in ("nats-ca", "nats-cert", "nats-key")}
    for path in (tmp_path / "bus").glob("*.env"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "bus/nats.conf").stat().st_mode) == 0o600


def test_compose_services_serve_on_the_closed_bus_nats_config_writes(tiny_llama, tmp_path):
    """What compose.secure.yaml runs, without Docker: nats-server on the written config, and
    the four service commands, each with only its env file's identity, over TLS."""
    from llmbus.deploy.nats_config import write_bus_files
    from llmbus.deploy.nats_server import free_port, nats_server_binary
    from llmbus.deploy.serve import spawn_service, wait_healthy

    bus, secrets_dir = tmp_path / "bus", tmp_path / "secrets"  # secrets_dir stands for /run/secrets
    port, cluster_port = free_port(), free_port()
    write_bus_files(bus, "tiny", 1, tls=True, secrets_dir=str(secrets_dir), client_port=port,
                    cluster_port=cluster_port, extra_hosts=("127.0.0.1",))
    secrets_dir.mkdir()
    for secret, file in {"nats-ca": "ca.pem", "nats-cert": "server.pem", "nats-key": "server.key"}.items():
        (secrets_dir / secret).symlink_to(bus / "tls" / file)
    nats_proc = subprocess.Popen([nats_server_binary(), "-c", str(bus / "nats.conf"), "--name", "nats-1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [nats_proc]
    try:
        http_port = free_port()
        common = {k: v for k, v in os.environ.items() if not k.startswith("LLMBUS_")}
        common.update(LLMBUS_NATS_URL=f"nats://127.0.0.1:{port}", LLMBUS_MODEL=str(tiny_llama),
                      LLMBUS_SERVED_MODEL_NAME="tiny", LLMBUS_MAX_MODEL_LEN="256", LLMBUS_NUM_KV_BLOCKS="64",
                      LLMBUS_PORT=str(http_port))
        for service, env_file in [("scheduler", "scheduler.env"), ("tokenizer", "tokenizer.env"),
                                  ("worker", "worker-1.env"), ("gateway", "gateway.env")]:
            own = dict(line.split("=", 1) for line in (bus / env_file).read_text().splitlines())
            procs.append(spawn_service([service], {**common, **own}))
        base_url = f"http://127.0.0.1:{http_port}"
        wait_healthy(base_url, procs, 180)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        # Greedy: at OpenAI's default temperature of 1 the tiny model samples its EOS about once
        # in 700 requests of three tokens, which once ended this one after two.
        out = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    finally:
        stop_all(procs[1:])
        stop_all(procs[:1])


def test_a_service_logs_in_with_a_token_and_a_wrong_one_ends_it_cleanly(tiny_llama):
    """Against a NATS of the user's that takes a token: the tokenizer service logs in with
    --nats-token (given as its LLMBUS_ variable), and with a wrong one exits with status 2
    and a message, not a traceback or an endless retry."""
    from llmbus.deploy.serve import spawn_service

    server = NatsServer(authorization='authorization { token: "s3cret-token" }').start()
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("LLMBUS_")}
        args = ["tokenizer", "--nats-url", server.url, "--model", str(tiny_llama), "--served-model-name", "tiny"]
        wrong = subprocess.run([sys.executable, "-m", "llmbus", *args], capture_output=True, text=True, timeout=120,
                               env={**base, "LLMBUS_NATS_TOKEN": "not-it"})
        assert wrong.returncode == 2 and "could not log in to NATS" in wrong.stderr, wrong.stderr[-2000:]
        assert "Traceback" not in wrong.stderr and "not-it" not in wrong.stderr
        right = spawn_service(args, {**base, "LLMBUS_NATS_TOKEN": "s3cret-token"})
        try:
            async def ask():
                nc, errors = await login(server.url, token="s3cret-token")
                assert nc is not None, errors
                deadline = time.monotonic() + 60
                while True:  # until the tokenizer has subscribed
                    try:
                        return await nc.request(f"{P}.tokenize", b"\x80", timeout=1)
                    except Exception:  # noqa: BLE001 - no responders yet
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.3)

            reply = asyncio.run(ask())
            assert b"malformed tokenize request" in reply.data  # the service answered, logged in by token
        finally:
            stop_all([right])
    finally:
        server.stop()



def test_a_server_certificate_the_service_does_not_trust_ends_its_login(tmp_path):
    """shared.bus.connect against a TLS server signed by another CA: BusRefused at once,
    not nats-py's endless retry."""
    from llmbus.deploy.nats_tls import make_tls_files
    from shared.bus import BusRefused, connect

    ours, theirs = make_tls_files(tmp_path / "ours", ["127.0.0.1"]), make_tls_files(tmp_path / "theirs", ["127.0.0.1"])
    server = NatsServer(tls=theirs).start()
    try:
        async def attempt():
            await asyncio.wait_for(connect(server.url, "worker-x", auth=BusAuth(tls_ca=str(ours.ca))), 20)

        with pytest.raises(BusRefused, match="certificate verify failed"):
            asyncio.run(attempt())
    finally:
        server.stop()
