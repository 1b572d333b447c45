"""`specpool scale TENANT N`: a Ray-launched cluster's replicas of one tenant to N, the others untouched;
`specpool scale --endpoint NAME N`: an endpoint's instances to N.

New replicas start as actors (cluster/ray_launcher.py) and take traffic once they register; extra
ones drain their in-flight requests first, then go. New endpoint instances take the targets started
after them; an instance that goes first has its targets replaced by ones drafting on the others.
"""

from __future__ import annotations

import sys

from specpool.cluster.ray_plan import NAMESPACE


def add_ray_arguments(p) -> None:
    """The flags every command that finds a Ray-launched cluster takes."""
    p.add_argument("--ray", default="auto", metavar="ADDRESS",
                   help="the Ray cluster (auto: the local node's, or $RAY_ADDRESS)")
    p.add_argument("--node-ip-address", default=None,
                   help="this process's own address towards the Ray cluster (default: Ray's choice)")
    p.add_argument("--namespace", default=NAMESPACE, help="the Ray namespace the cluster's actors live in")


def add_arguments(p) -> None:
    p.add_argument("name", help="the tenant whose target replicas change (with --endpoint: the endpoint)")
    p.add_argument("replicas", type=int, help="how many replicas (endpoint instances) it has afterwards")
    p.add_argument("--endpoint", action="store_true",
                   help="NAME is an endpoint of the cluster file: scale its instances (at least 1)")
    p.add_argument("--grace-s", type=float, default=20.0, help="a drained replica's time to finish its requests")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per new replica, to come up")
    add_ray_arguments(p)


def main(args) -> int:
    from specpool.cluster.ray_launcher import RayCluster

    cluster = RayCluster.attach(args.ray, args.node_ip_address, args.namespace)
    scale = cluster.scale_endpoint if args.endpoint else cluster.scale
    added, drained = scale(args.name, args.replicas, grace_s=args.grace_s, timeout_s=args.timeout_s,
                           progress=lambda text: print(f"[scale] {text}", file=sys.stderr, flush=True))
    kind = "instance(s)" if args.endpoint else "replica(s)"
    print(f"{args.name}: {args.replicas} {kind}; added {', '.join(added) or 'none'}, "
          f"drained {', '.join(drained) or 'none'}")
    return 0
