"""Stream one completion from a specpool router with the client package (no torch needed).

    python generate.py --address 127.0.0.1:50070 --ca-cert CA.crt --token TOKEN --prompt "def fib(n):"

The token is a tenant's bearer token (`specpool up` prints where they are; SPECPOOL_TOKEN works too).
"""

import argparse
import os
import sys

from specpool_client import TargetClient, generate_request
from specpool_client.v1 import target_pb2 as pb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--address", default="127.0.0.1:50070", help="the router's gRPC address")
    p.add_argument("--ca-cert", default=None, help="the CA certificate that signed the router's (PEM file)")
    p.add_argument("--token", default=os.environ.get("SPECPOOL_TOKEN"), help="the tenant's bearer token")
    p.add_argument("--insecure", action="store_true", help="plaintext, for a cluster started with --insecure")
    p.add_argument("--prompt", default="def fibonacci(n):", help="the text to complete")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens at most")
    p.add_argument("--speculation", default="auto", help="auto, none, draft_model, ngram, ssd or head")
    p.add_argument("--timeout-s", type=float, default=120.0, help="deadline of the whole call, retries included")
    args = p.parse_args()

    request = generate_request(args.prompt, max_tokens=args.max_tokens, speculation=args.speculation)
    with TargetClient(args.address, token=args.token, ca_cert=args.ca_cert, insecure=args.insecure) as client:
        for response in client.stream(request, timeout_s=args.timeout_s):
            if response.HasField("delta"):
                print(response.delta.text, end="", flush=True)
            else:
                done = response.final.completions[0]
                stats = done.speculation
                print(f"\n[{len(done.token_ids)} tokens, {pb.FinishReason.Name(done.finish_reason)}, "
                      f"{pb.SpeculationMethod.Name(stats.method)}: {stats.accepted_tokens}/{stats.drafted_tokens} "
                      f"drafts accepted, {stats.mean_accept_len:.2f} tokens per target step]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
