"""`specpool up`: a whole specpool cluster as local processes, described by a YAML file.

The embedded default (cluster/default.yaml) is Redis, one router, two target services (tenant "alpha" of
Qwen2.5-Coder-1.5B-Instruct, "beta" of SmolLM2-135M-Instruct) and one speculation endpoint drafting for both,
all registering in Redis. Other topologies are other files (cluster/examples/). cluster/config.py reads the file,
cluster/launcher.py starts and stops the servers. With --ray the members run as actors on a Ray
cluster instead (cluster/ray_launcher.py) and stay up after `specpool up` returns: `specpool scale`
and `specpool down` act on them.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from specpool.cluster.config import DEFAULT_CONFIG, ClusterConfig
from specpool.cluster.launcher import Cluster, format_members
from specpool.common.logs import FORMATS, LOG_FORMAT_ENV


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help=f"cluster YAML (default: {DEFAULT_CONFIG.name}, the embedded "
                                                  "default: Redis, a router, two targets, one endpoint)")
    p.add_argument("--free-ports", action="store_true", help="let every server pick a free port")
    p.add_argument("--verbose", action="store_true", help="echo every server's log lines to stderr")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per server, to come up")
    p.add_argument("--insecure", action="store_true",
                   help="no TLS, tokens or certificates (anyone reaching a port is any tenant); Redis keeps its password")
    p.add_argument("--log-format", default=None, choices=FORMATS,
                   help=f"every server's log lines as text or as JSON objects, one a line (default: ${LOG_FORMAT_ENV}, "
                        "which the servers inherit, else text)")
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run the members as actors on the Ray cluster at ADDRESS (alone: auto, the local node's or "
                        "$RAY_ADDRESS) and return; `specpool down` stops them")
    p.add_argument("--node-ip-address", default=None,
                   help="with --ray: this process's own address towards the Ray cluster (default: Ray's choice)")
    p.add_argument("--namespace", default="specpool", help="with --ray: the Ray namespace of the cluster's actors")


def main(args) -> int:
    config = ClusterConfig.load(args.config)
    if args.free_ports:
        config = config.with_free_ports()
    if args.ray is not None:
        return _up_on_ray(config, args)
    stop = threading.Event()

    def on_signal(signum: int, _frame) -> None:
        stop.set()
        raise KeyboardInterrupt  # also interrupts a start in progress

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    try:
        try:
            cluster = Cluster.start(config, echo=args.verbose, timeout_s=args.timeout_s, insecure=args.insecure,
                                    log_format=args.log_format,
                                    progress=lambda text: print(f"[up] {text}", file=sys.stderr, flush=True))
        except KeyboardInterrupt:
            print("[up] interrupted while starting; stopped what had started", file=sys.stderr)
            return 130
        try:
            print(f"specpool cluster up in {time.monotonic() - started:.0f}s ({args.config or DEFAULT_CONFIG}):")
            print(format_members(cluster))
            for note in cluster.notes:
                print(f"note: {note}")
            if cluster.routers:
                print(f"\nsend requests to {cluster.router_address} (specpool.v1.TargetService); Ctrl-C stops "
                      "everything", flush=True)
            if cluster.routers and cluster.routers[0].http_port:
                port = cluster.routers[0].http_port
                how = "" if cluster.ca is None else (f"; its certificate names router.specpool: curl --cacert CA "
                                                     f"--resolve router.specpool:{port}:127.0.0.1 "
                                                     f"https://router.specpool:{port}/v1/models")
                print(f"OpenAI-compatible API: {cluster.http_url()} (the tenant's token as the API key{how})",
                      flush=True)
            if cluster.ca is not None:
                print(f"TLS: CA certificate {cluster.ca.dir / 'ca.crt'} (verify the router as router.specpool); "
                      f"tenants' bearer tokens in {cluster.ca.dir / 'tokens.yaml'}", flush=True)
            else:
                print("WARNING: --insecure: plaintext and no authentication on every port", flush=True)
            while not stop.wait(1.0):
                dead = cluster.dead()
                if dead:
                    for s in dead:
                        print(f"[up] {s.name} exited with {s.proc.returncode}; its log:\n{s.logs()}", file=sys.stderr)
                    return 1
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the drain short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("[up] stopping: routers, targets, endpoints, redis (each drains)", file=sys.stderr, flush=True)
            cluster.stop()
            print("[up] stopped", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _up_on_ray(config: ClusterConfig, args) -> int:
    from specpool.cluster.ray_launcher import RayCluster

    def on_signal(signum: int, _frame) -> None:
        raise KeyboardInterrupt  # a start cut short removes what it started

    previous = signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    try:
        cluster = RayCluster.start(config, address=args.ray, node_ip=args.node_ip_address, namespace=args.namespace,
                                   insecure=args.insecure, log_format=args.log_format, timeout_s=args.timeout_s,
                                   progress=lambda text: print(f"[up] {text}", file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("[up] interrupted while starting; removed what had started", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"specpool cluster up on Ray in {time.monotonic() - started:.0f}s ({args.config or DEFAULT_CONFIG}), "
          f"namespace {args.namespace!r}:")
    print(format_members(cluster))
    if cluster.ca is None:
        print("WARNING: --insecure: plaintext and no authentication on every port", flush=True)
    else:
        print("TLS: the cluster's CA and tenants' tokens live with its actors; a client in Python: "
              "RayCluster.attach().router_channel(TENANT)")
    print(f"`specpool scale TENANT N` adds or drains replicas; `specpool down` stops it "
          f"(both with --ray {args.ray} --namespace {args.namespace})")
    return 0
