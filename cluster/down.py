"""`specpool down`: stops a Ray-launched cluster (`specpool up --ray`): each tier drains (routers, targets,
endpoints, Redis), then its actors, placement groups and state go."""

from __future__ import annotations

import sys

from specpool.cluster.scale import add_ray_arguments


def add_arguments(p) -> None:
    p.add_argument("--grace-s", type=float, default=20.0, help="each server's time to finish its requests")
    add_ray_arguments(p)


def main(args) -> int:
    from specpool.cluster.ray_launcher import RayCluster

    cluster = RayCluster.attach(args.ray, args.node_ip_address, args.namespace)
    print("[down] draining routers, targets, endpoints, redis", file=sys.stderr, flush=True)
    cluster.down(grace_s=args.grace_s)
    print(f"specpool cluster in Ray namespace {args.namespace!r} stopped")
    return 0
