"""Benchmark modes that go through the servers: sd-remote and ngram-remote.

A speculation endpoint and a target service start as separate processes (once per run); each
chunk of prompts is sent as concurrent Generate calls through the Target API, and the wall time
from the first submit to the last answer is what the chunk costs, as for the in-process modes.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from cluster.processes import ServerProcess, start_server
from engine.gguf_loader import model_name
from engine.sampling import SamplingParams
from specpool.v1 import target_pb2 as pb
from specpool.v1 import target_pb2_grpc

METHODS = {"sd-remote": pb.SPECULATION_METHOD_DRAFT_MODEL, "ngram-remote": pb.SPECULATION_METHOD_NGRAM}


class RemoteCluster:
    """One endpoint + one target for the whole benchmark run; stopped by close()."""

    def __init__(self, model_path: Path, dtype: str, max_batch: int, draft_dir: Path | None,
                 datastore: Path | None, max_context: int = 2048):
        drafter = f"{model_name(model_path)}={model_path}"
        if draft_dir:
            drafter += f",draft={draft_dir}"
        if datastore:
            drafter += f",datastore={datastore}"
        self.servers: list[ServerProcess] = []
        try:
            self.endpoint = self._start("spec-endpoint", [
                "serve-spec", "--port", "0", "--metrics-port", "0", "--drafter", drafter,
                "--max-sessions", str(max(64, max_batch)), "--max-len", str(max_context),
            ])
            self.target = self._start("target", [
                "serve-target", "--port", "0", "--metrics-port", "0", "--model", str(model_path),
                "--dtype", dtype, "--spec-endpoint", self.endpoint.address, "--max-batch", str(max_batch),
                "--max-context", str(max_context), "--datastore", str(datastore or ""), "--tenant", "bench",
            ])
        except Exception:
            self.close()
            raise
        self.channel = grpc.insecure_channel(self.target.address)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)

    def _start(self, name: str, args: list[str]) -> ServerProcess:
        server = start_server(name, args)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    def runner(self, mode: str, max_tokens: int):
        method = METHODS[mode]

        def run(prompts: list[list[int]], params: SamplingParams, totals) -> None:
            def one(ids: list[int]) -> pb.GenerateResult:
                sampling = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
                if params.seed is not None:
                    sampling.seed = params.seed
                return self.stub.GenerateUnary(pb.GenerateRequest(
                    prompt_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens, sampling=sampling,
                    speculation=pb.SpeculationPreference(method=method),
                ))

            start = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(pool.map(one, prompts))
            totals.seconds += time.perf_counter() - start
            totals.target_steps = totals.target_steps or 0
            for r in results:
                c = r.completions[0]
                totals.new_tokens += len(c.token_ids)
                totals.first_tokens += 1
                totals.target_steps += c.speculation.target_steps
                totals.drafted += c.speculation.drafted_tokens
                totals.fallback_rounds = (totals.fallback_rounds or 0) + c.speculation.fallback_rounds
                totals.outputs.append(list(c.token_ids))

        return run
